"""The compiler end to end on real models: partition decisions, bundles, verification."""

from __future__ import annotations

from collections import Counter

import pytest

from support.cli import compiled, manifest_of, run_cli
from tandoor_compiler.stages import frontend, importer, partition, passes
from tandoor_contract import hmod
from tandoor_zoo import models as zoo

CNNS = sorted(zoo.ALL_CNNS)


def _partitioned(model_path):
    m = frontend.load(model_path)
    mod, facts = passes.optimise(importer.to_relax(m))
    return partition.partition(mod, m.name)


# Partitioner decisions per model, as TVM's ACL tests asserted them: number of ACL subgraphs
# and exactly which ops stay in TVM.
EXPECTED = {
    "efficientnet_lite0": (1, Counter()),
    "mobilenet_v2": (1, Counter()),
    "resnet18": (1, Counter()),
    "squeezenet11": (1, Counter()),
    "vgg_small": (1, Counter()),
}


@pytest.mark.parametrize("name", CNNS)
def test_partition_decisions(name):
    r = _partitioned(zoo.ALL_CNNS[name]())
    subgraphs, tvm_ops = EXPECTED[name]
    assert len(r.partitions) == subgraphs
    assert Counter(op for op, _ in r.tvm_ops) == tvm_ops
    assert r.ops_delegated / r.ops_total >= 0.9
    ops = Counter(o for p in r.partitions for o in p.ops)
    assert ops["relax.nn.conv2d"] >= 8          # convolutions are what ACL is for
    assert "relax.nn.batch_norm" not in ops      # folded away before partitioning
    symbols = [p.symbol for p in r.partitions]
    assert len(set(symbols)) == len(symbols)


def test_unsupported_op_in_the_middle_splits_into_two_subgraphs():
    r = _partitioned(zoo.with_unsupported_middle())
    assert len(r.partitions) == 2
    assert [op for op, _ in r.tvm_ops] == ["relax.erf"]
    assert "no ACL kernel for erf" in r.tvm_ops[0][1]
    assert r.partitions[0].symbol != r.partitions[1].symbol


def test_grouped_conv_is_left_to_tvm_with_a_reason(tmp_path):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 2, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=2, pads=[1, 1, 1, 1]), helper.make_node("Relu", ["y"], ["z"])],
        "grouped", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 8, 16, 16])], [w])
    p = tmp_path / "grouped.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    r = _partitioned(p)
    reasons = dict(r.tvm_ops)
    assert "grouped convolution (groups=2" in reasons["relax.nn.conv2d"]


@pytest.mark.parametrize("name", CNNS + ["with_unsupported_middle"])
def test_compile_host_and_aarch64_then_verify(name, bundles_dir):
    model = getattr(zoo, name)()
    out = compiled(name, model, bundles_dir)
    m = manifest_of(out)
    assert set(m["targets"]) == {"host", "aarch64"}
    assert m["targets"]["aarch64"]["arch"] == "aarch64"
    # one fallback library per target: format 4 (hmod.format_version_for)
    assert m["format_version"] == 4 and all(g["inputs"] == "probe" for g in m["golden"])
    assert 0.9 <= m["delegation_ratio"] <= 1.0
    assert m["ops_delegated"] <= m["ops_total"]
    import zipfile

    with zipfile.ZipFile(out) as z:
        elf = hmod.unpack_lib(z.read(hmod.packed_lib("aarch64")), "aarch64")   # format 4: packed
        host = hmod.unpack_lib(z.read(hmod.packed_lib("host")), "host")
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183   # EM_AARCH64
    assert int.from_bytes(host[18:20], "little") == 62                                # EM_X86_64
    res = run_cli("tandoor", "verify", str(out), "--reference", str(model), "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    import json

    v = json.loads(res.stdout)
    assert v["ok"] is True and v["max_abs_err"] < 1e-3
    assert {s["executor"] for s in v["subgraphs"]} == {"onnxruntime"}

    # weights are stored once: the ONNX renderings and the TVM fallbacks refer to the order's blob
    with zipfile.ZipFile(out) as z:
        size = {i.filename: i.file_size for i in z.infolist()}
    for p in m["partitions"]:
        if not p["delegate"]:
            continue
        blob = size[p["weights"]]
        assert size[p["onnx"]] < 0.05 * blob + 65536, (p["symbol"], size[p["onnx"]], blob)
        assert p["onnx_external"] == {f"{p['symbol']}.bin": p["weights"]}
        params = p["fallback_params"]
        assert params and sum(q["nbytes"] for q in params) >= 0.9 * blob
        in_blob = sum(q["nbytes"] for q in params if q["member"] == p["weights"])
        assert in_blob >= 0.95 * sum(q["nbytes"] for q in params)
    blobs = sum(size[p["weights"]] for p in m["partitions"] if p["delegate"])
    # one fallback library per target, a function per subgraph, and no weights in it
    delegated = {p["symbol"] for p in m["partitions"] if p["delegate"]}
    for name_, t in m["targets"].items():
        assert t["fallback"] == dict.fromkeys(delegated, hmod.fallback_lib(name_)), t["fallback"]
        assert size[hmod.fallback_lib(name_)] < 0.3 * blobs + 300_000, (name_, blobs)
    assert sum(size.values()) < 1.3 * blobs + 2_000_000


def test_verify_fails_against_a_different_model(bundles_dir):
    out = compiled("resnet18", zoo.resnet18(), bundles_dir)
    res = run_cli("tandoor", "verify", str(out), "--reference", str(zoo.mobilenet_v2()), "--json")
    assert res.returncode == 1
    import json

    v = json.loads(res.stdout)
    assert v["ok"] is False and v["max_abs_err"] > 1e-3 and v["reference_matches_source"] is False


def test_inspect_json_keys_and_graph(bundles_dir, tmp_path):
    import json

    out = compiled("with_unsupported_middle", zoo.with_unsupported_middle(), bundles_dir)
    svg = tmp_path / "g.svg"
    res = run_cli("tandoor", "inspect", str(out), "--json", "--graph", str(svg), check=True)
    info = json.loads(res.stdout)
    for k in ("format_version", "model", "targets", "inputs", "outputs", "ops_total", "ops_delegated",
              "delegation_ratio", "predicted_speedup", "partitions"):
        assert k in info
    assert [p["delegate"] for p in info["partitions"]] == [True, True]
    assert all({"symbol", "ops", "delegate"} <= set(p) for p in info["partitions"])
    text = svg.read_text()
    graph = manifest_of(out)["graph"]
    legend = 3   # TVM + two ACL subgraphs
    assert text.startswith("<svg") and text.count("<rect") == len(graph["nodes"]) + legend
    assert len(graph["nodes"]) >= 12 and "erf" in text
    human = run_cli("tandoor", "inspect", str(out), check=True).stdout
    assert "no ACL kernel for erf" in human and "_acl_1" in human
    for p in info["partitions"]:  # the cost model's numbers per subgraph, as the manifest has them
        est = p["est"]
        assert 0 < est["p"] < 1 and f"{est['p']:.1%}" in human and f"{est['tvm_us']:.1f}" in human


# --- bad input: one line naming the problem and the fix, exit 2, nothing at the output path ----

def _bad(tmp_path, model, *extra, env=None):
    out = tmp_path / "out.hmod"
    res = run_cli("tandoor", "compile", str(model), "-o", str(out), "-q", *extra, env=env)
    assert res.returncode == 2, res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    assert not out.exists()
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
    return lines[0]


def test_not_onnx(tmp_path):
    p = tmp_path / "notes.onnx"
    p.write_text("this is not a model\n" * 10)
    assert "not a readable ONNX model" in _bad(tmp_path, p)


def test_truncated(tmp_path):
    p = tmp_path / "trunc.onnx"
    p.write_bytes(zoo.resnet18().read_bytes()[:100_000])
    msg = _bad(tmp_path, p)
    assert "trunc.onnx" in msg and ("truncated" in msg or "invalid" in msg)


def test_missing_file(tmp_path):
    assert "no such file" in _bad(tmp_path, tmp_path / "nope.onnx")


def test_op_neither_tvm_nor_acl_nor_onnxruntime_can_take(tmp_path):
    """A custom-domain op goes to the escape hatch (compiler/backends/onnx/hatch.py), and onnxruntime has no
    kernel for it either: refused in one line naming the op and all three."""
    msg = _bad(tmp_path, zoo.unsupported_op())
    assert "com.example::Frobnicate" in msg and "neither TVM nor ACL, nor by onnxruntime" in msg
    assert "replace them in the exported model" in msg


def test_unpinned_dynamic_dim(tmp_path):
    msg = _bad(tmp_path, zoo.dynamic_batch())
    assert "dynamic dims" in msg and "--input input=1x3x32x32" in msg


def test_dynamic_dim_pinned_compiles(tmp_path):
    out = tmp_path / "dyn.hmod"
    run_cli("tandoor", "compile", str(zoo.dynamic_batch()), "--input", "input=1x3x32x32", "-o", str(out), "-q", check=True)
    assert manifest_of(out)["inputs"][0]["shape"] == [1, 3, 32, 32]


def test_unknown_input_name(tmp_path):
    msg = _bad(tmp_path, zoo.dynamic_batch(), "--input", "image=1x3x32x32")
    assert "no input named 'image'" in msg and "input" in msg


def test_unknown_target(tmp_path):
    msg = _bad(tmp_path, zoo.dynamic_batch(), "--input", "input=1x3x32x32", "--target", "sparc")
    assert "unknown target 'sparc'" in msg and "rk3588" in msg


def test_missing_cross_compiler(tmp_path):
    import os

    env = dict(os.environ, PATH=str(tmp_path))   # nothing on PATH: no aarch64-linux-gnu-g++
    msg = _bad(tmp_path, zoo.dynamic_batch(), "--input", "input=1x3x32x32", "--target", "aarch64", env=env)
    assert "aarch64-linux-gnu-g++" in msg and "apt-get install g++-aarch64-linux-gnu" in msg


def test_failed_compile_keeps_the_previous_bundle(tmp_path):
    out = tmp_path / "good.hmod"
    run_cli("tandoor", "compile", str(zoo.dynamic_batch()), "--input", "input=1x3x32x32", "-o", str(out), "-q", check=True)
    before = out.read_bytes()
    res = run_cli("tandoor", "compile", str(zoo.unsupported_op()), "-o", str(out), "-q")
    assert res.returncode == 2
    assert out.read_bytes() == before


def _onnx_model(tmp_path, name, nodes, inputs, outputs, inits):
    import onnx
    from onnx import helper

    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    p = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    return p


@pytest.mark.parametrize("conv_bias", [True, False])
def test_batchnorm_folds_into_conv_with_and_without_bias(tmp_path, conv_bias):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    inits = [numpy_helper.from_array(f(8, 3, 3, 3), "w"), numpy_helper.from_array(f(8), "s"),
             numpy_helper.from_array(f(8), "b"), numpy_helper.from_array(f(8), "m"),
             numpy_helper.from_array(np.abs(f(8)) + 0.5, "v")]
    conv_in = ["x", "w"]
    if conv_bias:
        inits.append(numpy_helper.from_array(f(8), "cb"))
        conv_in.append("cb")
    nodes = [helper.make_node("Conv", conv_in, ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["y", "s", "b", "m", "v"], ["z"]),
             helper.make_node("HardSwish", ["z"], ["o"])]
    p = _onnx_model(tmp_path, "convbn", nodes, [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 16, 16])],
                    [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    r = _partitioned(p)
    assert r.tvm_ops == []
    comps = [c for part in r.partitions for c in part.composites]
    assert "acl.conv2d_bias" in comps                     # BN became the conv's bias
    assert any(c.startswith("acl.hardswish") for c in comps)
    assert not any("batch_norm" in o for part in r.partitions for o in part.ops)
