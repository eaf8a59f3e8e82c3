"""What the ARM Compute Library (through Arm NN) runs well: the support table, as data.

Each Rule is a Relax dataflow pattern (a fused composite, most specific first) plus a small
check that returns None when ACL can take the match, or a one-line reason when it cannot.
The constraints follow Arm NN 20.08 / ACL and TVM v0.19's ACL integration:
  - float32 only (quantised kernels come later);
  - conv2d in NHWC with a constant OHWI kernel; depthwise (groups == C_in) is ACL's
    NEDepthwiseConvolutionLayer; other grouped convolutions have no Arm NN 20.08 layer;
  - pools in NHWC with padding smaller than the window (ACL's pooling validation);
  - softmax over the last axis only; resize nearest/bilinear in NHWC.
The partitioning mechanics live in partition.py and know nothing of these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

Check = Callable[[Mapping[str, relax.Expr]], "str | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: DFPattern
    annotations: dict[str, DFPattern] = field(default_factory=dict)
    check: Check = lambda _: None


# --- helpers ---------------------------------------------------------------------------------

def _ty(e: relax.Expr):
    return e.ty


def _shape(e: relax.Expr) -> list[int] | None:
    sh = getattr(_ty(e), "shape", None)
    if sh is None:
        return None
    try:
        return [int(d) for d in sh]
    except (TypeError, ValueError):
        return None


def _dtype(e: relax.Expr) -> str:
    return str(getattr(_ty(e), "dtype", "?"))


def _attr(call: relax.Call, name: str):
    v = getattr(call.attrs, name)
    if hasattr(v, "__iter__") and not isinstance(v, str):
        return [int(x) if hasattr(x, "value") or isinstance(x, int) else x for x in v]
    return v


def _fp32(*exprs: relax.Expr) -> str | None:
    for e in exprs:
        if _dtype(e) != "float32":
            return f"dtype {_dtype(e)}: Tandoor's ACL kernels are float32-only for now"
        if _shape(e) is None:
            return "dynamic shape: ACL needs static shapes"
    return None


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
    size = [int(x) for x in call.attrs.pool_size]
    pad = [int(x) for x in call.attrs.padding]
    if pad[0] >= size[0] or pad[2] >= size[0] or pad[1] >= size[1] or pad[3] >= size[1]:
        return f"pool padding {pad} not smaller than the window {size} (ACL refuses it)"
    if bool(call.attrs.ceil_mode):
        # ONNX drops a last window that starts inside the bottom/right padding; ACL does not.
        shape = _shape(call.args[0])
        strides = [int(x) for x in call.attrs.strides]
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
    if out is None or [int(o) for o in out] != [1, 1]:
        return "adaptive pooling to a size other than 1x1 has no ACL kernel"
    return None


def check_elementwise(call: relax.Call) -> str | None:
    args = [a for a in call.args if isinstance(a, relax.Expr) and hasattr(a.ty, "dtype")]
    if r := _fp32(*args):
        return r
    if len(args) == 2:
        a, b = _shape(args[0]), _shape(args[1])
        if len(a) > 4 or len(b) > 4:
            return "elementwise op on a tensor of rank > 4"
    return None


def check_unary(call: relax.Call) -> str | None:
    return _fp32(call.args[0])


def check_clip(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    return None


def check_concat(call: relax.Call) -> str | None:
    fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
    if fields is None:
        return "concat of a non-literal tuple"
    if r := _fp32(*fields):
        return r
    if len(_shape(fields[0])) > 4:
        return "concat of rank > 4 tensors"
    return None


def check_reshape(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if _shape(call) is None or len(_shape(call)) > 4 or len(_shape(call.args[0])) > 4:
        return "reshape to or from rank > 4 (Arm NN tensors are at most 4-D)"
    return None


def check_softmax(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    rank = len(_shape(call.args[0]))
    if int(call.attrs.axis) % rank != rank - 1:
        return f"softmax over axis {int(call.attrs.axis)}: ACL's softmax runs over the last axis only"
    return None


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


def check_transpose(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if len(_shape(call.args[0])) > 4:
        return "transpose of a rank > 4 tensor"
    return None


def _num(v) -> float:
    """A PrimValue/IntImm/FloatImm clip bound as a float."""
    return float(v.value) if hasattr(v, "value") else float(v)


def _is_const(e: relax.Expr) -> bool:
    import tvm

    return isinstance(e, tvm.ir.GenericConst)


# Standalone checks by Relax op: the explanation for ops left in TVM.
OP_CHECKS: dict[str, Callable[[relax.Call], str | None]] = {
    "relax.nn.conv2d": check_conv2d,
    "relax.matmul": check_dense,
    "relax.nn.max_pool2d": check_pool2d,
    "relax.nn.avg_pool2d": check_pool2d,
    "relax.nn.adaptive_avg_pool2d": check_adaptive_pool,
    "relax.mean": check_global_pool,
    "relax.max": check_global_pool,
    "relax.add": check_elementwise,
    "relax.subtract": check_elementwise,
    "relax.multiply": check_elementwise,
    "relax.nn.relu": check_unary,
    "relax.clip": check_clip,
    "relax.sigmoid": check_unary,
    "relax.tanh": check_unary,
    "relax.nn.leakyrelu": check_unary,
    "relax.concat": check_concat,
    "relax.reshape": check_reshape,
    "relax.nn.softmax": check_softmax,
    "relax.image.resize2d": check_resize,
    "relax.permute_dims": check_transpose,
}

ACTIVATIONS = ["relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.leakyrelu"]


# --- the patterns ------------------------------------------------------------------------------

def _activation(x: DFPattern, op: str) -> DFPattern:
    if op == "relax.clip":
        return is_op(op)(x, wildcard(), wildcard())
    return is_op(op)(x)


def _with_epilogue(name: str, root: DFPattern, check_root, const_bias: bool = True) -> list[Rule]:
    """root -> add(const)? -> activation?, most specific first (dpl has no optional())."""
    rules = []
    for act in ACTIVATIONS + [None]:
        for bias in (True, False):
            p = root
            ann = {"root": root}
            if bias:
                b = is_const()
                p = is_op("relax.add")(p, b)
                ann["bias"] = b
                ann["bias_add"] = p
            if act:
                p = _activation(p, act)
                ann["act"] = p
            suffix = ("_bias" if bias else "") + ("_" + act.split(".")[-1] if act else "")
            rules.append(Rule(f"acl.{name}{suffix}", p, ann, _epilogue_check(check_root, bias)))
    return rules


def _epilogue_check(check_root, bias: bool) -> Check:
    def check(ann: Mapping[str, relax.Expr]) -> str | None:
        root = ann["root"]
        if r := check_root(root):
            return r
        if bias:
            bshape = _shape(ann["bias"])
            oshape = _shape(root)
            # a bias is per output channel: broadcastable to (..., C)
            if bshape is None or not bshape or bshape[-1] != oshape[-1] or any(d != 1 for d in bshape[:-1]):
                return "add after conv/dense is not a per-channel bias"
        if "act" in ann and (r := check_unary(ann["act"])):
            return r
        return None

    return check


def _single(name: str, op: str, check, arity: int = 1) -> Rule:
    p = is_op(op)(*[wildcard() for _ in range(arity)])
    return Rule(f"acl.{name}", p, {"root": p}, lambda ann: check(ann["root"]))


def _conv_pattern() -> DFPattern:
    return is_op("relax.nn.conv2d")(wildcard(), is_const())


def _dense_pattern() -> DFPattern:
    return is_op("relax.matmul")(wildcard(), is_const())


def _hardswish_rules() -> list[Rule]:
    """Hard-swish in the forms it reaches Relax: x * clip(x + 3, 0, 6) / 6 (TVM's import of ONNX
    HardSwish, either association) and x * clip(x / 6 + 0.5, 0, 1) (HardSigmoid times x, as
    onnxruntime's folding leaves it), operands in either order."""
    out = []
    for variant in ("mul_div", "div_mul", "hsig", "hsig_r"):
        x, a, b = wildcard(), is_const(), is_const()
        if variant in ("mul_div", "div_mul"):
            clip = is_op("relax.clip")(is_op("relax.add")(x, a), wildcard(), wildcard())
            if variant == "mul_div":   # x * (clip / 6)
                p = is_op("relax.multiply")(x, is_op("relax.divide")(clip, b))
            else:                      # (x * clip) / 6
                p = is_op("relax.divide")(is_op("relax.multiply")(x, clip), b)
        else:
            scaled = is_op("relax.multiply")(a, x) | is_op("relax.multiply")(x, a)
            clip = is_op("relax.clip")(is_op("relax.add")(scaled, b), wildcard(), wildcard())
            p = is_op("relax.multiply")(x, clip) if variant == "hsig" else is_op("relax.multiply")(clip, x)
        ann = {"root": p, "clip": clip, "a": a, "b": b, "x": x}
        out.append(Rule(f"acl.hardswish_{variant}", p, ann, _hardswish_check(variant)))
    return out


def _hardswish_check(variant: str) -> Check:
    # (a, b, clip_hi) for x * clip(x + a, 0, hi) / b, or x * clip(a * x + b, 0, hi)
    want = (3.0, 6.0, 6.0) if variant in ("mul_div", "div_mul") else (1.0 / 6.0, 0.5, 1.0)

    def check(ann: Mapping[str, relax.Expr]) -> str | None:
        if r := _fp32(ann["x"]):
            return r
        a, b, clip = ann["a"].value.numpy(), ann["b"].value.numpy(), ann["clip"]
        if a.size != 1 or b.size != 1:
            return "not a hard-swish (non-scalar constants)"
        got = (float(a), float(b), _num(clip.args[2]))
        if _num(clip.args[1]) != 0.0 or any(abs(g - w) > 1e-6 for g, w in zip(got, want)):
            return "not a hard-swish (constants differ)"
        return None

    return check


def rules() -> list[Rule]:
    """The table, most specific first."""
    table: list[Rule] = []
    table += _with_epilogue("conv2d", _conv_pattern(), check_conv2d)
    table += _with_epilogue("dense", _dense_pattern(), check_dense)
    table += _hardswish_rules()
    table += [
        _single("max_pool2d", "relax.nn.max_pool2d", check_pool2d),
        _single("avg_pool2d", "relax.nn.avg_pool2d", check_pool2d),
        _single("global_avg_pool2d", "relax.nn.adaptive_avg_pool2d", check_adaptive_pool),
        _single("global_avg_pool2d_mean", "relax.mean", check_global_pool),
        _single("global_max_pool2d", "relax.max", check_global_pool),
        _single("relu", "relax.nn.relu", check_unary),
        _single("clip", "relax.clip", check_clip, 3),
        _single("sigmoid", "relax.sigmoid", check_unary),
        _single("tanh", "relax.tanh", check_unary),
        _single("leaky_relu", "relax.nn.leakyrelu", check_unary),
        _single("add", "relax.add", check_elementwise, 2),
        _single("subtract", "relax.subtract", check_elementwise, 2),
        _single("multiply", "relax.multiply", check_elementwise, 2),
        _single("concat", "relax.concat", check_concat),
        _single("reshape", "relax.reshape", check_reshape, 2),
        _single("softmax", "relax.nn.softmax", check_softmax),
        _single("resize2d", "relax.image.resize2d", check_resize, 2),
        _single("transpose", "relax.permute_dims", check_transpose),
    ]
    return table


def explain(call: relax.Call) -> str:
    """Why a call that is still in the TVM part was not delegated."""
    name = call.op.name if hasattr(call.op, "name") else str(call.op)
    chk = OP_CHECKS.get(name)
    if chk is None:
        return f"no ACL kernel for {name.removeprefix('relax.')}"
    try:
        reason = chk(call)
    except Exception as err:  # a check must never break compilation
        reason = f"could not check ({type(err).__name__})"
    return reason or "supported, but not delegated (cost model or isolated op)"
