"""Ops exporters write out as chains (GELU, TF-style LayerNorm, rank-5 channel shuffles) fold into
one op each (compiler/stages/written_out.py) and no longer cut the delegated region; the bundle reports
its ACL/TVM boundaries. Each trait is a tiny generated model through the real `tandoor compile`
(with its golden self-test) and `tandoor verify` against onnxruntime, with every executor.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import manifest_of, run_cli
from tandoor_compiler.stages import written_out

RNG = np.random.default_rng(20261204)
N = helper.make_node


def _w(*shape, scale=0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _c(v) -> np.ndarray:
    return np.array(v, np.float32)


def _model(nodes, x_shape, y_shape, inits: dict) -> bytes:
    g = helper.make_graph(nodes, "cuts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                          [numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


def _conv(x: str, out: str, cin: int, cout: int, inits: dict, k: int = 1):
    inits[f"{out}_w"], inits[f"{out}_b"] = _w(cout, cin, k, k), _w(cout, scale=0.1)
    return N("Conv", [x, f"{out}_w", f"{out}_b"], [out], pads=[k // 2] * 4)


def compiled(tmp: Path, name: str, onnx_bytes: bytes) -> tuple[Path, Path, dict]:
    """Compiled with every supported op delegated (--policy all), checked by verify with each
    executor; returns (model, bundle, manifest) and the executors armnn's verify used."""
    src, out = tmp / f"{name}.onnx", tmp / f"{name}.hmod"
    src.write_bytes(onnx_bytes)
    res = run_cli("tandoor", "compile", str(src), "-o", str(out), "-q", "--policy", "all", "--measure", "off")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return src, out, manifest_of(out)


def verify(src: Path, out: Path, delegate: str) -> dict:
    v = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--delegate", delegate, "--json")
    assert v.returncode == 0, f"{delegate}: {v.stdout[-1500:]} {v.stderr[-800:]}"
    got = json.loads(v.stdout)
    assert got["ok"]
    return got


def regions(man: dict) -> list[dict]:
    return [p for p in man["partitions"] if p["delegate"]]


# --- GELU --------------------------------------------------------------------------------------

def _gelu_model(form: str) -> bytes:
    inits = {"half": _c(0.5), "one": _c(1.0)}
    if form == "erf_div":       # torch.onnx: x * 0.5 * (1 + erf(x / sqrt 2))
        inits["s"] = _c(math.sqrt(2))
        body = [N("Div", ["h", "s"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["p"]),
                N("Mul", ["h", "p"], ["m"]), N("Mul", ["m", "half"], ["g"])]
    elif form == "erf_mul":     # constants first, 0.5 * x first, x * 1/sqrt 2
        inits["s"] = _c(1 / math.sqrt(2))
        body = [N("Mul", ["s", "h"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["one", "e"], ["p"]),
                N("Mul", ["half", "h"], ["m"]), N("Mul", ["m", "p"], ["g"])]
    else:                       # tanh form, BERT/GPT-2 exports
        inits.update(three=_c(3.0), a=_c(0.044715), k=_c(math.sqrt(2 / math.pi)))
        body = [N("Pow", ["h", "three"], ["c3"]), N("Mul", ["c3", "a"], ["ac"]), N("Add", ["h", "ac"], ["i"]),
                N("Mul", ["i", "k"], ["ik"]), N("Tanh", ["ik"], ["t"]), N("Add", ["t", "one"], ["p"]),
                N("Mul", ["h", "half"], ["m"]), N("Mul", ["m", "p"], ["g"])]
    nodes = [_conv("x", "h", 3, 8, inits), *body, _conv("g", "y", 8, 4, inits)]
    return _model(nodes, [1, 3, 8, 8], [1, 4, 8, 8], inits)


@pytest.mark.parametrize("form", ["erf_div", "erf_mul"])
def test_gelu_erf_written_out_is_one_op_left_to_tvm_naming_the_release_that_has_it(tmp_path, form):
    src, out, man = compiled(tmp_path, form, _gelu_model(form))
    # one GELU in TVM, nothing of its chain (erf, the scaling multiplies) cut out around it
    assert [o["op"] for o in man["tvm_ops"]] == ["nn.gelu"]
    assert "only since 23.11" in man["tvm_ops"][0]["reason"]
    assert len(regions(man)) == 2
    # conv -> TVM -> conv: each region takes one tensor and gives one
    assert man["boundaries"] == 4
    for delegate in ("onnxruntime", "tvm", "armnn"):
        verify(src, out, delegate)


def test_gelu_tanh_written_out_is_delegated_inside_one_region(tmp_path):
    src, out, man = compiled(tmp_path, "gelu_tanh", _gelu_model("tanh"))
    assert man["tvm_ops"] == []
    (region,) = regions(man)
    assert "acl.gelu_tanh" in region["composites"]
    assert man["boundaries"] == 2
    for delegate in ("onnxruntime", "tvm"):
        verify(src, out, delegate)
    got = verify(src, out, "armnn")   # built from Multiplication, Addition and TanH layers
    assert [s["executor"] for s in got["subgraphs"]] == ["armnn"]


# --- LayerNorm ---------------------------------------------------------------------------------

def _layer_norm_model(form: str, affine: bool = True) -> bytes:
    c, inits = 16, {}
    inits.update(w=_w(c, c), two=_c(2.0), eps=_c(1e-5), gamma=_w(c) + 1, beta=_w(c, scale=0.1))
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("ReduceMean", ["h"], ["mu"], axes=[-1]), N("Sub", ["h", "mu"], ["d"]),
             N("Pow", ["d", "two"], ["d2"]) if form != "mul" else N("Mul", ["d", "d"], ["d2"]),
             N("ReduceMean", ["d2"], ["var"], axes=[2]), N("Add", ["var", "eps"], ["ve"]), N("Sqrt", ["ve"], ["sd"])]
    if form == "div":
        nodes.append(N("Div", ["d", "sd"], ["n"]))
    else:                       # TF: Reciprocal then Mul
        nodes += [N("Reciprocal", ["sd"], ["r"]), N("Mul", ["d", "r"], ["n"])]
    if affine:
        nodes += [N("Mul", ["n", "gamma"], ["ng"]), N("Add", ["ng", "beta"], ["a"])]
    else:
        del inits["gamma"], inits["beta"]
    nodes.append(N("MatMul", ["a" if affine else "n", "w"], ["y"]))
    return _model(nodes, [1, 10, c], [1, 10, c], inits)


@pytest.mark.parametrize("form,affine", [("reciprocal", True), ("div", True), ("mul", False)])
def test_tf_layer_norm_is_one_op_and_the_model_one_region(tmp_path, form, affine):
    src, out, man = compiled(tmp_path, f"ln_{form}", _layer_norm_model(form, affine))
    assert man["tvm_ops"] == []      # before: two means and a sqrt in TVM, four regions
    (region,) = regions(man)
    assert "acl.layer_norm" in region["composites"]
    assert man["boundaries"] == 2
    for delegate in ("onnxruntime", "tvm"):
        verify(src, out, delegate)
    got = verify(src, out, "armnn")   # Mean, Subtraction, Multiplication, Rsqrt layers
    assert [s["executor"] for s in got["subgraphs"]] == ["armnn"]


def test_a_mean_over_another_axis_is_not_a_layer_norm(tmp_path):
    """The variance's mean over axis 1 while the centring's is over the last: left as it was."""
    c = 16
    inits = {"w": _w(c, c), "two": _c(2.0), "eps": _c(1e-5)}
    nodes = [N("MatMul", ["x", "w"], ["h"]), N("ReduceMean", ["h"], ["mu"], axes=[-1]), N("Sub", ["h", "mu"], ["d"]),
             N("Pow", ["d", "two"], ["d2"]), N("ReduceMean", ["d2"], ["var"], axes=[1]), N("Add", ["var", "eps"], ["ve"]),
             N("Sqrt", ["ve"], ["sd"]), N("Div", ["d", "sd"], ["y"])]
    src, out, man = compiled(tmp_path, "not_ln", _model(nodes, [1, 10, c], [1, 10, c], inits))
    assert not any("layer_norm" in c for p in regions(man) for c in p["composites"])
    assert "sqrt" in [o["op"] for o in man["tvm_ops"]]
    verify(src, out, "onnxruntime")


# --- channel shuffle -----------------------------------------------------------------------------

def _shuffle_model(layout: str, groups: int = 2, c: int = 8, hw: int = 6, blocks: int = 2) -> bytes:
    """conv -> (Reshape rank 5 -> Transpose -> Reshape) x blocks; NCHW as ShuffleNet exports it, or
    on the last axis of an NHWC tensor as tf2onnx leaves TF's shuffle."""
    inits: dict = {}
    nodes = [_conv("x", "t0", 3, c, inits)]
    cur = "t0"
    if layout == "nhwc":
        nodes.append(N("Transpose", ["t0"], ["t0h"], perm=[0, 2, 3, 1]))
        cur = "t0h"
    for b in range(blocks):
        if layout == "nchw":
            inits[f"s5_{b}"] = np.array([1, groups, c // groups, hw, hw], np.int64)
            perm = [0, 2, 1, 3, 4]
        else:
            inits[f"s5_{b}"] = np.array([1, hw, hw, groups, c // groups], np.int64)
            perm = [0, 1, 2, 4, 3]
        inits[f"s4_{b}"] = np.array([1, c, hw, hw] if layout == "nchw" else [1, hw, hw, c], np.int64)
        nodes += [N("Reshape", [cur, f"s5_{b}"], [f"r5_{b}"]), N("Transpose", [f"r5_{b}"], [f"p_{b}"], perm=perm),
                  N("Reshape", [f"p_{b}", f"s4_{b}"], [f"r4_{b}"])]
        cur = f"r4_{b}"
        if layout == "nchw":
            nodes.append(_conv(cur, f"t{b + 1}", c, c, inits, 3))
            cur = f"t{b + 1}"
        else:
            inits[f"bias_{b}"] = _w(c)
            nodes.append(N("Add", [cur, f"bias_{b}"], [f"t{b + 1}"]))
            cur = f"t{b + 1}"
    nodes.append(N("Relu", [cur], ["y"]))
    return _model(nodes, [1, 3, hw, hw], [1, c, hw, hw] if layout == "nchw" else [1, hw, hw, c], inits)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_rank5_channel_shuffles_fold_into_one_region_without_layout_transposes(tmp_path, layout):
    src, out, man = compiled(tmp_path, f"shuffle_{layout}", _shuffle_model(layout))
    # before: the rank-5 reshapes and transposes stayed in TVM between NCHW<->NHWC transposes,
    # 3 regions and 6 layout transposes for the NCHW model
    assert man["tvm_ops"] == []
    assert len(regions(man)) == 1
    assert man["layout_transposes"] == (2 if layout == "nchw" else 1)   # the model input's (and output's)
    assert man["boundaries"] == 2
    for delegate in ("onnxruntime", "tvm"):
        verify(src, out, delegate)
    got = verify(src, out, "armnn")
    assert [s["executor"] for s in got["subgraphs"]] == ["armnn"]


def test_a_rank5_pair_that_only_swaps_h_and_w_is_a_rank4_transpose(tmp_path):
    """Reshape to [N, g, C/g, H, W], swap H and W, reshape back: no shuffle, one rank-4 transpose."""
    inits = {"s5": np.array([1, 2, 4, 6, 6], np.int64), "s4": np.array([1, 8, 6, 6], np.int64)}
    nodes = [_conv("x", "h", 3, 8, inits), N("Reshape", ["h", "s5"], ["r5"]),
             N("Transpose", ["r5"], ["p"], perm=[0, 1, 2, 4, 3]), N("Reshape", ["p", "s4"], ["y"])]
    src, out, man = compiled(tmp_path, "swap_hw", _model(nodes, [1, 3, 6, 6], [1, 8, 6, 6], inits))
    assert man["tvm_ops"] == [] and len(regions(man)) == 1
    verify(src, out, "onnxruntime")


def test_a_rank5_transpose_that_no_rank4_op_expresses_is_computed_as_written(tmp_path):
    """The split channel pair ends up apart ([N, g, H, C/g, W] merged to [N, g*H, C/g, W]): left as
    it is, rank 5 in TVM, still right."""
    inits = {"s5": np.array([1, 2, 4, 6, 6], np.int64), "s4": np.array([1, 12, 4, 6], np.int64)}
    nodes = [_conv("x", "h", 3, 8, inits), N("Reshape", ["h", "s5"], ["r5"]),
             N("Transpose", ["r5"], ["p"], perm=[0, 1, 3, 2, 4]), N("Reshape", ["p", "s4"], ["y"])]
    src, out, man = compiled(tmp_path, "rank5", _model(nodes, [1, 3, 6, 6], [1, 12, 4, 6], inits))
    assert any("rank-5" in o["reason"] for o in man["tvm_ops"])
    verify(src, out, "onnxruntime")


def test_every_plan_for_a_rank5_pair_equals_numpys_reshape_transpose_reshape():
    """written_out.shuffle_plan over every split, permutation and merge of two shapes: each plan it
    makes (shuffle an axis, then a rank-4 transpose) gives numpy's result of the rank-5 chain."""
    made = 0
    for s4 in ([1, 8, 6, 6], [2, 6, 4, 3]):
        x = RNG.standard_normal(s4)
        for a in range(4):
            for g in (d for d in range(1, s4[a] + 1) if s4[a] % d == 0):
                s5 = s4[:a] + [g, s4[a] // g] + s4[a + 1:]
                for p in itertools.permutations(range(5)):
                    moved = [s5[i] for i in p]
                    for b in range(4):
                        out = moved[:b] + [moved[b] * moved[b + 1]] + moved[b + 2:]
                        plan = written_out.shuffle_plan(s4, s5, list(p), out)
                        if plan is None:
                            continue
                        axis, groups, perm = plan
                        y = np.moveaxis(x, axis, -1)
                        if groups:
                            y = y.reshape(*y.shape[:-1], groups, -1).swapaxes(-1, -2).reshape(y.shape)
                        got = np.moveaxis(y, -1, axis).transpose(perm)
                        np.testing.assert_array_equal(got, x.reshape(s5).transpose(p).reshape(out))
                        made += 1
    assert made > 1000     # the channel shuffles, and every pair that is a plain transpose


def test_shufflenet_from_onnxs_wheel_keeps_no_rank5_op_and_no_inner_layout_transpose(tmp_path):
    """A real export (onnx's model-zoo ShuffleNet, placeholder weights, IR 3): 16 rank-5 channel
    shuffles. Before the fold: 20 regions, 34 layout transposes, 117 boundaries, reshapes and
    transposes in TVM; now only its grouped convolutions (no Arm NN layer) stay in TVM."""
    src = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_shufflenet.onnx"
    _, out, man = compiled(tmp_path, "shufflenet", src.read_bytes())
    assert {o["op"] for o in man["tvm_ops"]} == {"nn.conv2d"}
    assert all("grouped convolution" in o["reason"] for o in man["tvm_ops"])
    assert man["layout_transposes"] == 2                  # the input's and the output's
    assert len(regions(man)) <= 16 and man["boundaries"] <= 85
    verify(src, out, "onnxruntime")


# --- the boundary count in inspect -----------------------------------------------------------------

def test_inspect_reports_the_boundary_count(tmp_path):
    _, out, man = compiled(tmp_path, "gelu_erf", _gelu_model("erf_div"))
    js = run_cli("tandoor", "inspect", str(out), "--json")
    assert js.returncode == 0 and json.loads(js.stdout)["boundaries"] == man["boundaries"] == 4
    text = run_cli("tandoor", "inspect", str(out))
    assert text.returncode == 0 and "TVM/order boundaries: 4" in " ".join(text.stdout.split())
