"""What the ARM Compute Library (through Arm NN) runs well: the support table, as data.

One :class:`Entry` per op family: the Relax dataflow patterns it matches (fused composites, most
specific first), a check per pattern that returns None when ACL can take the match or a one-line
reason when it cannot, the order op type it becomes (the contract's vocabulary,
``tandoor_contract.orders.OPS``) and the function that writes that order op. Next to it,
``RELAX_OPS`` says per Relax operator how an op left alone is explained (the same checks) and what
it costs (compiler/cost.py). partition.py, codegen.py and cost.py dispatch on these tables and
know no op by name.

The constraints follow Arm NN 20.08 / ACL and TVM v0.19's ACL integration:
  - float32, or a QDQ-quantized conv2d/dense (int8/uint8 activations per tensor, int8 weights per
    tensor or per output channel) or residual add (the "q" entries), tensors of rank <= 4, static
    shapes;
  - conv2d in NHWC with a constant OHWI kernel; depthwise (groups == C_in) is ACL's
    NEDepthwiseConvolutionLayer; other grouped convolutions have no Arm NN 20.08 layer;
  - pools in NHWC with padding smaller than the window (ACL's pooling validation);
  - resize nearest/bilinear in NHWC, with the coordinate modes whose index maps equal ACL's.
Each entry names the first Arm NN release that builds it (``since``, default 20.08: a layer of its
own or layers 20.08 has); one that no release in ARMNN_RELEASES has matches nothing (GELU's erf
form, an Arm NN layer since 23.11), so its op stays in TVM as one fused kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from tandoor_contract import orders

Check = Callable[[Mapping[str, relax.Expr]], "str | None"]
OpCheck = Callable[[relax.Call], "str | None"]


@dataclass(frozen=True)
class Rule:
    name: str                                   # the composite's name, "acl.<entry>[_variant]"
    pattern: DFPattern
    annotations: dict[str, DFPattern] = field(default_factory=dict)
    check: Check = lambda _: None


class Match:
    """One composite function of a delegated region, as codegen hands it to an entry's ``emit``."""

    def __init__(self, composite: str, func: relax.Function, ins: list[str], out: str,
                 add_weight: Callable[..., str], add_tensor: Callable[[list[int]], str],
                 set_quant: Callable[[str, orders.Quant], None] | None = None):
        self.composite, self.func, self.ins, self.out = composite, func, ins, out
        self.add_weight, self.add_tensor = add_weight, add_tensor
        self.set_quant = set_quant or (lambda name, q: None)
        self.calls = _calls(func)
        self.params = list(func.params)

    def call(self, op: str) -> relax.Call | None:
        """The last call of Relax op ``op`` in the composite (the root when it occurs once)."""
        found = [c for c in self.calls if c.op.name == op]
        return found[-1] if found else None

    @property
    def root(self) -> relax.Call:
        return self.calls[0]

    def name_of(self, e: relax.Expr) -> str:
        """The order tensor behind an argument of the composite (one of its parameters)."""
        for p, n in zip(self.params, self.ins):
            if e.same_as(p):
                return n
        raise ValueError(f"{self.composite}: an operand is neither a parameter nor a constant")

    @property
    def variant(self) -> str:
        return self.composite.split(".", 1)[1]


Emit = Callable[[Match], list[dict]]


@dataclass(frozen=True)
class Entry:
    name: str
    order_type: str          # a key of tandoor_contract.orders.OPS
    rules: tuple[Rule, ...]
    emit: Emit
    doc: str = ""
    # the first Arm NN release that builds this order op (a layer of its own, or layers 20.08 has):
    # an entry newer than every release in ARMNN_RELEASES is refused, so its op stays in TVM
    since: str = "20.08"


# The Arm NN releases the agent's armnn executor speaks (the last ones with a Python binding; Debian
# 12 and 13). The executor refuses an order op its release lacks (agent/run/executors/armnn.py).
ARMNN_RELEASES = ("20.08", "23.08")


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def release_reason(what: str, since: str) -> str | None:
    """Why ``what`` cannot be delegated when no board's Arm NN has it yet (None when one has)."""
    if _release(since) <= max(_release(r) for r in ARMNN_RELEASES):
        return None
    return (f"{what} is an Arm NN layer only since {since}; the Arm NN releases Tandoor's boards run "
            f"({', '.join(ARMNN_RELEASES)}) lack it")


@dataclass(frozen=True)
class RelaxOp:
    """A Relax operator: why it may stay in TVM (``check``; None: no ACL kernel at all) and how
    compiler/cost.py counts it (``cost``: heavy = a kernel of its own even when fused, fused =
    rides along with a neighbour in TVM, free = no data movement; ``flops``: work done)."""
    check: OpCheck | None
    cost: str = "fused"
    flops: Callable[[relax.Call], float] | None = None


# --- helpers ---------------------------------------------------------------------------------

def _shape(e: relax.Expr) -> list[int] | None:
    sh = getattr(e.ty, "shape", None)
    if sh is None:
        return None
    try:
        return [int(d) for d in sh]
    except (TypeError, ValueError):
        return None


def _dtype(e: relax.Expr) -> str:
    return str(getattr(e.ty, "dtype", "?"))


def _ints(v) -> list[int]:
    return [int(x) for x in v]


def _num(v) -> float:
    """A PrimValue/IntImm/FloatImm bound as a float."""
    return float(v.value) if hasattr(v, "value") else float(v)


def _is_const(e: relax.Expr) -> bool:
    return isinstance(e, tvm.ir.GenericConst)


def _const(e: relax.Expr) -> np.ndarray:
    if not _is_const(e):
        raise ValueError(f"expected a constant, got {type(e).__name__}")
    return e.value.numpy()


def _calls(func: relax.Function) -> list[relax.Call]:
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                out.append(b.value)
    if isinstance(func.body.body, relax.Call) and isinstance(func.body.body.op, tvm.ir.Op):
        out.append(func.body.body)
    return out


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))


def _fp32(*exprs: relax.Expr) -> str | None:
    for e in exprs:
        if _dtype(e) != "float32":
            return f"dtype {_dtype(e)}: Tandoor's ACL kernels are float32-only for now"
        s = _shape(e)
        if s is None:
            return "dynamic shape: ACL needs static shapes"
        if len(s) > 4:
            return f"rank-{len(s)} tensor: Arm NN's kernels take rank <= 4"
    return None


def _tensor_args(call: relax.Call) -> list[relax.Expr]:
    return [a for a in call.args if isinstance(a, relax.Expr) and isinstance(a.ty, relax.TensorType)]


# --- per-op constraint checks (also used to explain why an op stayed in TVM) ------------------

def check_conv2d(call: relax.Call) -> str | None:
    data, kernel = call.args[0], call.args[1]
    if r := _fp32(data, kernel):
        return r
    if not _is_const(kernel):
        return "conv2d kernel is not a constant: Arm NN needs weights at network build time"
    if call.attrs.data_layout != "NHWC" or call.attrs.kernel_layout != "OHWI":
        return f"conv2d in {call.attrs.data_layout}/{call.attrs.kernel_layout}: ACL's fast kernels are NHWC/OHWI"
    if str(call.attrs.out_dtype) not in ("", "float32", "None"):
        return f"conv2d out_dtype {call.attrs.out_dtype}"
    groups = int(call.attrs.groups)
    cin = _shape(data)[3]
    cout = _shape(kernel)[0]
    if groups != 1 and not (groups == cin and cout % cin == 0):
        return f"grouped convolution (groups={groups}, {cin} channels): Arm NN 20.08 has only ordinary and depthwise convolution"
    return None


def check_conv2d_transpose(call: relax.Call) -> str | None:
    data, kernel = call.args[0], call.args[1]
    if r := _fp32(data, kernel):
        return r
    if not _is_const(kernel):
        return "conv2d_transpose kernel is not a constant"
    a = call.attrs
    if a.data_layout != "NHWC" or a.kernel_layout != "IOHW":
        return f"conv2d_transpose in {a.data_layout}/{a.kernel_layout}: ACL's kernels are NHWC"
    if int(a.groups) != 1:
        return f"grouped conv2d_transpose (groups={int(a.groups)}) has no Arm NN layer"
    if any(int(d) != 1 for d in a.dilation):
        return "dilated conv2d_transpose has no Arm NN layer"
    return None


def check_dense(call: relax.Call) -> str | None:
    x, w = call.args[0], call.args[1]
    if r := _fp32(x, w):
        return r
    if not _is_const(w):
        return "matmul with a non-constant right operand: ACL's fully-connected layer needs constant weights"
    if len(_shape(w)) != 2:
        return f"matmul with a rank-{len(_shape(w))} weight: only 2-D weights map to a fully-connected layer"
    return None


def check_pool2d(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if call.attrs.layout != "NHWC":
        return f"pooling in {call.attrs.layout}: ACL pools run in NHWC"
    if any(int(d) != 1 for d in call.attrs.dilation):
        return "dilated pooling has no ACL kernel"
    size = _ints(call.attrs.pool_size)
    pad = _ints(call.attrs.padding)
    if pad[0] >= size[0] or pad[2] >= size[0] or pad[1] >= size[1] or pad[3] >= size[1]:
        return f"pool padding {pad} not smaller than the window {size} (ACL refuses it)"
    if bool(call.attrs.ceil_mode):
        # ONNX drops a last window that starts inside the bottom/right padding; ACL does not.
        shape = _shape(call.args[0])
        strides = _ints(call.attrs.strides)
        for ax, (lo, hi) in ((1, (pad[0], pad[2])), (2, (pad[1], pad[3]))):
            n, k, st = shape[ax], size[ax - 1], strides[ax - 1]
            out = -(-(n + lo + hi - k) // st) + 1
            if (out - 1) * st >= n + lo:
                return "ceil_mode pooling whose last window starts in the padding: ACL and ONNX disagree on its size"
    return None


def check_global_pool(call: relax.Call) -> str | None:
    x = call.args[0]
    if r := _fp32(x):
        return r
    shape = _shape(x)
    if len(shape) != 4:
        return f"reduction over a rank-{len(shape)} tensor: only NHWC spatial reductions map to ACL's global pool"
    axes = sorted(int(a) % 4 for a in call.attrs.axis) if call.attrs.axis is not None else []
    if axes != [1, 2]:
        return f"reduction over axes {axes}: only the H,W axes of NHWC map to ACL's global pool"
    return None


def check_adaptive_pool(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if call.attrs.layout != "NHWC":
        return f"adaptive pooling in {call.attrs.layout}"
    out = call.attrs.output_size
    if out is None or _ints(out) != [1, 1]:
        return "adaptive pooling to a size other than 1x1 has no ACL kernel"
    return None


def check_elementwise(call: relax.Call) -> str | None:
    return _fp32(*_tensor_args(call), call)


def check_unary(call: relax.Call) -> str | None:
    return _fp32(call.args[0])


def check_prelu(call: relax.Call) -> str | None:
    x, alpha = call.args[0], call.args[1]
    if r := _fp32(x, alpha):
        return r
    if not _is_const(alpha):
        return "prelu slope is not a constant"
    if _numel(_shape(alpha)) not in (1, _shape(x)[int(call.attrs.axis) % len(_shape(x))]):
        return "prelu slope is neither a scalar nor one per channel"
    return None


def check_concat(call: relax.Call) -> str | None:
    fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
    if fields is None:
        return "concat of a non-literal tuple"
    if r := _fp32(*fields):
        return r
    if any(_is_const(f) for f in fields):
        return "concat with a constant operand: orders concatenate tensors only"
    return None


def check_reshape(call: relax.Call) -> str | None:
    return _fp32(call.args[0], call)


def check_softmax(call: relax.Call) -> str | None:
    return _fp32(call.args[0])


def check_resize(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    a = call.attrs
    if a.layout != "NHWC":
        return f"resize in {a.layout}"
    if a.method not in ("nearest_neighbor", "linear"):
        return f"resize method {a.method}: ACL has nearest and bilinear only"
    mode, rounding = str(a.coordinate_transformation_mode), str(a.rounding_method)
    if a.method == "linear" and mode not in ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"):
        return f"bilinear resize with coordinate mode {mode} has no ACL equivalent"
    # Nearest: only the (mode, rounding) pairs whose index maps match ACL's for every size.
    if a.method == "nearest_neighbor" and (mode, rounding) not in NEAREST_OK:
        return f"nearest resize with {mode}/{rounding or 'default'} rounding picks other pixels than ACL"
    return None


NEAREST_OK = {("asymmetric", "floor"), ("half_pixel", "round_prefer_ceil"), ("align_corners", "round_prefer_ceil"),
              ("tf_half_pixel_for_nn", "floor")}


def check_gelu(call: relax.Call) -> str | None:
    return release_reason("GELU (erf)", GELU_SINCE) or _fp32(call.args[0])


GELU_SINCE = "23.11"      # ActivationFunction::Gelu (Arm NN 23.11 release notes)


def check_layer_norm(call: relax.Call) -> str | None:
    x, gamma, beta = call.args[0], call.args[1], call.args[2]
    if r := _fp32(x, gamma, beta):
        return r
    rank = len(_shape(x))
    if sorted(int(a) % rank for a in call.attrs.axes) != [rank - 1]:
        return "layer norm over axes other than the last: orders normalise the last axis only"
    if not (_is_const(gamma) and _is_const(beta)):
        return "layer norm with a non-constant gamma or beta"
    return None


def check_transpose(call: relax.Call) -> str | None:
    shape = _shape(call.args[0])
    if shape is not None and len(shape) < 2:    # a rank-0/1 "transpose" moves nothing; ONNX has no empty perm
        return f"transpose of a rank-{len(shape)} tensor moves nothing"
    return _fp32(call.args[0])


def slice_spec(call: relax.Call) -> tuple[list[int], list[int], list[int]] | str:
    """A strided_slice as full-rank (begin, end, strides), normalised like numpy; or a reason."""
    shape = _shape(call.args[0])
    vals = []
    for arg in call.args[1:5]:
        if arg is None:
            vals.append(None)
            continue
        items = arg.fields if isinstance(arg, relax.Tuple) else getattr(arg, "values", None)
        if items is None:
            return "strided_slice with non-constant bounds"
        try:
            vals.append([int(_num(v)) for v in items])
        except (TypeError, ValueError):
            return "strided_slice with non-constant bounds"
    axes, begin, end = vals[0], vals[1], vals[2]
    strides = vals[3] if len(vals) > 3 and vals[3] is not None else [1] * len(axes)
    rank = len(shape)
    b, e, s = [0] * rank, list(shape), [1] * rank
    for ax, lo, hi, st in zip(axes, begin, end, strides):
        ax %= rank
        if st <= 0:
            return f"strided_slice with step {st}: ACL slices forwards only"
        n = shape[ax]
        lo = max(0, min(n, lo + n if lo < 0 else lo))
        hi = max(0, min(n, hi + n if hi < 0 else hi))
        b[ax], e[ax], s[ax] = lo, max(hi, lo), st
    return b, e, s


def check_strided_slice(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0], call):
        return r
    spec = slice_spec(call)
    if isinstance(spec, str):
        return spec
    if any(d == 0 for d in _shape(call)):
        return "strided_slice to an empty tensor"
    return None


def check_pad(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if str(call.attrs.pad_mode) != "constant":
        return f"pad mode {call.attrs.pad_mode}: Arm NN pads with a constant only"
    if any(int(p) < 0 for p in call.attrs.pad_width):
        return "negative padding (a crop) is not a pad"
    return None


# --- activations: how each is matched and written ------------------------------------------------

def _clip_bounds(call: relax.Call) -> tuple[float, float]:
    return _num(call.args[1]), _num(call.args[2])


@dataclass(frozen=True)
class Activation:
    """An activation as an epilogue of a conv/dense (``epilogue(p)`` wraps the producer pattern
    ``p``) and as an op alone; ``write(match)`` is the order's activation object."""
    kind: str
    epilogue: Callable[[DFPattern], DFPattern]
    write: Callable[[Match], dict]
    check: OpCheck = check_unary


def _silu(p: DFPattern) -> DFPattern:
    s = is_op("relax.sigmoid")(p)
    return is_op("relax.multiply")(p, s) | is_op("relax.multiply")(s, p)


EPILOGUES: dict[str, Activation] = {a.kind: a for a in [
    Activation("silu", _silu, lambda m: {"kind": "silu"}),        # before sigmoid: it contains one
    Activation("relu", lambda p: is_op("relax.nn.relu")(p), lambda m: {"kind": "relu"}),
    Activation("clip", lambda p: is_op("relax.clip")(p, wildcard(), wildcard()),
               lambda m: dict(zip(("kind", "min", "max"), ("clip", *_clip_bounds(m.call("relax.clip")))))),
    Activation("sigmoid", lambda p: is_op("relax.sigmoid")(p), lambda m: {"kind": "sigmoid"}),
    Activation("tanh", lambda p: is_op("relax.tanh")(p), lambda m: {"kind": "tanh"}),
    Activation("leakyrelu", lambda p: is_op("relax.nn.leakyrelu")(p),
               lambda m: {"kind": "leaky_relu", "alpha": float(m.call("relax.nn.leakyrelu").attrs.alpha)}),
]}


def _act_of(m: Match) -> dict | None:
    """The activation a composite's name ends in (``acl.conv2d_bias_relu`` -> relu), or None."""
    suffix = m.variant.rsplit("_", 1)[-1]
    a = EPILOGUES.get(suffix)
    return a.write(m) if a else None


# --- the patterns ------------------------------------------------------------------------------

def _with_epilogue(name: str, root: DFPattern, check_root: OpCheck, bias: bool = True) -> list[Rule]:
    """root -> add(const)? -> activation?, most specific first (dpl has no optional())."""
    rules = []
    for act in list(EPILOGUES.values()) + [None]:
        for with_bias in ((True, False) if bias else (False,)):
            p = root
            ann = {"root": root}
            if with_bias:
                b = is_const()
                p = is_op("relax.add")(p, b)
                ann["bias"] = b
            if act:
                p = act.epilogue(p)
                ann["act"] = p
            suffix = ("_bias" if with_bias else "") + ("_" + act.kind if act else "")
            rules.append(Rule(f"acl.{name}{suffix}", p, ann, _epilogue_check(check_root, with_bias)))
    return rules


def _epilogue_check(check_root: OpCheck, bias: bool) -> Check:
    def check(ann: Mapping[str, relax.Expr]) -> str | None:
        root = ann["root"]
        if r := check_root(root):
            return r
        if bias:
            bshape, oshape = _shape(ann["bias"]), _shape(root)
            # a bias is per output channel: broadcastable to (..., C)
            if bshape is None or not bshape or bshape[-1] != oshape[-1] or any(d != 1 for d in bshape[:-1]):
                return "add after conv/dense is not a per-channel bias"
        return None

    return check


def _single(name: str, op: str, check: OpCheck, arity: int = 1) -> Rule:
    """One op alone; its first ``arity`` arguments are tensors (any further ones, such as
    strided_slice's bounds, are matched as they come and read by the check)."""
    p = is_op(op)(*[wildcard() for _ in range(arity)], varg_default_wildcard=True)
    return Rule(f"acl.{name}", p, {"root": p}, lambda ann: check(ann["root"]))


def _hardswish_rules() -> list[Rule]:
    """Hard-swish in the forms it reaches Relax: x * clip(x + 3, 0, 6) / 6 (TVM's import of ONNX
    HardSwish, either association, or * 1/6) and x * clip(x / 6 + 0.5, 0, 1) (HardSigmoid times x,
    as onnxruntime's folding leaves it), operands in either order."""
    def mul(a, b):
        return is_op("relax.multiply")(a, b) | is_op("relax.multiply")(b, a)

    out = []
    for variant in ("mul_div", "div_mul", "mul_mul", "mul_mul2", "hsig"):
        x, a, b = wildcard(), is_const(), is_const()
        if variant == "hsig":
            clip = is_op("relax.clip")(is_op("relax.add")(mul(a, x), b), wildcard(), wildcard())
            p = mul(x, clip)
        else:
            clip = is_op("relax.clip")(is_op("relax.add")(x, a), wildcard(), wildcard())
            p = {"mul_div": lambda: mul(x, is_op("relax.divide")(clip, b)),         # x * (clip / 6)
                 "div_mul": lambda: is_op("relax.divide")(mul(x, clip), b),         # (x * clip) / 6
                 "mul_mul": lambda: mul(mul(x, clip), b),                           # (x * clip) * 1/6
                 "mul_mul2": lambda: mul(x, mul(clip, b))}[variant]()               # x * (clip * 1/6)
        ann = {"root": p, "clip": clip, "a": a, "b": b, "x": x}
        out.append(Rule(f"acl.hardswish_{variant}", p, ann, _hardswish_check(variant)))
    return out


def _hardswish_check(variant: str) -> Check:
    # (a, b, clip_hi) for x * clip(x + a, 0, hi) / b (or * b), or x * clip(a * x + b, 0, hi)
    want = {"mul_div": (3.0, 6.0, 6.0), "div_mul": (3.0, 6.0, 6.0), "mul_mul": (3.0, 1 / 6, 6.0),
            "mul_mul2": (3.0, 1 / 6, 6.0), "hsig": (1 / 6, 0.5, 1.0)}[variant]

    def check(ann: Mapping[str, relax.Expr]) -> str | None:
        if r := _fp32(ann["x"]):
            return r
        a, b, clip = _const(ann["a"]), _const(ann["b"]), ann["clip"]
        if a.size != 1 or b.size != 1:
            return "not a hard-swish (non-scalar constants)"
        got = (float(a.reshape(())), float(b.reshape(())), _num(clip.args[2]))
        if _num(clip.args[1]) != 0.0 or any(abs(g - w) > 1e-6 for g, w in zip(got, want)):
            return "not a hard-swish (constants differ)"
        return None

    return check


def _hardsigmoid_rule() -> Rule:
    x, a, b = wildcard(), is_const(), is_const()
    scaled = is_op("relax.multiply")(a, x) | is_op("relax.multiply")(x, a)
    p = is_op("relax.clip")(is_op("relax.add")(scaled, b), wildcard(), wildcard())

    def check(ann):
        if r := _fp32(ann["x"]):
            return r
        if _const(ann["a"]).size != 1 or _const(ann["b"]).size != 1:
            return "not a hard-sigmoid (non-scalar constants)"
        if _clip_bounds(ann["root"]) != (0.0, 1.0):
            return "not a hard-sigmoid (clip bounds are not 0..1)"
        return None

    return Rule("acl.hardsigmoid", p, {"root": p, "x": x, "a": a, "b": b}, check)


def _silu_rule() -> Rule:
    x = wildcard()
    p = _silu(x)
    return Rule("acl.silu", p, {"root": p, "x": x}, lambda ann: _fp32(ann["x"]))


# --- writing order ops -----------------------------------------------------------------------

def _op(m: Match, type_: str, inputs: list[str], attrs: dict, weights: dict | None = None,
        output: str | None = None) -> dict:
    op = {"type": type_, "inputs": inputs, "output": output or m.out, "attrs": attrs}
    if weights:
        op["weights"] = weights
    return op


def _conv_attrs(m: Match, conv: relax.Call) -> dict:
    """A conv2d order op's attrs (float and quantized alike)."""
    a = conv.attrs
    groups = int(a.groups)
    return {"strides": _ints(a.strides), "padding": _ints(a.padding), "dilation": _ints(a.dilation),
            "groups": groups, "depthwise": groups != 1 and groups == _shape(conv.args[0])[3], "activation": _act_of(m)}


def emit_conv2d(m: Match) -> list[dict]:
    conv = m.call("relax.nn.conv2d")
    weights = {"kernel": m.add_weight(_const(conv.args[1]), "kernel")}
    if m.variant.startswith("conv2d_bias"):
        weights["bias"] = m.add_weight(_const(m.call("relax.add").args[1]).reshape(-1), "bias")
    return [_op(m, "conv2d", [m.name_of(conv.args[0])], _conv_attrs(m, conv), weights)]


def emit_conv2d_transpose(m: Match) -> list[dict]:
    conv = m.call("relax.nn.conv2d_transpose")
    a = conv.attrs
    kernel = _const(conv.args[1]).transpose(1, 2, 3, 0)      # IOHW -> OHWI
    weights = {"kernel": m.add_weight(kernel, "kernel")}
    if "_bias" in m.variant:
        weights["bias"] = m.add_weight(_const(m.call("relax.add").args[1]).reshape(-1), "bias")
    attrs = {"strides": _ints(a.strides), "padding": _ints(a.padding), "output_padding": _ints(a.output_padding),
             "activation": _act_of(m)}
    return [_op(m, "conv2d_transpose", [m.name_of(conv.args[0])], attrs, weights)]


def emit_dense(m: Match) -> list[dict]:
    mm = m.call("relax.matmul")
    weights = {"kernel": m.add_weight(_const(mm.args[1]).T, "kernel")}
    if m.variant.startswith("dense_bias"):
        weights["bias"] = m.add_weight(_const(m.call("relax.add").args[1]).reshape(-1), "bias")
    return [_op(m, "dense", [m.name_of(mm.args[0])], {"activation": _act_of(m)}, weights)]


def _first_param(m: Match) -> list[str]:
    return [m.ins[0]]


def emit_activation(m: Match) -> list[dict]:
    v = m.variant
    if v.startswith("hardswish"):
        act = {"kind": "hardswish"}
    elif v == "hardsigmoid":
        mul = m.call("relax.multiply")
        alpha = next(_const(x) for x in mul.args if _is_const(x))
        act = {"kind": "hardsigmoid", "alpha": float(alpha.reshape(())),
               "beta": float(_const(m.call("relax.add").args[1]).reshape(()))}
    elif v in ("silu", "gelu", "gelu_tanh"):
        act = {"kind": v}
    else:
        act = EPILOGUES[{"leaky_relu": "leakyrelu"}.get(v, v)].write(m)
    return [_op(m, "activation", _first_param(m), {"activation": act})]


def emit_prelu(m: Match) -> list[dict]:
    call = m.root
    x, alpha = call.args[0], _const(call.args[1]).reshape(-1)
    rank = len(_shape(x))
    axis = int(call.attrs.axis) % rank
    slope = alpha.reshape([alpha.size] + [1] * (rank - 1 - axis)) if alpha.size > 1 else alpha.reshape(1)
    return [_op(m, "prelu", [m.name_of(x)], {}, {"slope": m.add_weight(slope, "slope")})]


def emit_pool2d(m: Match) -> list[dict]:
    a = m.root.attrs
    kind = "max" if m.variant == "max_pool2d" else "avg"
    return [_op(m, "pool2d", _first_param(m), {
        "kind": kind, "pool_size": _ints(a.pool_size), "strides": _ints(a.strides), "padding": _ints(a.padding),
        "ceil_mode": bool(a.ceil_mode), "count_include_pad": bool(a.count_include_pad)})]


def emit_global_pool2d(m: Match) -> list[dict]:
    kind = "max" if m.variant == "global_max_pool2d" else "avg"
    oshape = _shape(m.root)
    if len(oshape) == 4:
        return [_op(m, "global_pool2d", _first_param(m), {"kind": kind})]
    n, c = _shape(m.root.args[0])[0], _shape(m.root.args[0])[3]
    mid = m.add_tensor([n, 1, 1, c])
    return [_op(m, "global_pool2d", _first_param(m), {"kind": kind}, output=mid),
            _op(m, "reshape", [mid], {"shape": oshape})]


BINARY_KINDS = {"relax.add": "add", "relax.subtract": "sub", "relax.multiply": "mul", "relax.divide": "div",
                "relax.maximum": "max", "relax.minimum": "min"}


def emit_binary(m: Match) -> list[dict]:
    root = m.root
    op = _op(m, "binary", [], {"kind": BINARY_KINDS[root.op.name]})
    weights = {}
    for role, arg in (("lhs", root.args[0]), ("rhs", root.args[1])):
        if _is_const(arg):
            weights[role] = m.add_weight(_const(arg), role)
        else:  # by identity: Mul(x, x) has one parameter used twice
            op["inputs"].append(m.name_of(arg))
    if weights:
        op["weights"] = weights
    return [op]


def emit_concat(m: Match) -> list[dict]:
    rank = len(_shape(m.root))
    return [_op(m, "concat", [m.name_of(f) for f in m.root.args[0].fields], {"axis": int(m.root.attrs.axis) % rank})]


def emit_reshape(m: Match) -> list[dict]:
    return [_op(m, "reshape", _first_param(m), {"shape": _shape(m.root)})]


def emit_softmax(m: Match) -> list[dict]:
    rank = len(_shape(m.root))
    return [_op(m, "softmax", _first_param(m), {"axis": int(m.root.attrs.axis) % rank})]


def emit_resize2d(m: Match) -> list[dict]:
    a = m.root.attrs
    return [_op(m, "resize2d", _first_param(m), {
        "method": "nearest" if a.method == "nearest_neighbor" else "linear",
        "coordinate_transformation_mode": str(a.coordinate_transformation_mode),
        "rounding_method": str(a.rounding_method), "size": _shape(m.root)[1:3]})]


def emit_layer_norm(m: Match) -> list[dict]:
    call = m.root
    c = _shape(call)[-1]
    weights = {role: m.add_weight(np.broadcast_to(_const(arg).reshape(-1), (c,)).astype(np.float32), role)
               for role, arg in (("gamma", call.args[1]), ("beta", call.args[2]))}
    return [_op(m, "layer_norm", _first_param(m), {"epsilon": float(call.attrs.epsilon)}, weights)]


def emit_transpose(m: Match) -> list[dict]:
    rank = len(_shape(m.root))
    a = m.root.attrs
    axes = _ints(a.axes) if a.axes is not None else list(reversed(range(rank)))
    return [_op(m, "transpose", _first_param(m), {"axes": axes})]


def emit_strided_slice(m: Match) -> list[dict]:
    b, e, s = slice_spec(m.root)
    return [_op(m, "strided_slice", _first_param(m), {"begin": b, "end": e, "strides": s})]


def emit_pad(m: Match) -> list[dict]:
    pw = _ints(m.root.attrs.pad_width)          # relax: before_1, after_1, ..., before_N, after_N
    pads = pw[0::2] + pw[1::2]                  # order: all befores, then all afters (as ONNX)
    return [_op(m, "pad", _first_param(m), {"pads": pads, "value": float(m.root.attrs.pad_value)})]



# --- quantized (QDQ) composites ----------------------------------------------------------------
#
# A QDQ model (tandoor quantize, or PyTorch/NNCF/ModelOpt exports) reaches Relax as
# quantize(act?(conv2d(dequantize(x_q), W) + B)) with W and B already folded to float32 (their
# DequantizeLinear of int8/int32 constants folds like any constant). The composite takes the int8
# tensor x_q and gives an int8 tensor, which is what ACL's quantized kernels do; the kernel's int8
# codes and scales are recovered from W exactly (int8_grid) rather than trusted from names.

QUANT_ACTS = ("relu", "clip")     # what a quantized kernel fuses (onnxruntime folds most into Q)
INT8_ACTIVATIONS = ("int8", "uint8")


def int8_grid(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(int8 codes, float scales) with w == codes * scale exactly (to float32 rounding): one
    scale for the tensor (axis None) or one per index of ``axis``; None when w is not such a grid
    (a float weight). The largest |w| of each group is some n <= 128 steps, which gives the scale."""
    w64 = np.asarray(w, np.float64)
    groups = w64.reshape(1, -1) if axis is None else np.moveaxis(w64, axis, 0).reshape(w64.shape[axis], -1)
    codes, scales = np.empty(groups.shape, np.int8), np.empty(len(groups))
    for i, g in enumerate(groups):
        m = float(np.abs(g).max()) if g.size else 0.0
        if m == 0.0:
            codes[i], scales[i] = 0, 1.0
            continue
        for n in (127, 128, *range(126, 0, -1)):
            q = g * (n / m)
            r = np.round(q)
            if np.abs(q - r).max() <= 1e-3 and r.min() >= -128 and r.max() <= 127:
                codes[i], scales[i] = r, m / n
                break
        else:
            return None
    if axis is not None:
        shape = list(np.moveaxis(w64, axis, 0).shape)
        codes = np.moveaxis(codes.reshape(shape), 0, axis)
    return codes.reshape(w.shape), scales


def weight_grid(w: np.ndarray, axis: int) -> tuple[np.ndarray, orders.Quant] | None:
    """A weight's int8 codes and quant: per tensor when one scale holds it (what Arm NN's Python
    bindings can express), else per index of ``axis``."""
    for ax in (None, axis):
        got = int8_grid(w, ax)
        if got is not None:
            codes, scales = got
            return codes, orders.Quant(tuple(float(x) for x in scales), (0,) * len(scales), ax)
    return None


def _qparams(scale: relax.Expr, zp: relax.Expr) -> orders.Quant:
    return orders.Quant((float(_const(scale).reshape(())),), (int(_const(zp).reshape(())),))


def _quantized_rules(name: str, root: Callable[[DFPattern], DFPattern], check_root: OpCheck,
                     kernel_of: Callable[[relax.Call], np.ndarray]) -> list[Rule]:
    """quantize(act?(add(root(dequantize(x)), const)?)), act in QUANT_ACTS, most specific first."""
    rules = []
    for act in [EPILOGUES[k] for k in QUANT_ACTS] + [None]:
        for with_bias in (True, False):
            x = wildcard()
            dq = is_op("relax.dequantize")(x, is_const(), is_const())
            r = root(dq)
            p, ann = r, {"root": r, "dq": dq, "x": x}
            if with_bias:
                b = is_const()
                p = is_op("relax.add")(p, b)
                ann["bias"] = b
            if act:
                p = act.epilogue(p)
                ann["act"] = p
            q = is_op("relax.quantize")(p, is_const(), is_const())
            ann["q"] = q
            suffix = ("_bias" if with_bias else "") + ("_" + act.kind if act else "")
            rules.append(Rule(f"acl.q{name}{suffix}", q, ann, _quantized_check(check_root, with_bias, kernel_of)))
    return rules


def _quantized_check(check_root: OpCheck, bias: bool, kernel_of: Callable[[relax.Call], np.ndarray]) -> Check:
    plain = _epilogue_check(check_root, bias)

    def check(ann: Mapping[str, relax.Expr]) -> str | None:
        if r := plain(ann):
            return r
        dq, q = ann["dq"], ann["q"]
        src, dst = _dtype(dq.args[0]), _dtype(q)
        if src not in INT8_ACTIVATIONS:
            return f"dequantize of {src}: quantized kernels take int8/uint8 activations"
        if dst != src:
            return f"quantized from {src} to {dst}: ACL's quantized kernels keep the activation type"
        if any(_const(a).size != 1 for a in (dq.args[1], dq.args[2], q.args[1], q.args[2])):
            return "per-channel activation quantization: ACL quantizes activations per tensor"
        if weight_grid(kernel_of(ann["root"]), 0) is None:
            return "the weight is not int8-quantized (no int8 grid fits it): kept in float in TVM"
        return None

    return check


def _conv_kernel(call: relax.Call) -> np.ndarray:
    return _const(call.args[1])                              # OHWI: out channels on axis 0


def _dense_kernel(call: relax.Call) -> np.ndarray:
    return _const(call.args[1]).T                            # [N, K]: out features on axis 0


def bias_limit(kernel: np.ndarray) -> int:
    """The largest int32 bias code whose sum with any accumulator of the kernel stays an int32.
    ACL adds the bias to the int32 accumulator in wrapping arithmetic; a channel whose weights are
    all but zero beside a real bias has a tiny kernel scale, and its bias code sits at int32's end:
    EfficientNet-Lite0's stem (two of 32 channels, multipliers ~1e-8) wrapped to +14 and +22 steps
    on CpuAcc where CpuRef and onnxruntime clamp to 0. Such a code moves by at most this headroom,
    which those channels' multipliers make a few thousandths of a step."""
    per_channel = int(np.prod(kernel.shape[1:]))          # |code| <= 128, |x - zero point| <= 255
    return 2 ** 31 - 1 - per_channel * 128 * 255


def _quantized_weights(m: Match, kernel: np.ndarray) -> dict:
    """The int8 kernel, the int32 bias (scale: input scale x kernel scale) and the activations'
    quant, registered with the order."""
    dq, q = m.call("relax.dequantize"), m.call("relax.quantize")
    q_in = _qparams(dq.args[1], dq.args[2])
    m.set_quant(m.name_of(dq.args[0]), q_in)
    m.set_quant(m.out, _qparams(q.args[1], q.args[2]))
    codes, kq = weight_grid(kernel, 0)
    weights = {"kernel": m.add_weight(codes, "kernel", kq)}
    if "_bias" in m.variant:
        b = _const(m.call("relax.add").args[1]).reshape(-1).astype(np.float64)
        bscale = np.asarray(kq.scale) * q_in.scale[0]
        lim = bias_limit(kernel)
        bq = np.clip(np.round(b / np.broadcast_to(bscale, b.shape)), -lim, lim).astype(np.int32)
        weights["bias"] = m.add_weight(bq, "bias", orders.Quant(tuple(float(x) for x in bscale), (0,) * len(kq.scale), kq.axis))
    return weights


def emit_qconv2d(m: Match) -> list[dict]:
    conv = m.call("relax.nn.conv2d")
    weights = _quantized_weights(m, _conv_kernel(conv))
    return [_op(m, "conv2d", [m.name_of(m.call("relax.dequantize").args[0])], _conv_attrs(m, conv), weights)]


def emit_qdense(m: Match) -> list[dict]:
    mm = m.call("relax.matmul")
    weights = _quantized_weights(m, _dense_kernel(mm))
    return [_op(m, "dense", [m.name_of(m.call("relax.dequantize").args[0])], {"activation": _act_of(m)}, weights)]

def _qadd_rules() -> list[Rule]:
    """quantize(act?(add(dequantize(a), dequantize(b)))): a residual add between int8 tensors, each
    read with its own scale and zero point and the sum requantized to the output's (ACL's
    NEArithmeticAddition takes three quantizations). Without it every residual add of a QDQ model
    cut its int8 order in two (EfficientNet-Lite0: 9 adds, 11 orders)."""
    rules = []
    for act in [EPILOGUES[k] for k in QUANT_ACTS] + [None]:
        dqa = is_op("relax.dequantize")(wildcard(), is_const(), is_const())
        dqb = is_op("relax.dequantize")(wildcard(), is_const(), is_const())
        add = is_op("relax.add")(dqa, dqb)
        p, ann = add, {"root": add, "dqa": dqa, "dqb": dqb}
        if act:
            p = act.epilogue(p)
            ann["act"] = p
        q = is_op("relax.quantize")(p, is_const(), is_const())
        ann["q"] = q
        rules.append(Rule("acl.qadd" + ("_" + act.kind if act else ""), q, ann, _check_qadd))
    return rules


def _check_qadd(ann: Mapping[str, relax.Expr]) -> str | None:
    add, q, dqs = ann["root"], ann["q"], (ann["dqa"], ann["dqb"])
    if any(_is_const(d.args[0]) for d in dqs):
        return "a quantized add of a constant: orders add quantized tensors only"
    src = [_dtype(d.args[0]) for d in dqs]
    if src[0] != src[1] or src[0] not in INT8_ACTIVATIONS:
        return f"dequantize of {' and '.join(src)}: a quantized add takes two int8 or two uint8 tensors"
    if _dtype(q) != src[0]:
        return f"quantized from {src[0]} to {_dtype(q)}: ACL's quantized kernels keep the activation type"
    if any(_const(a).size != 1 for d in (*dqs, q) for a in (d.args[1], d.args[2])):
        return "per-channel activation quantization: ACL quantizes activations per tensor"
    shapes = [_shape(d.args[0]) for d in dqs]
    if shapes[0] is None or shapes[0] != shapes[1] or shapes[0] != _shape(add):
        return "a quantized add that broadcasts: only equal shapes (residual adds) are delegated"
    if len(shapes[0]) > 4:
        return f"rank-{len(shapes[0])} tensor: Arm NN's kernels take rank <= 4"
    return None


def emit_qadd(m: Match) -> list[dict]:
    ins = []
    for dq in (c for c in m.calls if c.op.name == "relax.dequantize"):
        name = m.name_of(dq.args[0])
        m.set_quant(name, _qparams(dq.args[1], dq.args[2]))
        ins.append(name)
    q = m.call("relax.quantize")
    m.set_quant(m.out, _qparams(q.args[1], q.args[2]))
    return [_op(m, "binary", ins, {"kind": "add", "activation": _act_of(m)})]

# --- the table ---------------------------------------------------------------------------------

def _entries() -> list[Entry]:
    conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
    deconv = is_op("relax.nn.conv2d_transpose")(wildcard(), is_const())
    dense = is_op("relax.matmul")(wildcard(), is_const())
    return [
        # quantized first: their patterns contain the float ones
        Entry("qconv2d", "conv2d", tuple(_quantized_rules(
            "conv2d", lambda x: is_op("relax.nn.conv2d")(x, is_const()), check_conv2d, _conv_kernel)), emit_qconv2d,
              "QDQ convolution: int8/uint8 in and out, int8 kernel (per tensor or channel), int32 bias, relu/clip"),
        Entry("qdense", "dense", tuple(_quantized_rules(
            "dense", lambda x: is_op("relax.matmul")(x, is_const()), check_dense, _dense_kernel)), emit_qdense,
              "QDQ fully connected: int8/uint8 in and out, int8 kernel, int32 bias"),
        Entry("qadd", "binary", tuple(_qadd_rules()), emit_qadd,
              "QDQ add of two int8/uint8 tensors of one shape (residual adds), relu/clip"),
        Entry("conv2d", "conv2d", tuple(_with_epilogue("conv2d", conv, check_conv2d)), emit_conv2d,
              "convolution (ordinary, depthwise, dilated) + per-channel bias + activation"),
        Entry("conv2d_transpose", "conv2d_transpose",
              tuple(_with_epilogue("conv2d_transpose", deconv, check_conv2d_transpose)), emit_conv2d_transpose,
              "transposed convolution + bias + activation (FPN/U-Net decoders)"),
        Entry("dense", "dense", tuple(_with_epilogue("dense", dense, check_dense)), emit_dense,
              "fully connected + bias + activation"),
        Entry("hardswish", "activation", tuple(_hardswish_rules()), emit_activation,
              "hard-swish written out as ops"),
        Entry("hardsigmoid", "activation", (_hardsigmoid_rule(),), emit_activation, "clip(a*x + b, 0, 1)"),
        Entry("silu", "activation", (_silu_rule(),), emit_activation, "x * sigmoid(x) written out"),
        Entry("gelu", "activation", (_single("gelu", "relax.nn.gelu", check_gelu),), emit_activation,
              "GELU, erf form (ONNX Gelu, or written out: compiler/written_out.py)", since=GELU_SINCE),
        Entry("gelu_tanh", "activation", (_single("gelu_tanh", "relax.nn.gelu_tanh", check_unary),), emit_activation,
              "GELU, tanh form (built from multiply, add and tanh layers)"),
        Entry("layer_norm", "layer_norm", (_single("layer_norm", "relax.nn.layer_norm", check_layer_norm, 3),),
              emit_layer_norm, "LayerNormalization over the last axis (built from mean, subtract, rsqrt layers)"),
        Entry("activation", "activation", (
            _single("relu", "relax.nn.relu", check_unary),
            _single("clip", "relax.clip", check_unary, 3),
            _single("sigmoid", "relax.sigmoid", check_unary),
            _single("tanh", "relax.tanh", check_unary),
            _single("leaky_relu", "relax.nn.leakyrelu", check_unary)), emit_activation, "activations alone"),
        Entry("prelu", "prelu", (_single("prelu", "relax.nn.prelu", check_prelu, 2),), emit_prelu,
              "PRelu with a constant scalar or per-channel slope"),
        Entry("pool2d", "pool2d", (
            _single("max_pool2d", "relax.nn.max_pool2d", check_pool2d),
            _single("avg_pool2d", "relax.nn.avg_pool2d", check_pool2d)), emit_pool2d, "max/average pooling"),
        Entry("global_pool2d", "global_pool2d", (
            _single("global_avg_pool2d", "relax.nn.adaptive_avg_pool2d", check_adaptive_pool),
            _single("global_avg_pool2d_mean", "relax.mean", check_global_pool),
            _single("global_max_pool2d", "relax.max", check_global_pool)), emit_global_pool2d,
              "mean/max over H and W"),
        Entry("binary", "binary", tuple(_single(n, op, check_elementwise, 2) for op, n in (
            ("relax.add", "add"), ("relax.subtract", "subtract"), ("relax.multiply", "multiply"),
            ("relax.divide", "divide"), ("relax.maximum", "maximum"), ("relax.minimum", "minimum"))),
              emit_binary, "elementwise arithmetic with broadcasting"),
        Entry("concat", "concat", (_single("concat", "relax.concat", check_concat),), emit_concat, "concatenation"),
        Entry("reshape", "reshape", tuple(_single(n, op, check_reshape, ar) for op, n, ar in (
            ("relax.reshape", "reshape", 2), ("relax.squeeze", "squeeze", 1), ("relax.expand_dims", "expand_dims", 1),
            ("relax.flatten", "flatten", 1))), emit_reshape, "reshape, squeeze, unsqueeze, flatten"),
        Entry("transpose", "transpose", (_single("transpose", "relax.permute_dims", check_transpose),), emit_transpose,
              "axis permutation"),
        Entry("strided_slice", "strided_slice", (_single("strided_slice", "relax.strided_slice", check_strided_slice),),
              emit_strided_slice, "Slice, Split outputs, the Focus space-to-depth stem"),
        Entry("pad", "pad", (_single("pad", "relax.nn.pad", check_pad),), emit_pad, "constant padding"),
        Entry("softmax", "softmax", (_single("softmax", "relax.nn.softmax", check_softmax),), emit_softmax,
              "softmax on any axis"),
        Entry("resize2d", "resize2d", (_single("resize2d", "relax.image.resize2d", check_resize, 2),), emit_resize2d,
              "nearest/bilinear resize"),
    ]


def _gated(e: Entry) -> Entry:
    """An entry no board's Arm NN can build yet matches nothing: its ops stay in TVM, and a board
    release that has the layer (ARMNN_RELEASES) delegates them with no other change."""
    reason = release_reason(e.name, e.since)
    if reason is None:
        return e
    return replace(e, rules=tuple(replace(r, check=lambda ann, reason=reason: reason) for r in e.rules))


ENTRIES: list[Entry] = [_gated(e) for e in _entries()]
_BY_RULE: dict[str, Entry] = {r.name: e for e in ENTRIES for r in e.rules}
assert all(e.order_type in orders.OPS for e in ENTRIES), "an ACL entry names an op type the contract lacks"


def rules() -> list[Rule]:
    """Every pattern, most specific first (entries are listed in that order)."""
    return [r for e in ENTRIES for r in e.rules]


def entry_for(composite: str) -> Entry:
    try:
        return _BY_RULE[composite]
    except KeyError:
        raise KeyError(f"no ACL entry has the composite {composite}") from None


# --- Relax operators: explanation and cost ---------------------------------------------------------

def _conv_flops(call: relax.Call) -> float:
    k = _shape(call.args[1])
    layout = str(call.attrs.kernel_layout)
    per_out = k[layout.index("I")] * k[layout.index("H")] * k[layout.index("W")]
    return 2.0 * _numel(_shape(call)) * per_out


def _deconv_flops(call: relax.Call) -> float:
    k = _shape(call.args[1])                     # IOHW: every input pixel meets O*KH*KW weights
    return 2.0 * _numel(_shape(call.args[0])) * k[1] * k[2] * k[3]


def _matmul_flops(call: relax.Call) -> float:
    return 2.0 * _numel(_shape(call)) * int(call.args[0].ty.shape[-1])


def _pool_flops(call: relax.Call) -> float:
    return float(_numel(_shape(call)) * math.prod(int(x) for x in call.attrs.pool_size))


def _reduce_flops(call: relax.Call) -> float:
    return float(_numel(_shape(call.args[0])))


RELAX_OPS: dict[str, RelaxOp] = {
    "relax.nn.conv2d": RelaxOp(check_conv2d, "heavy", _conv_flops),
    "relax.nn.conv2d_transpose": RelaxOp(check_conv2d_transpose, "heavy", _deconv_flops),
    "relax.matmul": RelaxOp(check_dense, "heavy", _matmul_flops),
    "relax.nn.max_pool2d": RelaxOp(check_pool2d, "heavy", _pool_flops),
    "relax.nn.avg_pool2d": RelaxOp(check_pool2d, "heavy", _pool_flops),
    "relax.nn.adaptive_avg_pool2d": RelaxOp(check_adaptive_pool, "heavy", _reduce_flops),
    "relax.mean": RelaxOp(check_global_pool, "heavy", _reduce_flops),
    "relax.max": RelaxOp(check_global_pool, "heavy", _reduce_flops),
    "relax.sum": RelaxOp(None, "heavy", _reduce_flops),
    "relax.nn.softmax": RelaxOp(check_softmax, "heavy"),
    "relax.image.resize2d": RelaxOp(check_resize, "heavy"),
    "relax.permute_dims": RelaxOp(check_transpose, "heavy"),
    "relax.concat": RelaxOp(check_concat, "heavy"),
    "relax.strided_slice": RelaxOp(check_strided_slice, "heavy"),
    "relax.nn.pad": RelaxOp(check_pad, "heavy"),
    "relax.reshape": RelaxOp(check_reshape, "free", lambda c: 0.0),
    "relax.squeeze": RelaxOp(check_reshape, "free", lambda c: 0.0),
    "relax.expand_dims": RelaxOp(check_reshape, "free", lambda c: 0.0),
    "relax.flatten": RelaxOp(check_reshape, "free", lambda c: 0.0),
    **{op: RelaxOp(check_elementwise) for op in BINARY_KINDS},
    **{op: RelaxOp(check_unary) for op in ("relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh",
                                           "relax.nn.leakyrelu")},
    "relax.nn.prelu": RelaxOp(check_prelu),
    "relax.nn.gelu": RelaxOp(check_gelu),
    "relax.nn.gelu_tanh": RelaxOp(check_unary),
    "relax.nn.layer_norm": RelaxOp(check_layer_norm, "heavy", lambda c: 8.0 * _numel(_shape(c))),
}


def relax_op(name: str) -> RelaxOp:
    """The table's row for a Relax operator; ops it does not list are elementwise-like and have no
    ACL kernel."""
    return RELAX_OPS.get(name) or RelaxOp(None)


def explain(call: relax.Call) -> str:
    """Why a call that is still in the TVM part was not delegated."""
    name = call.op.name if hasattr(call.op, "name") else str(call.op)
    chk = relax_op(name).check
    if chk is None:
        return f"no ACL kernel for {name.removeprefix('relax.')}"
    try:
        reason = chk(call)
    except Exception as err:  # a check must never break compilation
        reason = f"could not check ({type(err).__name__})"
    return reason or "supported, but not delegated (cost model or isolated op)"
