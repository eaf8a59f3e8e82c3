"""Op level: every op/composite of the ACL table (compiler/backends/acl/) as a tiny ONNX model, compiled
by the real pipeline (host only, policy "all" so that tiny graphs are delegated), then run
through each executor (armnn on this machine's backend, onnxruntime, tvm) by HybridModule and
compared with onnxruntime on the original model (fp32, atol 1e-3, rtol 1e-3). Each case also
asserts that its op really landed in an order, as the composite it names.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tandoor_contract import hmod  # noqa: E402
from tandoor_agent.run.executors import armnn as armnn_ex  # noqa: E402
from tandoor_agent.run.runtime import HybridModule  # noqa: E402

ATOL = RTOL = 1e-3
ARMNN_OK, ARMNN_WHY = armnn_ex.available()
RNG = np.random.default_rng(20240601)


def _w(*shape, scale=0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@dataclass
class Case:
    name: str
    nodes: list
    inputs: dict[str, list[int]]
    outputs: dict[str, list[int]]
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    composites: tuple[str, ...] = ()   # each must be in a delegated partition's composites
    check_order: object = None          # optional: f(list of order ops) -> None
    opset: int = 17

    def model_bytes(self) -> bytes:
        vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
        inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in self.inits.items()]
        g = helper.make_graph(self.nodes, self.name, [vi(n, s) for n, s in self.inputs.items()],
                              [vi(n, s) for n, s in self.outputs.items()], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8).SerializeToString()


N = helper.make_node
X = {"x": [1, 4, 8, 8]}
Y = lambda *s: {"y": list(s)}  # noqa: E731


def _conv(name, cin=4, cout=8, k=3, bias=True, act=None, act_attrs=None, composite=None, **attrs) -> Case:
    group = attrs.get("group", 1)
    inits = {"w": _w(cout, cin // group, k, k)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = _w(cout)
        ins.append("b")
    nodes = [N("Conv", ins, ["c" if act else "y"], **attrs)]
    if act == "Clip":
        inits.update(lo=np.array(0, np.float32), hi=np.array(6, np.float32))
        nodes.append(N("Clip", ["c", "lo", "hi"], ["y"]))
    elif act:
        nodes.append(N(act, ["c"], ["y"], **(act_attrs or {})))
    h = 8
    pads = attrs.get("pads", [0, 0, 0, 0])
    s = attrs.get("strides", [1, 1])[0]
    d = attrs.get("dilations", [1, 1])[0]
    oh = (h + pads[0] + pads[2] - d * (k - 1) - 1) // s + 1
    ow = (h + pads[1] + pads[3] - d * (k - 1) - 1) // s + 1
    return Case(name, nodes, {"x": [1, cin, h, h]}, Y(1, cout, oh, ow), inits, (composite,))


def _depthwise_check(ops):
    conv = next(o for o in ops if o["type"] == "conv2d")
    assert conv["attrs"]["depthwise"] is True


def _act_check(kind):
    def check(ops):
        conv = next(o for o in ops if o["type"] in ("conv2d", "dense"))
        assert conv["attrs"]["activation"]["kind"] == kind, conv["attrs"]
    return check


def _unary(name, op, composite, **attrs) -> Case:
    return Case(name, [N(op, ["x"], ["y"], **attrs)], X, Y(1, 4, 8, 8), {}, (composite,))


def _binary(name, op, composite, const_shape=None) -> Case:
    if const_shape is None:
        return Case(name, [N(op, ["x", "x2"], ["y"])], {"x": [1, 4, 8, 8], "x2": [1, 4, 8, 8]}, Y(1, 4, 8, 8), {},
                    (composite,))
    return Case(name, [N(op, ["x", "k"], ["y"])], X, Y(1, 4, 8, 8), {"k": _w(*const_shape)}, (composite,))


def _resize(name, mode, ctm, nearest_mode, hw_in, hw_out) -> Case:
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = nearest_mode
    return Case(name, [N("Resize", ["x", "", "", "sizes"], ["y"], **attrs)], {"x": [1, 4, *hw_in]},
                Y(1, 4, *hw_out), {"sizes": np.array([1, 4, *hw_out], np.int64)}, ("acl.resize2d",))


def _after_conv(case: Case) -> Case:
    """The case's op fed by a 1x1 conv, as in real models: the compiler converts only conv2d to
    NHWC (ConvertLayout), so pools, global pools and resizes reach ACL's NHWC table only when a
    conv's layout propagates to them. The same op straight on the model input stays in TVM
    (see test_layout_op_at_the_model_input)."""
    cin = case.inputs["x"][1]
    pre = N("Conv", ["x", "pre_w", "pre_b"], ["x_c"])
    nodes = [pre] + [helper.make_node(n.op_type, ["x_c" if i == "x" else i for i in n.input], list(n.output),
                                      name=n.name, **{a.name: helper.get_attribute_value(a) for a in n.attribute})
                     for n in case.nodes]
    inits = {"pre_w": _w(cin, cin, 1, 1), "pre_b": _w(cin), **case.inits}
    return Case(case.name, nodes, case.inputs, case.outputs, inits, ("acl.conv2d_bias", *case.composites),
                case.check_order)


LAYOUT_OPS = [
    Case("max_pool", [N("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])], X,
         Y(1, 4, 4, 4), {}, ("acl.max_pool2d",)),
    Case("max_pool_ceil", [N("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)],
         {"x": [1, 4, 8, 8]}, Y(1, 4, 4, 4), {}, ("acl.max_pool2d",)),
    Case("avg_pool", [N("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], X, Y(1, 4, 4, 4), {},
         ("acl.avg_pool2d",)),
    Case("avg_pool_pad_excl", [N("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])],
         X, Y(1, 4, 8, 8), {}, ("acl.avg_pool2d",)),
    Case("avg_pool_pad_incl", [N("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1],
                                 count_include_pad=1)], X, Y(1, 4, 8, 8), {}, ("acl.avg_pool2d",)),
    Case("global_avg_pool", [N("GlobalAveragePool", ["x"], ["y"])], X, Y(1, 4, 1, 1), {}, ("acl.global_avg_pool2d_mean",)),
    Case("global_max_pool", [N("GlobalMaxPool", ["x"], ["y"])], X, Y(1, 4, 1, 1), {}, ("acl.global_max_pool2d",)),
    _resize("resize_nearest_2x", "nearest", "asymmetric", "floor", (8, 8), (16, 16)),
    _resize("resize_nearest_half_pixel", "nearest", "half_pixel", "round_prefer_ceil", (8, 8), (12, 12)),
    _resize("resize_linear_half_pixel", "linear", "half_pixel", None, (8, 8), (16, 16)),
    _resize("resize_linear_align_corners", "linear", "align_corners", None, (8, 8), (13, 13)),
]

# Detection and dense-prediction ops (real YOLO/CenterFace/PicoDet/DBNet exports have each)
DETECTION = [
    Case("conv_transpose_k2s2", [N("ConvTranspose", ["x", "w", "b"], ["y"], strides=[2, 2], kernel_shape=[2, 2])], X,
         Y(1, 3, 16, 16), {"w": _w(4, 3, 2, 2), "b": _w(3)}, ("acl.conv2d_transpose_bias",)),
    Case("conv_transpose_k3s2_outpad", [N("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2], kernel_shape=[3, 3],
                                          pads=[1, 1, 1, 1], output_padding=[1, 1])],
         X, Y(1, 2, 16, 16), {"w": _w(4, 2, 3, 3)}, ("acl.conv2d_transpose",)),
    Case("prelu_per_channel", [N("PRelu", ["x", "s"], ["y"])], X, Y(1, 4, 8, 8), {"s": _w(4, 1, 1)}, ("acl.prelu",)),
    Case("prelu_scalar", [N("PRelu", ["x", "s"], ["y"])], X, Y(1, 4, 8, 8), {"s": np.array([0.25], np.float32)},
         ("acl.prelu",)),
    Case("slice_focus", [N("Slice", ["x", "st", "en", "ax", "sp"], ["a"]), N("Slice", ["x", "st2", "en", "ax", "sp"], ["b"]),
                         N("Concat", ["a", "b"], ["y"], axis=1)], X, Y(1, 8, 4, 4),
         {"st": np.array([0, 0], np.int64), "st2": np.array([1, 1], np.int64), "en": np.array([8, 8], np.int64),
          "ax": np.array([2, 3], np.int64), "sp": np.array([2, 2], np.int64)}, ("acl.strided_slice", "acl.concat")),
    Case("split_channels", [N("Split", ["x", "parts"], ["a", "b"], axis=1), N("Add", ["a", "b"], ["y"])], X, Y(1, 2, 8, 8),
         {"parts": np.array([2, 2], np.int64)}, ("acl.strided_slice", "acl.add")),
    Case("pad_asymmetric", [N("Pad", ["x", "pads", "v"], ["y"])], X, Y(1, 4, 9, 11),
         {"pads": np.array([0, 0, 0, 1, 0, 0, 1, 2], np.int64), "v": np.array(0.5, np.float32)}, ("acl.pad",)),
    _binary("div", "Div", "acl.divide"),
    _binary("div_const", "Div", "acl.divide", (1, 4, 1, 1)),
    _binary("max", "Max", "acl.maximum"),
    _binary("min_const", "Min", "acl.minimum", (1, 4, 1, 1)),
    Case("silu", [N("Sigmoid", ["x"], ["s"]), N("Mul", ["x", "s"], ["y"])], X, Y(1, 4, 8, 8), {}, ("acl.silu",)),
    Case("conv_bias_silu", [N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Sigmoid", ["c"], ["s"]),
                            N("Mul", ["c", "s"], ["y"])], X, Y(1, 8, 8, 8), {"w": _w(8, 4, 3, 3), "b": _w(8)},
         ("acl.conv2d_bias_silu",)),
    _unary("hardsigmoid", "HardSigmoid", "acl.hardsigmoid", alpha=0.2, beta=0.5),
    Case("hardswish_op", [N("HardSwish", ["x"], ["y"])], X, Y(1, 4, 8, 8), {}, ("acl.hardswish_hsig",), opset=14),
    Case("hardswish_mul_sixth", [N("Add", ["x", "three"], ["a"]), N("Clip", ["a", "zero", "six"], ["c"]),
                                 N("Mul", ["x", "c"], ["m"]), N("Mul", ["m", "sixth"], ["y"])], X, Y(1, 4, 8, 8),
         {"three": np.array(3, np.float32), "zero": np.array(0, np.float32), "six": np.array(6, np.float32),
          "sixth": np.array(1 / 6, np.float32)}, ("acl.hardswish_mul_mul",)),
    Case("softmax_middle_axis", [N("Softmax", ["x"], ["y"], axis=1)], {"x": [1, 6, 5]}, Y(1, 6, 5), {}, ("acl.softmax",)),
    Case("reduce_mean_spatial", [N("ReduceMean", ["x", "axes"], ["y"], keepdims=1)], X, Y(1, 4, 1, 1),
         {"axes": np.array([2, 3], np.int64)}, ("acl.global_avg_pool2d_mean",), opset=18),
    Case("unsqueeze_squeeze", [N("Unsqueeze", ["x", "ax"], ["u"]), N("Relu", ["u"], ["r"]), N("Squeeze", ["r", "ax"], ["y"])],
         {"x": [1, 4, 8]}, Y(1, 4, 8), {"ax": np.array([1], np.int64)}, ("acl.expand_dims", "acl.squeeze")),
    Case("batchnorm_alone", [N("BatchNormalization", ["x", "g", "be", "mu", "var"], ["y"])], X, Y(1, 4, 8, 8),
         {"g": np.abs(_w(4)) + 0.5, "be": _w(4), "mu": _w(4), "var": np.abs(_w(4)) + 0.5}, ("acl.multiply", "acl.add")),
    Case("pow_square", [N("Pow", ["x", "two"], ["y"])], X, Y(1, 4, 8, 8), {"two": np.array(2, np.float32)},
         ("acl.multiply",)),
    Case("sppf_pools", [N("Conv", ["x", "w"], ["c"]), N("MaxPool", ["c"], ["p1"], kernel_shape=[5, 5], pads=[2, 2, 2, 2]),
                        N("MaxPool", ["p1"], ["p2"], kernel_shape=[5, 5], pads=[2, 2, 2, 2]),
                        N("Concat", ["c", "p1", "p2"], ["y"], axis=1)], X, Y(1, 12, 8, 8), {"w": _w(4, 4, 1, 1)},
         ("acl.conv2d", "acl.max_pool2d", "acl.concat")),
]

CASES = [
    # conv2d: padding, bias and activation fused into one order op
    _conv("conv", bias=False, pads=[1, 1, 1, 1], composite="acl.conv2d"),
    _conv("conv_bias", pads=[1, 1, 1, 1], composite="acl.conv2d_bias"),
    _conv("conv_bias_relu", act="Relu", pads=[1, 1, 1, 1], composite="acl.conv2d_bias_relu"),
    _conv("conv_bias_relu6", act="Clip", pads=[0, 1, 1, 0], strides=[2, 2], composite="acl.conv2d_bias_clip"),
    _conv("conv_bias_sigmoid", act="Sigmoid", k=1, composite="acl.conv2d_bias_sigmoid"),
    _conv("conv_tanh", bias=False, act="Tanh", dilations=[2, 2], pads=[2, 2, 2, 2], composite="acl.conv2d_tanh"),
    _conv("conv_bias_leaky", act="LeakyRelu", act_attrs={"alpha": 0.1}, composite="acl.conv2d_bias_leakyrelu"),
    _conv("dwconv_bias_relu6", cin=4, cout=4, act="Clip", group=4, pads=[1, 1, 1, 1],
          composite="acl.conv2d_bias_clip"),
    _conv("dwconv_mult2_s2", cin=4, cout=8, group=4, strides=[2, 2], pads=[1, 1, 1, 1], composite="acl.conv2d_bias"),
    Case("pad_then_conv", [N("Pad", ["x", "pads"], ["p"]), N("Conv", ["p", "w"], ["y"])], X, Y(1, 8, 8, 8),
         {"w": _w(8, 4, 3, 3), "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}, ("acl.conv2d",)),
    # dense (+bias, +activation)
    Case("dense_bias", [N("Gemm", ["x", "w", "b"], ["y"], transB=1)], {"x": [1, 32]}, Y(1, 10),
         {"w": _w(10, 32), "b": _w(10)}, ("acl.dense_bias",)),
    Case("dense", [N("MatMul", ["x", "w"], ["y"])], {"x": [1, 32]}, Y(1, 10), {"w": _w(32, 10)}, ("acl.dense",)),
    Case("dense_bias_relu", [N("Gemm", ["x", "w", "b"], ["h"], transB=1), N("Relu", ["h"], ["y"])],
         {"x": [1, 32]}, Y(1, 10), {"w": _w(10, 32), "b": _w(10)}, ("acl.dense_bias_relu",)),
    # activations on their own
    _unary("relu", "Relu", "acl.relu"),
    Case("relu6", [N("Clip", ["x", "lo", "hi"], ["y"])], X, Y(1, 4, 8, 8),
         {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}, ("acl.clip",)),
    Case("clip", [N("Clip", ["x", "lo", "hi"], ["y"])], X, Y(1, 4, 8, 8),
         {"lo": np.array(-0.5, np.float32), "hi": np.array(0.75, np.float32)}, ("acl.clip",)),
    _unary("sigmoid", "Sigmoid", "acl.sigmoid"),
    _unary("tanh", "Tanh", "acl.tanh"),
    _unary("leaky_relu", "LeakyRelu", "acl.leaky_relu", alpha=0.2),
    *[_after_conv(c) for c in LAYOUT_OPS],
    # elementwise binaries: two inputs, or a constant operand
    _binary("add", "Add", "acl.add"),
    _binary("sub", "Sub", "acl.subtract"),
    _binary("mul", "Mul", "acl.multiply"),
    _binary("add_const_per_channel", "Add", "acl.add", (1, 4, 1, 1)),
    _binary("mul_const_full", "Mul", "acl.multiply", (1, 4, 8, 8)),
    Case("sub_const_lhs", [N("Sub", ["k", "x"], ["y"])], X, Y(1, 4, 8, 8), {"k": _w(1, 4, 1, 1)}, ("acl.subtract",)),
    # structure
    Case("concat", [N("Concat", ["x", "x2"], ["y"], axis=1)], {"x": [1, 4, 8, 8], "x2": [1, 3, 8, 8]},
         Y(1, 7, 8, 8), {}, ("acl.concat",)),
    Case("reshape", [N("Reshape", ["x", "shape"], ["y"])], X, Y(1, 16, 16), {"shape": np.array([1, 16, 16], np.int64)},
         ("acl.reshape",)),
    Case("flatten", [N("Flatten", ["x"], ["y"], axis=1)], X, Y(1, 256), {}, ("acl.reshape",)),
    Case("softmax", [N("Softmax", ["x"], ["y"], axis=-1)], {"x": [1, 10]}, Y(1, 10), {}, ("acl.softmax",)),
    Case("softmax_rank4", [N("Softmax", ["x"], ["y"], axis=-1)], X, Y(1, 4, 8, 8), {}, ("acl.softmax",)),
    Case("transpose", [N("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1])], X, Y(1, 8, 8, 4), {}, ("acl.transpose",)),
    *DETECTION,
    # a small chain: several composites in one order
    Case("chain", [N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["r"]),
                   N("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]), N("Add", ["p", "k"], ["a"]),
                   N("GlobalAveragePool", ["a"], ["g"]), N("Flatten", ["g"], ["f"]),
                   N("Gemm", ["f", "fw", "fb"], ["l"], transB=1), N("Softmax", ["l"], ["y"], axis=1)],
         X, Y(1, 5), {"w": _w(8, 4, 3, 3), "b": _w(8), "k": _w(1, 8, 1, 1), "fw": _w(5, 8), "fb": _w(5)},
         ("acl.conv2d_bias_relu", "acl.max_pool2d", "acl.add", "acl.dense_bias", "acl.softmax")),
]
_BY_NAME = {c.name: c for c in CASES}
assert len(_BY_NAME) == len(CASES)
_BY_NAME["dwconv_bias_relu6"].check_order = _depthwise_check
_BY_NAME["dwconv_mult2_s2"].check_order = _depthwise_check
_BY_NAME["conv_bias_relu6"].check_order = _act_check("clip")
_BY_NAME["conv_bias_leaky"].check_order = _act_check("leaky_relu")


def _padding_folded(ops):
    assert [o["type"] for o in ops if o["type"] != "transpose"] == ["conv2d"]
    assert next(o for o in ops if o["type"] == "conv2d")["attrs"]["padding"] == [1, 1, 1, 1]


_BY_NAME["pad_then_conv"].check_order = _padding_folded


# --- compile once per case (in-process, host only) ----------------------------------------------

_bundles: dict[str, tuple[Path, dict]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ops")


def _compiled(case: Case, workdir: Path) -> tuple[Path, dict]:
    if case.name not in _bundles:
        from tandoor_compiler.pipeline import Options, compile_model

        src = workdir / f"{case.name}.onnx"
        src.write_bytes(case.model_bytes())
        out = workdir / f"{case.name}.hmod"
        # check=False: every test below runs the bundle against onnxruntime itself, per executor
        man = compile_model(src, out, Options(targets=[], policy="all", check=False))
        _bundles[case.name] = (out, man)
    return _bundles[case.name]


def _reference(case: Case, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(case.model_bytes(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op_lands_in_an_order(case, workdir):
    bundle, man = _compiled(case, workdir)
    delegated = [p for p in man["partitions"] if p["delegate"]]
    assert delegated, f"{case.name}: nothing delegated; TVM kept {man['tvm_ops']}"
    composites = [c for p in delegated for c in p["composites"]]
    for want in case.composites:
        assert want in composites, f"{case.name}: {want} not in {composites}; TVM kept {man['tvm_ops']}"
    assert man["tvm_ops"] == [], f"{case.name}: TVM kept {man['tvm_ops']}"
    if case.check_order is not None:
        with hmod.open_bundle(bundle) as b:
            case.check_order([op for p in delegated for op in b.order(p["symbol"])["ops"]])


@pytest.mark.parametrize("executor", ["armnn", "onnxruntime", "tvm"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_op_through_executor(case, executor, workdir):
    if executor == "armnn" and not ARMNN_OK:
        pytest.skip(ARMNN_WHY)
    bundle, man = _compiled(case, workdir)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in case.inputs.items()}
    want = _reference(case, feeds)
    with hmod.open_bundle(bundle) as b:
        module = HybridModule(b, delegate=executor)
        try:
            got = module.run([feeds[i["name"]] for i in man["inputs"]])
            subgraphs = module.describe()
        finally:
            module.close()
    assert subgraphs, f"{case.name}: no delegated subgraph"
    for s in subgraphs:
        assert s["executor"] == executor and "fallback_reason" not in s, s
    for g, w in zip(got, want):
        g = np.asarray(g).reshape(w.shape)
        assert np.allclose(g, w, atol=ATOL, rtol=RTOL), f"{case.name} via {executor}: max abs err {np.abs(g - w).max()}"


@pytest.mark.parametrize("case", LAYOUT_OPS, ids=lambda c: c.name)
def test_layout_op_at_the_model_input(case, workdir):
    """Pools, global pools and resizes straight on the (NCHW) model input are delegated too:
    passes.nhwc_layout_ops puts them in NHWC between transposes."""
    bundle, man = _compiled(Case(case.name + "_alone", case.nodes, case.inputs, case.outputs, case.inits,
                                 case.composites), workdir)
    composites = [c for p in man["partitions"] if p["delegate"] for c in p["composites"]]
    assert set(case.composites) <= set(composites), man["tvm_ops"]
