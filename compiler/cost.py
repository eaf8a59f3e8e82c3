"""How much work each op does, and whether a delegated region pays for its boundary.

S = 1 / ((1 - p) + p / s_e + c_o): delegating a share p of the work to an executor s_e times
faster pays only above p_min = c_o * s_e / (s_e - 1). Estimates use FLOPs; measured profiles
replace them later (tandoor profile).
"""

from __future__ import annotations

import math

from tvm import relax

S_E = 3.0      # ACL NEON vs untuned TVM on the same cores (conservative)
C_O = 0.03     # one bridge crossing, as a share of the whole model's time


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))


def op_flops(call: relax.Call) -> float:
    name = call.op.name
    try:
        out = [int(d) for d in call.ty.shape]
    except Exception:
        return 0.0
    if name == "relax.nn.conv2d":
        k = [int(d) for d in call.args[1].ty.shape]          # OHWI or OIHW: 4-D
        per_out = k[1] * k[2] * k[3] if call.attrs.kernel_layout == "OHWI" else k[1] * k[2] * k[3]
        return 2.0 * _numel(out) * per_out
    if name == "relax.matmul":
        kdim = int(call.args[0].ty.shape[-1])
        return 2.0 * _numel(out) * kdim
    if name in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return float(_numel(out) * math.prod(int(x) for x in call.attrs.pool_size))
    if name in ("relax.mean", "relax.max", "relax.nn.adaptive_avg_pool2d"):
        return float(_numel([int(d) for d in call.args[0].ty.shape]))
    return float(_numel(out))


def p_min(s_e: float = S_E, c_o: float = C_O) -> float:
    return c_o * s_e / (s_e - 1.0)


def speedup(p: float, boundaries: int, s_e: float = S_E, c_o: float = C_O) -> float:
    if p <= 0:
        return 1.0
    return 1.0 / ((1.0 - p) + p / s_e + c_o * boundaries)
