"""Bundles cross-compiled on the host run on arm64 boards with the real Arm Compute Library.

The boards are the emulated ones (scripts/board/build.sh: Debian bookworm with Arm NN 20.08 and
Debian trixie with Arm NN 23.08, under qemu-user; every test runs on each), or a real one over SSH
when TANDOOR_BOARD_SSH=user@host is set (scripts/board/run-remote.sh). Every model of
zoo.ALL_CNNS is compiled here for aarch64 and run there with `tandoor-agent run --delegate armnn --json`:

* every delegated subgraph runs on Arm NN's CpuAcc backend (ACL NEON kernels);
* the outputs match the host onnxruntime reference recorded in the bundle (atol/rtol 1e-3);
* with pyarmnn (and onnxruntime) made unimportable, the same bundle falls back to its TVM
  fallback libs and still matches;
* a bundle compiled for the host only is refused with NoLibForArch (exit 17) and its reason;
* one model per op type of the order vocabulary (tests/board/op_models.py) runs with every Arm NN
  layer on CpuAcc and matches onnxruntime;
* the agent's process there maps no TVM compiler library.

The emulated boards are built by tests/board/conftest.py (in the background while the host tests
run). Env: TANDOOR_BOARD=bookworm|trixie|all (default all; a comma-separated list works too)
picks the boards, TANDOOR_BOARD=0 skips these tests, TANDOOR_BOARD=1 is all and fails (instead of
skipping) when this machine cannot run the emulated boards. TANDOOR_BOARD_SSH=user@host uses a
real board whose agent venv is TANDOOR_BOARD_VENV (default /opt/tandoor/venv);
TANDOOR_BOARD_SSH_OPTS adds ssh options.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from support.cli import ROOT, compiled, manifest_of, run_cli
from tandoor_compiler.backends import acl
from tandoor_agent.run.executors import armnn_tflite
from tandoor_contract import hmod, orders
from tandoor_zoo import models as zoo

from .boards import TIMEOUT, EmulatedBoard, assert_matches, board_root, reference, run_on_board

HERE = Path(__file__).resolve().parent
# every CNN of the compiler issue, plus the one with an op ACL lacks between two subgraphs
MODELS = sorted(zoo.ALL_CNNS) + ["with_unsupported_middle"]


def _model(name: str) -> Path:
    return zoo.ALL_CNNS[name]() if name in zoo.ALL_CNNS else getattr(zoo, name)()


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
    if not shutil.which("ssh") or not (Path(board_root(board.name)) / "usr/sbin/sshd").exists():
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
        board.command(["sh", "-c",
                       f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p {port} -o ListenAddress=127.0.0.1 "
                       "-h /work/host_key -o AuthorizedKeysFile=/work/authorized_keys "
                       "-o PermitRootLogin=prohibit-password"], share=share),
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


# --------------------------------------------------------------------------------- every op type
def _order_ops(bundle: Path) -> list[dict]:
    with hmod.open_bundle(bundle) as b:
        return [op for p in b.manifest["partitions"] if p["delegate"] for op in b.order(p["symbol"])["ops"]]


def test_op_models_cover_the_order_vocabulary(op_bundles):
    """tests/board/op_models.py has a model for every op type of the contract, and together their
    orders hold every op type, every activation kind and every binary kind the vocabulary lists,
    with nothing left to TVM: what the board test below runs is the whole vocabulary."""
    assert set(op_bundles) == set(orders.OPS), "tests/board/op_models.py MODELS must have one model per OPS entry"
    types, acts, binaries = set(), set(), set()
    for op_type, bundle in op_bundles.items():
        man = manifest_of(bundle)
        assert man["tvm_ops"] == [], f"{op_type}: TVM kept {man['tvm_ops']}"
        ops = _order_ops(bundle)
        assert op_type in {o["type"] for o in ops}, f"the {op_type} model's orders hold no {op_type} op"
        for o in ops:
            types.add(o["type"])
            a = o.get("attrs") or {}
            if a.get("activation"):
                acts.add(a["activation"]["kind"])
            if o["type"] == "binary":
                binaries.add(a["kind"])
    assert types == set(orders.OPS)
    # an activation no board's Arm NN has (the ACL table's "since", e.g. GELU's erf form) stays in TVM
    no_board = {e.name for e in acl.ENTRIES if acl.release_reason(e.name, e.since)}
    want = set(orders.ACTIVATIONS) - no_board
    assert acts == want, f"activation kinds never built: {want - acts}"
    assert binaries == set(orders.OPS["binary"].attrs["kind"].choices)


# What `tandoor-agent run BUNDLE --delegate armnn --save-outputs DIR` does for one bundle (open it,
# HybridModule, the first golden input, describe), for many bundles in one process: each agent
# process costs ~10-20 s of imports under emulation.
_RUN_MANY = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from tandoor_agent.run import lean
lean.runtime_only()
from tandoor_contract import hmod
from tandoor_agent.run.runtime import HybridModule
report, secs = {}, {}
for path in sys.argv[1:]:
    t0 = time.monotonic()
    with hmod.open_bundle(path) as b:
        m = HybridModule(b, delegate="armnn")
        try:
            outs = m.run(b.golden()[0][0])
            report[Path(path).name] = m.describe()
        finally:
            m.close()
    secs[Path(path).name] = round(time.monotonic() - t0, 1)
    d = Path(path).with_suffix(".outs")
    d.mkdir()
    for j, o in enumerate(outs):
        np.save(d / f"output_{j}.npy", o)
print(json.dumps({"report": report, "secs": secs}))
"""


def _run_many(board, bundles: dict[str, Path], tmp_path, env: dict | None = None, timeout: int = TIMEOUT):
    """Run ``bundles`` (name -> bundle) in one board process with --delegate armnn: the per-bundle
    describe() report, the outputs as a list per name, and the seconds it took."""
    remote = {name: board.put(b) for name, b in bundles.items()}
    t0 = time.monotonic()
    res = board.run([f"{board.venv}/bin/python", "-c", _RUN_MANY, *remote.values()], env=env, timeout=timeout)
    secs = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    said = json.loads(res.stdout.strip().splitlines()[-1])
    report = said["report"]
    print("seconds per bundle (load + one run): " + ", ".join(f"{n}: {s}" for n, s in said["secs"].items()))
    subgraphs, outs = {}, {}
    for name, bundle in bundles.items():
        subgraphs[name] = report[Path(remote[name]).name]
        local = board.get(str(Path(remote[name]).with_suffix(".outs")), tmp_path / f"{name}.outs")
        outs[name] = [np.load(local / f"output_{j}.npy") for j in range(len(reference(bundle)))]
    return subgraphs, outs, secs


def _off_cpuacc_or_reference(bundles: dict[str, Path], subgraphs: dict, outs: dict) -> list[str]:
    """One line per order not on Arm NN with every layer on CpuAcc, and per bundle whose outputs
    are not within 1e-3 of the host onnxruntime reference."""
    failures = []
    for name, bundle in bundles.items():
        if not subgraphs[name]:
            failures.append(f"{name}: no delegated subgraph")
        for sg in subgraphs[name]:
            if sg["executor"] != "armnn" or sg.get("fallback_reason"):
                failures.append(f"{name}: {sg['symbol']} ran on {sg['executor']}: {sg.get('fallback_reason')}")
            elif set(sg.get("layers") or {}) != {"CpuAcc"}:
                failures.append(f"{name}: {sg['symbol']} layers {sg.get('layers')}, off CpuAcc: "
                                f"{sg.get('layers_elsewhere')}")
        try:
            assert_matches(outs[name], reference(bundle), f"{name} on armnn/CpuAcc")
        except AssertionError as err:
            failures.append(str(err).strip().splitlines()[0])
    return failures


def test_every_op_type_on_cpuacc_matches_onnxruntime(board, op_bundles, tmp_path):
    """One bundle per op type (tests/board/op_models.py) run on the board by the agent's runtime
    with --delegate armnn: every order on Arm NN, every one of its layers on CpuAcc (ACL NEON),
    every output within 1e-3 of onnxruntime on the source model (the bundle's golden output)."""
    subgraphs, outs, secs = _run_many(board, op_bundles, tmp_path)
    failures = _off_cpuacc_or_reference(op_bundles, subgraphs, outs)
    assert not failures, "\n".join(failures)
    print(f"{len(op_bundles)} op types, {sum(len(v) for v in subgraphs.values())} orders on {board.describe}: "
          f"{secs:.0f} s")


# --------------------------------------------------------------------------------- the board itself
_PROBE = r"""
import json, subprocess, sys, time
from tandoor_agent.run.lean import footprint_facts, mapped_libraries
p = subprocess.Popen([sys.argv[1], "run", sys.argv[2], "--delegate", "armnn", "--repeat", "100000000"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
deadline = time.monotonic() + 600
while not any(lib.endswith(sys.argv[3]) for lib in mapped_libraries(p.pid)):
    if p.poll() is not None or time.monotonic() > deadline:
        sys.exit(f"tandoor-agent run exited ({p.poll()}) or never loaded {sys.argv[3]}: {p.stderr.read() if p.poll() is not None else ''}")
    time.sleep(0.5)
facts = footprint_facts(p.pid)
p.terminate(); p.wait(60)
print(json.dumps(facts))
"""


def test_agent_on_the_board_maps_no_tvm_compiler(board, bundles_dir):
    """A `tandoor-agent run` process on the board, looked at from outside (/proc/PID/maps) once
    its VM is made: TVM's runtime library mapped, its compiler library (in the same wheel) not."""
    bundle = compiled("with_unsupported_middle", zoo.with_unsupported_middle(), bundles_dir)
    target = next(t for t, v in manifest_of(bundle)["targets"].items() if v["arch"] == "aarch64")
    res = board.run([f"{board.venv}/bin/python", "-c", _PROBE, f"{board.venv}/bin/tandoor-agent", board.put(bundle),
                     f"{target}.so"])
    assert res.returncode == 0, res.stderr[-3000:]
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    assert facts == {"tvm_runtime_mapped": True, "tvm_compiler_mapped": False, "torch_mapped": False}, facts


_PROBE_BITS = """
import hashlib, json, sys
from tandoor_contract import probe
order = json.loads(sys.argv[1])
print(hashlib.sha256(b"".join(a.tobytes() for a in probe.inputs(order))).hexdigest())
"""


def test_the_board_makes_the_probe_inputs_the_compiler_made(board):
    """The load-time check compares the board's Arm NN with outputs the host recorded for the
    probe inputs, so the board's numpy (its release, its CPU) must make the same bits as the host's."""
    import hashlib

    from tandoor_contract import probe

    order = {"inputs": [{"shape": [1, 3, 67, 45]}, {"shape": [1, 1000]}, {"shape": [2, 7, 9, 4]}]}
    here = hashlib.sha256(b"".join(a.tobytes() for a in probe.inputs(order))).hexdigest()
    res = board.run([f"{board.venv}/bin/python", "-c", _PROBE_BITS, json.dumps(order)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == here, board.describe


def test_the_board_has_the_packages_install_on_board_picks(board):
    """install-on-board.sh, asked on the board itself, names the packages for that distribution;
    they are what the board has, and Arm NN's ABI is the one those packages are built for."""
    script = "/opt/tandoor/src/scripts/board/install-on-board.sh"
    if board.run(["test", "-f", script], timeout=120).returncode != 0:
        pytest.skip(f"no {script} on {board.describe}")
    res = board.run(["bash", script, "--print-packages"], timeout=300)
    assert res.returncode == 0, res.stderr
    pkgs = res.stdout.split()
    res = board.run(["dpkg-query", "-W", "-f", "${Package} ${Status}\\n", *pkgs], timeout=300)
    installed = {ln.split()[0] for ln in res.stdout.splitlines() if ln.endswith("install ok installed")}
    assert installed == set(pkgs), f"install-on-board.sh picks {pkgs}; not installed: {set(pkgs) - installed}"
    abi = next(p for p in pkgs if p.startswith("libarmnn-cpuacc-backend")).removeprefix("libarmnn-cpuacc-backend")
    res = board.run([f"{board.venv}/bin/python", "-c",
                     "from tandoor_agent.run.executors import armnn; print(armnn.available()[1])"], timeout=600)
    assert f"Arm NN ABI {abi}." in res.stdout, (res.stdout, res.stderr[-2000:])
    assert "CpuAcc" in res.stdout


@pytest.mark.parametrize("codename,abi", [("bookworm", "22"), ("jammy", "22"), ("trixie", "33"), ("noble", "33")])
def test_install_on_board_picks_packages_per_distribution(codename, abi):
    """Arm NN 20.08 (ABI 22) on Debian 12 and Ubuntu 22.04, 23.08 (ABI 33) on Debian 13 and
    Ubuntu 24.04; the GpuAcc backend only for a Mali GPU (or when asked)."""
    script = ROOT / "scripts" / "board" / "install-on-board.sh"
    env = {**os.environ, "TANDOOR_GPUACC": "0"}
    res = subprocess.run(["bash", str(script), "--print-packages", codename], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python3", "python3-venv", "ca-certificates", "python3-pyarmnn",
                                  f"libarmnn-cpuacc-backend{abi}", f"libarmnn-cpuref-backend{abi}"]
    env["TANDOOR_GPUACC"] = "1"
    res = subprocess.run(["bash", str(script), "--print-packages", codename], capture_output=True, text=True, env=env)
    assert res.stdout.split()[-1] == f"libarmnn-gpuacc-backend{abi}"
    res = subprocess.run(["bash", str(script), "--print-packages", "sid"], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and res.stdout == ""
    assert "no Arm NN package table for 'sid'" in res.stderr and "TANDOOR_DISTRO" in res.stderr


# --- real pretrained models from registry packages (zoo/wild.py) ------------------------------------

def _wild_bundle(name: str, bundles_dir) -> Path:
    """A real model's bundle as tests/compiler/test_wild.py compiles it (host + aarch64), once per session."""
    from tandoor_zoo import wild

    pins = [a for pin in wild.MODELS[name].inputs for a in ("--input", pin)]
    return compiled(f"wild_{name}", wild.fetch(name), bundles_dir, *pins)


BOARD_ARMNN = {"bookworm": "20.08", "trixie": "23.08"}  # the emulated boards' Arm NN (common.sh)


def test_real_models_run_on_cpuacc_and_match_the_reference(board, bundles_dir, tmp_path):
    """Detectors and dense models from the wild (YOLOv8, YOLOX, PicoDet, CenterFace, DBNet) and
    classic CNNs, as the compiler test compiled them: on the board every order on Arm NN, every
    layer on CpuAcc (each passed the load-time check), outputs within 1e-3 of onnxruntime on the
    host (the golden output). One board process runs them all (imports cost ~20 s a process under
    emulation). Three of them need the executor's way around an Arm NN defect (Api in
    agent/run/executors/armnn.py): PicoDet and PP-OCRv4 det on 20.08 (a depthwise convolution
    sharing its input), YOLOX on 23.08 (concat inputs written in place)."""
    from tandoor_zoo import wild

    # the unseen models (wild.UNSEEN) are not run here: under emulation they took 12 min a board
    bundles = {n: _wild_bundle(n, bundles_dir) for n in sorted(set(wild.MODELS) - set(wild.UNSEEN))}
    subgraphs, outs, secs = _run_many(board, bundles, tmp_path)
    failures = _off_cpuacc_or_reference(bundles, subgraphs, outs)
    assert not failures, "\n".join(failures)
    print(f"{len(bundles)} real models on armnn/CpuAcc on {board.describe}: {secs:.0f} s")


def test_a_model_ending_in_nms_runs_its_tail_on_the_board(board, tmp_path):
    """An end-to-end detector in miniature (tests/support/tails.py): ACL orders on Arm NN, then the
    NMS and its gathers in the board's onnxruntime after the VM (the bundle's tail); outputs of the
    size NMS chose, agreeing with onnxruntime on the host."""
    from support.tails import e2e_detector
    from tandoor_compiler.pipeline import Options, compile_model
    from tandoor_contract import agreement

    bundle = tmp_path / "e2e.hmod"
    compile_model(e2e_detector(tmp_path), bundle, Options(targets=["aarch64"], policy="all"))
    subgraphs, outs, _ = _run_many(board, {"e2e": bundle}, tmp_path)
    with hmod.open_bundle(bundle) as b:
        assert b.manifest.get("tail"), "the model should end in a tail"
        want = b.golden()[0][1]
        verdict = agreement.compare(outs["e2e"], want, b.manifest, agreement.path_of(subgraphs["e2e"]))
    assert verdict.ok, verdict.reason
    assert [o.shape for o in outs["e2e"]] == [w.shape for w in want]
    assert any(sg["executor"] == "armnn" for sg in subgraphs["e2e"]), subgraphs


def test_unseen_real_models_run_on_the_board_and_agree(board, bundles_dir, tmp_path):
    """The models first tried as a new user would (zoo/wild.py UNSEEN: LSTM and Loop recognisers,
    tf2onnx detectors, a Siamese pair), their aarch64 bundles on the board's runtime: each order on
    Arm NN where it can, else the next executor (onnxruntime orders run only there); every output
    agrees with onnxruntime on the host (the golden output) within the bundle's own promise per
    output and path (contract/agreement.py, what the health gate applies), ties left free."""
    from tandoor_contract import agreement
    from tandoor_zoo import wild

    bundles = {n: _wild_bundle(n, bundles_dir) for n in sorted(wild.UNSEEN_ON_BOARDS)}
    subgraphs, outs, secs, failures = {}, {}, 0.0, []
    for name, bundle in bundles.items():     # one board process each: a slow one is named by its timeout
        s, o, t = _run_many(board, {name: bundle}, tmp_path)
        subgraphs.update(s)
        outs.update(o)
        secs += t
        with hmod.open_bundle(bundle) as b:
            verdict = agreement.compare(outs[name], b.golden()[0][1], b.manifest, agreement.path_of(subgraphs[name]),
                                        free=(agreement.golden_ties(b) or [None])[0])
        if not verdict.ok:
            failures.append(f"{name} on {board.describe}: {verdict.reason}")
    assert not failures, "\n".join(failures)
    on = sorted({f"{sg['executor']}/{sg['backend']}" for v in subgraphs.values() for sg in v})
    print(f"{len(bundles)} unseen real models on {board.describe} ({', '.join(on)}): {secs:.0f} s")


def test_an_order_arm_nn_gets_wrong_is_caught_at_load(board, bundles_dir, tmp_path):
    """The load-time check on CpuAcc: one order of a real bundle whose probe says other numbers
    than Arm NN computes (its recorded values shifted by one element, as PicoDet's wrong rows were
    on 20.08 before the executor avoided that defect) runs on onnxruntime with the reason, the
    other on CpuAcc, and the outputs still match the host's golden output."""
    from support.bundle_edit import rewrite, shift_probe

    base = compiled("with_unsupported_middle", zoo.with_unsupported_middle(), bundles_dir)
    parts = [p for p in manifest_of(base)["partitions"] if p["delegate"]]
    wrong = parts[-1]
    bundle = rewrite(base, tmp_path / "shifted.hmod", shift_probe(wrong["probe"]))
    subgraphs, outs, _ = _run_many(board, {"shifted": bundle}, tmp_path)
    by_symbol = {sg["symbol"]: sg for sg in subgraphs["shifted"]}
    release = BOARD_ARMNN.get(getattr(board, "name", ""), "")
    assert by_symbol[wrong["symbol"]]["executor"] == "onnxruntime", by_symbol
    assert f"Arm NN {release} on CpuAcc computes this order wrongly" in by_symbol[wrong["symbol"]]["fallback_reason"]
    others = [sg for sym, sg in by_symbol.items() if sym != wrong["symbol"]]
    assert others and all(sg["executor"] == "armnn" and set(sg.get("layers") or {}) == {"CpuAcc"} for sg in others)
    assert_matches(outs["shifted"], reference(bundle), "the caught order on onnxruntime")


#: The board's frame is not the host's: OpenCV 5.0's aarch64 INTER_LINEAR (its KleidiCV HAL) rounds
#: differently from x86's, by 1 in 24% of the astronaut's 320x320 letterboxed values, and YOLOv8n's
#: face score moves 0.72031 -> 0.72669 with it, on CpuAcc and on the board's onnxruntime alike; the
#: model itself matches the host within 1e-3 on one tensor (the real-model test above).
BOARD_SCORE_TOL = 1e-2


def test_detectors_on_cpuacc_find_the_boxes_their_packages_find(board, bundles_dir, tmp_path):
    """The real detectors compiled with their packages' preprocessing and decoders
    (tests/support/detectors.py), run on the board by `tandoor-agent run --input IMG --json` on
    Arm NN's CpuAcc: the boxes in the image's pixels match the package's own code on the host
    (IoU >= 0.9 one to one, same labels, scores within BOARD_SCORE_TOL)."""
    import cv2

    from support import detectors
    from support.references import match

    problems = []
    for name, det in detectors.DETECTORS.items():
        bundle = detectors.compiled_detector(name, bundles_dir)
        img = det.images[0]
        rgb = detectors.image(img)
        png = tmp_path / f"{name}-{img}.png"
        cv2.imwrite(str(png), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        res = board.run([f"{board.venv}/bin/tandoor-agent", "run", board.put(bundle), "--input", board.put(png),
                         "--delegate", "armnn", "--json"])
        assert res.returncode == 0, f"{name}: {res.stderr[-2000:]}"
        report = json.loads(res.stdout)
        for sg in report["subgraphs"]:
            if sg["executor"] != "armnn" or set(sg.get("layers") or {}) != {"CpuAcc"}:
                problems.append(f"{name}: {sg['symbol']} on {sg['executor']} {sg.get('layers')}")
        ours = report["result"]["detections"]
        problems += [f"{name} on {img}: {p}" for p in match(ours, detectors.reference(name, rgb),
                                                                  score_tol=BOARD_SCORE_TOL)]
        print(f"{name} on {img}: {len(ours)} detection(s) on armnn/CpuAcc, {board.describe}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("weights", ["per-tensor", "per-channel"])
def test_an_int8_bundle_runs_on_cpuacc_within_its_quantization_steps(board, bundles_dir, tmp_path, weights):
    """A QDQ model with int8 weights, per tensor or per output channel (the per-axis scales from the
    TFLite model the agent makes from the order, through Arm NN's TfLite parser): its quantized orders (order_version 2, or
    5 where long scale lists are in the blob) run on Arm NN with every layer on CpuAcc (ACL's int8 kernels), and the output is within the
    manifest's tolerance, in quantization steps of the output, of onnxruntime's run of the QDQ model
    on the host. Per channel the model is an inverted residual block's convolutions in one order,
    whose depthwise reads a convolution's output: 20.08 computed that wrongly (95% of the elements
    off, caught by the load-time check) until the depthwise read a copy (Api.per_axis_depthwise_copy)."""
    from support.qdq import mbconv_cnn, quantized_small_cnn

    per_channel = weights == "per-channel"
    _, q = quantized_small_cnn(tmp_path, per_channel=per_channel, activations="int8",
                               model=mbconv_cnn() if per_channel else None)
    bundle = compiled(f"{'mbconv' if per_channel else 'small'}_int8_{weights.replace('-', '_')}", q, bundles_dir,
                      "--policy", "all")
    with hmod.open_bundle(bundle) as b:
        # per channel: the per-axis TFLite model the agent makes from each order
        quantized = {p["symbol"]: armnn_tflite.quant_model(b.order(p["symbol"])) for p in b.manifest["partitions"]
                     if p["delegate"] and orders.is_quantized(b.order(p["symbol"]))}
    assert len(quantized) >= 2
    assert all(quantized.values()) if weights == "per-channel" else not any(quantized.values())
    report, outs, secs = run_on_board(board, bundle, tmp_path, "--delegate", "armnn")
    for sg in report["subgraphs"]:
        if sg["symbol"] in quantized:
            assert sg["executor"] == "armnn" and sg["backend"] == "CpuAcc", sg
            assert set(sg.get("layers") or {}) == {"CpuAcc"}, sg
    man = manifest_of(bundle)
    step, atol = man["quantized"]["steps"]["logits"], man["tolerance"]["atol"]
    diff = float(np.abs(outs[0].astype(np.float64) - reference(bundle)[0]).max())
    # in whole steps: one step between two float32 dequantized outputs is the float64 step give or
    # take float32's rounding (1.0000007 steps was measured)
    assert diff / step <= atol / step + 1e-4, f"INT8 on CpuAcc is {diff / step:.1f} steps from onnxruntime's QDQ run (tolerance {atol / step:.0f})"
    print(f"{'mbconv' if per_channel else 'small'} CNN INT8 ({weights}) on armnn/CpuAcc ({board.describe}): "
          f"{diff / step:.0f} step(s) from "
          f"onnxruntime's QDQ run, tolerance {atol / step:.0f}; {secs:.1f} s")


def test_an_npu_bundle_runs_its_onnx_rendering_on_a_board_without_the_npu_runtime(board, bundles_dir, tmp_path):
    """compile --npu (fp16, the RKNN toolkit on the host) gives an rknn order; the emulated boards
    have rknn-toolkit-lite2 where a wheel exists for their Python (install-on-board.sh with
    TANDOOR_RKNN=1) but no librknnrt.so and no NPU: the agent runs the order's ONNX rendering
    through onnxruntime, matches the reference and says why the NPU is unavailable."""
    import onnx
    from onnx import TensorProto as T
    from onnx import helper
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(31)
    w = nh.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"])], "npu_conv",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 8, 32, 32])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    src, bundle = tmp_path / "npu_conv.onnx", bundles_dir / "npu_conv.hmod"
    onnx.save(m, src)
    if not bundle.exists():
        run_cli("tandoor", "compile", str(src), "-o", str(bundle), "--target", "rk3588", "--npu", "--npu-dtype",
                "fp16", check=True)
    report, outs, _ = run_on_board(board, bundle, tmp_path)
    [sg] = report["subgraphs"]
    assert sg["executor"] == "onnxruntime", sg
    lite = board.run([f"{board.venv}/bin/python", "-c", "import rknnlite.api"], timeout=600).returncode == 0
    want = "librknnrt.so not found" if lite else "rknn-toolkit-lite2 not importable"
    assert sg["npu_unavailable"].startswith(want), (sg, board.describe)
    assert report["npu"] == f"unavailable ({sg['npu_unavailable']})"
    assert_matches(outs, reference(bundle), "npu_conv")
    print(f"npu fallback on {board.describe}: rknnlite {'installed' if lite else 'absent'}: {sg['npu_unavailable']}")


def test_an_int8_npu_bundle_deployed_over_mqtt_commits_on_the_board_through_its_fallback(board, tmp_path):
    """The agent service on the board (no librknnrt.so, no NPU), a real mosquitto on the host: an
    INT8 NPU bundle (golden pairs: stored held-out frames) deployed with the fleet's rollout commits
    through the health gate on the rknn order's ONNX rendering, and the retained status names the
    NPU as unavailable and why."""
    if not isinstance(board, EmulatedBoard):
        pytest.skip("the broker runs on this host: the emulated boards share its network")
    from support.agents import acks, deploy, running_sha, seed_slots, write_config
    from support.bundle_edit import rewrite, sha, version
    from support.mosquitto import Broker, Recorder
    from support.npu import npu_cnn, npu_frames
    from tandoor_compiler.pipeline import compile_model

    hmod.generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub.pem")
    base = tmp_path / "npu.hmod"
    compile_model(npu_cnn(tmp_path / "npu_cls.onnx"), base, targets=["rk3588"], npu=True, npu_dtype="int8",
                  npu_samples=npu_frames(), measure="off", key=tmp_path / "k.pem")
    v1, v2 = (rewrite(base, tmp_path / f"v{i}.hmod", version(str(i)), tmp_path / "k.pem") for i in (1, 2))
    remote = board.mkdir()                       # /work/d-...: the board's view of `here`
    here = board.share / Path(remote).name
    shutil.copy2(tmp_path / "k.pub.pem", here / "k.pub.pem")
    seed_slots(here / "slots", v1, tmp_path / "k.pub.pem")
    lite = board.run([f"{board.venv}/bin/python", "-c", "import rknnlite.api"], timeout=600).returncode == 0
    want = "librknnrt.so not found" if lite else "rknn-toolkit-lite2 not importable"
    broker = Broker(tmp_path / "broker").start()
    write_config(here / "n1.toml", device_id="b1", slot_dir=f"{remote}/slots", trusted_keys=[f"{remote}/k.pub.pem"],
                 delegate="auto", telemetry_period_s=1.0, results_max_rate_hz=5.0,
                 broker={"host": "127.0.0.1", "port": broker.port, "reconnect_min_s": 0.5, "reconnect_max_s": 2.0},
                 camera={"source": "synthetic:64x48@5"})      # the bookworm image has no /etc/hosts
    rec = Recorder(broker.port, "tandoor/#").start()
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen(board.command([f"{board.venv}/bin/tandoor-agent", "--config", f"{remote}/n1.toml"]),
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        st = running_sha(rec, "b1", sha(v1), 600)
        assert st["npu"].startswith(f"unavailable ({want}"), st
        res = deploy(broker.port, v2, ["b1"], job_id="npu-board", timeout=600)
        assert res["devices"]["b1"]["state"] == "committed", (res, (tmp_path / "agent.log").read_text()[-3000:])
        assert "health gate passed" in res["devices"]["b1"]["reason"]
        st = running_sha(rec, "b1", sha(v2), 120)
        assert st["npu"].startswith(f"unavailable ({want}") and [e["executor"] for e in st["executors"]] == ["onnxruntime"]
        assert "committed" in [a["state"] for a in acks(rec, "b1", "npu-board")]
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(10)
        log.close()
        rec.stop()
        broker.stop()
