"""Mark -> merge -> keep what pays -> unique symbols. Mechanics only; the rules are the backends' tables
(compiler/backends/acl/, the escape hatch's compiler/backends/onnx/hatch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.transform import FusionPattern

from ..backends import acl
from ..backends.onnx import hatch

CODEGEN = "acl"


@dataclass
class Partition:
    symbol: str
    composites: list[str]          # composite names, in order (e.g. acl.conv2d_bias_relu)
    ops: list[str]                 # relax op names inside (what counts toward the ratio)
    func: relax.Function | None = None
    delegate: bool = True
    reason: str = "supported by ACL"
    est: dict = field(default_factory=dict)


@dataclass
class PartitionResult:
    mod: tvm.IRModule
    partitions: list[Partition]
    tvm_ops: list[tuple[str, str]]   # (op, reason) left to TVM
    ops_total: int
    ops_delegated: int


def _fusion_patterns() -> list[FusionPattern]:
    # Passed straight to FuseOpsByPattern: registering Python checks in the global pattern
    # registry segfaults at interpreter exit in TVM 0.27.
    pats = []
    for rule in acl.rules():
        def check(ctx, rule=rule):
            return not _escapes(ctx) and rule.check(ctx.annotated_expr) is None
        pats.append(FusionPattern(rule.name, rule.pattern, rule.annotations, check))
    return pats


def _escapes(ctx) -> bool:
    """A match whose intermediate value is also used outside it (conv -> add -> sigmoid where the
    add feeds a multiply too, as in SiLU): FuseOpsByPattern would give the composite a second
    result, and an order op has one. Such a match is refused; a smaller rule takes the ops."""
    inside = list(ctx.matched_bindings.keys())
    out = ctx.value_to_bound_var.get(ctx.matched_expr)
    for var in inside:
        if out is not None and var.same_as(out):
            continue
        for user in ctx.var_usages.get(var, []):
            if not any(user.same_as(v) for v in inside):
                return True
    return False


def calls(func: relax.Function) -> list[relax.Call]:
    """Operator calls (not function calls) of a function body, in binding order."""
    out: list[relax.Call] = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            out.append(e)

    relax.analysis.post_order_visit(func.body, visit)
    return out


COUNTED_EXCLUDE = {"relax.call_tir", "relax.call_dps_packed"}


def count_ops(func: relax.Function) -> int:
    return sum(1 for c in calls(func) if c.op.name not in COUNTED_EXCLUDE)


def partition(mod: tvm.IRModule, model_name: str, keep=None) -> PartitionResult:
    """Group ACL-supported ops into connected, cycle-free regions (MergeCompositeFunctions
    guarantees both), then let `keep(partition) -> (bool, reason)` veto regions that do not pay."""
    ops_total = count_ops(mod["main"])
    mod = relax.transform.FuseOpsByPattern(_fusion_patterns(), bind_constants=True, annotate_codegen=False)(mod)
    mod = relax.transform.MergeCompositeFunctions()(mod)
    mod = _keep_external_symbols(mod)

    parts: list[Partition] = []
    prefix = hatch.symbol_prefix(model_name)
    renames: dict[str, str] = {}
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function) or func.attrs is None or func.attrs.get("Codegen") != CODEGEN:
            continue
        renames[gv.name_hint] = gv.name_hint
    # Order partitions by their first use in main so symbols follow the data flow.
    order = []
    for call in _all_calls(mod["main"]):
        if isinstance(call.op, relax.GlobalVar) and call.op.name_hint in renames and call.op.name_hint not in order:
            order.append(call.op.name_hint)
    for k, name in enumerate(order):
        func = mod[name]
        composites, ops = [], []
        for f in local_composites(func):
            composites.append(str(f.attrs["Composite"]))
            ops += [c.op.name for c in calls(f)]
        symbol = f"{prefix}_acl_{k}"
        parts.append(Partition(symbol, composites, ops, func))
        renames[name] = symbol

    if keep is not None:
        for p in parts:
            p.delegate, p.reason = keep(p)

    mod = _apply(mod, parts, renames)
    delegated = sum(len(p.ops) for p in parts if p.delegate)
    tvm_ops = [(c.op.name, acl.explain(c)) for c in calls(mod["main"]) if c.op.name not in COUNTED_EXCLUDE]
    for p in parts:
        if not p.delegate:
            tvm_ops += [(o, p.reason) for o in p.ops]
    return PartitionResult(mod, parts, tvm_ops, ops_total, delegated)


def _keep_external_symbols(mod: tvm.IRModule) -> tvm.IRModule:
    """MergeCompositeFunctions renames every function with a Codegen attr to "<name>_<codegen>",
    the escape hatch's already named ones too (compiler/backends/onnx/hatch.py): their symbols are what the
    device registers, so they get their names back."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and func.attrs is not None and func.attrs.get("Codegen") == hatch.CODEGEN:
            mod[gv] = func.with_attr("global_symbol", gv.name_hint.removesuffix(f"_{hatch.CODEGEN}"))
    return mod


def _all_calls(func: relax.Function) -> list[relax.Call]:
    out: list[relax.Call] = []
    relax.analysis.post_order_visit(func.body, lambda e: out.append(e) if isinstance(e, relax.Call) else None)
    return out


def local_composites(func: relax.Function) -> list[relax.Function]:
    """Composite functions inside a merged region, in binding order."""
    found: list[relax.Function] = []
    local: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Function):
                local[b.var] = b.value
            elif isinstance(b.value, relax.Call) and b.value.op in local:
                found.append(local[b.value.op])
    return found


def _apply(mod: tvm.IRModule, parts: list[Partition], renames: dict[str, str]) -> tvm.IRModule:
    """Rename kept regions to their symbols; inline the refused ones back into main."""
    by_symbol = {p.symbol: p for p in parts}
    inline_any = False
    for gv in list(mod.get_global_vars()):
        func = mod[gv]
        if not (isinstance(func, relax.Function) and func.attrs is not None and func.attrs.get("Codegen") == CODEGEN):
            continue
        p = by_symbol[renames[gv.name_hint]]
        if p.delegate:
            func = func.with_attr("global_symbol", p.symbol)
            p.func = func
            mod[gv] = func
        else:
            mod[gv] = plain_calls(func)
            inline_any = True
    if inline_any:
        # region -> main, then its composite closures -> lifted -> main
        mod = relax.transform.InlinePrivateFunctions()(mod)
        mod = relax.transform.LambdaLift()(mod)
        mod = relax.transform.InlinePrivateFunctions()(mod)
        mod = relax.transform.DeadCodeElimination()(mod)
    # RunCodegen names each packed call after the region's global_symbol, so GlobalVar names
    # may stay as TVM made them.
    return mod


def plain_calls(func: relax.Function) -> relax.Function:
    """A refused region as an ordinary private function whose composites are ordinary closures."""
    func = func.without_attr("Codegen").without_attr("global_symbol")

    @relax.expr_functor.mutator
    class Strip(relax.PyExprMutator):
        def visit_function_(self, f):
            f = super().visit_function_(f)
            return f.without_attr("Composite") if f.attrs is not None and "Composite" in f.attrs else f

    body = Strip().visit_expr(func.body)
    return relax.Function(func.params, body, func.ret_ty if hasattr(func, "ret_ty") else None, func.is_pure, func.attrs)
