"""Quantized orders (order_version 2): int8/uint8 conv2d and dense through the Arm NN executor,
checked against onnxruntime's own quantized kernels (QLinearConv, QLinearMatMul) or the QDQ
formula in float (DequantizeLinear -> Conv/Gemm -> activation -> QuantizeLinear, unfused); the
onnxruntime and TVM executors with int8 buffers; the VM's int8 DLTensors into a delegate.

The reference runs NCHW graphs built here with onnx.helper (not the compiler's rendering of orders).
Agreement is counted in quantization steps. On CpuRef every element of every case is equal (as
measured: Arm NN's reference, like onnxruntime on x86, requantizes in float); ACL requantizes in
fixed point, so there one step is allowed anywhere and 95% of the elements must be equal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import pytest

from tandoor_agent.run.executors import armnn as ax
from tandoor_agent.run.executors import armnn_api

_OK, _WHY = ax.available()
needs_armnn = pytest.mark.skipif(not _OK, reason=_WHY)

import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

RNG = np.random.default_rng(20250301)   # tests' own data; build() seeds per case
QRANGE = {"int8": (-128, 127), "uint8": (0, 255)}
ONNX_TYPE = {"float32": TensorProto.FLOAT, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8}
X_SHAPE = (1, 8, 8, 4)
SX = 0.05                       # input scale; zero points per dtype below
ZX = {"int8": -3, "uint8": 131}
SW = 0.004                      # kernel scale (per tensor)
KSPREAD = (0.25, 2.0)           # per-channel kernel scales: SW times these ends, spread over the channels


# --- building quantized orders ----------------------------------------------------------------

def qspec(shape, dtype: str, scale=None, zp=None, axis=None) -> dict:
    spec = {"shape": [int(d) for d in shape], "dtype": dtype}
    if dtype != "float32":
        many = isinstance(scale, (list, tuple, np.ndarray))
        spec["quant"] = {"scale": [float(s) for s in (scale if many else [scale])],
                         "zero_point": [int(z) for z in (zp if many else [zp])]}
        if axis is not None:
            spec["quant"]["axis"] = int(axis)
    return spec


class QOrder:
    """An order_version 2 order: tensors and weights of any order dtype, weights packed raw
    little-endian (nbytes = element size x count), 64-byte aligned."""

    def __init__(self, symbol: str = "test_q_0"):
        self.symbol = symbol
        self.tensors: dict[str, dict] = {}
        self.ins: list[str] = []
        self.weights: dict[str, tuple[np.ndarray, dict]] = {}
        self.ops: list[dict] = []

    def input(self, name: str, spec: dict) -> str:
        self.tensors[name] = spec
        self.ins.append(name)
        return name

    def weight(self, name: str, a: np.ndarray, spec_extra: dict | None = None) -> str:
        self.weights[name] = (np.ascontiguousarray(a), spec_extra or {})
        return name

    def op(self, type_: str, inputs, output: str, spec: dict, attrs=None, weights=None) -> str:
        self.tensors[output] = spec
        op = {"type": type_, "inputs": list(inputs), "output": output, "attrs": attrs or {}}
        if weights:
            op["weights"] = weights
        self.ops.append(op)
        return output

    def build(self, outputs, version: int = 2) -> tuple[dict, bytes]:
        table, blob = {}, bytearray()
        for name, (a, extra) in self.weights.items():
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
            blob += b"\0" * (-len(blob) % 64)
            table[name] = {"shape": list(a.shape), "dtype": a.dtype.name, "offset": len(blob), "nbytes": a.nbytes,
                           **extra}
            blob += a.tobytes()
        spec = lambda n: {"name": n, **self.tensors[n]}  # noqa: E731
        order = {"order_version": version, "symbol": self.symbol, "inputs": [spec(n) for n in self.ins],
                 "outputs": [spec(n) for n in outputs], "tensors": self.tensors, "weights": table, "ops": self.ops}
        return order, bytes(blob)


def codes(dtype: str, shape, rng: np.random.Generator = RNG) -> np.ndarray:
    lo, hi = QRANGE[dtype]
    return rng.integers(lo, hi + 1, shape).astype(dtype)


def json_copy(order: dict) -> dict:
    return json.loads(json.dumps(order))


def nchw(x):
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def nhwc(x):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


# --- onnxruntime references -------------------------------------------------------------------

def onnx_model(nodes, inputs: dict[str, tuple[str, list]], outputs: dict[str, str], inits: dict) -> bytes:
    graph = helper.make_graph(
        nodes, "qref",
        [helper.make_tensor_value_info(n, ONNX_TYPE[d], s) for n, (d, s) in inputs.items()],
        [helper.make_tensor_value_info(n, ONNX_TYPE[d], None) for n, d in outputs.items()],
        initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model.SerializeToString()


def ort_run(model: bytes, feeds: dict, unfused: bool = False) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3   # not the unused-initializer notes of the shared initializer set
    if unfused:  # the QDQ formula as written: no fusing into onnxruntime's integer kernels
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def act_nodes(act: dict | None, src: str, dst: str, inits: dict) -> list:
    if act is None:
        return [helper.make_node("Identity", [src], [dst])]
    if act["kind"] == "relu":
        return [helper.make_node("Relu", [src], [dst])]
    inits.update(lo=np.array(act["min"], np.float32), hi=np.array(act["max"], np.float32))
    return [helper.make_node("Clip", [src, "lo", "hi"], [dst])]


# --- the cases: an order and onnxruntime's answer for one quantized op ------------------------

@dataclass(frozen=True)
class Case:
    op: str                      # conv | depthwise | dense
    dtype: str                   # int8 | uint8: input and output
    stride: int = 1
    act: str | None = None       # None | relu | clip
    bias: bool = True
    ref: str = "qdq"             # qlinear: QLinearConv/QLinearMatMul; qdq: the unfused float formula
    mult: int = 1                # depthwise channel multiplier
    pad: tuple[int, int, int, int] = (1, 1, 1, 1)   # top, left, bottom, right
    x_shape: tuple[int, ...] = X_SHAPE
    per_channel: bool = False    # a kernel scale per output channel (KSPREAD), else SW for all

    def __str__(self) -> str:
        parts = [self.op, self.dtype, f"s{self.stride}", self.act or "linear", self.ref]
        parts += [] if self.bias else ["nobias"]
        parts += [f"m{self.mult}"] if self.mult != 1 else []
        parts += [f"pad{''.join(map(str, self.pad))}"] if self.pad != (1, 1, 1, 1) and self.op != "dense" else []
        parts += ["x" + "x".join(map(str, self.x_shape))] if self.x_shape != X_SHAPE else []
        parts += ["perchannel"] if self.per_channel else []
        return "-".join(parts)


@dataclass
class Built:
    order: dict
    blob: bytes
    x: np.ndarray                # NHWC (or the dense input) codes
    want: np.ndarray             # onnxruntime's output codes, in the order's layout
    nhwc_model: bytes | None     # conv: the reference with the order's NHWC input/output (QLinearConv)


def _out_quant(acc: np.ndarray, dtype: str) -> tuple[float, int]:
    """An output scale and zero point that spread the pre-activation accumulator over the codes
    (0.5% saturated at each end): agreement then counts real roundings, not clamped codes."""
    lo, hi = QRANGE[dtype]
    a, b = np.quantile(acc, [0.005, 0.995])
    sy = float(b - a) / 250
    return sy, int(np.clip(np.round(lo + 2 - a / sy), lo, hi))


def _act(case: Case, acc: np.ndarray) -> dict | None:
    if case.act == "clip":   # bounds inside the accumulator's range, so both ends clip
        lo, hi = np.quantile(acc, [0.25, 0.8])
        return {"kind": "clip", "min": round(float(lo), 3), "max": round(float(hi), 3)}
    return {"kind": case.act} if case.act else None


def build(case: Case, kernel_quant: dict | None = None, bias_quant: dict | None = None) -> Built:
    dt = case.dtype
    rng = np.random.default_rng(list(str(case).encode()))   # each case its own data, whatever runs first
    x = codes(dt, case.x_shape, rng)
    xf = (x.astype(np.float32) - ZX[dt]) * np.float32(SX)
    o = QOrder()
    o.input("x", qspec(x.shape, dt, SX, ZX[dt]))
    if case.op == "dense":
        rows, k = (x.shape[0], int(np.prod(x.shape[1:])))
        n = 32 if rows > 1 else 256   # a few hundred outputs either way
        kernel = rng.integers(-127, 128, (n, k)).astype(np.int8)
    elif case.op == "depthwise":
        kernel = rng.integers(-127, 128, (x.shape[3] * case.mult, 3, 3, 1)).astype(np.int8)
    else:
        kernel = rng.integers(-127, 128, (16, 3, 3, x.shape[3])).astype(np.int8)
    oc = kernel.shape[0]
    # kernel scales per output channel (float32, as every reader keeps them) and the bias's, x's times them
    ks = (SW * np.linspace(*KSPREAD, oc) if case.per_channel else np.full(oc, SW)).astype(np.float32)
    sb = np.float32(SX) * ks
    b_q = np.round(rng.standard_normal(oc) * 0.5 / sb).astype(np.int32) if case.bias else np.zeros(oc, np.int32)
    kf = kernel.astype(np.float32) * ks.reshape(-1, *[1] * (kernel.ndim - 1))
    if case.op == "dense":
        acc = xf.reshape(rows, k) @ kf.T + b_q * sb
        out_shape = (rows, n)
    else:
        cin = x.shape[3]
        groups = cin if case.op == "depthwise" else 1
        conv_attrs = dict(strides=[case.stride] * 2, pads=list(case.pad), group=groups, kernel_shape=[3, 3])
        float_conv = onnx_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], **conv_attrs)],
                                {"x": ("float32", [1, cin, x.shape[1], x.shape[2]])}, {"y": "float32"},
                                {"w": kf.transpose(0, 3, 1, 2), "b": b_q.astype(np.float32) * sb})
        acc = nhwc(ort_run(float_conv, {"x": nchw(xf)})[0])
        out_shape = acc.shape
    sy, zy = _out_quant(acc, dt)
    act = _act(case, acc)
    # per channel: 1-D scales and zero points on axis 0 (OIHW, [N, K]); per tensor: scalars
    one = lambda a: a if case.per_channel else a[:1].reshape(())   # noqa: E731
    inits = {"xs": np.array(SX, np.float32), "xz": np.array(ZX[dt], dt), "ws": one(ks),
             "wz": one(np.zeros(oc, np.int8)), "bs": one(sb),
             "ys": np.array(sy, np.float32), "yz": np.array(zy, dt), "w": kernel, "b": b_q}
    per = {"axis": 0} if case.per_channel else {}
    kq = kernel_quant or {"scale": ks.tolist() if per else [SW], "zero_point": [0] * len(one(ks).reshape(-1)), **per}
    wts = {"kernel": o.weight("k", kernel, {"quant": kq})}
    if case.bias:
        bq = bias_quant or {"scale": sb.tolist() if per else [float(sb[0])], "zero_point": [0] * len(one(sb).reshape(-1)),
                            **per}
        wts["bias"] = o.weight("b", b_q, {"quant": bq})
    deq_w = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs"], ["bf"], axis=0)]

    nhwc_model = None
    if case.op == "dense":
        o.op("dense", ["x"], "y", qspec(out_shape, dt, sy, zy), {"activation": act}, wts)
        feeds = {"x": x.reshape(rows, k)}
        ins = {"x": (dt, [rows, k])}
        if case.ref == "qlinear":
            assert not case.bias and act is None, "QLinearMatMul has neither"
            inits["wt"] = np.ascontiguousarray(kernel.T)
            nodes = [helper.make_node("QLinearMatMul", ["x", "xs", "xz", "wt", "ws", "wz", "ys", "yz"], ["y"])]
        else:
            nodes = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]), *deq_w,
                     helper.make_node("Gemm", ["xf", "wf", "bf"], ["c"], transB=1),
                     *act_nodes(act, "c", "a", inits),
                     helper.make_node("QuantizeLinear", ["a", "ys", "yz"], ["y"])]
        want = ort_run(onnx_model(nodes, ins, {"y": dt}, inits), feeds, unfused=case.ref == "qdq")[0]
    else:
        attrs = {"strides": [case.stride] * 2, "padding": list(case.pad), "dilation": [1, 1], "groups": groups,
                 "depthwise": case.op == "depthwise", "activation": act}
        o.op("conv2d", ["x"], "y", qspec(out_shape, dt, sy, zy), attrs, wts)
        inits["w"] = kernel.transpose(0, 3, 1, 2)   # OIHW; depthwise [C*M, 1, KH, KW]
        ins = {"x": (dt, [1, cin, x.shape[1], x.shape[2]])}
        if case.ref == "qlinear":
            assert act is None, "QLinearConv has no activation"
            qins = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"] + (["b"] if case.bias else [])
            core = [helper.make_node("QLinearConv", qins, ["y"], **conv_attrs)]
            # the same kernel with the order's NHWC input and output (the onnxruntime executor's test)
            nhwc_model = onnx_model(
                [helper.make_node("Transpose", ["x"], ["xc"], perm=[0, 3, 1, 2]),
                 helper.make_node("QLinearConv", ["xc", *qins[1:]], ["yc"], **conv_attrs),
                 helper.make_node("Transpose", ["yc"], ["y"], perm=[0, 2, 3, 1])],
                {"x": (dt, list(x.shape))}, {"y": dt}, inits)
        else:
            core = [helper.make_node("DequantizeLinear", ["x", "xs", "xz"], ["xf"]), *deq_w,
                    helper.make_node("Conv", ["xf", "wf", "bf"], ["c"], **conv_attrs),
                    *act_nodes(act, "c", "a", inits),
                    helper.make_node("QuantizeLinear", ["a", "ys", "yz"], ["y"])]
        want = nhwc(ort_run(onnx_model(core, ins, {"y": dt}, inits), {"x": nchw(x)}, unfused=case.ref == "qdq")[0])
    order, blob = o.build(["y"])
    return Built(order, blob, x, want, nhwc_model)


CASES = [
    Case("conv", "int8", 1, None, ref="qlinear"),
    Case("conv", "int8", 2, None, ref="qlinear", pad=(0, 0, 1, 1)),
    Case("conv", "int8", 1, "relu"),
    Case("conv", "int8", 2, "clip"),
    Case("conv", "int8", 1, "clip", bias=False),
    Case("conv", "uint8", 1, None, ref="qlinear"),
    Case("conv", "uint8", 2, "relu"),
    Case("conv", "uint8", 1, "clip"),
    Case("conv", "uint8", 2, None, ref="qlinear", bias=False),
    Case("depthwise", "int8", 1, None, ref="qlinear"),
    Case("depthwise", "int8", 2, "relu", mult=2),
    Case("depthwise", "int8", 1, "clip"),
    Case("depthwise", "uint8", 1, "relu"),
    Case("depthwise", "uint8", 2, None, ref="qlinear", mult=2),
    Case("dense", "int8", x_shape=(16, 64)),
    Case("dense", "int8", act="relu", x_shape=(16, 64)),
    Case("dense", "int8", act="clip"),                              # 1x8x8x4 flattened: K = 256
    Case("dense", "int8", bias=False, ref="qlinear", x_shape=(16, 64)),
    Case("dense", "uint8", act="clip", x_shape=(16, 64)),
    Case("dense", "uint8", bias=False, ref="qlinear", x_shape=(16, 64)),
]


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[int, float]:
    """(largest difference in steps, fraction of elements equal)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    steps = np.abs(got.astype(np.int32) - want.astype(np.int32))
    return int(steps.max()), float(np.mean(steps == 0))


# --- Arm NN against onnxruntime -----------------------------------------------------------------

@needs_armnn
@pytest.mark.parametrize("case", CASES, ids=str)
def test_quantized_op_on_armnn_agrees_with_onnxruntime(case):
    b = build(case)
    lo, hi = QRANGE[case.dtype]
    # the reference is no clamped-flat output that would agree trivially
    assert np.mean((b.want == lo) | (b.want == hi)) < 0.03 and len(np.unique(b.want)) > 40
    with ax.ArmnnExecutor(b.order, b.blob) as ex:
        assert ex.input_dtypes == ex.output_dtypes == [np.dtype(case.dtype)]
        got = ex.run([b.x])[0]
    worst, exact = agreement(got, b.want)
    print(f"\n{case} on {ex.backend}: {exact:.2%} of {got.size} exact, at most {worst} step(s)")
    if ex.backend == "CpuRef":
        # measured: Arm NN's reference dequantizes, accumulates in float and rounds once, as
        # onnxruntime's kernels do on x86: every element of every case equal
        assert (worst, exact) == (0, 1.0)
    else:  # ACL requantizes in fixed point: one step here and there
        assert worst <= 1
        assert exact >= 0.95


# --- a quantized add: two int8 tensors, each with its own quantization ---------------------------

ADD_CASES = [("int8", None), ("int8", "relu"), ("uint8", None), ("uint8", "clip")]


def build_add(dtype: str, act: str | None) -> Built:
    """a + b -> y (orders.QUANT_OPS "binary"): a residual add whose inputs and output each have
    their own scale and zero point; onnxruntime's QDQ run (fused into QLinearAdd) is the answer."""
    rng = np.random.default_rng(list(f"add-{dtype}-{act}".encode()))
    lo, hi = QRANGE[dtype]
    shape = (1, 8, 8, 16)
    a, b = codes(dtype, shape, rng), codes(dtype, shape, rng)
    (sa, za), (sb, zb) = (0.05, lo + 120), (0.11, lo + 140)
    acc = (a.astype(np.float64) - za) * sa + (b.astype(np.float64) - zb) * sb
    sy, zy = _out_quant(acc, dtype)
    act_obj = {"kind": "relu"} if act == "relu" else (
        {"kind": "clip", "min": -2.0, "max": 4.0} if act == "clip" else None)
    o = QOrder()
    o.input("a", qspec(shape, dtype, sa, za))
    o.input("b", qspec(shape, dtype, sb, zb))
    o.op("binary", ["a", "b"], "y", qspec(shape, dtype, sy, zy), {"kind": "add", "activation": act_obj})
    inits = {"sa": np.array(sa, np.float32), "za": np.array(za, dtype), "sb": np.array(sb, np.float32),
             "zb": np.array(zb, dtype), "sy": np.array(sy, np.float32), "zy": np.array(zy, dtype)}
    nodes = [helper.make_node("DequantizeLinear", ["a", "sa", "za"], ["af"]),
             helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["bf"]),
             helper.make_node("Add", ["af", "bf"], ["s"]), *act_nodes(act_obj, "s", "r", inits),
             helper.make_node("QuantizeLinear", ["r", "sy", "zy"], ["y"])]
    ref = onnx_model(nodes, {"a": (dtype, list(shape)), "b": (dtype, list(shape))}, {"y": dtype}, inits)
    want = ort_run(ref, {"a": a, "b": b})[0]
    order, blob = o.build(["y"])
    return Built(order, blob, np.stack([a, b]), want, ref)


@needs_armnn
@pytest.mark.parametrize("dtype, act", ADD_CASES, ids=lambda v: str(v))
def test_a_quantized_add_on_armnn_agrees_with_onnxruntime(dtype, act):
    """Arm NN's addition takes each input's quantization as it is (no requantizing copies), and the
    compiler's ONNX rendering of the order (what onnxruntime runs on the board) gives the same."""
    from tandoor_compiler.backends.acl.order_onnx import order_to_onnx

    b = build_add(dtype, act)
    lo, hi = QRANGE[dtype]
    assert np.mean((b.want == lo) | (b.want == hi)) < 0.05 and len(np.unique(b.want)) > 40
    with ax.ArmnnExecutor(b.order, b.blob) as ex:
        assert ex.input_dtypes == [np.dtype(dtype)] * 2 and ex.output_dtypes == [np.dtype(dtype)]
        got = ex.run([b.x[0], b.x[1]])[0]
    worst, exact = agreement(got, b.want)
    print(f"\nadd {dtype} {act} on {ex.backend}: {exact:.2%} of {got.size} exact, at most {worst} step(s)")
    if ex.backend == "CpuRef":   # measured: every element equal, as for the convolutions
        assert (worst, exact) == (0, 1.0)
    else:   # ACL requantizes in fixed point
        assert worst <= 1 and exact >= 0.95
    rendered = ort_run(order_to_onnx(b.order, b.blob).SerializeToString(), {"a": b.x[0], "b": b.x[1]})[0]
    np.testing.assert_array_equal(rendered, b.want)


@needs_armnn
def test_run_into_takes_and_writes_int8_buffers():
    b = build(Case("conv", "int8", 1, "relu"))
    with ax.ArmnnExecutor(b.order, b.blob) as ex:
        want = ex.run([b.x])[0]
        y = np.full(want.shape, 99, np.int8)
        ex.run_into([b.x], [y])
        assert ex.last_zero_copy == (armnn_api._raw is not None)   # Arm NN wrote the caller's int8 buffer
        np.testing.assert_array_equal(y, want)
        as_float = np.full(want.shape, np.nan, np.float32)   # another dtype: a copy, the codes as floats
        ex.run_into([b.x], [as_float])
        assert not ex.last_zero_copy
        np.testing.assert_array_equal(as_float, want.astype(np.float32))
        with pytest.raises(TypeError, match="takes int8 codes, got float32"):
            ex.run([b.x.astype(np.float32)])


@needs_armnn
def test_a_depthwise_sharing_its_quantized_input_reads_a_quantized_copy():
    """Api.depthwise_own_input (20.08): the copy of a quantized input keeps its codes (a BoundedReLu
    over the type's whole range, as ACL has no quantized Linear activation)."""
    b = build(Case("depthwise", "int8", 1, None, ref="qlinear"))
    order = json_copy(b.order)
    k = np.arange(-64, 64, dtype=np.int8).reshape(32, 1, 1, 4)   # a 1x1 conv reading x too
    order["weights"]["k1"] = {"shape": [32, 1, 1, 4], "dtype": "int8", "offset": len(b.blob), "nbytes": k.nbytes,
                              "quant": {"scale": [SW], "zero_point": [0]}}
    order["tensors"]["z"] = qspec([1, 8, 8, 32], "int8", 0.05, 0)
    order["ops"].append({"type": "conv2d", "inputs": ["x"], "output": "z", "weights": {"kernel": "k1"},
                         "attrs": {"strides": [1, 1], "padding": [0, 0, 0, 0], "activation": None}})
    order["outputs"].append({"name": "z", **order["tensors"]["z"]})
    with ax.ArmnnExecutor(order, b.blob + k.tobytes()) as ex, ax.ArmnnExecutor(b.order, b.blob) as ref:
        copies = [n for n, _, _ in ex.layer_backends if n == "0:copy"]
        assert len(copies) == int(ax.api().depthwise_own_input)
        y, z = ex.run([b.x])
        np.testing.assert_array_equal(y, ref.run([b.x])[0])
    xf = (b.x.astype(np.float64) - ZX["int8"]) * SX
    want_z = np.clip(np.round(xf @ (k.reshape(32, 4).astype(np.float64) * SW).T / 0.05), -128, 127)
    # numpy's float64 formula against Arm NN's float32 one: measured 2 elements of 2048 a step off
    assert np.abs(z.astype(np.int32) - want_z).max() <= 1 and np.mean(z == want_z) >= 0.99


# --- what the Arm NN executor refuses -----------------------------------------------------------

# every case again with a kernel scale per output channel (QLinearMatMul has no per-column scales)
PER_CHANNEL = [replace(c, per_channel=True) for c in CASES if not (c.op == "dense" and c.ref == "qlinear")]


@needs_armnn
@pytest.mark.parametrize("case", PER_CHANNEL, ids=str)
def test_per_channel_op_on_armnn_agrees_with_onnxruntime(case):
    """Per-axis kernel and bias scales reach Arm NN through the TFLite model the executor makes
    from the order (the TensorInfos its TfLite parser makes), conv, depthwise and dense (built as
    a 1x1 convolution); the bundle holds nothing for it."""
    import pyarmnn as ann

    from tandoor_agent.run.executors import armnn_tflite

    # the premise: neither binding's TensorInfo takes several scales
    assert not hasattr(ann.TensorInfo, "SetQuantizationScales")
    b = build(case)
    lo, hi = QRANGE[case.dtype]
    assert np.mean((b.want == lo) | (b.want == hi)) < 0.03 and len(np.unique(b.want)) > 40
    model = armnn_tflite.quant_model(b.order)
    oc = b.order["weights"]["k"]["shape"][0]
    assert model is not None and len(model) < 40 * oc + 1024   # scales and zero points only: no weight data
    with ax.ArmnnExecutor(b.order, b.blob) as ex:
        got = ex.run([b.x])[0]
        kinds = {t for _, t, _ in ex.layer_backends}
        copies = [n for n, _, _ in ex.layer_backends if n == "0:copy"]
    assert "FullyConnected" not in kinds   # a per-channel dense is a convolution
    assert len(copies) == int(case.op == "depthwise" and ax.api().per_axis_depthwise_copy)   # 20.08's work-around
    worst, exact = agreement(got, b.want)
    print(f"\n{case} on {ex.backend}: {exact:.2%} of {got.size} exact, at most {worst} step(s)")
    if ex.backend == "CpuRef":   # measured, as per tensor: every element equal
        assert (worst, exact) == (0, 1.0)
    else:
        assert worst <= 1
        assert exact >= 0.95


@needs_armnn
def test_per_axis_kernel_with_one_scale_is_per_tensor():
    """Per-axis scales that are all equal are one per tensor: the same reals, built as such."""
    case = Case("conv", "int8", 1, None, ref="qlinear")
    per_tensor = build(case)
    sb = float(np.float32(SX) * np.float32(SW))
    per_axis = build(case, {"scale": [SW] * 16, "zero_point": [0] * 16, "axis": 0},
                     {"scale": [sb] * 16, "zero_point": [0] * 16, "axis": 0})
    np.testing.assert_array_equal(per_axis.x, per_tensor.x)
    with ax.ArmnnExecutor(per_axis.order, per_axis.blob) as ex, \
            ax.ArmnnExecutor(per_tensor.order, per_tensor.blob) as ref:
        np.testing.assert_array_equal(ex.run([per_axis.x])[0], ref.run([per_tensor.x])[0])


def _edit(edit) -> tuple[dict, bytes]:
    b = build(Case("conv", "int8", 1, "relu"))
    edit(b.order)
    return b.order, b.blob


def _pool(order):
    order["ops"].append({"type": "pool2d", "inputs": ["y"], "output": "p",
                         "attrs": {"kind": "max", "pool_size": [2, 2], "strides": [2, 2]}})
    order["tensors"]["p"] = qspec([1, 4, 4, 16], "int8", 0.1, 0)
    order["outputs"] = [{"name": "p", **order["tensors"]["p"]}]


def _float_input(order):
    order["tensors"]["x"] = {"shape": list(X_SHAPE), "dtype": "float32"}
    order["inputs"][0] = {"name": "x", **order["tensors"]["x"]}


def _uint8_output(order):
    order["tensors"]["y"]["dtype"] = order["outputs"][0]["dtype"] = "uint8"
    order["tensors"]["y"]["quant"]["zero_point"] = order["outputs"][0]["quant"]["zero_point"] = [128]


def _set(path, value):
    def edit(order):
        *head, last = path
        d = order
        for k in head:
            d = d[k]
        d[last] = value
    return edit


def _quantized_mul(order):
    order["ops"].append({"type": "binary", "inputs": ["y", "y"], "output": "m", "attrs": {"kind": "mul"}})
    order["tensors"]["m"] = qspec([1, 8, 8, 16], "int8", 0.1, 0)
    order["outputs"] = [{"name": "m", **order["tensors"]["m"]}]


REFUSED = {
    "pool2d": (_pool, "op 1 (pool2d -> 'p'): a quantized pool2d is not supported yet"),
    "quantized mul": (_quantized_mul, "op 1 (binary -> 'm'): a quantized binary is an add of two tensors"),
    "float input": (_float_input, "mixes float32 and quantized tensors"),
    "uint8 output": (_uint8_output, "int8 input, uint8 output"),
    "sigmoid": (_set(["ops", 0, "attrs", "activation"], {"kind": "sigmoid"}),
                "sigmoid fused into a quantized conv2d; only relu and clip"),
    "kernel zero point": (_set(["weights", "k", "quant", "zero_point"], [3]), "kernel zero point 3"),
    "bias scale": (_set(["weights", "b", "quant", "scale"], [0.5]), "bias scale 0.5 / zero point 0 is not"),
    "version 1": (_set(["order_version"], 1), "is order_version 1 (float32 only) but has quantized tensors"),
    "int32 tensor": (_set(["tensors", "y", "dtype"], "int32"), "tensor 'y' has dtype int32"),
    "no quant": (_set(["tensors", "y", "quant"], None), "int8 needs a quant object"),
    "missing kernel": (_set(["ops", 0, "weights", "kernel"], "nope"), "weight(s) ['nope'] are not in the order's"),
}


@needs_armnn
@pytest.mark.parametrize("what", list(REFUSED))
def test_what_cannot_be_built_is_refused_in_one_line(what):
    edit, says = REFUSED[what]
    order, blob = _edit(edit)
    with pytest.raises(ax.UnsupportedOrder) as e:
        ax.ArmnnExecutor(order, blob)
    assert says in str(e.value) and "\n" not in str(e.value)


# --- the load-time check on quantized outputs ---------------------------------------------------

def test_differs_counts_quantized_outputs_in_steps():
    want = codes("int8", (1, 20, 20, 16))
    wide = want.astype(np.int16)

    def off(n: int, by: int) -> np.ndarray:
        g = wide.copy()
        g.flat[:n] = np.where(g.flat[:n] + by > 127, g.flat[:n] - by, g.flat[:n] + by)
        return g.astype(np.int8)

    assert ax.differs([off(want.size // 3, 1)], [want]) is None   # a third one step off: rounding
    assert ax.differs([off(5, 2)], [want]) is None                # 0.08% two steps off
    assert "more than 1 quantization step" in ax.differs([off(20, 2)], [want])   # 0.3%
    assert "at most 13 steps" in ax.differs([off(1, 13)], [want])
    # the probe member records the codes as float32: the same rule
    assert ax.differs([off(want.size // 3, 1)], [want.astype(np.float32)]) is None
    assert "more than 1 quantization step" in ax.differs([off(20, 2)], [want.astype(np.float32)])


def test_differs_allows_a_deep_int8_orders_recorded_drift_and_no_more():
    """A probe's drift (tandoor_contract.probe.drift: what another rounding of each requantization
    did to the order's output at compile time) widens the rule by DRIFT_MARGIN, for that output only."""
    want = codes("int8", (1, 20, 20, 16))
    g = want.astype(np.int16)
    n = want.size * 8 // 100                                    # 8% of the elements, 30 steps off
    g.flat[:n] = np.where(g.flat[:n] > 0, g.flat[:n] - 30, g.flat[:n] + 30)
    got = g.astype(np.int8)
    assert "at most 30 steps" in ax.differs([got], [want])                      # the strict rule
    assert ax.differs([got], [want], [(0.09, 44.0)]) is None                    # within what was measured
    assert ax.differs([got], [want], [None]) is not None                        # no drift for this output
    why = ax.differs([got], [want], [(0.02, 44.0)])                             # 8% > 1.5 x 2%
    assert "allows 3.0%, 66 steps" in why
    assert "allows" in ax.differs([got], [want], [(0.09, 10.0)])                # 30 > max(12.8, 15)
    # a builder defect (the 20.08 depthwise: most of an output wrong) is past any drift
    assert ax.differs([codes("int8", want.shape)], [want], [(0.09, 44.0)]) is not None


# --- onnxruntime and TVM executors, the VM's DLTensors ------------------------------------------

QCONV = Case("conv", "int8", 1, None, ref="qlinear")


def test_onnxruntime_executor_binds_int8_buffers():
    from tandoor_agent.run.executors.ort import OrtExecutor

    b = build(QCONV)
    ex = OrtExecutor(b.order, b.nhwc_model)
    y = np.full(b.want.shape, 99, np.int8)
    ex.run_into([b.x], [y])
    assert ex.last_zero_copy
    assert [v.data_ptr() for v in ex._binding.get_outputs()] == [y.ctypes.data]
    np.testing.assert_array_equal(y, b.want)
    as_float = np.full(b.want.shape, np.nan, np.float32)   # not the order's dtype: run + copy
    ex.run_into([b.x], [as_float])
    assert not ex.last_zero_copy
    np.testing.assert_array_equal(as_float, b.want.astype(np.float32))
    wrong = {**b.order, "inputs": [{**b.order["inputs"][0], "dtype": "float32"}]}
    with pytest.raises(ValueError, match="'x' as tensor\\(int8\\), the order says float32"):
        OrtExecutor(wrong, b.nhwc_model)


def _relax_lib(tmp_path, body, x_shape, out_shape, name: str):
    """A compiled Relax module main(x: int8) -> int8 whose body is ``body(x)``."""
    tvm = pytest.importorskip("tvm")
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(body(relax, x, out_shape)))
        bb.emit_func_output(out)
    path = tmp_path / f"{name}.so"
    relax.build(bb.get(), target="llvm").export_library(str(path))
    return tvm, path


def test_tvm_executor_hands_int8_codes_to_the_fallback(tmp_path):
    from tandoor_agent.run.executors.tvm_exec import TvmExecutor

    _, path = _relax_lib(tmp_path, lambda relax, x, _: relax.op.add(x, x), X_SHAPE, X_SHAPE, "fallback")
    spec = {"name": "x", **qspec(X_SHAPE, "int8", SX, ZX["int8"])}
    ex = TvmExecutor({"inputs": [spec], "outputs": [{**spec, "name": "y"}]}, path)
    x = codes("int8", X_SHAPE)
    want = x + x   # int8 arithmetic: wraps, as TVM's does
    raw = np.empty(x.size + 64, np.int8)   # a 64-byte aligned copy: handed over as a dlpack view
    start = -raw.ctypes.data % 64
    aligned = raw[start:start + x.size].reshape(X_SHAPE)
    aligned[...] = x
    for given in (x, aligned, x[..., ::-1].copy()[..., ::-1]):   # whatever alignment and layout
        y = np.zeros(X_SHAPE, np.int8)
        ex.run_into([given], [y])
        np.testing.assert_array_equal(y, want)
    got = ex.run([x])[0]
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, want)


def test_the_vm_hands_int8_dltensors_to_a_delegate_and_takes_int8_back(tmp_path):
    """runtime.HybridModule's delegate: the VM's call_dps_packed passes int8 DLTensors, which
    arrive as int8 numpy views (no float cast), and the executor writes the VM's int8 output."""
    tvm_ffi = pytest.importorskip("tvm_ffi")

    from tandoor_agent.run.executors.ort import OrtExecutor
    from tandoor_agent.run.runtime import HybridModule, Subgraph

    b = build(QCONV)
    symbol = "tandoor_test_qconv_dps"
    tvm, path = _relax_lib(
        tmp_path, lambda relax, x, shape: relax.call_dps_packed(symbol, [x], relax.TensorType(shape, "int8")),
        X_SHAPE, b.want.shape, "hybrid")
    ex = OrtExecutor(b.order, b.nhwc_model)
    sg = Subgraph(symbol, "onnxruntime", ex.backend)
    tvm_ffi.register_global_func(symbol, HybridModule._make_delegate(ex, sg, 1), override=True)
    from tvm.runtime.vm import VirtualMachine

    vm = VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(b.x)).numpy()
    assert out.dtype == np.int8
    np.testing.assert_array_equal(out, b.want)
    assert sg.calls == 1 and sg.zero_copy   # onnxruntime bound the VM's own int8 buffers
