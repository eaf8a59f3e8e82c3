"""Quantized (QDQ) composites.

A QDQ model (tandoor quantize, or PyTorch/NNCF/ModelOpt exports) reaches Relax as
quantize(act?(conv2d(dequantize(x_q), W) + B)) with W and B already folded to float32 (their
DequantizeLinear of int8/int32 constants folds like any constant). The composite takes the int8
tensor x_q and gives an int8 tensor, which is what ACL's quantized kernels do; the kernel's int8
codes and scales are recovered from W exactly (int8_grid) rather than trusted from names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from tandoor_contract import orders

from .emit import _act_of, _conv_attrs, _op
from .entry import Check, Match, OpCheck, Rule
from .exprs import _const, _dtype, _is_const, _shape
from .patterns import EPILOGUES, _epilogue_check


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
