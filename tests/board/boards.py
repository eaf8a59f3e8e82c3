"""Where tests/board runs bundles: the emulated boards (scripts/board/run.sh) or a real board over
ssh, behind one small interface, and the helpers every board test shares (run a bundle there the
way a user runs it, the host's onnxruntime reference, the comparison).

The emulated boards are named in scripts/board/common.sh (BOARDS); TANDOOR_BOARD picks them:
unset, "all" or "1": every one; "0": none; a name or a comma-separated list: those.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from support.cli import ROOT
from tandoor_contract import hmod

RUN_SH = ROOT / "scripts" / "board" / "run.sh"
COMMON_SH = ROOT / "scripts" / "board" / "common.sh"
ATOL = RTOL = 1e-3
TIMEOUT = 1200


def emulated_boards() -> list[str]:
    """The emulated boards scripts/board/common.sh knows, the default first."""
    m = re.search(r"^BOARDS=\(([^)]*)\)", COMMON_SH.read_text(), re.M)
    assert m, f"no BOARDS=(...) in {COMMON_SH}"
    return m.group(1).split()


def selected_boards() -> list[str]:
    """The boards TANDOOR_BOARD asks for ([] for 0); a name that is no board is a usage error."""
    want = os.environ.get("TANDOOR_BOARD", "").strip()
    known = emulated_boards()
    if want == "0":
        return []
    if want in ("", "1", "all"):
        return known
    names = [n.strip() for n in want.split(",") if n.strip()]
    if bad := [n for n in names if n not in known]:
        raise pytest.UsageError(f"TANDOOR_BOARD={want}: no board {', '.join(bad)}; "
                                f"choose all, 0 or from {', '.join(known)}")
    return [n for n in known if n in names]


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
    """scripts/board/run.sh --board NAME with a host directory shared at /work."""

    def __init__(self, name: str, share: Path) -> None:
        self.name, self.share = name, share
        self.describe = f"emulated {name} arm64 (qemu-user, 2 x Cortex-A76 cpuinfo)"

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
        return subprocess.run(self.command(args, env), capture_output=True, text=True, timeout=timeout)

    def get(self, board_path, local):
        src = self.share / Path(board_path).relative_to("/work")
        if src.is_dir():
            shutil.copytree(src, local, dirs_exist_ok=True)
        else:
            shutil.copy2(src, local)
        return local


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


