"""The escape hatch: ONNX nodes that neither ACL nor the device's TVM runtime can run become
onnxruntime orders (an order of kind "onnx", contract/orders.py KINDS).

Two kinds of node go this way, each with its reason (``why``):

    no converter     TVM's ONNX importer has none for the op (LSTM, Loop, a custom domain)
    runtime lacks    TVM imports the op but lowers it to a packed function that only the full
                     TVM library registers (RUNTIME_LACKS); the device loads the runtime only

``cut`` replaces each connected run of such nodes (merged only where that makes no cycle) by one
placeholder node; while TVM imports the model (compiler/importer.py) the placeholder becomes a
call to an external function (Codegen "onnxruntime", ``converter``), which RunCodegen turns into
``call_dps_packed(symbol, inputs)`` as it does for the ACL regions; the VM resolves the symbol to
the agent's onnxruntime executor, as it does every delegated order. The order's ONNX rendering is the original nodes with the
initializers they read, shapes from onnx's shape inference (or, where it cannot say, from running
the model: a Loop's outputs); an output whose size depends on the data is refused at compile time.

``check_runtime`` is the backstop after TVM's build pipeline: a packed function the lowered module
calls that the runtime library lacks (RUNTIME_PREFIXES / RUNTIME_ABSENT say what it has) refuses
the compile, naming the op, instead of writing a bundle the device cannot run.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from tandoor_contract import orders, probe

from .errors import CompileError
from .frontend import ONNX_DTYPES as _DTYPES

DOMAIN = "ai.tandoor"          # the placeholder's domain: no ONNX op set uses it
PLACEHOLDER = "OnnxruntimeOrder"


@dataclass(frozen=True)
class Lack:
    op: str              # ONNX op type
    function: str        # the packed function TVM's lowering calls
    via: str             # what TVM makes of the op on the way


# Found by compiling each op with TVM 0.27's CPU pipeline and listing the packed functions the
# lowered module calls (``external_calls``); tests/compiler/test_hatch.py checks each against the
# wheel (absent from a runtime-only process, present with the compiler library).
RUNTIME_LACKS: dict[str, Lack] = {x.op: x for x in [
    Lack("TopK", "tvm.contrib.sort.topk", "relax.topk, dispatched to the sort library"),
    Lack("NonMaxSuppression", "tvm.contrib.sort.argsort", "topi.vision.all_class_non_max_suppression"),
    Lack("NonZero", "relax.run.nonzero", "relax.nonzero"),
    Lack("Unique", "relax.run.unique", "relax.unique"),
]}

# Ops whose output size is the data's to decide (the count of hits, of unique values, of boxes kept):
# unless shape inference gives it statically, such an output is refused, whatever the probes gave.
DATA_SHAPED = frozenset({"NonZero", "Unique", "NonMaxSuppression", "Compress"})

# What the runtime-only library registers that lowered modules call by name: the VM's builtins
# (the VM lives in libtvm_runtime), except the few below that only the compiler library adds.
# tests/compiler/test_hatch.py compares both with the registries of the two libraries.
RUNTIME_PREFIXES = ("vm.builtin.",)
RUNTIME_ABSENT = frozenset({"vm.builtin.debug_print"})


def symbol_prefix(model_name: str) -> str:
    """The start of every symbol a model's orders register (the runtime's registry is process-wide)."""
    return "".join(c if c.isalnum() else "_" for c in model_name)[:40]


@dataclass
class Group:
    """A connected run of nodes for onnxruntime: one order."""

    symbol: str
    nodes: list[onnx.NodeProto]
    inputs: list[str] = field(default_factory=list)      # tensors from outside, in first-use order
    outputs: list[str] = field(default_factory=list)     # tensors used outside (or model outputs)
    why: dict[str, str] = field(default_factory=dict)    # op type -> reason
    specs: dict[str, tuple[list[int], str]] = field(default_factory=dict)   # name -> (shape, dtype)
    onnx_bytes: bytes = b""
    kind: str = "onnx"           # the order's kind: "onnx", or "rknn" (compiler/npu.py picked it)
    rknn: dict = field(default_factory=dict)    # an rknn order's toolkit facts (compiler/rknn.py)
    rknn_blob: bytes = b""

    @property
    def op_types(self) -> list[str]:
        return [op_name(n) for n in self.nodes]

    def order(self) -> dict:
        """The order (contract/orders.py): kind onnx, its tensors, no layers."""
        def spec(n: str) -> dict:
            shape, dtype = self.specs[n]
            return {"name": n, "shape": shape, "dtype": dtype}

        order = {"order_version": orders.ONNX_ORDER_VERSION, "kind": "onnx", "symbol": self.symbol,
                 "onnx_ops": sorted(set(self.op_types)),
                 "inputs": [spec(n) for n in self.inputs], "outputs": [spec(n) for n in self.outputs],
                 "tensors": {n: {k: v for k, v in spec(n).items() if k != "name"} for n in self.inputs + self.outputs},
                 "weights": {}, "ops": []}
        if self.kind == "rknn":
            order.update(order_version=orders.RKNN_ORDER_VERSION, kind="rknn", rknn=dict(self.rknn))
        return order

    def manifest_entry(self, member: str) -> dict:
        ops = Counter(self.op_types)
        entry = {"symbol": self.symbol, "ops": [f"onnx.{o}" for o in self.op_types], "composites": [],
                 "delegate": True, "executor": "onnxruntime", "kind": "onnx",
                 "reason": "onnxruntime: " + "; ".join(f"{o}: {self.why[o]}" for o in ops),
                 "why": dict(self.why), "nodes": [n.name or n.output[0] for n in self.nodes],
                 "est": {}, "order": f"{member}.json", "onnx": f"{member}.onnx"}
        if self.kind == "rknn":
            entry.update(executor="rknn", kind="rknn", rknn=f"{member}.rknn",
                         reason=f"rknn: {len(self.nodes)} node(s) the RK3588 NPU takes (compiler/npu.py)",
                         est={"source": "estimate (NPU op table)"})
        return entry


def op_name(node: onnx.NodeProto) -> str:
    """The op type, with its domain when it is not ONNX's own (com.example::Frobnicate)."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (Loop/If/Scan bodies) read from the enclosing graph."""
    out: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            made = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                made |= set(n.output)
            for n in g.node:
                out |= {i for i in n.input if i and i not in made} | (_subgraph_reads(n) - made)
            out |= {o.name for o in g.output if o.name not in made}
    return out


def reads(node: onnx.NodeProto) -> list[str]:
    return [i for i in node.input if i] + sorted(_subgraph_reads(node) - set(node.input))


def reasons(model: onnx.ModelProto) -> dict[int, str]:
    """Node index -> why it goes to onnxruntime, for each node that must."""
    import tvm
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"If", "Constant"}
    out = {}
    for k, n in enumerate(model.graph.node):
        if n.domain not in ("", "ai.onnx"):
            out[k] = f"an op of domain {n.domain}; TVM imports the standard ONNX domain only"
        elif n.op_type not in known:
            out[k] = f"TVM {tvm.__version__}'s ONNX importer has no converter for it"
        elif n.op_type in RUNTIME_LACKS:
            lack = RUNTIME_LACKS[n.op_type]
            out[k] = (f"TVM lowers it ({lack.via}) to {lack.function}, which only the full TVM library registers "
                      "(the device loads TVM's runtime only)")
    return out


def merge(model: onnx.ModelProto, picked: dict[int, str]) -> list[list[int]]:
    """Picked nodes merged along direct edges between them, unless the merge would make a cycle
    (a path from one to the other through a node that stays in TVM)."""
    nodes = list(model.graph.node)
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    succ: dict[int, set[int]] = {k: set() for k in range(len(nodes))}
    for k, n in enumerate(nodes):
        for i in reads(n):
            if i in producer:
                succ[producer[i]].add(k)
    group = {k: [k] for k in picked}

    def reaches_outside(src: set[int], dst: set[int]) -> bool:
        """Is there a path from ``src`` to ``dst`` that leaves src | dst on the way?"""
        inside = src | dst
        todo = [s for k in src for s in succ[k] if s not in inside]
        seen = set(todo)
        while todo:
            k = todo.pop()
            if k in dst:
                return True
            for s in succ[k]:
                if s not in seen and (s in dst or s not in inside):
                    seen.add(s)
                    todo.append(s)
        return False

    for k in sorted(picked):
        for s in sorted(succ[k]):
            if s not in picked or group[k] is group[s]:
                continue
            a, b = set(group[k]), set(group[s])
            if not reaches_outside(a, b) and not reaches_outside(b, a):
                merged = sorted(a | b)
                for m in merged:
                    group[m] = merged
    seen, out = set(), []
    for k in sorted(picked):
        if id(group[k]) not in seen:
            seen.add(id(group[k]))
            out.append(group[k])
    return out




def _known_specs(model: onnx.ModelProto) -> dict[str, tuple[list, int]]:
    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        out[vi.name] = (dims, t.elem_type)
    for i in model.graph.initializer:
        out[i.name] = (list(i.dims), i.data_type)
    return out


def session(model_bytes: bytes, ops: list[str]):
    """An onnxruntime session of a model holding ``ops`` (the hatch's op types), or the refusal:
    neither TVM, ACL nor onnxruntime runs them."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as err:
        text = " ".join(str(err).split()).removeprefix("[ONNXRuntimeError] : ")
        raise CompileError(f"op(s) {', '.join(sorted(set(ops)))} can be run by neither TVM nor ACL, nor by "
                           f"onnxruntime {ort.__version__} ({text[:200]}); replace them in the exported model "
                           "(or export with standard ONNX ops only)") from None


def _run_for_shapes(model: onnx.ModelProto, names: list[str], inputs: list[dict],
                    ops: list[str]) -> list[dict[str, tuple]]:
    """Shapes and dtypes of ``names`` when onnxruntime runs the model on the golden probe inputs
    (seeds 1 and 2, as compiler/pipeline.py's golden pairs)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    sess = session(m.SerializeToString(), ops)
    runs = []
    for seed in (1, 2):
        ins = probe.inputs({"inputs": inputs}, seed=seed)
        outs = sess.run(names, {i["name"]: a for i, a in zip(inputs, ins)})
        runs.append({n: (list(np.shape(a)), str(np.asarray(a).dtype)) for n, a in zip(names, outs)})
    return runs


def cut(model: onnx.ModelProto, model_name: str, inputs: list[dict],
        npu: list[tuple[list[int], dict[int, str]]] = ()) -> tuple[onnx.ModelProto, list[Group]]:
    """(the model with each group as a placeholder node, the groups); the model itself when no node
    needs onnxruntime. ``inputs``: the model's input specs (for sizing outputs by running it).
    ``npu``: groups of node indices the NPU takes (compiler/npu.py pick, disjoint from ``reasons``),
    each with its nodes' reasons: they become groups of kind "rknn" (converted later)."""
    picked = reasons(model)
    if not picked and not npu:
        return model, []
    nodes = list(model.graph.node)
    inits = {i.name: i for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    prefix = symbol_prefix(model_name)
    groups: list[Group] = []
    cuts = [(f"{prefix}_ort_{k}", "onnx", members, picked) for k, members in enumerate(merge(model, picked))]
    cuts += [(f"{prefix}_rknn_{k}", "rknn", members, why) for k, (members, why) in enumerate(npu)]
    for symbol, kind, members, why in cuts:
        g = Group(symbol, [nodes[m] for m in members], why={op_name(nodes[m]): why[m] for m in members}, kind=kind)
        made = {o for n in g.nodes for o in n.output if o}
        for n in g.nodes:
            for i in reads(n):
                if i not in made and i not in inits and i not in g.inputs:
                    g.inputs.append(i)
        used_outside = {i for m, n in enumerate(nodes) if m not in members for i in reads(n)}
        g.outputs = [o for n in g.nodes for o in n.output if o and (o in used_outside or o in graph_outputs)]
        groups.append(g)
    _size(model, groups, inputs)
    for g in groups:
        g.onnx_bytes = _render(model, g, inits)
    return _with_placeholders(model, groups), groups


def _size(model: onnx.ModelProto, groups: list[Group], inputs: list[dict]) -> None:
    """Each group's boundary tensors get a static shape and a dtype, or the compile is refused."""
    known = _known_specs(model)
    unknown = [n for g in groups for n in g.inputs + g.outputs
               if known.get(n, (None, 0))[0] is None or None in known[n][0] or known[n][1] not in _DTYPES]
    runs = _run_for_shapes(model, unknown, inputs, [t for g in groups for t in g.op_types]) if unknown else []
    for g in groups:
        for n in g.inputs + g.outputs:
            if n in unknown:
                seen = {tuple(r[n][0]) for r in runs}
                op = next((x.op_type for x in g.nodes if n in x.output), g.nodes[0].op_type)
                if len(seen) > 1 or op in DATA_SHAPED:   # two probes agreeing proves nothing for these
                    sizes = " vs ".join("x".join(map(str, s)) for s in sorted(seen))
                    raise CompileError(f"{op} ({n}) gives outputs whose size depends on the input data ({sizes}); "
                                       "a Tandoor bundle needs static shapes: end the model before it (run it on "
                                       "the host)")
                g.specs[n] = (list(runs[0][n][0]), runs[0][n][1])
            else:
                dims, et = known[n]
                g.specs[n] = ([int(d) for d in dims], _DTYPES[et])


def _render(model: onnx.ModelProto, g: Group, inits: dict[str, onnx.TensorProto]) -> bytes:
    """The group as a standalone ONNX model: its nodes, the initializers they read, its tensors as
    graph inputs/outputs with the static shapes the order promises."""
    codes = {v: k for k, v in _DTYPES.items()}
    vi = lambda n: helper.make_tensor_value_info(n, codes[g.specs[n][1]], g.specs[n][0])  # noqa: E731
    used = {i for n in g.nodes for i in reads(n)}
    graph = helper.make_graph(list(g.nodes), g.symbol, [vi(n) for n in g.inputs], [vi(n) for n in g.outputs],
                              [inits[n] for n in sorted(used) if n in inits])
    m = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    for f in model.functions:   # model-local functions a node may call
        m.functions.append(f)
    try:
        onnx.checker.check_model(m)
    except Exception as err:
        text = " ".join(str(err).split())
        raise CompileError(f"the part of the model for onnxruntime ({', '.join(sorted(set(g.op_types)))}) is not a "
                           f"valid ONNX model on its own ({text[:240]}); report the model") from None
    data = m.SerializeToString()
    session(data, g.op_types)     # what the device's executor will do with it
    return data


def _with_placeholders(model: onnx.ModelProto, groups: list[Group]) -> onnx.ModelProto:
    """A copy of the model where each group is one placeholder node (inputs -> outputs), in the
    position of the group's last node (all of its inputs exist there)."""
    last = {id(g.nodes[-1]): g for g in groups}
    gone = {id(n) for g in groups for n in g.nodes}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for n in model.graph.node:
        if id(n) in last:
            g = last[id(n)]
            out.graph.node.append(helper.make_node(PLACEHOLDER, g.inputs, g.outputs, name=g.symbol, domain=DOMAIN,
                                                   symbol=g.symbol))
        elif id(n) not in gone:
            out.graph.node.append(n)
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return out


CODEGEN = "onnxruntime"   # the placeholder functions' Codegen attr: RunCodegen calls relax.ext.onnxruntime


def converter(groups: list[Group]):
    """The importer's converter class for the placeholder (compiler/importer.py): a call to an
    external function (attr Codegen) named by the group's symbol, which RunCodegen turns into
    call_dps_packed(symbol) as it does for the ACL regions. (A call_dps_packed made here would
    meet MergeCompositeFunctions, which cannot visit an ExternFunc in TVM 0.27.) Its body, zeros
    of the output types, is never compiled: it only gives the call its types."""
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    by_symbol = {g.symbol: g for g in groups}

    class OnnxruntimeOrder(fe.OnnxOpConverter):
        @classmethod
        def _impl_v1(cls, bb, inputs, attr, params):
            sym = attr["symbol"]
            g = by_symbol[sym.decode() if isinstance(sym, bytes) else str(sym)]
            args = list(inputs)
            ps = [relax.Var(f"in{k}", a.ty) for k, a in enumerate(args)]
            outs = [relax.op.zeros(relax.ShapeExpr(g.specs[o][0]), g.specs[o][1]) for o in g.outputs]
            tys = [relax.TensorType(g.specs[o][0], g.specs[o][1]) for o in g.outputs]
            f = relax.Function(ps, relax.SeqExpr([], outs[0] if len(outs) == 1 else relax.Tuple(outs)),
                               tys[0] if len(tys) == 1 else relax.TupleType(tys))
            f = f.with_attr("Codegen", CODEGEN).with_attr("global_symbol", g.symbol)
            return relax.Call(bb.add_func(f, g.symbol), args)

    return OnnxruntimeOrder


# --- the backstop -------------------------------------------------------------------------------

_PACKED = re.compile(r'call_packed(?:_lowered)?\("([^"]+)"')


def external_calls(mod) -> set[str]:
    """Names of the packed functions a (lowered) module calls: Relax ExternFuncs and TIR packed calls."""
    import tvm
    from tvm import relax

    names: set[str] = set()
    for _, f in mod.functions.items():
        if isinstance(f, relax.Function):
            relax.analysis.post_order_visit(
                f.body, lambda e: names.add(str(e.global_symbol)) if isinstance(e, relax.ExternFunc) else None)
        elif isinstance(f, tvm.tirx.PrimFunc):
            text = f.script()
            if "call_packed" in text:
                names.update(_PACKED.findall(text))
    return names


def missing(names: set[str], provided: set[str] | frozenset[str]) -> list[str]:
    """The functions of ``names`` that neither the runtime library nor the bundle's orders provide."""
    return sorted(n for n in names if n not in provided and (n in RUNTIME_ABSENT or not n.startswith(RUNTIME_PREFIXES)))


def check_runtime(calls: set[str], provided: set[str] | frozenset[str]) -> None:
    """Refuse (CompileError) a module whose lowered form ``calls`` (external_calls) a function the
    device's runtime lacks and no order of the bundle (``provided``) registers."""
    lacking = missing(calls, provided)
    if lacking:
        by_function = {x.function: x.op for x in RUNTIME_LACKS.values()}
        what = ", ".join(f"{n} (from {by_function[n]})" if n in by_function else n for n in lacking)
        raise CompileError(f"the TVM part of the model calls {what}, which the device's TVM runtime does not "
                           "register; the bundle could not run there. Report the model's ops")


def observer(seen: set[str]):
    """A pass for the end of TVM's build pipeline that adds the module's external calls to ``seen``
    (an error raised inside a pass would cross TVM's FFI as a RuntimeError: the caller checks)."""
    import tvm

    def record(mod, _ctx):
        seen.update(external_calls(mod))
        return mod

    return tvm.transform.module_pass(record, opt_level=0, name="TandoorExternalCalls")
