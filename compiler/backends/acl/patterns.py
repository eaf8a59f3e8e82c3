"""The dataflow patterns of the float entries: activations as epilogues and alone, a producer
with its bias and activation (most specific first), single ops, and the written-out forms
(hard-swish, hard-sigmoid, SiLU)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard

from .checks import check_unary
from .entry import Check, Match, OpCheck, Rule
from .exprs import _const, _fp32, _num, _shape


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
