"""Writing order ops: one function per float entry turns a matched composite into the order ops
(``tandoor_contract.orders.OPS``) it becomes."""

from __future__ import annotations

import numpy as np
from tvm import relax

from .checks import slice_spec
from .entry import Match
from .exprs import _const, _ints, _is_const, _shape
from .patterns import EPILOGUES, _act_of


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
