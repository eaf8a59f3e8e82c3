"""Graph optimisation before partitioning: the stages, in the order ``optimise`` runs them.

    FoldConstant              weights and shape arithmetic folded
    split_to_slices           Split -> one strided_slice per output, so every op has one result
    batch_norm_to_affine      inference BatchNorm that no conv absorbed -> x * scale + shift
    power_to_multiply         x ** 2 -> x * x (YOLO box decoders); Arm NN has no Pow layer
    constants_right           c * x -> x * c, so that layout inference follows the tensor
    written_out.fold          GELU (erf, tanh), TF-style LayerNorm and rank-5 channel shuffles
                              written as chains of small ops -> one op each (compiler/stages/written_out.py)
    FoldBatchnormToConv2D     conv2d -> batch_norm folded (onnxruntime folds most already)
    ConvertLayout             conv2d and conv2d_transpose to NHWC, as ACL wants; TVM carries the
                              layout through elementwise ops, concat, slices, pools and resizes
    nhwc_layout_ops           pools, global pools and resizes the layout did not reach (on the
                              model input, behind a reshape) to NHWC between a transpose pair
    cancel_transposes         layout transposes that meet cancel; a transpose is moved through
                              pads and elementwise ops to meet its partner
    FoldConstant, DCE

``count_layout_transposes`` is what the manifest and ``tandoor inspect`` report.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from . import written_out

_LAYOUT_RULES_REGISTERED = False

TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]
LAYOUT_PERMS = (TO_NHWC, TO_NCHW)


def _register_layout_rules() -> None:
    """clip and leakyrelu have no layout-inference rule in TVM 0.27, so ConvertLayout puts a
    transpose pair around every ReLU6. They are elementwise: reuse relu's rule."""
    global _LAYOUT_RULES_REGISTERED
    if _LAYOUT_RULES_REGISTERED:
        return
    unary = tvm.ir.Op.get("relax.nn.relu").get_attr("FRelaxInferLayout")
    for name in ("relax.clip", "relax.nn.leakyrelu"):
        op = tvm.ir.Op.get(name)
        if op.get_attr("FRelaxInferLayout") is None:
            tvm.ir.register_op_attr(name, "FRelaxInferLayout", unary)
    _LAYOUT_RULES_REGISTERED = True


def op_name(e) -> str | None:
    return e.op.name if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None


def _shape(e) -> list[int] | None:
    try:
        return [int(d) for d in e.ty.shape]
    except (AttributeError, TypeError, ValueError):
        return None


def _perm(e) -> list[int] | None:
    """The axes of a permute_dims call, else None."""
    if op_name(e) != "relax.permute_dims" or e.attrs.axes is None:
        return None
    return [int(a) for a in e.attrs.axes]


def count_layout_transposes(mod: tvm.IRModule) -> int:
    """NCHW<->NHWC transposes of tensors (weights excluded): what the layout change costs."""
    n = 0

    def visit(e):
        nonlocal n
        if _perm(e) in LAYOUT_PERMS and not isinstance(e.args[0], tvm.ir.GenericConst):
            n += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return n


# --- stages -------------------------------------------------------------------------------------

def rewrite_calls(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """Apply ``rewrite(call, mutator) -> expr | None`` to every op call of main, bottom-up."""

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op):
                new = rewrite(call, self)
                if new is not None:
                    return new
            return call

    m = Rewriter(mod)
    f = m.visit_expr(mod["main"])
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["main"] = f
    return relax.transform.Normalize()(mod)


def bind_params(mutator, expr):
    """Emit ``expr`` as a binding of its own (a var), so two consumers share one value."""
    return mutator.builder_.emit(expr)


def split_to_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """relax.split -> a tuple of strided_slices. Orders have one result per op; a split's parts are
    slices of one tensor (Arm NN's StridedSlice, ONNX Slice), and TVM fuses them the same."""

    def rewrite(call, m):
        if op_name(call) != "relax.split":
            return None
        shape = _shape(call.args[0])
        if shape is None:
            return None
        axis = int(call.attrs.axis) % len(shape)
        ios = call.attrs.indices_or_sections
        if isinstance(ios, (int, tvm.tirx.IntImm)) if hasattr(tvm, "tirx") else isinstance(ios, int):
            n = int(ios)
            if shape[axis] % n:
                return None
            cuts = [shape[axis] // n * k for k in range(1, n)]
        else:
            cuts = [int(i) for i in ios]
        bounds = [0] + cuts + [shape[axis]]
        x = call.args[0]
        parts = [bind_params(m, relax.op.strided_slice(x, [axis], [lo], [hi], [1]))
                 for lo, hi in zip(bounds[:-1], bounds[1:])]
        return relax.Tuple(parts)

    return rewrite_calls(mod, rewrite)


def batch_norm_to_affine(mod: tvm.IRModule) -> tvm.IRModule:
    """Inference batch_norm with constant statistics -> x * scale + shift (two ops ACL runs as
    elementwise layers, or that fold into a neighbouring conv's bias)."""

    def rewrite(call, m):
        if op_name(call) != "relax.nn.batch_norm":
            return None
        x, *params = call.args
        if not all(isinstance(p, tvm.ir.GenericConst) for p in params):
            return None
        shape = _shape(x)
        if shape is None:
            return None
        gamma, beta, mean, var = (p.value.numpy().astype(np.float64) for p in params)
        eps = float(call.attrs.epsilon)
        scale = (gamma if call.attrs.scale else 1.0) / np.sqrt(var + eps)
        shift = (beta if call.attrs.center else 0.0) - mean * scale
        axis = int(call.attrs.axis) % len(shape)
        bshape = [1] * len(shape)
        bshape[axis] = shape[axis]
        dt = str(x.ty.dtype)
        y = bind_params(m, relax.op.multiply(x, relax.const(scale.reshape(bshape).astype(dt))))
        y = bind_params(m, relax.op.add(y, relax.const(shift.reshape(bshape).astype(dt))))
        # batch_norm returns (y, running mean, running var); inference uses only y
        return relax.Tuple([y, params[2], params[3]])

    return rewrite_calls(mod, rewrite)


_COMMUTATIVE = {"relax.add", "relax.multiply", "relax.maximum", "relax.minimum"}


def constants_right(mod: tvm.IRModule) -> tvm.IRModule:
    """c * x -> x * c for commutative ops (HardSigmoid imports as multiply(alpha, x)): TVM's
    layout inference follows the first operand, and a constant there sends x back to NCHW."""

    def rewrite(call, m):
        if (op_name(call) in _COMMUTATIVE and len(call.args) == 2 and isinstance(call.args[0], tvm.ir.GenericConst)
                and not isinstance(call.args[1], tvm.ir.GenericConst)):
            return relax.Call(call.op, [call.args[1], call.args[0]], call.attrs)
        return None

    return rewrite_calls(mod, rewrite)


def power_to_multiply(mod: tvm.IRModule) -> tvm.IRModule:
    def rewrite(call, m):
        if op_name(call) != "relax.power" or not isinstance(call.args[1], tvm.ir.GenericConst):
            return None
        e = call.args[1].value.numpy()
        if e.size != 1 or float(e.reshape(())) != 2.0:
            return None
        x = call.args[0]
        return relax.op.multiply(x, x)

    return rewrite_calls(mod, rewrite)


def _ints(v) -> list[int]:
    return [int(x) for x in v]


def _pool_nhwc(fn):
    def make(call, x):
        a = call.attrs
        return fn(x, _ints(a.pool_size), _ints(a.strides), _ints(a.padding), _ints(a.dilation), bool(a.ceil_mode),
                  bool(a.count_include_pad), layout="NHWC", out_layout="NHWC")
    return make


def _resize_nhwc(call, x):
    a = call.attrs
    return relax.op.image.resize2d(x, call.args[1], [float(r) for r in a.roi], "NHWC", str(a.method),
                                   str(a.coordinate_transformation_mode), str(a.rounding_method),
                                   float(a.cubic_alpha), int(a.cubic_exclude), float(a.extrapolation_value))


# NCHW ops that ACL runs in NHWC only, rebuilt in NHWC: op -> (call, NHWC input) -> NHWC call
_NHWC_REBUILD = {
    "relax.nn.max_pool2d": _pool_nhwc(relax.op.nn.max_pool2d),
    "relax.nn.avg_pool2d": _pool_nhwc(relax.op.nn.avg_pool2d),
    "relax.nn.adaptive_avg_pool2d": lambda c, x: relax.op.nn.adaptive_avg_pool2d(
        x, None if c.attrs.output_size is None else _ints(c.attrs.output_size), "NHWC", "NHWC"),
    "relax.image.resize2d": _resize_nhwc,
}


def nhwc_layout_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """Pools, global pools and resizes still in NCHW (ConvertLayout only follows a conv's layout
    and refuses a desired layout for pools): NHWC between a transpose pair, which
    cancel_transposes then removes where it meets another."""

    def rewrite(call, m):
        name = op_name(call)
        if name in _REDUCE and len(_shape(call.args[0]) or []) == 4 and call.attrs.axis is not None \
                and sorted(int(a) % 4 for a in call.attrs.axis) == [2, 3]:   # GlobalAveragePool/GlobalMaxPool
            x = bind_params(m, relax.op.permute_dims(call.args[0], TO_NHWC))
            keep = bool(call.attrs.keepdims)
            y = bind_params(m, _REDUCE[name](x, [1, 2], keep))
            return relax.op.permute_dims(y, TO_NCHW) if keep else y
        make = _NHWC_REBUILD.get(name)
        if make is None or str(call.attrs.layout) != "NCHW" or len(_shape(call.args[0]) or []) != 4:
            return None
        x = bind_params(m, relax.op.permute_dims(call.args[0], TO_NHWC))
        y = bind_params(m, make(call, x))
        return relax.op.permute_dims(y, TO_NCHW)

    return rewrite_calls(mod, rewrite)


# Ops through which a layout transpose moves unchanged: elementwise on one tensor (a scalar
# constant second operand at most).
_ELEMENTWISE = {"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.leakyrelu",
                "relax.exp", "relax.sqrt", "relax.negative", "relax.abs", "relax.nn.silu", "relax.nn.gelu"}
_SCALAR_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum",
                  "relax.minimum", "relax.power"}


_QDQ = {"relax.quantize": relax.op.quantize, "relax.dequantize": relax.op.dequantize}


def _is_scalar_const(e) -> bool:
    return isinstance(e, tvm.ir.GenericConst) and e.value.numpy().size == 1


_REDUCE = {"relax.mean": relax.op.mean, "relax.max": relax.op.max, "relax.sum": relax.op.sum}


def _slice_args(call) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(axes, begin, end, strides) of a strided_slice with constant bounds, else None."""
    out = []
    for k, arg in enumerate(call.args[1:5]):
        items = arg.fields if isinstance(arg, relax.Tuple) else getattr(arg, "values", None)
        if items is None:
            return None
        try:
            out.append([int(v.value) if hasattr(v, "value") else int(v) for v in items])
        except (TypeError, ValueError):
            return None
    if len(out) == 3:
        out.append([1] * len(out[0]))
    return tuple(out) if len(out) == 4 else None


def _compose(a: list[int], b: list[int]) -> list[int]:
    """permute(permute(x, a), b) == permute(x, _compose(a, b))."""
    return [a[i] for i in b]


def cancel_transposes(mod: tvm.IRModule) -> tvm.IRModule:
    """permute(permute(x, a), b) -> permute(x, a.b) (or x when that is the identity), and a layout
    transpose moved below a pad or an elementwise op on its result, so that it can meet the
    transpose that follows. Repeated until nothing changes."""

    def rewrite(call, m):
        name = op_name(call)
        if name == "relax.permute_dims":
            outer = _perm(call)
            inner_e = call.args[0]
            inner_e = m.lookup_binding(inner_e) if isinstance(inner_e, relax.Var) and m.lookup_binding(inner_e) is not None else inner_e
            inner = _perm(inner_e)
            if outer is None or inner is None:
                return None
            p = _compose(inner, outer)
            return inner_e.args[0] if p == list(range(len(p))) else relax.op.permute_dims(inner_e.args[0], p)
        # op(permute(x, p)) -> permute(op'(x), p) for layout-free ops
        if not call.args:
            return None

        def unpermuted(arg):
            e = m.lookup_binding(arg) if isinstance(arg, relax.Var) and m.lookup_binding(arg) is not None else arg
            q = _perm(e)
            return (e.args[0], q) if q in LAYOUT_PERMS else (None, None)

        if name in _SCALAR_BINARY and len(call.args) == 2:
            (xa, pa), (xb, pb) = unpermuted(call.args[0]), unpermuted(call.args[1])
            if xa is not None and xb is not None and pa == pb:       # both sides in the same layout
                p, new_args = pa, [xa, xb]
            else:
                k = 0 if xa is not None else 1 if xb is not None else None
                other = call.args[1 - k] if k is not None else None
                if k is None or not isinstance(other, tvm.ir.GenericConst):
                    return None
                p = pa if k == 0 else pb
                c = other.value.numpy()
                if 1 < c.ndim < len(p):    # (C, 1, 1) broadcasts from the right: make it (1, C, 1, 1)
                    c = c.reshape((1,) * (len(p) - c.ndim) + c.shape)
                if c.ndim == len(p):       # a per-channel (or full) constant: permute it the other way
                    c = c.transpose(np.argsort(p))
                elif c.size != 1:
                    return None
                new_args = [xa, relax.const(c)] if k == 0 else [relax.const(c), xb]
            return relax.op.permute_dims(bind_params(m, relax.Call(call.op, new_args, call.attrs)), p)
        if name == "relax.concat" and isinstance(call.args[0], relax.Tuple):
            parts = [unpermuted(f) for f in call.args[0].fields]
            perms = {tuple(q) for _, q in parts if q is not None}
            if any(x is None for x, _ in parts) or len(perms) != 1:
                return None
            p = list(perms.pop())
            axis = p[int(call.attrs.axis) % len(p)]
            inner = relax.op.concat([x for x, _ in parts], axis=axis)
            return relax.op.permute_dims(bind_params(m, inner), p)
        x, p = unpermuted(call.args[0])
        if x is None:
            return None
        if name in _REDUCE and call.attrs.axis is not None and p == TO_NCHW:   # only ever into NHWC
            axes = sorted(p[int(a) % len(p)] for a in call.attrs.axis)
            keep = bool(call.attrs.keepdims)
            rest = [p[i] for i in range(len(p)) if p[i] not in axes]
            if not keep and rest != sorted(rest):
                return None
            inner = bind_params(m, _REDUCE[name](x, axes, keep))
            return relax.op.permute_dims(inner, p) if keep else inner
        if name == "relax.strided_slice":
            sl = _slice_args(call)
            if sl is None:
                return None
            axes, begin, end, strides = sl
            inner = relax.op.strided_slice(x, [p[int(a) % len(p)] for a in axes], begin, end, strides)
        elif name in _ELEMENTWISE:
            inner = relax.Call(call.op, [x, *call.args[1:]], call.attrs)
        elif name in _QDQ and all(_is_scalar_const(a) for a in call.args[1:3]):
            # per-tensor (de)quantization is elementwise: without this every QDQ pair of a quantized
            # model keeps the NCHW<->NHWC transposes ConvertLayout put around it
            axis = p[int(call.attrs.axis) % len(p)]
            inner = _QDQ[name](x, call.args[1], call.args[2], axis=axis, out_dtype=str(call.attrs.out_dtype))
        elif name == "relax.nn.pad":
            pw = [int(v) for v in call.attrs.pad_width]
            pairs = [pw[2 * i:2 * i + 2] for i in range(len(pw) // 2)]
            inv = list(np.argsort(p))            # the source axis of each axis of x
            new_pairs = [pairs[inv[a]] for a in range(len(pairs))]
            inner = relax.op.nn.pad(x, [v for pr in new_pairs for v in pr], str(call.attrs.pad_mode),
                                    float(call.attrs.pad_value))
        else:
            return None
        return relax.op.permute_dims(bind_params(m, inner), p)

    for _ in range(8):   # a pass moves whole chains; keep it only when it removed transposes
        new = relax.transform.DeadCodeElimination()(rewrite_calls(mod, rewrite))
        if count_layout_transposes(new) >= count_layout_transposes(mod):
            break
        mod = new
    return mod


def transpose_before_dequantize(mod: tvm.IRModule) -> tvm.IRModule:
    """permute(dequantize(q)) -> dequantize(permute(q)) for per-tensor dequantization: the layout
    transpose moves a quarter of the bytes, and a quantized conv2d composite (compiler/backends/acl/)
    then starts right at the dequantize (the model input's first conv, after the NCHW -> NHWC
    transpose)."""

    def rewrite(call, m):
        if op_name(call) != "relax.permute_dims" or _perm(call) not in LAYOUT_PERMS:
            return None
        inner = call.args[0]
        inner = m.lookup_binding(inner) if isinstance(inner, relax.Var) and m.lookup_binding(inner) is not None else inner
        if op_name(inner) != "relax.dequantize" or not all(_is_scalar_const(a) for a in inner.args[1:3]):
            return None
        p = _perm(call)
        moved = bind_params(m, relax.op.permute_dims(inner.args[0], p))
        axis = int(np.argsort(p)[int(inner.attrs.axis) % len(p)])
        return relax.op.dequantize(moved, inner.args[1], inner.args[2], axis=axis, out_dtype=str(inner.attrs.out_dtype))

    return relax.transform.DeadCodeElimination()(rewrite_calls(mod, rewrite))


def fold_layout_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """reshape, permute_dims, expand_dims and squeeze of a constant, done with numpy. TVM's
    FoldConstant compiles every call it folds with LLVM, ~35 ms apiece: after the NHWC change
    PicoDet's 204 kernel transposes were 7.6 s and its 102 BatchNorm-parameter reshapes 3.6 s of a
    40 s compile. What it folds afterwards is what numpy is not asked to."""

    def rewrite(call, m):
        name = op_name(call)
        if name not in ("relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze"):
            return None
        x = call.args[0]
        if isinstance(x, relax.Var) and m.lookup_binding(x) is not None:
            x = m.lookup_binding(x)
        if not isinstance(x, tvm.ir.GenericConst):
            return None
        a = x.value.numpy()
        if name == "relax.reshape":
            target = call.args[1]
            if not isinstance(target, relax.ShapeExpr) or not all(isinstance(v, tvm.tirx.IntImm) for v in target.values):
                return None
            out = a.reshape([int(v) for v in target.values])
        elif name == "relax.permute_dims":
            axes = call.attrs.axes
            out = np.transpose(a, [int(v) for v in axes] if axes is not None else None)
        elif name == "relax.expand_dims":
            out = np.expand_dims(a, tuple(int(v) for v in call.attrs.axis))
        else:
            axis = call.attrs.axis
            out = np.squeeze(a, tuple(int(v) for v in axis) if axis is not None else None)
        return relax.const(np.ascontiguousarray(out), str(a.dtype))

    return relax.transform.DeadCodeElimination()(rewrite_calls(mod, rewrite))


def optimise(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict]:
    """Returns the module and facts for the manifest (transposes added by the layout change)."""
    _register_layout_rules()
    fold = tvm.transform.Sequential([relax.transform.FoldConstant(), relax.transform.DeadCodeElimination()])
    mod = fold(fold_layout_constants(mod))
    mod = split_to_slices(mod)
    mod = batch_norm_to_affine(mod)
    mod = power_to_multiply(mod)
    mod = constants_right(mod)
    mod, folded = written_out.fold(mod)
    mod = tvm.transform.Sequential([
        relax.transform.CanonicalizeBindings(),
        relax.transform.FoldConstant(),
        relax.transform.FoldBatchnormToConv2D(),
        relax.transform.FoldConstant(),
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"],
                                       "relax.nn.conv2d_transpose": ["NHWC", "IOHW"]}),
    ])(mod)
    mod = fold(fold_layout_constants(mod))
    mod = nhwc_layout_ops(mod)
    mod = cancel_transposes(mod)
    mod = transpose_before_dequantize(mod)
    mod = tvm.transform.Sequential([relax.transform.CanonicalizeBindings(), fold])(mod)
    return mod, {"layout_transposes": count_layout_transposes(mod), "written_out": folded}


def legalise_for_tvm(mod: tvm.IRModule) -> tvm.IRModule:
    """What TVM cannot compile as the layout pass left it: conv2d_transpose in NHWC has no
    legalisation in TVM 0.27, so the TVM side (and a fallback) runs it in NCHW between
    transposes."""

    def rewrite(call, m):
        if op_name(call) != "relax.nn.conv2d_transpose" or str(call.attrs.data_layout) != "NHWC":
            return None
        a = call.attrs
        x = bind_params(m, relax.op.permute_dims(call.args[0], TO_NCHW))
        y = bind_params(m, relax.op.nn.conv2d_transpose(
            x, call.args[1], strides=[int(s) for s in a.strides], padding=[int(p) for p in a.padding],
            output_padding=[int(p) for p in a.output_padding], dilation=[int(d) for d in a.dilation],
            groups=int(a.groups), data_layout="NCHW", kernel_layout=str(a.kernel_layout), out_layout="NCHW"))
        return relax.op.permute_dims(y, TO_NHWC)

    out = tvm.IRModule({})
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            sub = rewrite_calls(tvm.IRModule({"main": f}), rewrite)
            out[gv] = sub["main"]
        else:
            out[gv] = f
    if mod.attrs is not None:
        out = out.with_attrs(mod.attrs) if hasattr(out, "with_attrs") else out
    return out
