"""One TVM fallback library per target (format_version 4): a model of several delegated subgraphs
holds one library per target, a function per subgraph, and computes on the TVM fallback path what
the old layout (a library per subgraph and target, format 2) computes; bundles in the old layout
still load and run."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandoor_compiler.stages import codegen
from tandoor_compiler import pipeline
from tandoor_contract import hmod, probe


def _model(path: Path) -> Path:
    """conv -> sin -> conv -> sin -> conv: ACL takes the convs, not sin, so three subgraphs."""
    rng = np.random.default_rng(32)
    nodes, inits, x = [], [], "x"
    for i in range(3):
        inits.append(numpy_helper.from_array((rng.standard_normal((4, 4 if i else 3, 3, 3)) * 0.3).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        x = f"c{i}"
        if i < 2:
            nodes.append(helper.make_node("Sin", [x], [f"s{i}"]))
            x = f"s{i}"
    g = helper.make_graph(nodes, "three", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, 16, 16])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _old_build(plan, fallbacks, tgts, members, say, gpu_mod=None, gpu_tuning=None):
    """pipeline._build before format 4: a fallback library per subgraph and target, each with main
    (no GPU part: the targets here have none)."""
    lowered = codegen.lower_regions(plan.result.mod)
    entries = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in tgts:
            lib = Path(tmp) / f"{t.name}.so"
            codegen.build(lowered, t.llvm, lib, t.cross_cc, frozenset(p.symbol for p in plan.kept))
            members[f"lib/{t.name}.so"] = lib.read_bytes()
            entry = {"arch": t.arch, "lib": f"lib/{t.name}.so", "llvm": t.llvm, "fallback": {}}
            for symbol, mod in fallbacks.items():
                fb = Path(tmp) / f"{t.name}.{symbol}.so"
                codegen.build(mod, t.llvm, fb, t.cross_cc)
                entry["fallback"][symbol] = member = f"fallback/{t.name}/{symbol}.so"
                members[member] = fb.read_bytes()
            entries[t.name] = entry
    return entries


def _run_on_tvm(path: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    from tandoor_agent.run.runtime import HybridModule

    with hmod.open_bundle(path) as b:
        m = HybridModule(b, delegate="tvm")
        try:
            assert {s["executor"] for s in m.describe()} == {"tvm"}
            return [np.array(o) for o in m.run(inputs)]
        finally:
            m.close()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("fblib")
    src = _model(d / "three.onnx")
    new = d / "new.hmod"
    pipeline.compile_model(src, new, policy="all", measure="off", cache=False)
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "_build", _old_build)
    try:
        old = d / "old.hmod"
        pipeline.compile_model(src, old, policy="all", measure="off", cache=False, check=False)
    finally:
        mp.undo()
    return src, new, old


def test_every_subgraph_is_a_function_of_one_library_per_target(bundles):
    src, new, old = bundles
    with hmod.open_bundle(new) as b:
        man = b.manifest
    symbols = [p["symbol"] for p in man["partitions"] if p["delegate"]]
    assert len(symbols) == 3 and man["format_version"] == 4
    assert man["targets"]["host"]["fallback"] == dict.fromkeys(symbols, hmod.fallback_lib("host"))
    with zipfile.ZipFile(new) as z, zipfile.ZipFile(old) as zo:
        libs = [n for n in z.namelist() if n.startswith("fallback/")]
        old_libs = {n: zo.getinfo(n).file_size for n in zo.namelist() if n.startswith("fallback/")}
        assert libs == [hmod.fallback_lib("host")] and len(old_libs) == 3
        # the runtime glue once instead of three times, and packed
        packed = z.read(libs[0])
    lib = hmod.unpack_lib(packed, libs[0])
    assert lib[:4] == b"\x7fELF" and len(packed) < 0.5 * len(lib)
    assert len(lib) < 0.6 * sum(old_libs.values()), old_libs


def test_the_old_layout_still_loads_and_both_compute_what_onnxruntime_does(bundles):
    src, new, old = bundles
    with hmod.open_bundle(old) as b:
        assert b.manifest["format_version"] == hmod.PLAIN_FORMAT_VERSION
    x = probe.inputs({"inputs": [{"shape": [1, 3, 16, 16], "dtype": "float32"}]}, seed=5)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x[0]})[0]
    got_new, got_old = _run_on_tvm(new, x)[0], _run_on_tvm(old, x)[0]
    assert np.array_equal(got_new, got_old)          # the same functions, only packed together
    np.testing.assert_allclose(got_new.reshape(want.shape), want, rtol=1e-4, atol=1e-4)


def test_inspect_sizes_says_where_the_bytes_go(bundles, tmp_path):
    import json

    from support.cli import run_cli

    src, new, old = bundles
    res = run_cli("tandoor", "inspect", str(new), "--sizes", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    kinds = {r["kind"]: r for r in info["kinds"]}
    assert info["file_bytes"] == new.stat().st_size == sum(r["bytes"] for r in info["kinds"]) + info["zip_overhead"]
    assert kinds["TVM fallbacks"]["members"] == 1 and kinds["order weights"]["members"] == 3
    assert info["format_version"] == 4
    text = run_cli("tandoor", "inspect", str(old), "--sizes")
    assert text.returncode == 0 and "TVM fallbacks" in text.stdout and "3 member(s)" in text.stdout, text.stdout
    bad = tmp_path / "bad.hmod"
    bad.write_bytes(b"not a zip")
    res = run_cli("tandoor", "inspect", str(bad), "--sizes")
    assert res.returncode == hmod.NotABundle.exit_code and len(res.stderr.strip().splitlines()) == 1, res.stderr
