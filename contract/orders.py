"""The order op vocabulary: every op type an order may hold, once, as data.

An *order* (docs/bundle-format.md) is one delegated subgraph: tensors, weights and a list of ops.
This table is what the compiler emits (compiler/backends/acl/ names an op type per ACL entry), what the
compiler renders as ONNX (compiler/backends/acl/order_onnx.py), what the Arm NN executor builds
(agent/run/executors/armnn.py) and what the format doc lists: each of those dispatches on
``OPS`` by name, and tests check that every consumer covers every entry. Adding an op type is an
entry here plus one function in each consumer.

Conventions for every op: rank-4 tensors are NHWC; ``inputs`` are tensor names in the order the
op type lists; ``output`` is one tensor name; ``weights`` maps a role to a name in the order's
weights table (a weight keeps the source model's rank, 0 for a scalar: a reader whose library needs
rank >= 1 takes a scalar as one element, as the Arm NN executor does); attrs not listed here are
ignored by readers.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from .backends import BACKENDS, LAYERS

# 1: float32 tensors only. 2: tensors and weights may also be quantized (int8/uint8 activations,
# int8 weights, int32 biases, each with a ``quant`` object; QUANT below). 3: the order may be of
# kind "onnx" (KINDS). The compiler writes the lowest version that describes the order (1 for a
# float layer list), so agents that know only 1 still run float bundles, and an agent refuses a
# quantized or onnx order it cannot read instead of computing something else. 4: the order may be
# of kind "rknn" (an RK3588 NPU model beside its ONNX rendering); older kinds keep their versions.
# 5: a long list of quant scales may be a reference {"offset", "count"} to float32s in the order's
# weights blob (scale_refs_out): EfficientNet-Lite0 INT8 carried its per-channel scales three times,
# as JSON text (0.71 MB), in the ONNX rendering and in the TVM fallback's parameters; now once, as
# bytes all three read. A long zero_point list of one value may be {"fill", "count"} (per-channel
# int8 kernels are symmetric: 0.09 of that model's 0.12 MB of order JSON were zeros). Readers
# resolve both first (resolve_scales; hmod.Bundle.order).
ORDER_VERSION = 5
ORDER_VERSIONS = (1, 2, 3, 4, 5)
QUANT_ORDER_VERSION = 2
ONNX_ORDER_VERSION = 3
RKNN_ORDER_VERSION = 4
SCALE_REF_ORDER_VERSION = 5
#: scale lists at least this long go to the blob (a per-tensor scale stays inline)
SCALE_REF_MIN = 16

# What runs an order on a device (the agent's executor registry implements each; profiles and the
# manifest's executor hints name them). FALLBACK is the order compiled by TVM alone: it runs
# anywhere, so delegating *to* it gains nothing over leaving the subgraph in TVM.
EXECUTORS = ("armnn", "onnxruntime", "tvm", "rknn")
FALLBACK = "tvm"

# What an order holds (its ``kind``; absent: "layers"), and the executors that can run each kind.
# "layers": ``ops`` from OPS below, which every executor builds. "onnx": a piece of the source model
# that neither ACL nor the device's TVM runtime can run (an op TVM's importer lacks, or one TVM
# lowers to a function only its compiler library registers); ``ops`` is empty, ``onnx_ops`` lists
# the ONNX op types, and the order's ONNX rendering (the original nodes) is all there is to run.
# "rknn": nodes the RK3588's NPU takes (compiler/backends/rknn/npu.py), as the toolkit's ``.rknn`` model (the
# manifest entry's ``rknn`` member) and as their ONNX rendering, which onnxruntime runs wherever the
# NPU's runtime is missing or of another version; ``rknn`` holds {"toolkit_version", "dtype",
# "target_platform", "tolerance", "check"} (docs/npu.md).
# The kinds and their executors are the backend registry's (contract/backends.py).
KINDS: dict[str, tuple[str, ...]] = {b.kind: b.executors for b in BACKENDS.values()}


def kind_of(order: Mapping) -> str:
    return str(order.get("kind") or LAYERS)


def refuses(executor: str, order: Mapping) -> str | None:
    """None when ``executor`` can run ``order``'s kind, else a one-line reason."""
    kind = kind_of(order)
    runners = KINDS.get(kind)
    if runners is None:
        return f"order kind {kind!r} is unknown to this agent (known: {', '.join(KINDS)})"
    if executor in runners:
        return None
    ops = ", ".join(order.get("onnx_ops") or ()) or kind
    return f"an {kind} order ({ops}) runs on {', '.join(runners)} only"


@dataclass(frozen=True)
class Attr:
    kind: str                  # "int", "float", "bool", "ints", "floats", "str", "activation", "any"
    doc: str
    required: bool = False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpType:
    name: str
    doc: str
    inputs: tuple[int, int | None] = (1, 1)       # (min, max) tensor inputs; None: any number
    attrs: Mapping[str, Attr] = field(default_factory=dict)
    weights: Mapping[str, str] = field(default_factory=dict)   # role -> doc; a trailing "?" = optional


# Activation objects: null or {"kind": ..., params}. Fused into conv2d/dense/binary or an op alone.
ACTIVATIONS: dict[str, str] = {
    "relu": "max(x, 0)",
    "clip": "min(max(x, min), max); relu6 is {kind: clip, min: 0, max: 6}",
    "sigmoid": "1 / (1 + exp(-x))",
    "tanh": "tanh(x)",
    "leaky_relu": "x if x > 0 else alpha * x (alpha)",
    "hardswish": "x * clip(x + 3, 0, 6) / 6",
    "hardsigmoid": "clip(alpha * x + beta, 0, 1) (alpha, beta)",
    "silu": "x * sigmoid(x) (SiLU / Swish-1)",
    "gelu": "x * (1 + erf(x / sqrt(2))) / 2 (GELU)",
    "gelu_tanh": "x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) / 2 (GELU, tanh approximation)",
}

_ACT = Attr("activation", "null or an activation object (ACTIVATIONS)")
_PADDING = Attr("ints", "[top, left, bottom, right]")

OPS: dict[str, OpType] = {op.name: op for op in [
    OpType("conv2d", "2-D convolution, NHWC; bias and activation fused",
           attrs={"strides": Attr("ints", "[sh, sw]"), "padding": _PADDING, "dilation": Attr("ints", "[dh, dw]"),
                  "groups": Attr("int", "1, or C_in for depthwise"), "depthwise": Attr("bool", "groups == C_in"),
                  "activation": _ACT},
           weights={"kernel": "OHWI; depthwise: [C*M, KH, KW, 1]", "bias?": "[O]"}),
    OpType("conv2d_transpose", "2-D transposed convolution (deconvolution), NHWC; bias and activation fused",
           attrs={"strides": Attr("ints", "[sh, sw]"), "padding": _PADDING,
                  "output_padding": Attr("ints", "[oh, ow], added at the bottom/right"),
                  "activation": _ACT},
           weights={"kernel": "[O, KH, KW, I] (OHWI)", "bias?": "[O]"}),
    OpType("dense", "fully connected: y = x @ kernel.T (+ bias) over the last axis",
           attrs={"activation": _ACT}, weights={"kernel": "[N, K]", "bias?": "[N]"}),
    OpType("activation", "an activation on its own", attrs={"activation": Attr("activation", "the activation", True)}),
    OpType("prelu", "x if x >= 0 else slope * x, slope broadcast from the right (per channel in NHWC)",
           weights={"slope": "broadcastable to the input"}),
    OpType("pool2d", "max or average pooling, NHWC",
           attrs={"kind": Attr("str", "max or avg", True, ("max", "avg")), "pool_size": Attr("ints", "[kh, kw]", True),
                  "strides": Attr("ints", "[sh, sw]"), "padding": _PADDING, "ceil_mode": Attr("bool", "ONNX ceil_mode"),
                  "count_include_pad": Attr("bool", "average counts padded cells")}),
    OpType("global_pool2d", "max or mean over H and W, NHWC -> N,1,1,C",
           attrs={"kind": Attr("str", "max or avg", True, ("max", "avg"))}),
    OpType("binary", "elementwise with numpy broadcasting; a constant operand is a weight",
           inputs=(0, 2),
           attrs={"kind": Attr("str", "the operation", True,
                               ("add", "sub", "mul", "div", "max", "min")),
                  "activation": _ACT},
           weights={"lhs?": "a constant left operand (the op's inputs are then the right one)",
                    "rhs?": "a constant right operand"}),
    OpType("concat", "join along an axis", inputs=(1, None), attrs={"axis": Attr("int", "non-negative", True)}),
    OpType("reshape", "same data, the output's shape", attrs={"shape": Attr("ints", "the output shape", True)}),
    OpType("transpose", "permute axes as numpy.transpose(axes)", attrs={"axes": Attr("ints", "a permutation", True)}),
    OpType("strided_slice", "x[begin:end:stride] on every axis (normalised: 0 <= begin, end <= dim, stride > 0)",
           attrs={"begin": Attr("ints", "per axis", True), "end": Attr("ints", "per axis", True),
                  "strides": Attr("ints", "per axis, > 0", True)}),
    OpType("pad", "constant padding",
           attrs={"pads": Attr("ints", "[(before, after) per axis], flattened as ONNX orders them: "
                                       "all befores then all afters", True),
                  "value": Attr("float", "the fill value")}),
    OpType("softmax", "softmax over one axis", attrs={"axis": Attr("int", "non-negative", True)}),
    OpType("layer_norm", "(x - mean) / sqrt(var + epsilon) * gamma + beta, mean and var over the last axis",
           attrs={"epsilon": Attr("float", "added to the variance", True)},
           weights={"gamma": "[C], C the last axis", "beta": "[C]"}),
    OpType("resize2d", "spatial resize, NHWC",
           attrs={"method": Attr("str", "nearest or linear", True, ("nearest", "linear")),
                  "coordinate_transformation_mode": Attr("str", "TVM/ONNX coordinate mode"),
                  "rounding_method": Attr("str", "nearest: TVM's rounding name ('' = its default)"),
                  "size": Attr("ints", "[h, w] of the output", True)}),
]}


# Quantized tensors (order_version 2): real = (q - zero_point) * scale. ``quant`` is
# {"scale": [float...], "zero_point": [int...], "axis": int?}: one scale and zero point per tensor,
# or (with ``axis``) one per index of that axis (per-channel weights: axis 0 of a conv kernel, OHWI,
# and of a dense kernel, [N, K]; a bias's scales are input scale x kernel scales).
QUANT_DTYPES: dict[str, tuple[int, int]] = {"int8": (-128, 127), "uint8": (0, 255),
                                            "int32": (-2 ** 31, 2 ** 31 - 1)}
TENSOR_DTYPES = ("float32", *QUANT_DTYPES)

# The op types a quantized tensor may flow through, and what each does with it. An agent whose
# table lacks an entry refuses such an op when it builds the order, and the order runs on its ONNX
# rendering (onnxruntime) instead: no version bump, no wrong numbers.
QUANT_OPS: dict[str, str] = {
    "conv2d": "x and y int8 (or both uint8), int8 kernel (per tensor or per output channel, zero "
              "points 0), int32 bias of scale x scale times kernel scale; relu/clip on y's quantization",
    "dense": "as conv2d",
    "binary": "kind add of two tensors of y's dtype and shape, each read with its own quant and the "
              "sum requantized to y's; relu/clip (since 2026-12-05: older agents run it on onnxruntime)",
}


def float32_text(x: float) -> float:
    """``x`` rounded to float32, as the float with the fewest digits that is still that float32:
    scales are float32 everywhere they are used (ONNX, Arm NN, TVM), and a per-channel order's
    scales written with float64's 17 digits made half of EfficientNet-Lite0's order JSON."""
    want = struct.pack("<f", x)
    for digits in range(6, 10):      # 9 significant digits identify every float32
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == want:
            return y
    return float(struct.unpack("<f", want)[0])


@dataclass(frozen=True)
class Quant:
    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int | None = None

    @property
    def per_tensor(self) -> bool:
        return self.axis is None

    @property
    def varies(self) -> bool:
        """Scales or zero points that differ along the axis (per-axis ones all equal are one per
        tensor: the same reals)."""
        return len(set(self.scale)) > 1 or len(set(self.zero_point)) > 1

    def as_dict(self) -> dict:
        d: dict[str, Any] = {"scale": [float32_text(s) for s in self.scale],
                             "zero_point": [int(z) for z in self.zero_point]}
        if self.axis is not None:
            d["axis"] = int(self.axis)
        return d


def quant_of(spec: Mapping, what: str = "tensor") -> Quant | None:
    """The ``quant`` of a tensor or weight spec (None for float32); ValueError when it is malformed:
    a quantized dtype without one, lengths that disagree with each other or with the axis, a
    non-positive scale, a zero point outside the dtype."""
    dtype = spec.get("dtype", "float32")
    q = spec.get("quant")
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"{what}: dtype {dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
    if dtype == "float32":
        if q is not None:
            raise ValueError(f"{what}: a float32 tensor has a quant object")
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"{what}: {dtype} needs a quant object {{scale, zero_point}}")
    scale, zp, axis = q.get("scale"), q.get("zero_point"), q.get("axis")
    if (not isinstance(scale, list) or not isinstance(zp, list) or not scale or len(scale) != len(zp)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scale)
            or not all(isinstance(z, int) and not isinstance(z, bool) for z in zp)):
        raise ValueError(f"{what}: quant scale and zero_point must be equal-length lists of numbers")
    if not all(math.isfinite(x) and x > 0 for x in scale):
        raise ValueError(f"{what}: quant scales must be positive")
    lo, hi = QUANT_DTYPES[dtype]
    if not all(lo <= z <= hi for z in zp):
        raise ValueError(f"{what}: a zero point is outside {dtype}")
    shape = spec.get("shape")
    if axis is not None:
        if not isinstance(axis, int) or isinstance(axis, bool) or not isinstance(shape, list) or not 0 <= axis < len(shape):
            raise ValueError(f"{what}: quant axis {axis!r} is not an axis of shape {shape}")
        if len(scale) != shape[axis]:
            raise ValueError(f"{what}: {len(scale)} scales for axis {axis} of size {shape[axis]}")
    elif len(scale) != 1:
        raise ValueError(f"{what}: {len(scale)} scales without an axis")
    return Quant(tuple(float(x) for x in scale), tuple(int(z) for z in zp), axis)


def _quant_specs(order: Mapping):
    for table in ("tensors", "weights"):
        for spec in (order.get(table) or {}).values():
            if isinstance(spec, Mapping) and isinstance(spec.get("quant"), Mapping):
                yield spec["quant"]


def scale_refs_out(order: Mapping, blob: bytes, *, min_count: int = SCALE_REF_MIN) -> tuple[dict, bytes]:
    """(order, blob) with every scale list of at least ``min_count`` moved to the end of the blob
    as float32 (64-byte aligned, equal lists once) and referred to, and every zero_point list that
    long of one value written as {fill, count}; order_version 5 if any changed."""
    import copy

    import numpy as np

    out, data, at = copy.deepcopy(dict(order)), bytearray(blob), {}
    filled = False
    for q in _quant_specs(out):
        zp = q.get("zero_point")
        if isinstance(zp, list) and len(zp) >= min_count and len(set(zp)) == 1:
            q["zero_point"], filled = {"fill": zp[0], "count": len(zp)}, True
        scale = q.get("scale")
        if not isinstance(scale, list) or len(scale) < min_count:
            continue
        raw = np.asarray(scale, "<f4").tobytes()
        if raw not in at:
            data.extend(b"\0" * (-len(data) % 64))
            at[raw] = len(data)
            data.extend(raw)
        q["scale"] = {"offset": at[raw], "count": len(scale)}
    if at or filled:
        out["order_version"] = SCALE_REF_ORDER_VERSION
    return out, bytes(data)


def scale_refs(order: Mapping) -> list[tuple[int, int]]:
    """(offset, nbytes) in the blob of every referred scale list (order_version 5)."""
    return [(int(q["scale"]["offset"]), 4 * int(q["scale"]["count"]))
            for q in _quant_specs(order) if isinstance(q.get("scale"), Mapping)]


def resolve_scales(order: Mapping, blob: bytes) -> dict:
    """The order with its scale references read from the blob as lists (a copy when there are
    any); ValueError for a reference that is not float32s inside the blob."""
    if not any(isinstance(q.get(k), Mapping) for q in _quant_specs(order) for k in ("scale", "zero_point")):
        return dict(order)
    import copy

    import numpy as np

    out = copy.deepcopy(dict(order))
    for q in _quant_specs(out):
        fill = q.get("zero_point")
        if isinstance(fill, Mapping):
            v, n = fill.get("fill"), fill.get("count")
            if type(v) is not int or type(n) is not int or not 0 < n <= 1 << 20:
                raise ValueError(f"a quant zero_point {dict(fill)} is not {{fill: an integer, count: 1..{1 << 20}}}")
            q["zero_point"] = [v] * n
        ref = q.get("scale")
        if not isinstance(ref, Mapping):
            continue
        off, n = ref.get("offset"), ref.get("count")
        if (type(off) is not int or type(n) is not int or off < 0 or n < 1 or off % 4
                or off + 4 * n > len(blob)):
            raise ValueError(f"a quant scale reference {dict(ref)} is not float32s inside the "
                             f"{len(blob)}-byte weights blob")
        q["scale"] = [float(x) for x in np.frombuffer(blob, "<f4", n, off)]
    return out


def is_quantized(order: Mapping) -> bool:
    specs = list((order.get("tensors") or {}).values()) + list((order.get("weights") or {}).values())
    return any(isinstance(s, Mapping) and s.get("dtype", "float32") != "float32" for s in specs)


def weight_roles(op_type: OpType) -> tuple[set[str], set[str]]:
    """(required roles, optional roles) of an op type."""
    req = {r for r in op_type.weights if not r.endswith("?")}
    opt = {r[:-1] for r in op_type.weights if r.endswith("?")}
    return req, opt


def check_op(op: Any) -> str | None:
    """None when ``op`` is well formed by this table (types, arity, attrs, weight roles), else a
    one-line reason. Shapes are the consumers' business."""
    if not isinstance(op, Mapping):
        return f"op is a {type(op).__name__}, not an object"
    t = OPS.get(op.get("type")) if isinstance(op.get("type"), str) else None
    if t is None:
        return f"op type {op.get('type')!r} is not in order_version {ORDER_VERSION}'s vocabulary (known: {', '.join(OPS)})"
    ins = op.get("inputs", [])
    if not isinstance(ins, list) or not all(isinstance(i, str) for i in ins):
        return f"{t.name}: inputs must be a list of tensor names"
    weights = op.get("weights") or {}
    if not isinstance(weights, Mapping) or not all(isinstance(v, str) for v in weights.values()):
        return f"{t.name}: weights must map roles to weight names"
    attrs = op.get("attrs") or {}
    if not isinstance(attrs, Mapping):
        return f"{t.name}: attrs must be an object"
    for name, a in t.attrs.items():
        if name not in attrs or attrs[name] is None:
            if a.required:
                return f"{t.name}: attr {name!r} is required"
            continue
        if r := _check_attr(t.name, name, a, attrs[name]):
            return r
    req, opt = weight_roles(t)
    if missing := req - set(weights):
        return f"{t.name}: missing weight(s) {sorted(missing)}"
    if extra := set(weights) - req - opt:
        return f"{t.name}: unknown weight role(s) {sorted(extra)}"
    lo, hi = t.inputs
    n = len(ins) + (len(weights) if t.name == "binary" else 0)
    if t.name == "binary" and n != 2:
        return f"binary: needs two operands (inputs + constant weights), has {n}"
    if t.name != "binary" and (len(ins) < lo or (hi is not None and len(ins) > hi)):
        return f"{t.name}: takes {lo}{'' if hi == lo else '+' if hi is None else f'..{hi}'} input(s), has {len(ins)}"
    if not isinstance(op.get("output"), str):
        return f"{t.name}: output must be one tensor name"
    return None


def _check_attr(op: str, name: str, a: Attr, v: Any) -> str | None:
    ok = {
        "int": lambda: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda: isinstance(v, bool),
        "str": lambda: isinstance(v, str),
        "ints": lambda: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "floats": lambda: isinstance(v, list) and all(isinstance(x, (int, float)) for x in v),
        "activation": lambda: isinstance(v, Mapping) and v.get("kind") in ACTIVATIONS,
        "any": lambda: True,
    }[a.kind]()
    if not ok:
        return f"{op}: attr {name!r} = {v!r} is not a valid {a.kind}"
    if a.choices and v not in a.choices:
        return f"{op}: attr {name!r} = {v!r} is not one of {', '.join(a.choices)}"
    return None


def markdown_table() -> str:
    """The op types as the format doc shows them (docs/bundle-format.md is tested against it)."""
    def attr(n: str, a: Attr) -> str:
        choices = f": {'/'.join(a.choices)}" if a.choices else ""
        return f"{n}{'' if a.required else '?'} ({a.doc}{choices})"

    rows = ["| type | what | inputs | attrs | weights |", "|---|---|---|---|---|"]
    for t in OPS.values():
        lo, hi = t.inputs
        ins = str(lo) if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"
        attrs = "; ".join(attr(n, a) for n, a in t.attrs.items()) or "-"
        weights = "; ".join(f"{r} ({d})" for r, d in t.weights.items()) or "-"
        rows.append(f"| `{t.name}` | {t.doc} | {ins} | {attrs} | {weights} |")
    rows.append("")
    rows.append("Activation objects are null or `{kind, ...}`: " + "; ".join(
        f"`{k}` {d}" for k, d in ACTIVATIONS.items()) + ".")
    return "\n".join(rows)
