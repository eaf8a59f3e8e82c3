"""Ops that exporters write out as chains of small ops, folded back into one Relax op each.

Each form is a row of ``FORMS``: a dataflow pattern, and a function that returns the one op the
match computes, or None when the constants or shapes say it is something else (the match is then
left as it was). Written out, these chains cut a delegated region into pieces (Erf, Sqrt, a mean
over the last axis and rank-5 tensors have no ACL kernel) and cost TVM a layout transpose pair
each; as one op, the ACL table (compiler/backends/acl/) either takes the op or TVM runs it as one fused
kernel.

    GELU, erf form      x * (1 + erf(x / sqrt 2)) * 0.5   (any association; / sqrt 2 or * 1/sqrt 2)
                        -> relax.nn.gelu
    GELU, tanh form     x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))  -> relax.nn.gelu_tanh
    LayerNorm, TF style d = x - mean(x); d / sqrt(mean(d*d) + eps) (or d * 1/sqrt(..), d * rsqrt(..)),
                        then * gamma + beta when present  -> relax.nn.layer_norm over the last axis
    channel shuffle     reshape [N,C,H,W] -> [N,g,C/g,H,W], swap axes 1 and 2, reshape back (tf2onnx,
                        ShuffleNet); and the NHWC one on the last axis -> the same shuffle as rank-4
                        reshape / transpose(0,1,3,2) / reshape in NHWC, which ACL runs and which
                        meets the neighbouring convolutions' layout without transposes

``fold`` runs before the layout change (compiler/stages/passes.py), once per form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, rewrite_call, wildcard

Rewrite = Callable[[relax.Expr, Mapping[str, relax.Expr]], "relax.Expr | None"]


@dataclass(frozen=True)
class Form:
    name: str
    pattern: DFPattern
    parts: dict[str, DFPattern]     # named sub-patterns the rewrite reads
    rewrite: Rewrite


# --- helpers ---------------------------------------------------------------------------------

def _mul(a: DFPattern, b: DFPattern) -> DFPattern:
    return is_op("relax.multiply")(a, b) | is_op("relax.multiply")(b, a)


def _add(a: DFPattern, b: DFPattern) -> DFPattern:
    return is_op("relax.add")(a, b) | is_op("relax.add")(b, a)


def _scalar(e: relax.Expr) -> float | None:
    if not isinstance(e, tvm.ir.GenericConst):
        return None
    v = e.value.numpy()
    return float(v.reshape(())) if v.size == 1 else None


def _near(e: relax.Expr, want: float, rel: float = 1e-4) -> bool:
    v = _scalar(e)
    return v is not None and abs(v - want) <= rel * abs(want)


def _shape(e: relax.Expr) -> list[int] | None:
    try:
        return [int(d) for d in e.ty.shape]
    except (AttributeError, TypeError, ValueError):
        return None


def _fp32(e: relax.Expr) -> bool:
    return str(getattr(e.ty, "dtype", "")) == "float32"


# --- GELU ------------------------------------------------------------------------------------

def _gelu_tail(x: DFPattern, inner: DFPattern, half: DFPattern) -> tuple[DFPattern, DFPattern]:
    """x * (inner + 1) * 0.5 in the associations exporters write, and the pattern of the 1."""
    one = is_const()
    phi2 = _add(inner, one)
    return (_mul(_mul(x, phi2), half) | _mul(x, _mul(phi2, half)) | _mul(_mul(x, half), phi2)), one


def _gelu_erf() -> Form:
    x, c, half = wildcard(), is_const(), is_const()
    div = is_op("relax.divide")(x, c)
    inner = is_op("relax.erf")(div | _mul(x, c))
    p, one = _gelu_tail(x, inner, half)

    def rewrite(_, m):
        scale = _scalar(m["c"])
        if scale is None or not _fp32(m["x"]) or not _near(m["one"], 1.0) or not _near(m["half"], 0.5):
            return None
        want = math.sqrt(2) if "div" in m else 1 / math.sqrt(2)     # x / sqrt 2 or x * (1 / sqrt 2)
        return relax.op.nn.gelu(m["x"]) if math.isclose(scale, want, rel_tol=1e-4) else None

    return Form("gelu_erf", p, {"x": x, "c": c, "half": half, "one": one, "div": div}, rewrite)


def _gelu_tanh() -> Form:
    x, a, k, half, three = wildcard(), is_const(), is_const(), is_const(), is_const()
    cube = is_op("relax.power")(x, three) | _mul(_mul(x, x), x) | _mul(x, _mul(x, x))
    s = _add(x, _mul(cube, a))
    inner = is_op("relax.tanh")(_mul(s, k))
    p, one = _gelu_tail(x, inner, half)

    def rewrite(_, m):
        if not _fp32(m["x"]) or not _near(m["one"], 1.0) or not _near(m["half"], 0.5):
            return None
        if not _near(m["a"], 0.044715, 1e-3) or not _near(m["k"], math.sqrt(2 / math.pi), 1e-3):
            return None
        if "three" in m and not _near(m["three"], 3.0):
            return None
        return relax.op.nn.gelu_tanh(m["x"])

    return Form("gelu_tanh", p, {"x": x, "a": a, "k": k, "half": half, "one": one, "three": three}, rewrite)


# --- LayerNorm -------------------------------------------------------------------------------

def _layer_norm(affine: bool) -> Form:
    x, eps, two = wildcard(), is_const(), is_const()
    mu = is_op("relax.mean")(x)
    d = is_op("relax.subtract")(x, mu)
    var = is_op("relax.mean")(is_op("relax.multiply")(d, d) | is_op("relax.power")(d, two))
    ve = _add(var, eps)
    sd = is_op("relax.sqrt")(ve)
    n = (is_op("relax.divide")(d, sd) | _mul(d, is_op("relax.divide")(is_const(), sd))
         | _mul(d, is_op("relax.rsqrt")(ve)))
    parts = {"x": x, "eps": eps, "mu": mu, "var": var, "two": two}
    p = n
    if affine:
        gamma, beta = is_const(), is_const()
        p = _add(_mul(n, gamma), beta)
        parts.update(gamma=gamma, beta=beta)

    def rewrite(matched, m):
        shape = _shape(m["x"])
        if shape is None or not _fp32(m["x"]):
            return None
        rank, c = len(shape), shape[-1]
        for mean in (m["mu"], m["var"]):
            axes = mean.attrs.axis
            if axes is None or [int(a) % rank for a in axes] != [rank - 1] or not bool(mean.attrs.keepdims):
                return None
        e = _scalar(m["eps"])
        if e is None or e < 0 or ("two" in m and not _near(m["two"], 2.0)):   # d ** 2, not another power
            return None
        if affine:
            gamma, beta = _per_channel(m["gamma"], c), _per_channel(m["beta"], c)
            if gamma is None or beta is None:
                return None
        else:
            gamma, beta = np.ones(c, np.float32), np.zeros(c, np.float32)
        return relax.op.nn.layer_norm(m["x"], relax.const(gamma), relax.const(beta), axes=[-1], epsilon=e)

    return Form("layer_norm" + ("_affine" if affine else ""), p, parts, rewrite)


def _per_channel(e: relax.Expr, c: int) -> np.ndarray | None:
    """A constant that broadcasts along the last axis only, as a [C] vector (a scalar repeated)."""
    v = e.value.numpy()
    if v.dtype != np.float32:
        return None
    if v.size == 1:
        return np.full(c, float(v.reshape(())), np.float32)
    if v.shape[-1] != c or any(d != 1 for d in v.shape[:-1]):
        return None
    return np.ascontiguousarray(v.reshape(c))


# --- channel shuffle -------------------------------------------------------------------------

def _channel_shuffle() -> Form:
    x = wildcard()
    r5 = is_op("relax.reshape")(x, wildcard())
    t5 = is_op("relax.permute_dims")(r5)
    p = is_op("relax.reshape")(t5, wildcard())

    def rewrite(matched, m):
        s4, s5, out = _shape(m["x"]), _shape(m["r5"]), _shape(matched)
        axes = m["t5"].attrs.axes
        if s4 is None or s5 is None or out is None or len(s4) != 4 or len(s5) != 5 or axes is None \
                or not _fp32(m["x"]):
            return None
        plan = shuffle_plan(s4, s5, [int(a) for a in axes], out)
        if plan is None:
            return None
        axis, groups, perm = plan
        y = _shuffle(m["x"], axis, groups) if groups else m["x"]
        return relax.op.permute_dims(y, perm) if perm != [0, 1, 2, 3] else y

    return Form("channel_shuffle", p, {"x": x, "r5": r5, "t5": t5}, rewrite)


def shuffle_plan(s4: list[int], s5: list[int], p: list[int], out: list[int]) -> tuple[int, int, list[int]] | None:
    """reshape(transpose(reshape(x[s4], s5), p), out) as (axis, groups, perm): shuffle the ``axis``
    of x in ``groups`` (0: no shuffle), then transpose(perm), rank 4 throughout; or None when it is
    not that. The first reshape splits one axis a into two (g, n/g), the last merges two adjacent
    axes of the transposed tensor that are those two: swapped, a shuffle; in order, none.
    (onnxruntime's optimiser moves an NHWC transpose into the middle one: p = [0,3,4,2,1].)"""
    for a in range(4):
        if s5[:a] + [s5[a] * s5[a + 1]] + s5[a + 2:] != s4:
            continue
        moved = [s5[i] for i in p]
        for b in range(4):
            if {p[b], p[b + 1]} != {a, a + 1} or moved[:b] + [moved[b] * moved[b + 1]] + moved[b + 2:] != out:
                continue
            to4 = [i if i <= a else i - 1 for i in range(5)]      # rank-5 axis -> the rank-4 axis it is part of
            perm = [to4[p[i]] for i in range(5) if i != b + 1]
            swapped = p[b] == a + 1 and s5[a] > 1 and s5[a + 1] > 1
            return a, s5[a] if swapped else 0, perm
    return None


def _shuffle(x: relax.Expr, axis: int, groups: int) -> relax.Expr:
    """The channel shuffle of ``axis`` of rank-4 x in ``groups``, as rank-4 ops on the axis moved
    last (NHWC for NCHW's channels: what the layout pass meets without transposes)."""
    last = [i for i in range(4) if i != axis] + [axis]
    a, b, c, n = (_shape(x)[i] for i in last)
    if axis != 3:
        x = relax.op.permute_dims(x, last)
    y = relax.op.reshape(x, [a * b, c, groups, n // groups])
    y = relax.op.reshape(relax.op.permute_dims(y, [0, 1, 3, 2]), [a, b, c, n])
    return relax.op.permute_dims(y, [int(i) for i in np.argsort(last)]) if axis != 3 else y


FORMS: list[Form] = [_gelu_erf(), _gelu_tanh(), _layer_norm(True), _layer_norm(False), _channel_shuffle()]


def fold(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, int]]:
    """Every form of FORMS in main folded to its op; also how many of each were folded."""
    func = mod["main"]
    counts: dict[str, int] = {}
    for form in FORMS:
        n = 0

        def rewrite(matched, matchings, form=form):
            nonlocal n
            m = {k: matchings[p] for k, p in form.parts.items() if p in matchings}
            try:
                new = form.rewrite(matched, m)
            except (AttributeError, TypeError, ValueError, KeyError):   # an unexpected shape of IR: leave it
                new = None
            if new is None:
                return matched
            n += 1
            return new

        rewritten = rewrite_call(form.pattern, rewrite, func)
        if n:   # rewrite_call also merges common subexpressions: keep a function it folded nothing in
            func = rewritten
            counts[form.name] = n
    mod = mod.clone() if hasattr(mod, "clone") else mod
    mod["main"] = func
    return relax.transform.Normalize()(mod), counts
