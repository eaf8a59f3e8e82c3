"""The compile cache (compiler/cache.py) as a user meets it through `tandoor compile`: a second
compile of the same model with the same options is the first one's bundle, re-dated and re-signed,
without running a stage; anything that changes the output (the model's bytes, an option, the
compiler's source) misses; `--no-cache` and TANDOOR_COMPILE_CACHE=0 compile afresh; a damaged
entry is recompiled; two compiles of one model at once compile it once; `inspect` and
`tandoor cache` say what came from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import BIN, manifest_of, run_cli
from tandoor_contract import hmod

RNG = np.random.default_rng(28)


def _tiny(path: Path, seed_scale: float = 0.3) -> Path:
    w1 = numpy_helper.from_array((RNG.standard_normal((8, 3, 3, 3)) * seed_scale).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((RNG.standard_normal((8, 8, 3, 3)) * seed_scale).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32, 32])], [w1, w2])
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString())
    return path


@pytest.fixture
def env(tmp_path) -> dict:
    """The CLI's environment with a cache of this test's own."""
    return {**os.environ, "TANDOOR_COMPILE_CACHE": str(tmp_path / "cache")}


def _compile(model: Path, out: Path, env: dict, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    res = run_cli("tandoor", "compile", str(model), "-o", str(out), "--target", "aarch64", "--timings",
                  *extra, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stderr[res.stderr.rindex("stage      seconds"):].splitlines()[1:]   # --timings, printed last
    stages = {name: float(secs) for name, secs in (ln.split() for ln in table)}
    return res, stages


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if n not in (hmod.MANIFEST, hmod.SIGNATURE)}


def test_a_second_compile_is_the_first_ones_bundle_resigned_and_redated(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    first, stages1 = _compile(model, tmp_path / "a.hmod", env)
    assert {"load", "build", "check"} <= set(stages1), stages1
    man1 = manifest_of(tmp_path / "a.hmod")
    assert man1["cache"]["hit"] is False

    run_cli("tandoor", "keygen", "-o", str(tmp_path / "k"), check=True)
    second, stages2 = _compile(model, tmp_path / "b.hmod", env, "--model-version", "2", "--build", "7",
                               "--key", str(tmp_path / "k.pem"))
    assert set(stages2) <= {"cache", "write", "total"}, f"a stage ran on a hit: {stages2}"
    said = " ".join(second.stderr.split())    # rich wraps the summary at the terminal's width
    assert "taking the bundle from the compile cache" in said and "from the compile cache (first compiled" in said
    man2 = manifest_of(tmp_path / "b.hmod")
    assert man2["cache"] == {"key": man1["cache"]["key"], "hit": True, "compiled": man1["created"]}
    assert man2["model"]["version"] == "2" and man2["build"] == 7 and man2["created"] >= man1["created"]
    # the same libraries, orders, weights and golden outputs: only the manifest and the signature differ
    assert _members(tmp_path / "a.hmod") == _members(tmp_path / "b.hmod")
    with hmod.open_bundle(tmp_path / "b.hmod", trusted_keys=[tmp_path / "k.pub.pem"]) as b:
        assert b.verified
    v = run_cli("tandoor", "verify", str(tmp_path / "b.hmod"), "--reference", str(model), "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stdout[-1500:]

    shown = run_cli("tandoor", "inspect", str(tmp_path / "b.hmod"), check=True, env={**env, "COLUMNS": "200"}).stdout
    shown = " ".join(shown.split())
    assert "taken from the compile cache" in shown and man1["cache"]["key"][:12] in shown
    listing = run_cli("tandoor", "cache", env=env, check=True).stdout
    assert "1 entry" in listing and "tiny.onnx" in listing and "aarch64" in listing


def test_what_changes_the_output_misses(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    _compile(model, tmp_path / "a.hmod", env)
    key = manifest_of(tmp_path / "a.hmod")["cache"]["key"]
    for i, (m, extra) in enumerate([(model, ("--policy", "all")), (model, ("--name", "renamed")),
                                    (_tiny(tmp_path / "other.onnx"), ())]):
        _, stages = _compile(m, tmp_path / f"m{i}.hmod", env, *extra)
        man = manifest_of(tmp_path / f"m{i}.hmod")
        assert "build" in stages and man["cache"]["hit"] is False and man["cache"]["key"] != key, extra


def test_frame_and_result_flags_rewrite_the_manifest_of_a_hit(tmp_path, env):
    """--mean/--std/--bgr/--resize, --decoder and its options, --labels change what the manifest
    says about frames and results, not what is compiled: a hit with the new entries, checked as a
    fresh compile would check them."""
    model = _tiny(tmp_path / "tiny.onnx")
    _compile(model, tmp_path / "a.hmod", env)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class{i}" for i in range(8)))
    _, stages = _compile(model, tmp_path / "b.hmod", env, "--mean", "0.5", "--std", "0.25", "--bgr", "--resize",
                         "letterbox", "--decoder", "classifier", "--labels", str(labels))
    assert "build" not in stages
    man = manifest_of(tmp_path / "b.hmod")
    assert man["cache"]["hit"] is True
    assert man["preprocess"]["bgr"] is True and man["preprocess"]["mean"] == [0.5]
    assert man["preprocess"]["resize"] == "letterbox" and man["postprocess"]["decoder"] == "classifier"
    with zipfile.ZipFile(tmp_path / "b.hmod") as z:
        assert z.read("labels.txt") == labels.read_bytes() and man["labels"] == "labels.txt"
    _compile(model, tmp_path / "c.hmod", env)    # and back: no labels, no preprocessing
    man = manifest_of(tmp_path / "c.hmod")
    assert man["preprocess"] is None and man["postprocess"] is None and man["labels"] is None
    assert "labels.txt" not in zipfile.ZipFile(tmp_path / "c.hmod").namelist()
    bad = run_cli("tandoor", "compile", str(model), "-o", str(tmp_path / "d.hmod"), "--target", "aarch64",
                  "--mean", "0.5,0.2", env=env)
    assert bad.returncode == 2 and "--mean has 2 values; the input has 3 channels" in bad.stderr
    assert not (tmp_path / "d.hmod").exists()


def test_the_compilers_source_is_part_of_the_key(tmp_path):
    """A changed compiler never hits an entry of the old one: one byte of one source file changes
    the fingerprint the key is made with."""
    from tandoor_compiler import cache

    import tandoor_compiler

    src = Path(tandoor_compiler.__file__).parent
    copy = tmp_path / "compiler"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.fingerprint({"tandoor_compiler": copy}) == cache.fingerprint({"tandoor_compiler": src})
    (copy / "stages" / "passes.py").write_text((copy / "stages" / "passes.py").read_text() + "\n# a change\n")
    assert cache.fingerprint({"tandoor_compiler": copy}) != cache.fingerprint({"tandoor_compiler": src})
    (copy / "new_pass.py").write_text("")
    assert len({cache.fingerprint({"tandoor_compiler": d}) for d in (src, copy)}) == 2


def test_no_cache_and_the_cache_turned_off_compile_afresh_and_store_nothing(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    _, stages = _compile(model, tmp_path / "a.hmod", env, "--no-cache")
    assert "build" in stages and "cache" not in manifest_of(tmp_path / "a.hmod")
    assert not list((tmp_path / "cache").glob("*.hmod")) if (tmp_path / "cache").exists() else True
    off = {**env, "TANDOOR_COMPILE_CACHE": "0"}
    _compile(model, tmp_path / "b.hmod", off)
    _, stages = _compile(model, tmp_path / "c.hmod", off)
    assert "build" in stages
    assert "the compile cache is off" in run_cli("tandoor", "cache", env=off, check=True).stdout


def test_a_damaged_entry_is_compiled_again(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    _compile(model, tmp_path / "a.hmod", env)
    entry = next((tmp_path / "cache").glob("*.hmod"))
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF            # one flipped byte inside a member
    entry.write_bytes(bytes(data))
    _, stages = _compile(model, tmp_path / "b.hmod", env)
    assert "build" in stages and manifest_of(tmp_path / "b.hmod")["cache"]["hit"] is False
    _, stages = _compile(model, tmp_path / "c.hmod", env)     # and the new entry serves
    assert "build" not in stages and manifest_of(tmp_path / "c.hmod")["cache"]["hit"] is True


def test_two_compiles_of_one_model_at_once_compile_it_once(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    procs = [subprocess.Popen([str(BIN / "tandoor"), "compile", str(model), "-o", str(tmp_path / f"{i}.hmod"),
                               "--target", "aarch64", "-q"], env=env, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        assert p.wait(600) == 0, p.stderr.read()
    hits = sorted(manifest_of(tmp_path / f"{i}.hmod")["cache"]["hit"] for i in range(2))
    assert hits == [False, True]
    assert len(list((tmp_path / "cache").glob("*.hmod"))) == 1


def test_a_failpoint_runs_its_stage_instead_of_the_cache(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    _compile(model, tmp_path / "a.hmod", env)
    res = run_cli("tandoor", "compile", str(model), "-o", str(tmp_path / "b.hmod"), "--target", "aarch64", "-q",
                  env={**env, "TANDOOR_FAILPOINT": "compile:build"})
    assert res.returncode == 3 and "internal error in stage build" in res.stderr
    assert not (tmp_path / "b.hmod").exists()


def test_the_cache_is_cleared_on_request(tmp_path, env):
    model = _tiny(tmp_path / "tiny.onnx")
    _compile(model, tmp_path / "a.hmod", env)
    out = run_cli("tandoor", "cache", "--clear", env=env, check=True).stdout
    assert "removed 1 entry" in out
    assert json.loads(run_cli("tandoor", "cache", "--json", env=env, check=True).stdout)["entries"] == []


def test_a_tiny_models_compile_takes_seconds_not_tens(tmp_path, env):
    """The fixed cost of one compile, stage by stage (`--timings`): TVM's start without torch, the
    self-check in a runtime-only process. Seconds are for docs/benchmarks.md; here the stages that
    must not run for a tiny model's host + aarch64 compile are checked, and that none of them
    spent time in torch (not imported: the check process and the compiler keep it out)."""
    model = _tiny(tmp_path / "tiny.onnx")
    res, stages = _compile(model, tmp_path / "a.hmod", env, "--no-cache")
    assert "measure" not in stages      # a board target decides from estimates
    assert set(stages) >= {"startup", "load", "build", "golden", "write", "check"}
    code = ("import sys, runpy; sys.argv=['tandoor','compile',sys.argv[1],'-o',sys.argv[2],'-q','--no-cache'];"
            "from tandoor_host.cli import main\ntry:\n main()\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(model), str(tmp_path / "b.hmod")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr[-2000:]
