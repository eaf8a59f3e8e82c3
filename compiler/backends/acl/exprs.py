"""Reading Relax expressions: shapes, dtypes, constants, the calls of a composite, and the
float32/static-shape/rank test every ACL check starts with."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax


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
