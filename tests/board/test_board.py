"""Bundles cross-compiled on the host run on an arm64 board with the real Arm Compute Library.

The board is the emulated one (scripts/board/build.sh: Debian arm64 + Arm NN 20.08 under
qemu-user), or a real one over SSH when TANDOOR_BOARD_SSH=user@host is set
(scripts/board/run-remote.sh). Every model of zoo.ALL_CNNS is compiled here for aarch64 and run
there with `tandoor-agent run --delegate armnn --json`:

* every delegated subgraph runs on Arm NN's CpuAcc backend (ACL NEON kernels);
* the outputs match the host onnxruntime reference recorded in the bundle (atol/rtol 1e-3);
* with pyarmnn (and onnxruntime) made unimportable, the same bundle falls back to its TVM
  fallback libs and still matches;
* a bundle compiled for the host only is refused with NoLibForArch (exit 17) and its reason.

The emulated board is built by tests/board/conftest.py (in the background while the host tests
run). Env: TANDOOR_BOARD=0 skips these tests, TANDOOR_BOARD=1 fails (instead of skipping) when
this machine cannot run the emulated board. TANDOOR_BOARD_SSH=user@host uses a real board whose agent
venv is TANDOOR_BOARD_VENV (default /opt/tandoor/venv); TANDOOR_BOARD_SSH_OPTS adds ssh options.
"""

from __future__ import annotations

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

from support.cli import ROOT, compiled, manifest_of, run_cli
from tandoor_contract import hmod
from tandoor_zoo import models as zoo

HERE = Path(__file__).resolve().parent
RUN_SH = ROOT / "scripts" / "board" / "run.sh"
ATOL = RTOL = 1e-3
# every CNN of the compiler issue, plus the one with an op ACL lacks between two subgraphs
MODELS = sorted(zoo.ALL_CNNS) + ["with_unsupported_middle"]
BLOCKED = ("pyarmnn", "onnxruntime")
TIMEOUT = 1200


def board_root() -> str:
    """The emulated board's rootfs (scripts/board/common.sh's default)."""
    cache = os.environ.get("TANDOOR_CACHE") or os.path.expanduser("~/.cache/tandoor")
    return os.environ.get("TANDOOR_BOARD_ROOT") or os.path.join(cache, "board", "rootfs")


def _model(name: str) -> Path:
    return zoo.ALL_CNNS[name]() if name in zoo.ALL_CNNS else getattr(zoo, name)()


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
    """scripts/board/run.sh with a host directory shared at /work."""

    describe = "emulated arm64 (qemu-user, 2 x Cortex-A76 cpuinfo)"

    def __init__(self, share: Path) -> None:
        self.share = share

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
        cmd = [str(RUN_SH), "--share", str(self.share)]
        for k, v in (env or {}).items():
            cmd += ["-e", f"{k}={v}"]
        return subprocess.run(cmd + ["--", *args], capture_output=True, text=True, timeout=timeout)

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
        self.target = target
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


@pytest.fixture(scope="session")
def board(request, tmp_path_factory):
    if os.environ.get("TANDOOR_BOARD") == "0":
        pytest.skip("TANDOOR_BOARD=0")
    target = os.environ.get("TANDOOR_BOARD_SSH")
    if target:
        b: Board = SshBoard(target)
    else:
        request.getfixturevalue("board_ready")  # tests/board/conftest.py: build.sh, or skip
        b = EmulatedBoard(tmp_path_factory.mktemp("board-share"))
    yield b
    b.close()


@pytest.fixture(scope="session")
def blockers(board, tmp_path_factory) -> str:
    """A directory for PYTHONPATH whose packages shadow pyarmnn and onnxruntime with an ImportError:
    a board that has neither."""
    d = tmp_path_factory.mktemp("blockers") / "blockers"
    for mod in BLOCKED:
        (d / mod).mkdir(parents=True)
        (d / mod / "__init__.py").write_text(
            f"raise ImportError('{mod} made unavailable by tests/board (a board without it)')\n")
    if isinstance(board, EmulatedBoard):
        shutil.copytree(d, board.share / "blockers")
        return "/work/blockers"
    board._scp(str(d), f"{board.target}:{board.home}/blockers")
    return f"{board.home}/blockers"


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
        err = float(np.max(np.abs(o.astype(np.float64) - r)))
        np.testing.assert_allclose(o, r, atol=ATOL, rtol=RTOL,
                                   err_msg=f"{what}: output {i} differs from the host onnxruntime reference "
                                           f"(max abs err {err:.3g})")


# --------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", MODELS)
def test_armnn_on_cpuacc_matches_reference(board, bundles_dir, tmp_path, name, record_property):
    bundle = compiled(name, _model(name), bundles_dir)
    report, outs, secs = run_on_board(board, bundle, tmp_path, "--delegate", "armnn")
    record_property("board_seconds", round(secs, 1))
    subgraphs = report["subgraphs"]
    assert subgraphs, f"{name}: the bundle has no delegated subgraph"
    for sg in subgraphs:
        assert sg["executor"] == "armnn", f"{name}: {sg['symbol']} ran on {sg['executor']}: {sg.get('fallback_reason')}"
        assert sg["backend"] == "CpuAcc", f"{name}: {sg['symbol']} reports backend {sg['backend']}, not CpuAcc"
        assert not sg.get("fallback_reason"), sg
        layers = sg.get("layers") or {}
        assert layers.get("CpuAcc", 0) > 0, f"{name}: {sg['symbol']} reports no Arm NN layer on CpuAcc: {layers}"
        assert set(layers) == {"CpuAcc"}, f"{name}: {sg['symbol']} has Arm NN layers off CpuAcc: {layers}"
    assert_matches(outs, reference(bundle), f"{name} on armnn/CpuAcc")
    print(f"{name}: armnn/CpuAcc on {board.describe}: {secs:.1f} s (process), "
          f"latency {report['latency_ms']['median']:.0f} ms")


@pytest.mark.parametrize("name", MODELS)
def test_tvm_fallback_without_pyarmnn_matches_reference(board, bundles_dir, blockers, tmp_path, name, record_property):
    """--delegate armnn on a board where pyarmnn (and onnxruntime, the next choice) cannot be
    imported: every subgraph falls back to the bundle's TVM fallback lib and says why."""
    bundle = compiled(name, _model(name), bundles_dir)
    report, outs, secs = run_on_board(board, bundle, tmp_path, "--delegate", "armnn",
                                         env={"PYTHONPATH": blockers})
    record_property("board_seconds", round(secs, 1))
    assert report["subgraphs"]
    for sg in report["subgraphs"]:
        assert sg["executor"] == "tvm", f"{name}: {sg['symbol']} ran on {sg['executor']}"
        reason = sg.get("fallback_reason") or ""
        assert "pyarmnn" in reason and "made unavailable" in reason, reason
    assert_matches(outs, reference(bundle), f"{name} on the tvm fallback")
    print(f"{name}: tvm fallback on {board.describe}: {secs:.1f} s (process), "
          f"latency {report['latency_ms']['median']:.0f} ms")


def test_host_only_bundle_is_refused_with_its_reason(board, tmp_path):
    bundle = tmp_path / "host_only.hmod"
    run_cli("tandoor", "compile", str(zoo.with_unsupported_middle()), "-o", str(bundle), "-q", check=True)
    with hmod.open_bundle(bundle) as b:
        assert {v["arch"] for v in b.manifest["targets"].values()} == {"x86_64"}
    remote = board.put(bundle)
    res = board.run([f"{board.venv}/bin/tandoor-agent", "run", remote, "--delegate", "armnn", "--json"])
    assert res.returncode == hmod.NoLibForArch.exit_code == 17, (res.returncode, res.stderr)
    assert res.stdout == ""
    err = res.stderr.strip()
    assert err.startswith("tandoor-agent: error:"), err
    assert "has no lib for aarch64" in err and "x86_64" in err, err
    assert "recompile the model with a target for aarch64" in err, err


def test_profile_measured_on_the_board_drives_compile(board, tmp_path):
    """The board measures a bundle with `tandoor-agent profile` (no compiler there); the host
    compiles with that profile: Arm NN measured on CpuAcc, the cost policy citing the profile."""
    model = zoo.with_unsupported_middle()
    bundle = tmp_path / "all.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(bundle), "--target", "aarch64", "--policy", "all",
            "-q", check=True)
    remote = board.put(bundle)
    res = board.run([f"{board.venv}/bin/tandoor-agent", "profile", remote, "--runs", "3", "--warmup", "1",
                     "--json"])
    assert res.returncode == 0, res.stderr[-4000:]
    prof = json.loads(res.stdout)
    assert prof["key"]["arch"] == "aarch64" and prof["target"] == "aarch64"
    symbols = [p["symbol"] for p in manifest_of(bundle)["partitions"] if p["delegate"]]
    assert sorted(prof["subgraphs"]) == sorted(symbols)
    for sym, s in prof["subgraphs"].items():
        assert s["backend"]["armnn"] == "CpuAcc", (sym, s)
        assert s["exec_us"]["armnn"] > 0 and s["exec_us"]["onnxruntime"] > 0 and s["tvm_us"] > 0, (sym, s)
    path = tmp_path / "board-profile.json"
    path.write_text(json.dumps(prof))
    out = tmp_path / "profiled.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(out), "--target", "aarch64", "--profile", str(path),
            "-q", check=True)
    man = manifest_of(out)
    assert man["profile"]["board"] == prof["key"]["board"] and man["profile"]["arch"] == "aarch64"
    for part in man["partitions"]:
        if part["symbol"] in prof["subgraphs"]:
            assert part["est"]["source"] == "profile"
            assert part["reason"].startswith(("cost (profile):", "policy")), part["reason"]


def test_run_remote_drives_the_board_tests_over_ssh(board, tmp_path):
    """scripts/board/run-remote.sh, as a user with a real board runs it, against an sshd running
    on the emulated board: bundles compiled here, copied over scp, run there over ssh."""
    if not isinstance(board, EmulatedBoard):
        pytest.skip("already running against a board over ssh")
    if not shutil.which("ssh") or not (Path(board_root()) / "usr/sbin/sshd").exists():
        pytest.skip("no ssh client here or no sshd on the board (rebuild it: scripts/board/build.sh)")
    share = tmp_path / "sshd"
    share.mkdir(mode=0o700)
    key = tmp_path / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(share / "host_key")], check=True)
    (share / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (share / "authorized_keys").chmod(0o600)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sshd = subprocess.Popen(
        [str(RUN_SH), "--share", str(share), "--", "sh", "-c",
         f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p {port} -o ListenAddress=127.0.0.1 "
         "-h /work/host_key -o AuthorizedKeysFile=/work/authorized_keys -o PermitRootLogin=prohibit-password"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert sshd.poll() is None, f"sshd on the board exited: {sshd.stderr.read()}"
                assert time.monotonic() < deadline, "sshd on the board did not listen within 120 s"
                time.sleep(0.5)
        env = {**os.environ, "TANDOOR_BOARD_SSH_OPTS":
               f"-o Port={port} -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"}
        res = subprocess.run([str(ROOT / "scripts/board/run-remote.sh"), "root@127.0.0.1", "-q", "-p", "no:cacheprovider",
                              "-k", "host_only_bundle_is_refused"], capture_output=True, text=True, env=env,
                             timeout=TIMEOUT)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "running tests/board against root@127.0.0.1" in res.stderr
        assert "1 passed" in res.stdout, res.stdout[-3000:]
        # and it says what to do when the board has no agent where it looks
        env["TANDOOR_BOARD_VENV"] = "/opt/nowhere"
        res = subprocess.run([str(ROOT / "scripts/board/run-remote.sh"), "root@127.0.0.1"], capture_output=True,
                             text=True, env=env, timeout=300)
        assert res.returncode == 1 and "no agent at root@127.0.0.1:/opt/nowhere" in res.stderr, res.stderr
        assert "--install root@127.0.0.1" in res.stderr
    finally:
        os.killpg(sshd.pid, signal.SIGTERM)
        sshd.wait(30)


# --- real pretrained models from registry packages (zoo/wild.py) ------------------------------------

def _wild_bundle(name: str, bundles_dir) -> Path:
    """The same bundle tests/compiler/test_wild.py compiled (host + aarch64), once per session."""
    from tandoor_zoo import wild

    m = wild.MODELS[name]
    pins = [a for pin in m.inputs for a in ("--input", pin)]
    return compiled(f"wild_{name}", wild.fetch(name), bundles_dir, *pins)


def _wild_names() -> list[str]:
    from tandoor_zoo import wild

    return sorted(wild.MODELS)


@pytest.mark.parametrize("name", _wild_names())
def test_a_real_model_runs_on_cpuacc_and_matches_the_reference(board, bundles_dir, tmp_path, name, record_property):
    """Detectors and dense models from the wild (YOLOv8, YOLOX, PicoDet, CenterFace, DBNet) and
    classic CNNs: every Arm NN layer on CpuAcc, outputs within 1e-3 of onnxruntime on the host."""
    bundle = _wild_bundle(name, bundles_dir)
    report, outs, secs = run_on_board(board, bundle, tmp_path, "--delegate", "armnn")
    record_property("board_seconds", round(secs, 1))
    assert report["subgraphs"], f"{name}: the bundle has no delegated subgraph"
    for sg in report["subgraphs"]:
        assert sg["executor"] == "armnn" and not sg.get("fallback_reason"), sg
        layers = sg.get("layers") or {}
        assert set(layers) == {"CpuAcc"}, f"{name}: {sg['symbol']} has Arm NN layers off CpuAcc: {layers}"
    assert_matches(outs, reference(bundle), f"{name} on armnn/CpuAcc")
    print(f"{name}: armnn/CpuAcc on {board.describe}: {secs:.1f} s (process)")
