"""What an entry of the ACL table is: its patterns (:class:`Rule`, each with a check that returns
a reason), the :class:`Match` its writer reads, the :class:`Entry` itself, and the Arm NN releases
an entry is gated on (``since``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tvm import relax
from tvm.relax.dpl import DFPattern

from tandoor_contract import orders

from .exprs import _calls


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
