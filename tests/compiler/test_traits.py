"""The traits of ONNX files from the wild (/work/shared/notes/real-world-onnx.md), one tiny
generated model each, through the real `tandoor compile` (which also runs the bundle's golden
self-test) and `tandoor verify`: each compiles and matches onnxruntime, or is refused in one line
with exit 2. Every trait here broke the compiler before (a traceback, a refusal of something a
user expects to work, or wrong numbers shipped).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import manifest_of, run_cli

RNG = np.random.default_rng(20261201)
N = helper.make_node


def _w(*shape, scale=0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def model(nodes, inputs: dict, outputs: dict, inits: dict | None = None, *, opset: int = 17, ir: int = 8,
          inits_as_inputs: bool = False, value_info=(), constants: dict | None = None):
    inits = inits or {}
    g_inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items()]
    g_inputs = [_vi(n, s) for n, s in inputs.items()]
    if inits_as_inputs:   # IR-3/4: every weight is also a graph input
        g_inputs += [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype),
                                                   list(np.asarray(a).shape)) for n, a in inits.items()]
    const_nodes = [N("Constant", [], [n], value=numpy_helper.from_array(np.asarray(a), n))
                   for n, a in (constants or {}).items()]
    g = helper.make_graph(const_nodes + nodes, "trait", g_inputs, [_vi(n, s) for n, s in outputs.items()], g_inits,
                          value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def compile_(tmp: Path, name: str, m, *args: str) -> tuple:
    src = tmp / f"{name}.onnx"
    src.write_bytes(m.SerializeToString())
    out = tmp / f"{name}.hmod"
    res = run_cli("tandoor", "compile", str(src), "-o", str(out), "-q", *args)
    return res, src, out


def assert_compiles_and_matches(tmp: Path, name: str, m, *args: str) -> dict:
    res, src, out = compile_(tmp, name, m, *args)
    assert res.returncode == 0, f"{name}: exit {res.returncode}: {res.stderr[-2000:]}"
    assert "Traceback" not in res.stderr
    for delegate in ("onnxruntime", "tvm"):
        v = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--delegate", delegate, "--json")
        assert v.returncode == 0, f"{name} via {delegate}: {v.stdout[-1500:]} {v.stderr[-800:]}"
        assert json.loads(v.stdout)["ok"]
    return manifest_of(out)


def assert_refused(tmp: Path, name: str, m, *args: str, says: str) -> str:
    res, _, out = compile_(tmp, name, m, *args)
    assert res.returncode == 2, f"{name}: exit {res.returncode}: {res.stderr[-2000:]}"
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandoor: error: "), res.stderr
    assert says in lines[0], lines[0]
    assert not out.exists()
    return lines[0]


def delegated_composites(man: dict) -> list[str]:
    return [c for p in man["partitions"] if p["delegate"] for c in p["composites"]]


CONV = {"w": _w(8, 3, 3, 3), "b": _w(8)}


# --- 1. IR-3/IR-4: initializers listed as graph inputs -----------------------------------------------

def test_ir4_initializers_listed_as_inputs(tmp_path):
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["y"])],
              {"x": [1, 3, 16, 16]}, {"y": [1, 8, 16, 16]}, CONV, opset=9, ir=4, inits_as_inputs=True)
    man = assert_compiles_and_matches(tmp_path, "ir4", m, "--policy", "all")
    assert [i["name"] for i in man["inputs"]] == ["x"]          # weights are not inputs of the bundle
    assert any("also listed as graph inputs" in n for n in man["notes"])


# --- 2. stale value_info -----------------------------------------------------------------------------

def test_stale_value_info_is_dropped_and_shapes_inferred_again(tmp_path):
    stale = [_vi("c", [1, 8, 99, 99])]                          # what an old converter wrote
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["y"])],
              {"x": [1, 3, 16, 16]}, {"y": [1, 8, 7, 7]}, CONV, value_info=stale)
    man = assert_compiles_and_matches(tmp_path, "stale", m)
    assert man["outputs"][0]["shape"] == [1, 8, 16, 16]
    assert any("value_info" in n for n in man["notes"])


# --- 3. Split (a multi-output op) inside a delegated region ---------------------------------------

def test_split_inside_a_delegated_region(tmp_path):
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
               N("Split", ["c", "parts"], ["s0", "s1"], axis=1),
               N("Conv", ["s1", "w2"], ["c2"], pads=[1, 1, 1, 1]), N("Sigmoid", ["c2"], ["g"]),
               N("Mul", ["c2", "g"], ["silu"]),
               N("Concat", ["s0", "silu"], ["y"], axis=1)],
              {"x": [1, 3, 16, 16]}, {"y": [1, 8, 16, 16]},
              {**CONV, "parts": np.array([4, 4], np.int64), "w2": _w(4, 4, 3, 3)})
    man = assert_compiles_and_matches(tmp_path, "split", m, "--policy", "all")
    comps = delegated_composites(man)
    assert "acl.strided_slice" in comps and "acl.conv2d_silu" in comps, comps
    assert man["tvm_ops"] == [] and sum(p["delegate"] for p in man["partitions"]) == 1


# --- 4. Resize with both scales and sizes ------------------------------------------------------------

@pytest.mark.parametrize("empty", ["scales", "sizes"])
def test_resize_with_scales_and_sizes_one_of_them_empty(tmp_path, empty):
    inits = {**CONV, "roi": np.zeros(0, np.float32)}
    if empty == "scales":   # tf2onnx / keras: sizes given, scales an empty tensor
        inits.update(scales=np.zeros(0, np.float32), sizes=np.array([1, 8, 32, 32], np.int64))
    else:
        inits.update(scales=np.array([1, 1, 2, 2], np.float32), sizes=np.zeros(0, np.int64))
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
               N("Resize", ["c", "roi", "scales", "sizes"], ["y"], mode="nearest",
                 coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
              {"x": [1, 3, 16, 16]}, {"y": [1, 8, 32, 32]}, inits)
    man = assert_compiles_and_matches(tmp_path, f"resize_{empty}", m, "--policy", "all")
    assert "acl.resize2d" in delegated_composites(man)
    assert any("scales and sizes" in n for n in man["notes"])


# --- 5. ConvTranspose after the NHWC layout pass -------------------------------------------------------

def test_conv_transpose_after_the_layout_pass(tmp_path):
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["r"]),
               N("ConvTranspose", ["r", "wt", "bt"], ["y"], strides=[2, 2], kernel_shape=[2, 2])],
              {"x": [1, 3, 16, 16]}, {"y": [1, 4, 32, 32]}, {**CONV, "wt": _w(8, 4, 2, 2), "bt": _w(4)})
    man = assert_compiles_and_matches(tmp_path, "deconv", m, "--policy", "all", "--target", "aarch64")
    assert "acl.conv2d_transpose_bias" in delegated_composites(man)
    # the layout stays NHWC through the region: one transpose in, one out
    assert man["layout_transposes"] <= 2


def test_conv_transpose_kept_in_tvm_is_compiled_too(tmp_path):
    """policy none: the NHWC conv2d_transpose is TVM's to compile (its legaliser has no NHWC rule)."""
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
               N("ConvTranspose", ["c", "wt"], ["y"], strides=[2, 2], kernel_shape=[3, 3], pads=[1, 1, 0, 0],
                 output_padding=[1, 1])],
              {"x": [1, 3, 16, 16]}, {"y": [1, 4, 32, 32]}, {**CONV, "wt": _w(8, 4, 3, 3)})
    assert_compiles_and_matches(tmp_path, "deconv_tvm", m, "--policy", "none")


# --- 6. a placeholder static input shape and --input -------------------------------------------------

def _fully_conv(batch=10, h=32, w=32):
    return model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["y"])],
                 {"x": [batch, 3, h, w]}, {"y": [batch, 8, h, w]}, CONV)


def test_input_overwrites_a_placeholder_static_shape(tmp_path):
    man = assert_compiles_and_matches(tmp_path, "placeholder", _fully_conv(), "--input", "x=1x3x48x64")
    assert man["inputs"][0]["shape"] == [1, 3, 48, 64] and man["outputs"][0]["shape"] == [1, 8, 48, 64]
    assert any("overwritten with 1x3x48x64" in n for n in man["notes"])


def test_input_that_breaks_shape_inference_is_refused_in_one_line(tmp_path):
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Reshape", ["c", "shape"], ["y"])],
              {"x": [1, 3, 8, 8]}, {"y": [1, 512]}, {**CONV, "shape": np.array([1, 512], np.int64)})
    assert_refused(tmp_path, "badpin", m, "--input", "x=1x3x16x16", says="does not fit the model")


# --- 7. exporter habits that used to collapse delegation ---------------------------------------------

def test_constant_nodes_unfused_bn_decomposed_activations_all_in_one_subgraph(tmp_path):
    c = 8
    consts = {"w": _w(c, 3, 3, 3), "g": np.abs(_w(c)) + 0.5, "be": _w(c), "mu": _w(c), "var": np.abs(_w(c)) + 0.5,
              "three": np.array(3, np.float32), "zero": np.array(0, np.float32), "six": np.array(6, np.float32),
              "sixth": np.array(1 / 6, np.float32), "slope": np.abs(_w(c, 1, 1)) * 0.2, "lo": np.array(-1, np.float32),
              "hi": np.array(2, np.float32), "w2": _w(c, c, 1, 1)}
    nodes = [
        N("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        N("BatchNormalization", ["c", "g", "be", "mu", "var"], ["bn"]),            # no conv bias to fold into
        N("Add", ["bn", "three"], ["a3"]), N("Clip", ["a3", "zero", "six"], ["cl"]),  # x * clip(x+3, 0, 6) / 6
        N("Mul", ["bn", "cl"], ["m"]), N("Div", ["m", "six"], ["hs"]),
        N("Conv", ["hs", "w2"], ["c2"]),
        N("Add", ["c2", "three"], ["b3"]), N("Clip", ["b3", "zero", "six"], ["cl2"]),  # ... * (1/6)
        N("Mul", ["c2", "cl2"], ["m2"]), N("Mul", ["m2", "sixth"], ["hs2"]),
        N("HardSigmoid", ["hs2"], ["hsig"], alpha=0.2, beta=0.5),
        N("Sigmoid", ["hsig"], ["sg"]), N("Mul", ["hsig", "sg"], ["silu"]),      # SiLU written out
        N("PRelu", ["silu", "slope"], ["pr"]),
        N("Clip", ["pr", "lo", "hi"], ["y"]),                                    # Clip with min/max inputs
    ]
    m = model(nodes, {"x": [1, 3, 16, 16]}, {"y": [1, c, 16, 16]}, constants=consts)
    man = assert_compiles_and_matches(tmp_path, "habits", m, "--policy", "all", "--target", "aarch64")
    assert man["tvm_ops"] == [], man["tvm_ops"]
    assert sum(p["delegate"] for p in man["partitions"]) == 1
    comps = delegated_composites(man)
    assert sum(c.startswith("acl.hardswish") for c in comps) == 2 and "acl.prelu" in comps and "acl.silu" in comps
    assert "acl.hardsigmoid" in comps
    assert any("Constant node" in n for n in man["notes"])
    assert man["layout_transposes"] <= 2


# --- 8. opsets onnxruntime does not run -----------------------------------------------------------------

def test_an_opset_6_model_is_upgraded(tmp_path):
    """AveragePool-1, BatchNormalization-6 and Gemm-6 have no onnxruntime kernel."""
    inits = {"g": np.abs(_w(3)) + 0.5, "be": _w(3), "mu": _w(3), "var": np.abs(_w(3)) + 0.5, "fw": _w(5, 48),
             "fb": _w(5), "shape": np.array([1, 48], np.int64)}
    m = model([N("BatchNormalization", ["x", "g", "be", "mu", "var"], ["bn"], is_test=1),
               N("AveragePool", ["bn"], ["p"], kernel_shape=[4, 4], strides=[4, 4]),
               N("Reshape", ["p", "shape"], ["f"]),
               N("Gemm", ["f", "fw", "fb"], ["y"], transB=1)],
              {"x": [1, 3, 16, 16]}, {"y": [1, 5]}, inits, opset=6, ir=3, inits_as_inputs=True)
    man = assert_compiles_and_matches(tmp_path, "opset6", m)
    assert any("opset 6 upgraded" in n for n in man["notes"])


def test_a_model_onnxruntime_cannot_run_is_refused_in_one_line(tmp_path):
    """RoiAlign-22 has no onnxruntime kernel (TVM imports it): the bundle would have no reference for
    its golden pairs and its self-check."""
    m = model([N("RoiAlign", ["x", "rois", "idx"], ["y"], output_height=2, output_width=2)],
              {"x": [1, 3, 8, 8]}, {"y": [2, 3, 2, 2]},
              {"rois": np.array([[0, 0, 4, 4], [2, 2, 6, 6]], np.float32), "idx": np.array([0, 0], np.int64)},
              opset=22, ir=10)
    assert_refused(tmp_path, "roialign22", m, says="onnxruntime")


# --- 9. --policy all on a constant Concat operand and on Mul(x, x) --------------------------------------

def test_policy_all_with_a_constant_concat_operand_and_a_square(tmp_path):
    m = model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
               N("Mul", ["c", "c"], ["sq"]),
               N("Concat", ["sq", "k"], ["y"], axis=1)],
              {"x": [1, 3, 8, 8]}, {"y": [1, 10, 8, 8]}, {**CONV, "k": _w(1, 2, 8, 8)})
    man = assert_compiles_and_matches(tmp_path, "square", m, "--policy", "all")
    assert "acl.multiply" in delegated_composites(man)
    assert [t["op"] for t in man["tvm_ops"]] == ["concat"]
    assert "constant operand" in man["tvm_ops"][0]["reason"]


# --- 10. a Resize scale that no output size expresses ----------------------------------------------------

def test_resize_by_a_scale_the_sizes_cannot_express_is_refused(tmp_path):
    m = model([N("Resize", ["x", "", "scales"], ["y"], mode="linear", name="up")],
              {"x": [1, 3, 8, 8]}, {"y": [1, 3, 4, 4]}, {"scales": np.array([1, 1, 0.6, 0.6], np.float32)})
    line = assert_refused(tmp_path, "scale06", m, says="Resize node 'up'")
    assert "0.6" in line


# --- never a traceback -----------------------------------------------------------------------------------

def test_an_internal_failure_is_one_line_naming_the_stage_and_debug_shows_the_traceback(tmp_path):
    import os

    m = _fully_conv(1, 8, 8)
    src = tmp_path / "fp.onnx"
    src.write_bytes(m.SerializeToString())
    env = {**os.environ, "TANDOOR_FAILPOINT": "compile:codegen"}
    res = run_cli("tandoor", "compile", str(src), "-o", str(tmp_path / "fp.hmod"), "-q", env=env)
    assert res.returncode == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error in stage codegen" in lines[0] and "--debug" in lines[0], res.stderr
    res = run_cli("tandoor", "compile", str(src), "-o", str(tmp_path / "fp.hmod"), "-q", "--debug", env=env)
    assert res.returncode == 3 and "Traceback" in res.stderr and "failpoint compile:codegen" in res.stderr
    assert not (tmp_path / "fp.hmod").exists() and not list(tmp_path.glob(".fp.hmod*"))


def test_a_build_number_travels_in_the_signed_manifest_and_orders_releases(tmp_path):
    from tandoor_contract import hmod

    res, _, out = compile_(tmp_path, "build7", _fully_conv(1, 8, 8), "--build", "7", "--no-check")
    assert res.returncode == 0, res.stderr
    man = manifest_of(out)
    assert man["build"] == 7
    assert "build 5 is older than the committed build 7" in hmod.downgrade_reason({**man, "build": 5}, man)
    assert hmod.downgrade_reason({**man, "build": 8}, man) is None


# --- 11. an NHWC image input (MTCNN, Keras exports) ----------------------------------------------------

def test_an_nhwc_image_input_is_recorded_as_nhwc_and_the_agent_feeds_it_an_image(tmp_path):
    """MTCNN's O-Net takes 1x48x48x3: compile used to record every 4-D input as NCHW, and
    `tandoor-agent run --input face.png` then failed ("48 channels") as an internal error."""
    import cv2
    import onnxruntime as ort

    m = model([N("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]), N("Conv", ["t", "w"], ["c"], pads=[1, 1, 1, 1]),
               N("Relu", ["c"], ["y"])], {"x": [1, 48, 40, 3]}, {"y": [1, 4, 48, 40]}, {"w": _w(4, 3, 3, 3)})
    man = assert_compiles_and_matches(tmp_path, "nhwc", m, "--mean", "127.5", "--std", "128")
    assert man["inputs"][0]["layout"] == "NHWC" and man["preprocess"]["layout"] == "NHWC"
    img = (RNG.uniform(0, 255, (30, 25, 3))).astype(np.uint8)
    png = tmp_path / "img.png"
    cv2.imwrite(str(png), img[..., ::-1])  # RGB on disk
    res = run_cli("tandoor-agent", "run", str(tmp_path / "nhwc.hmod"), "--input", str(png), "--delegate",
                  "onnxruntime", "--save-outputs", str(tmp_path / "o"), "--json")
    assert res.returncode == 0, res.stderr
    x = ((cv2.resize(img, (40, 48), interpolation=cv2.INTER_LINEAR).astype(np.float32) - 127.5) / 128)[None]
    want = ort.InferenceSession(str(tmp_path / "nhwc.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "o" / "output_0.npy"), want, atol=2e-2)


def test_a_model_whose_input_is_no_image_runs_from_an_npy_array(tmp_path):
    m = model([N("Gemm", ["x", "w"], ["y"], transB=1)], {"x": [1, 16]}, {"y": [1, 5]}, {"w": _w(5, 16)})
    assert_compiles_and_matches(tmp_path, "vec", m)
    x = RNG.standard_normal((1, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = run_cli("tandoor-agent", "run", str(tmp_path / "vec.hmod"), "--input", str(tmp_path / "x.npy"), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["result"]["kind"] == "classifier"


def test_a_bundle_given_where_a_model_is_expected_is_named_so(tmp_path):
    res, _, out = compile_(tmp_path, "fc", _fully_conv(1, 8, 8), "--no-check")
    assert res.returncode == 0, res.stderr
    for cmd in (("compile", str(out), "-o", str(tmp_path / "again.hmod")), ("bench", str(out))):
        r = run_cli("tandoor", *cmd)
        assert r.returncode == 2 and "a Tandoor bundle, not an ONNX model" in r.stderr, r.stderr
        assert [ln for ln in r.stderr.splitlines() if "error" in ln] == [r.stderr.strip().splitlines()[-1]]
        assert "Traceback" not in r.stderr


def test_a_scalar_constant_in_a_delegated_region_stays_a_scalar(tmp_path):
    """A reduction to a scalar (keepdims=0 over every axis) scaled by scalar constants: the order's
    weights keep rank 0 (numpy's ascontiguousarray made them 1-element vectors, and the order's
    ONNX rendering failed onnx's checker: an internal error in codegen)."""
    m = model([N("ReduceMax", ["x"], ["m"], axes=[0, 1, 2], keepdims=0), N("Mul", ["m", "half"], ["z"]),
               N("Add", ["z", "three"], ["t"]), N("Reshape", ["t", "one"], ["y"])],
              {"x": [3, 1, 4]}, {"y": [1]},
              {"half": np.float32(0.5), "three": np.float32(3.0), "one": np.array([1], np.int64)}, opset=17)
    assert_compiles_and_matches(tmp_path, "scalar", m, "--policy", "all")
    order = next(iter(manifest_of(tmp_path / "scalar.hmod")["partitions"]))
    assert order["delegate"], order


def test_a_scalar_constant_beside_a_tensor_runs_on_arm_nn(tmp_path):
    """A sigmoid scaled by a scalar constant (YOLOv8's head): the order's rank-0 weight is one
    element for Arm NN, which has no rank-0 tensors, so the region stays on armnn."""
    m = model([N("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), N("Sigmoid", ["c"], ["s"]), N("Mul", ["s", "half"], ["y"])],
              {"x": [1, 3, 8, 8]}, {"y": [1, 4, 8, 8]}, {"w": _w(4, 3, 3, 3), "half": np.float32(0.5)}, opset=17)
    res, src, out = compile_(tmp_path, "conv_scalar", m, "--policy", "all")
    assert res.returncode == 0, res.stderr[-2000:]
    v = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--delegate", "armnn", "--json")
    assert v.returncode == 0, v.stdout[-1500:] + v.stderr[-800:]
    got = json.loads(v.stdout)
    assert got["ok"] and {s["executor"] for s in got["subgraphs"]} == {"armnn"}, got["subgraphs"]
