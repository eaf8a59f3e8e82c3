"""Relax operators: why one that stayed in TVM was not delegated (the same checks as the table)
and how compiler/stages/cost.py counts it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tvm import relax

from .checks import (check_adaptive_pool, check_concat, check_conv2d, check_conv2d_transpose, check_dense,
                     check_elementwise, check_gelu, check_global_pool, check_layer_norm, check_pad, check_pool2d,
                     check_prelu, check_reshape, check_resize, check_softmax, check_strided_slice, check_transpose,
                     check_unary)
from .emit import BINARY_KINDS
from .entry import OpCheck
from .exprs import _numel, _shape


@dataclass(frozen=True)
class RelaxOp:
    """A Relax operator: why it may stay in TVM (``check``; None: no ACL kernel at all) and how
    compiler/stages/cost.py counts it (``cost``: heavy = a kernel of its own even when fused, fused =
    rides along with a neighbour in TVM, free = no data movement; ``flops``: work done)."""
    check: OpCheck | None
    cost: str = "fused"
    flops: Callable[[relax.Call], float] | None = None


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
