"""Where tests/board runs bundles: the emulated boards (scripts/board/run.sh) or a real board over
ssh, behind one small interface, and the helpers every board test shares (run a bundle there the
way a user runs it, the host's onnxruntime reference, the comparison).

The emulated boards are named in scripts/board/common.sh (BOARDS); TANDOOR_BOARD picks them:
unset, "all" or "1": every one; "0": none; a name or a comma-separated list: those.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from support.board_builds import emulated_boards, selected_boards  # noqa: F401 (re-exported for the board tests)
from support.cli import ROOT
from tandoor_contract import hmod

HERE = Path(__file__).resolve().parent
RUN_SH = ROOT / "scripts" / "board" / "run.sh"
ATOL = RTOL = 1e-3
TIMEOUT = 1200


def board_root(name: str) -> str:
    """An emulated board's rootfs (scripts/board/common.sh's default)."""
    cache = os.environ.get("TANDOOR_CACHE") or os.path.expanduser("~/.cache/tandoor")
    return os.environ.get("TANDOOR_BOARD_ROOT") or os.path.join(cache, "board", name, "rootfs")


# --------------------------------------------------------------------------------- boards
class Board:
    """Where bundles run: put files there, run commands there, get files back."""

    venv = "/opt/tandoor/venv"
    home = "/work"  # the board-side directory files are put in
    describe = "?"

    def put(self, path: Path) -> str:
        raise NotImplementedError

    def run(self, args: list[str], env: dict[str, str] | None = None,
            timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
        raise NotImplementedError

    def get(self, board_path: str, local: Path) -> Path:
        raise NotImplementedError

    def mkdir(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EmulatedBoard(Board):
    """scripts/board/run.sh --board NAME with a host directory shared at /work.

    Commands go through a fork server on the board (tests/board/forkserver.py): one warm Python
    there per distinct PYTHON* environment, forking a fresh process per command, so a command does
    not pay the emulator's 10-20 s of imports. TANDOOR_BOARD_FORKSERVER=0 runs each command through
    run.sh instead (a cold process each, as before)."""

    def __init__(self, name: str, share: Path) -> None:
        self.name, self.share = name, share
        self.describe = f"emulated {name} arm64 (qemu-user, 2 x Cortex-A76 cpuinfo)"
        self._servers: dict[tuple, _ForkServer] = {}
        self._forkserver = os.environ.get("TANDOOR_BOARD_FORKSERVER", "1") != "0"

    def command(self, args: list[str], env: dict[str, str] | None = None, share: Path | None = None) -> list[str]:
        """The run.sh command line that runs ``args`` on this board (for a Popen of one's own)."""
        cmd = [str(RUN_SH), "--board", self.name, "--share", str(share or self.share)]
        # the Arm NN executor's load-time check (one Arm NN run per order against the bundle's
        # probe) stays on, as on a real board
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        return cmd + ["--", *args]

    def put(self, path: Path) -> str:
        dst = self.share / path.name
        if path.resolve() != dst.resolve():
            shutil.copy2(path, dst)
        return f"/work/{path.name}"

    def mkdir(self) -> str:
        name = f"d-{uuid.uuid4().hex[:8]}"
        (self.share / name).mkdir()
        return f"/work/{name}"

    def run(self, args, env=None, timeout=TIMEOUT):
        if not self._forkserver:
            return subprocess.run(self.command(args, env), capture_output=True, text=True, timeout=timeout)
        env = env or {}
        # what the interpreter reads at start-up (a blocked pyarmnn on PYTHONPATH) needs its own server
        startup = tuple(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))
        if startup not in self._servers:
            self._servers[startup] = _ForkServer(self, dict(startup), len(self._servers))
        return self._servers[startup].run(args, {k: v for k, v in env.items() if not k.startswith("PYTHON")},
                                          timeout)

    def get(self, board_path, local):
        src = self.share / Path(board_path).relative_to("/work")
        if src.is_dir():
            shutil.copytree(src, local, dirs_exist_ok=True)
        else:
            shutil.copy2(src, local)
        return local

    def close(self):
        for s in self._servers.values():
            s.stop()
        self._servers.clear()


class _ForkServer:
    """One tests/board/forkserver.py running on an emulated board, reached through a Unix socket
    in the shared directory."""

    START_TIMEOUT = 600

    def __init__(self, board: EmulatedBoard, env: dict[str, str], n: int) -> None:
        d = board.share / ".forkserver"
        d.mkdir(exist_ok=True)
        shutil.copy2(HERE / "forkserver.py", d / "forkserver.py")
        self.sock = d / f"s{n}.sock"
        self.log = d / f"s{n}.log"
        ready = Path(f"{self.sock}.ready")
        ready.unlink(missing_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                board.command([f"{board.venv}/bin/python", "/work/.forkserver/forkserver.py",
                               f"/work/.forkserver/{self.sock.name}"], env),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.START_TIMEOUT
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the fork server on {board.describe} did not start "
                                   f"(exit {self.proc.returncode}): {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def run(self, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout + 120)
            s.connect(str(self.sock))
            f = s.makefile("rwb")
            f.write((json.dumps({"argv": list(args), "env": env, "timeout": timeout}) + "\n").encode())
            f.flush()
            line = f.readline()
        if not line:
            raise RuntimeError(f"the board's fork server dropped the command {args[:3]}: "
                               f"{self.log.read_text(errors='replace')[-2000:]}")
        r = json.loads(line)
        if r.get("timed_out"):
            raise subprocess.TimeoutExpired(args, timeout, r["stdout"], r["stderr"])
        return subprocess.CompletedProcess(args, r["rc"], r["stdout"], r["stderr"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class SshBoard(Board):
    """A real board over ssh/scp; files go to a fresh directory under /tmp there."""

    def __init__(self, target: str) -> None:
        self.target = self.name = target
        self.venv = os.environ.get("TANDOOR_BOARD_VENV", self.venv)
        self.opts = ["-o", "BatchMode=yes", *shlex.split(os.environ.get("TANDOOR_BOARD_SSH_OPTS", ""))]
        self.describe = f"ssh {target}"
        res = self._ssh("mktemp -d /tmp/tandoor-board.XXXXXX", timeout=60)
        if res.returncode != 0:
            pytest.fail(f"cannot reach the board {target} over ssh: {res.stderr.strip()}")
        self.dir = self.home = res.stdout.strip()

    def _ssh(self, command: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", *self.opts, self.target, command], capture_output=True, text=True,
                              timeout=timeout)

    def _scp(self, *args: str) -> None:
        subprocess.run(["scp", "-q", "-r", *self.opts, *args], check=True, timeout=TIMEOUT)

    def put(self, path):
        self._scp(str(path), f"{self.target}:{self.dir}/{path.name}")
        return f"{self.dir}/{path.name}"

    def mkdir(self):
        d = f"{self.dir}/d-{uuid.uuid4().hex[:8]}"
        self._ssh(f"mkdir -p {shlex.quote(d)}", timeout=60)
        return d

    def run(self, args, env=None, timeout=TIMEOUT):
        # the emulated board puts the venv first on PATH; do the same here
        envs = {"PATH": f"{self.venv}/bin:$PATH", **(env or {})}
        prefix = " ".join(f"{k}={v if k == 'PATH' else shlex.quote(v)}" for k, v in envs.items())
        return self._ssh(f"cd {shlex.quote(self.dir)} && env {prefix} {shlex.join(args)}", timeout=timeout)

    def get(self, board_path, local):
        local.parent.mkdir(parents=True, exist_ok=True)
        self._scp(f"{self.target}:{board_path}", str(local.parent))
        return local.parent / Path(board_path).name

    def close(self):
        self._ssh(f"rm -rf {shlex.quote(self.dir)}", timeout=60)


# --------------------------------------------------------------------------------- helpers
def run_on_board(board: Board, bundle: Path, tmp: Path, *options: str, env: dict | None = None):
    """`tandoor-agent run BUNDLE OPTIONS --save-outputs DIR --json` on the board, as a user runs
    it; returns (its json report, the saved outputs, seconds)."""
    remote = board.put(bundle)
    out_dir = board.mkdir()
    t0 = time.monotonic()
    res = board.run([f"{board.venv}/bin/tandoor-agent", "run", remote, *options,
                     "--save-outputs", out_dir, "--json"], env=env)
    secs = time.monotonic() - t0
    assert res.returncode == 0, (f"tandoor-agent run {' '.join(options)} failed on {board.describe} "
                                 f"(exit {res.returncode}):\n{res.stderr[-4000:]}")
    local = board.get(out_dir, tmp / Path(out_dir).name)
    report = json.loads(res.stdout)
    outs = [np.load(local / f"output_{j}.npy") for j in range(len(report["outputs"]))]
    return report, outs, secs


def reference(bundle: Path) -> list[np.ndarray]:
    """What onnxruntime computed on the host, from the source model, for the first golden input."""
    with hmod.open_bundle(bundle) as b:
        return b.golden()[0][1]


def assert_matches(outs, ref, what: str) -> None:
    assert len(outs) == len(ref), what
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.shape == r.shape, f"{what}: output {i} shape {o.shape} != {r.shape}"
        diff = np.abs(o.astype(np.float64) - r)
        bad = diff > ATOL + RTOL * np.abs(r)
        if bad.any():  # one line, the model named first (callers collect first lines)
            worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
            raise AssertionError(f"{what}: output {i} differs from the host onnxruntime reference: "
                                 f"{int(bad.sum())} of {bad.size} elements beyond {ATOL} + {RTOL}*|ref|, max abs "
                                 f"err {float(diff.max()):.3g} at {tuple(int(v) for v in worst)} "
                                 f"(got {float(o[worst]):.5g}, want {float(r[worst]):.5g})")


