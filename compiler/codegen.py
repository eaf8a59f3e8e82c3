"""Delegated regions -> orders (JSON + weights); the rest -> TVM libraries per target.

An order is the contract with the device's executors (docs/bundle-format.md). It is built from
the composite functions that partition.py left in each region: one composite -> one order op,
with bias, activation and padding folded into the op as ACL fuses them.
"""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tandoor_agent import hmod

from .errors import CompileError

ALIGN = 64


class WeightPacker:
    def __init__(self) -> None:
        self.blob = bytearray()
        self.table: dict[str, dict] = {}

    def add(self, array: np.ndarray, hint: str) -> str:
        array = np.ascontiguousarray(array, dtype=np.float32)
        name = f"w{len(self.table)}_{hint}"
        pad = (-len(self.blob)) % ALIGN
        self.blob += b"\0" * pad
        self.table[name] = {"shape": list(array.shape), "dtype": "float32", "offset": len(self.blob), "nbytes": array.nbytes}
        self.blob += array.astype("<f4").tobytes()
        return name


def _shape(e) -> list[int]:
    return [int(d) for d in e.ty.shape]


def _dtype(e) -> str:
    return str(e.ty.dtype)


def _const(e) -> np.ndarray:
    if not isinstance(e, tvm.ir.GenericConst):
        raise CompileError(f"internal: expected a constant in a delegated op, got {type(e).__name__}")
    return e.value.numpy()


def _num(v) -> float:
    return float(v.value) if hasattr(v, "value") else float(v)


def _ints(v) -> list[int]:
    return [int(x) for x in v]


def _calls(func: relax.Function) -> list[relax.Call]:
    out = []
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                out.append(b.value)
    if isinstance(func.body.body, relax.Call):
        out.append(func.body.body)
    return out


def _activation(call: relax.Call | None) -> dict | None:
    if call is None:
        return None
    name = call.op.name
    if name == "relax.nn.relu":
        return {"kind": "relu"}
    if name == "relax.clip":
        lo, hi = _num(call.args[1]), _num(call.args[2])
        return {"kind": "clip", "min": lo, "max": hi}
    if name == "relax.sigmoid":
        return {"kind": "sigmoid"}
    if name == "relax.tanh":
        return {"kind": "tanh"}
    if name == "relax.nn.leakyrelu":
        return {"kind": "leaky_relu", "alpha": float(call.attrs.alpha)}
    raise CompileError(f"internal: unknown activation {name}")


ACT_OPS = {"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.leakyrelu"}


def _composite_to_ops(comp: relax.Function, composite: str, ins: list[str], out: str, w: WeightPacker) -> list[dict]:
    """One composite function -> one or two order ops."""
    calls = _calls(comp)
    by = {c.op.name: c for c in calls}
    act = next((c for c in calls if c.op.name in ACT_OPS), None)
    kind = composite.split(".", 1)[1]
    if kind.startswith("conv2d"):
        conv = by["relax.nn.conv2d"]
        kernel = _const(conv.args[1])
        a = conv.attrs
        cin = _shape(conv.args[0])[3]
        groups = int(a.groups)
        weights = {"kernel": w.add(kernel, "kernel")}
        if "relax.add" in by and kind.startswith("conv2d_bias"):
            weights["bias"] = w.add(_const(by["relax.add"].args[1]).reshape(-1), "bias")
        attrs = {
            "strides": _ints(a.strides), "padding": _ints(a.padding), "dilation": _ints(a.dilation),
            "groups": groups, "depthwise": groups != 1 and groups == cin,
            "activation": _activation(act) if act is not None else None,
        }
        return [{"type": "conv2d", "inputs": ins[:1], "output": out, "attrs": attrs, "weights": weights}]
    if kind.startswith("dense"):
        mm = by["relax.matmul"]
        weights = {"kernel": w.add(_const(mm.args[1]).T, "kernel")}
        if kind.startswith("dense_bias"):
            weights["bias"] = w.add(_const(by["relax.add"].args[1]).reshape(-1), "bias")
        return [{"type": "dense", "inputs": ins[:1], "output": out,
                 "attrs": {"activation": _activation(act) if act is not None else None}, "weights": weights}]
    root = calls[0]
    a = root.attrs
    if kind.startswith("hardswish"):
        return [{"type": "activation", "inputs": ins[:1], "output": out, "attrs": {"activation": {"kind": "hardswish"}}}]
    if kind in ("relu", "clip", "sigmoid", "tanh", "leaky_relu"):
        return [{"type": "activation", "inputs": ins, "output": out, "attrs": {"activation": _activation(root)}}]
    if kind in ("max_pool2d", "avg_pool2d"):
        return [{"type": "pool2d", "inputs": ins, "output": out, "attrs": {
            "kind": "max" if kind == "max_pool2d" else "avg", "pool_size": _ints(a.pool_size),
            "strides": _ints(a.strides), "padding": _ints(a.padding), "ceil_mode": bool(a.ceil_mode),
            "count_include_pad": bool(a.count_include_pad)}}]
    if kind in ("global_avg_pool2d", "global_avg_pool2d_mean", "global_max_pool2d"):
        pk = "max" if kind == "global_max_pool2d" else "avg"
        oshape = _shape(root)
        if len(oshape) == 4:
            return [{"type": "global_pool2d", "inputs": ins, "output": out, "attrs": {"kind": pk}}]
        mid = out + "_pooled"
        n, c = oshape[0], oshape[-1]
        return [{"type": "global_pool2d", "inputs": ins, "output": mid, "attrs": {"kind": pk},
                 "_tensor": {"shape": [n, 1, 1, c], "dtype": "float32"}},
                {"type": "reshape", "inputs": [mid], "output": out, "attrs": {"shape": oshape}}]
    if kind in ("add", "subtract", "multiply"):
        bk = {"add": "add", "subtract": "sub", "multiply": "mul"}[kind]
        lhs, rhs = root.args[0], root.args[1]
        op = {"type": "binary", "inputs": [], "output": out, "attrs": {"kind": bk}, "weights": {}}
        # inputs are the non-constant args in order; constants become weights
        it = iter(ins)
        for role, arg in (("lhs", lhs), ("rhs", rhs)):
            if isinstance(arg, tvm.ir.GenericConst):
                op["weights"][role] = w.add(_const(arg), role)
            else:
                op["inputs"].append(next(it))
        return [op]
    if kind == "concat":
        rank = len(_shape(root))
        return [{"type": "concat", "inputs": ins, "output": out, "attrs": {"axis": int(a.axis) % rank}}]
    if kind == "reshape":
        return [{"type": "reshape", "inputs": ins[:1], "output": out, "attrs": {"shape": _shape(root)}}]
    if kind == "softmax":
        rank = len(_shape(root))
        return [{"type": "softmax", "inputs": ins, "output": out, "attrs": {"axis": int(a.axis) % rank}}]
    if kind == "resize2d":
        oshape = _shape(root)
        return [{"type": "resize2d", "inputs": ins[:1], "output": out, "attrs": {
            "method": "nearest" if a.method == "nearest_neighbor" else "linear",
            "coordinate_transformation_mode": str(a.coordinate_transformation_mode),
            "rounding_method": str(a.rounding_method), "size": oshape[1:3]}}]
    if kind == "transpose":
        rank = len(_shape(root))
        axes = _ints(a.axes) if a.axes is not None else list(reversed(range(rank)))
        return [{"type": "transpose", "inputs": ins, "output": out, "attrs": {"axes": axes}}]
    raise CompileError(f"internal: no order mapping for composite {composite}")


def region_to_order(func: relax.Function, symbol: str) -> tuple[dict, bytes]:
    """A merged ACL region -> (order dict, weights blob)."""
    w = WeightPacker()
    tensors: dict[str, dict] = {}
    names: dict = {}
    inputs = []
    for i, p in enumerate(func.params):
        n = f"in{i}"
        names[p] = n
        tensors[n] = {"shape": _shape(p), "dtype": _dtype(p)}
        inputs.append({"name": n, **tensors[n]})
    local: dict = {}
    ops: list[dict] = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Function):
                local[b.var] = v
                continue
            if isinstance(v, relax.Call) and v.op in local:
                comp = local[v.op]
                out = f"t{len(names)}"
                names[b.var] = out
                tensors[out] = {"shape": _shape(b.var), "dtype": _dtype(b.var)}
                ins = [_tensor_name(a, names) for a in _flat_args(v.args)]
                for op in _composite_to_ops(comp, str(comp.attrs["Composite"]), ins, out, w):
                    if "_tensor" in op:
                        tensors[op["output"]] = op.pop("_tensor")
                    ops.append(op)
                continue
            if isinstance(v, relax.Tuple) or isinstance(v, relax.TupleGetItem) or isinstance(v, relax.Var):
                names[b.var] = v  # resolved below through the tuple
                continue
            raise CompileError(f"internal: unexpected binding {type(v).__name__} in region {symbol}")
    result = func.body.body
    outs = result.fields if isinstance(result, relax.Tuple) else [result]
    outputs = []
    for o in outs:
        n = _tensor_name(o, names)
        outputs.append({"name": n, **tensors[n]})
    for t in tensors.values():
        if t["dtype"] != "float32":
            raise CompileError(f"internal: region {symbol} has a {t['dtype']} tensor")
    order = {"order_version": hmod.ORDER_VERSION, "symbol": symbol, "inputs": inputs, "outputs": outputs,
             "tensors": tensors, "weights": w.table, "ops": ops}
    return order, bytes(w.blob)


def _flat_args(args) -> list:
    out = []
    for a in args:
        if isinstance(a, relax.Tuple):
            out += list(a.fields)
        else:
            out.append(a)
    return out


def _tensor_name(e, names: dict) -> str:
    v = names.get(e, None)
    if isinstance(v, str):
        return v
    if isinstance(v, relax.Var):
        return _tensor_name(v, names)
    raise CompileError(f"internal: cannot resolve a region tensor ({type(e).__name__})")


# --- TVM side ----------------------------------------------------------------------------------

_REGISTERED = False


def _register_codegen() -> None:
    """RunCodegen calls `relax.ext.acl`; orders are written by us, so it only has to say
    'nothing to link' and let RunCodegen turn each region call into call_dps_packed(symbol)."""
    global _REGISTERED
    if not _REGISTERED:
        tvm_ffi.register_global_func("relax.ext.acl", lambda funcs, options, consts: [], override=True)
        _REGISTERED = True


def lower_regions(mod: tvm.IRModule) -> tvm.IRModule:
    _register_codegen()
    mod = relax.transform.RunCodegen()(mod)
    # The weights live in the orders; without this they are embedded in the .so a second time.
    if mod.attrs is not None and "const_name_to_constant" in mod.attrs:
        mod = mod.without_attr("const_name_to_constant")
    return mod


def region_as_module(func: relax.Function, lift_weights: bool = False):
    """A region as a standalone TVM module (the `tvm` executor's fallback for its order).

    With ``lift_weights`` its constants become trailing parameters of ``main`` and the function
    returns (module, [their values]): the compiled fallback then holds no weights, and the bundle
    stores them once (mostly as byte ranges of the order's own weights blob)."""
    from .partition import _plain

    main = _plain(func).with_attr("global_symbol", "main")
    mod = tvm.IRModule({"main": main})
    mod = relax.transform.LambdaLift()(mod)
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    if not lift_weights:
        return mod
    return _lift_constants(mod)


def _lift_constants(mod: tvm.IRModule):
    """Every tensor constant of main -> a new trailing parameter (scalars stay: they are tiny and
    some ops need them constant)."""
    values: list[np.ndarray] = []
    params: list[relax.Var] = []

    @relax.expr_functor.mutator
    class Lift(relax.PyExprMutator):
        def visit_generic_const_(self, c):
            if not hasattr(c.value, "numpy"):
                return c
            a = c.value.numpy()
            if a.ndim == 0 or a.size < 16:
                return c
            v = relax.Var(f"w{len(params)}", relax.TensorType([int(d) for d in a.shape], str(a.dtype)))
            params.append(v)
            values.append(a)
            return v

    f = mod["main"]
    n_inputs = len(f.params)
    body = Lift().visit_expr(f.body)
    mod["main"] = relax.Function(list(f.params) + params, body, None, f.is_pure, f.attrs).with_attr(
        "num_input", n_inputs)
    # What FoldConstant did to the weights at compile time (the TVM side's conv kernel layout)
    # is split off into main_transform_params, which the executor runs once at load.
    from .schedule import TVM_CONV_LAYOUT

    mod = relax.transform.ConvertLayout({"relax.nn.conv2d": TVM_CONV_LAYOUT})(mod)
    mod = relax.transform.LiftTransformParams()(mod)
    return mod, values


def build(mod: tvm.IRModule, target: dict, out_path, cross_cc: str | None) -> None:
    # schedule.py: relax's default CPU pipeline + vectorised, parallel schedules (docs/benchmarks.md);
    # the host target gets its CPU named (x86-64-v3 on AVX2 machines) instead of generic x86-64.
    from . import schedule

    t = tvm.target.Target(target if cross_cc else schedule.host_target(target))
    ex = tvm.compile(mod, target=t, relax_pipeline=schedule.cpu_pipeline(t))
    if cross_cc:
        from tvm.support import cc

        # The packed-imports object must be emitted for the board's triple, not the host's.
        fcompile = cc.cross_compiler(cross_cc, get_target_triple=lambda: t.attrs["mtriple"])
        ex.export_library(str(out_path), fcompile=fcompile)
    else:
        ex.export_library(str(out_path))
