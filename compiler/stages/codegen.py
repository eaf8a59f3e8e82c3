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

from tandoor_contract import hmod, orders

from ..backends import acl
from ..backends.onnx import hatch
from ..errors import CompileError

ALIGN = 64


class WeightPacker:
    def __init__(self) -> None:
        self.blob = bytearray()
        self.table: dict[str, dict] = {}

    def add(self, array: np.ndarray, hint: str, quant: orders.Quant | None = None) -> str:
        """A weight into the blob: float32, or (with ``quant``) its int8 codes / int32 bias as given."""
        dtype = np.dtype(array.dtype).name if quant is not None else "float32"
        if dtype not in orders.TENSOR_DTYPES:
            raise CompileError(f"internal: a {dtype} weight ({hint})")
        # not ascontiguousarray: it makes a scalar (a rank-0 Mul/Add constant) a 1-element vector
        array = np.array(array, dtype=dtype, order="C")
        name = f"w{len(self.table)}_{hint}"
        pad = (-len(self.blob)) % ALIGN
        self.blob += b"\0" * pad
        self.table[name] = {"shape": list(array.shape), "dtype": dtype, "offset": len(self.blob), "nbytes": array.nbytes}
        if quant is not None:
            self.table[name]["quant"] = quant.as_dict()
        self.blob += array.astype(array.dtype.newbyteorder("<")).tobytes()
        return name


def _shape(e) -> list[int]:
    ty = e.ty
    if not hasattr(ty, "shape"):
        raise CompileError(f"internal: a delegated tensor has no tensor type ({type(ty).__name__})")
    return [int(d) for d in ty.shape]


def _dtype(e) -> str:
    return str(e.ty.dtype)


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
        inputs.append(n)

    def set_quant(name: str, q: orders.Quant) -> None:
        had = tensors[name].get("quant")
        if had is not None and had != q.as_dict():
            raise CompileError(f"internal: tensor {name} of {symbol} is read with two quantizations ({had} and {q.as_dict()})")
        tensors[name]["quant"] = q.as_dict()
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
                composite = str(comp.attrs["Composite"])

                def add_tensor(shape: list[int], dtype: str = "float32") -> str:
                    name = f"t{len(names)}_{len(tensors)}"
                    tensors[name] = {"shape": list(shape), "dtype": dtype}
                    return name

                match = acl.Match(composite, comp, ins, out, w.add, add_tensor, set_quant)
                try:
                    ops += acl.entry_for(composite).emit(match)
                except (KeyError, ValueError) as err:
                    raise CompileError(f"internal: no order for composite {composite} in {symbol}: {err}") from None
                continue
            if isinstance(v, relax.Tuple) or isinstance(v, relax.TupleGetItem) or isinstance(v, relax.Var):
                names[b.var] = v  # resolved below through the tuple
                continue
            raise CompileError(f"internal: unexpected binding {type(v).__name__} in region {symbol}")
    result = func.body.body
    outs = result.fields if isinstance(result, relax.Tuple) else [result]
    outputs = [_tensor_name(o, names) for o in outs]
    for n, t in tensors.items():
        try:
            orders.quant_of(t, f"tensor {n}")
        except ValueError as err:
            raise CompileError(f"internal: region {symbol}: {err}") from None
    order = {"symbol": symbol, "inputs": [{"name": n, **tensors[n]} for n in inputs],
             "outputs": [{"name": n, **tensors[n]} for n in outputs], "tensors": tensors, "weights": w.table, "ops": ops}
    # version 1 while an order is all float32: agents that know only 1 still run it
    order = {"order_version": orders.QUANT_ORDER_VERSION if orders.is_quantized(order) else 1, **order}
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
    while isinstance(v, relax.Var):        # an alias of an alias ...: followed in a loop, not recursion
        e, v = v, names.get(v, None)
    if isinstance(v, str):
        return v
    raise CompileError(f"internal: cannot resolve a region tensor ({type(e).__name__})")


# --- TVM side ----------------------------------------------------------------------------------

_REGISTERED = False


def _register_codegen() -> None:
    """RunCodegen calls `relax.ext.acl`; orders are written by us, so it only has to say
    'nothing to link' and let RunCodegen turn each region call into call_dps_packed(symbol)."""
    global _REGISTERED
    if not _REGISTERED:
        # the same for the escape hatch's onnxruntime orders (compiler/backends/onnx/hatch.py), written by pipeline
        for name in ("acl", hatch.CODEGEN):
            tvm_ffi.register_global_func(f"relax.ext.{name}", lambda funcs, options, consts: [], override=True)
        _REGISTERED = True


def lower_regions(mod: tvm.IRModule) -> tvm.IRModule:
    _register_codegen()
    mod = relax.transform.RunCodegen()(mod)
    # The weights live in the orders; without this they are embedded in the .so a second time.
    if mod.attrs is not None and "const_name_to_constant" in mod.attrs:
        mod = mod.without_attr("const_name_to_constant")
    return mod


def lift_main_weights(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """The TVM side's weights out of its library: main's tensor constants become trailing
    parameters (a QDQ conv/dense kernel as its int8 codes, dequantized once at load), returned as
    values the bundle stores once for every target (``lib_params``, format_version 4). Inside the
    libraries they were float32, once per target: PP-OCR's direction classifier INT8 carried 2 x 0.6 MB."""
    lifted, values = _lift_constants(_int8_kernels(mod))
    return (lifted, values) if values else (mod, [])


def region_as_module(func: relax.Function, lift_weights: bool = False):
    """A region as a standalone TVM module (the `tvm` executor's fallback for its order).

    With ``lift_weights`` its constants become trailing parameters of ``main`` and the function
    returns (module, [their values]): the compiled fallback then holds no weights, and the bundle
    stores them once (mostly as byte ranges of the order's own weights blob)."""
    from .partition import plain_calls

    main = plain_calls(func).with_attr("global_symbol", "main")
    mod = tvm.IRModule({"main": main})
    mod = relax.transform.LambdaLift()(mod)
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    if not lift_weights:
        return mod
    return _lift_constants(_int8_kernels(mod))


def _int8_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """A quantized conv2d/dense's float kernel -> dequantize(its int8 codes): the fallback then
    takes the order's own int8 bytes as its parameters (the bundle holds INT8 weights once) and
    dequantizes them once at load (LiftTransformParams), computing what it computed before."""
    from .passes import bind_params, op_name, rewrite_calls

    def rewrite(call, m):
        name = op_name(call)
        if name not in ("relax.nn.conv2d", "relax.matmul") or not isinstance(call.args[1], tvm.ir.GenericConst):
            return None
        x = call.args[0]
        x = m.lookup_binding(x) if isinstance(x, relax.Var) and m.lookup_binding(x) is not None else x
        if op_name(x) != "relax.dequantize":
            return None
        w = call.args[1].value.numpy()
        got = acl.weight_grid(w if name == "relax.nn.conv2d" else w.T, 0)
        if got is None:
            return None
        codes, q = got
        axis = 0 if name == "relax.nn.conv2d" else 1
        if name == "relax.matmul":
            codes = codes.T
        scale = np.asarray(q.scale, np.float32) if q.axis is not None else np.float32(q.scale[0])
        zero = np.zeros(np.shape(scale), np.int8)
        kernel = bind_params(m, relax.op.dequantize(relax.const(np.ascontiguousarray(codes)), relax.const(scale),
                                              relax.const(zero), axis=axis, out_dtype="float32"))
        return relax.Call(call.op, [call.args[0], kernel], call.attrs)

    return rewrite_calls(mod, rewrite)


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


def merge_fallbacks(mods: dict[str, tvm.IRModule]) -> tvm.IRModule:
    """Every region's fallback module in one, its functions renamed for the region (``main`` ->
    ``<symbol>``, ``main_transform_params`` -> ``<symbol>_transform_params``; others get the
    symbol as a prefix): one library per target instead of one per subgraph, since each library
    carries TVM's runtime glue (~65 KB) whatever its code (format_version 4)."""
    out = tvm.IRModule({})
    for symbol, mod in mods.items():
        entry = hmod.fallback_function(hmod.FALLBACK_LIB_FORMAT_VERSION, symbol)
        names = {gv: (entry + gv.name_hint[len("main"):] if gv.name_hint.startswith("main")
                      else f"{symbol}__{gv.name_hint}") for gv, _ in mod.functions_items()}
        new = {gv: tvm.ir.GlobalVar(n) for gv, n in names.items()}

        @relax.expr_functor.mutator
        class Rename(relax.PyExprMutator):
            def visit_global_var_(self, gv):
                return new.get(gv, gv)

        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                raise CompileError(f"internal: fallback of {symbol}: {gv.name_hint} is not a relax function")
            f = Rename().visit_expr(func)
            if f.attrs is not None and "global_symbol" in f.attrs:
                f = f.with_attr("global_symbol", names[gv])
            out[new[gv]] = f
    return out


LINK_OPTIONS = ["-s"]


def build(mod: tvm.IRModule, target: dict, out_path, cross_cc: str | None, provided: frozenset[str] = frozenset()) -> None:
    """``provided``: the symbols the bundle's orders register on the device; any other packed
    function the lowered module calls must be in the device's runtime library (hatch.check_runtime)."""
    # schedule.py: relax's default CPU pipeline + vectorised, parallel schedules (docs/benchmarks.md);
    # the host target gets its CPU named (x86-64-v3 on AVX2 machines) instead of generic x86-64.
    from . import schedule

    from .passes import legalise_for_tvm

    t = tvm.target.Target(target if cross_cc else schedule.host_target(target))
    mod = legalise_for_tvm(mod)
    calls: set[str] = set()
    ex = tvm.compile(mod, target=t, relax_pipeline=tvm.transform.Sequential([schedule.cpu_pipeline(t),
                                                                             hatch.observer(calls)]))
    hatch.check_runtime(calls, provided)
    # -s: no static symbol table (the runtime finds its entry points through the dynamic one);
    # a third to a half of each library, and a bundle carries one per target and per fallback
    if cross_cc:
        from tvm.support import cc

        # The packed-imports object must be emitted for the board's triple, not the host's.
        fcompile = cc.cross_compiler(cross_cc, get_target_triple=lambda: t.attrs["mtriple"])
        ex.export_library(str(out_path), fcompile=fcompile, options=LINK_OPTIONS)
    else:
        ex.export_library(str(out_path), options=LINK_OPTIONS)
