"""The escape hatch: ONNX nodes that neither ACL nor the device's TVM runtime can run become
onnxruntime orders (an order of kind "onnx", contract/orders.py KINDS).

Two kinds of node go this way, each with its reason (``why``):

    no converter     TVM's ONNX importer has none for the op (LSTM, Loop, a custom domain)
    runtime lacks    TVM imports the op but lowers it to a packed function that only the full
                     TVM library registers (RUNTIME_LACKS); the device loads the runtime only

``cut`` replaces each connected run of such nodes (merged only where that makes no cycle) by one
placeholder node; while TVM imports the model (compiler/stages/importer.py) the placeholder becomes a
call to an external function (Codegen "onnxruntime", ``converter``), which RunCodegen turns into
``call_dps_packed(symbol, inputs)`` as it does for the ACL regions; the VM resolves the symbol to
the agent's onnxruntime executor, as it does every delegated order. The order's ONNX rendering is the original nodes with the
initializers they read, shapes from onnx's shape inference (or, where it cannot say, from running
the model: a Loop's outputs).

The **tail**: an op whose output size depends on the data (DATA_SHAPED: NonMaxSuppression, NonZero,
...) cannot be a VM call (call_dps_packed needs its outputs' shapes before the call). Such an op and
everything after it (every node it feeds, to the model's outputs) become one more onnxruntime
rendering that the device runs after the VM: the VM returns what the tail reads, the tail gives the
model's outputs of any size (the manifest's ``tail``, contract/tail.py). An end-to-end detector's
NMS and the gathers of the boxes it kept are the common case.

``check_runtime`` is the backstop after TVM's build pipeline: a packed function the lowered module
calls that the runtime library lacks (RUNTIME_PREFIXES / RUNTIME_ABSENT say what it has) refuses
the compile, naming the op, instead of writing a bundle the device cannot run.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from tandoor_contract import backends, orders, probe

from ...errors import CompileError
from ...stages.frontend import ONNX_DTYPES as _DTYPES
from ...stages.normalise import Context, reads, sort_nodes

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

# Ops TVM imports but whose result onnxruntime's reference decides by rounding, so that TVM's
# float arithmetic one ulp away flips whole quantization steps: they run in onnxruntime orders,
# beside the integer ops they feed where those go too (ConvInteger has no TVM 0.27 converter;
# MatMulInteger has one and stays in TVM, its DynamicQuantizeLinear an order of its own).
ROUNDED_IN_ONNXRUNTIME: dict[str, str] = {
    "DynamicQuantizeLinear": "its scale and zero point come from each frame's range at run time (onnxruntime's "
                             "quantize_dynamic); computed in TVM, a scale an ulp off rounds values to other "
                             "steps than the reference, so it runs in onnxruntime (beside its ConvInteger)",
}

# Ops whose output size is the data's to decide (the count of hits, of unique values, of boxes kept):
# unless shape inference gives it statically, such an output is refused, whatever the probes gave.
DATA_SHAPED = frozenset({"NonZero", "Unique", "NonMaxSuppression", "Compress"})   # and a Loop: _scans_vary

# What the runtime-only library registers that lowered modules call by name: the VM's builtins
# (the VM lives in libtvm_runtime), except the few below that only the compiler library adds.
# tests/compiler/test_hatch.py compares both with the registries of the two libraries.
RUNTIME_PREFIXES = ("vm.builtin.",)
RUNTIME_ABSENT = frozenset({"vm.builtin.debug_print"})


def symbol_prefix(model_name: str) -> str:
    """The start of every symbol a model's orders register (the runtime's registry is process-wide)."""
    return "".join(c if c.isalnum() else "_" for c in model_name)[:40]


def rknn_symbol(model_name: str, k: int) -> str:
    """The symbol of the NPU's k-th group (npu.pick's order): the same in every compile of a model,
    so a board's profile of one bundle speaks of the next compile's groups."""
    return f"{symbol_prefix(model_name)}_rknn_{k}"


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
    kind: str = "onnx"           # the order's kind: "onnx", or "rknn" (compiler/backends/rknn/npu.py picked it)
    rknn: dict = field(default_factory=dict)    # an rknn order's toolkit facts (compiler/backends/rknn/toolkit.py)
    rknn_blob: bytes = b""
    simulated: list = field(default_factory=list)   # rknn: the simulator's outputs on the check inputs
    tail: bool = False                # runs after the VM (module doc); its outputs may be any size

    @property
    def op_types(self) -> list[str]:
        return [op_name(n) for n in self.nodes]

    def order(self) -> dict:
        """The order (contract/orders.py): kind onnx, its tensors, no layers."""
        def spec(n: str) -> dict:
            shape, dtype = self.specs[n]
            return {"name": n, "shape": shape, "dtype": dtype}

        order = {"order_version": orders.ONNX_ORDER_VERSION, "kind": backends.ONNX, "symbol": self.symbol,
                 "onnx_ops": sorted(set(self.op_types)),
                 "inputs": [spec(n) for n in self.inputs], "outputs": [spec(n) for n in self.outputs],
                 "tensors": {n: {k: v for k, v in spec(n).items() if k != "name"} for n in self.inputs + self.outputs},
                 "weights": {}, "ops": []}
        if self.kind == backends.RKNN:
            order.update(order_version=orders.RKNN_ORDER_VERSION, kind=backends.RKNN, rknn=dict(self.rknn))
        return order

    def manifest_entry(self, member: str) -> dict:
        ops = Counter(self.op_types)
        entry = {"symbol": self.symbol, "ops": [f"onnx.{o}" for o in self.op_types], "composites": [],
                 "delegate": True, "executor": "onnxruntime", "kind": backends.ONNX,
                 "reason": "onnxruntime: " + "; ".join(f"{o}: {self.why[o]}" for o in ops),
                 "why": dict(self.why), "nodes": [n.name or n.output[0] for n in self.nodes],
                 "est": {}, "order": f"{member}.json", "onnx": f"{member}.onnx"}
        if self.kind == backends.RKNN:
            entry.update(executor="rknn", kind=backends.RKNN, rknn=f"{member}.rknn",
                         reason=f"rknn: {len(self.nodes)} node(s) the RK3588 NPU takes (compiler/backends/rknn/npu.py)",
                         est={"source": "estimate (NPU op table)"})
        return entry


def op_name(node: onnx.NodeProto) -> str:
    """The op type, with its domain when it is not ONNX's own (com.example::Frobnicate)."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


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
        elif n.op_type in ROUNDED_IN_ONNXRUNTIME:
            out[k] = ROUNDED_IN_ONNXRUNTIME[n.op_type]
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
    """(the model with each group as a placeholder node and without the tail, the groups with the
    tail last); the model itself when no node needs onnxruntime. ``inputs``: the model's input
    specs (for sizing outputs by running it). ``npu``: groups of node indices the NPU takes
    (compiler/backends/rknn/npu.py pick, disjoint from ``reasons``), each with its nodes' reasons: they become
    groups of kind "rknn" (converted later); a node of the tail leaves its group."""
    nodes = list(model.graph.node)
    tail_at = _tail(model)
    picked = {k: why for k, why in reasons(model).items() if k not in tail_at}
    if not picked and not tail_at and not npu:
        return model, []
    inits = {i.name: i for i in model.graph.initializer}
    graph_outputs = {o.name for o in model.graph.output}
    prefix = symbol_prefix(model_name)
    groups: list[Group] = []
    cuts = [(f"{prefix}_ort_{k}", backends.ONNX, members, picked) for k, members in enumerate(merge(model, picked))]
    cuts += [(rknn_symbol(model_name, k), "rknn", kept, why) for k, (members, why) in enumerate(npu)
             if (kept := [m for m in members if m not in tail_at])]
    if tail_at:
        cuts.append((f"{prefix}_tail", "onnx", sorted(tail_at), tail_at))
    for symbol, kind, members, why in cuts:
        g = Group(symbol, [nodes[m] for m in members], why={op_name(nodes[m]): why[m] for m in members}, kind=kind,
                  tail=why is tail_at)
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


# ops whose output is the input's shape, not its values: no data flows through them when that shape is static
_SHAPE_OF = frozenset({"Shape", "Size"})


def _valued(nodes, data: set[str], static: set[str]) -> set[str]:
    """``data`` grown by every output of ``nodes`` (in order) that a value in it reaches; a Shape or
    Size of a ``static``-shaped tensor does not carry it."""
    data = set(data)
    for n in nodes:
        if n.op_type in _SHAPE_OF and n.input[0] in static:
            continue
        if any(i in data for i in reads(n)):
            data.update(o for o in n.output if o)
    return data


def _loop_counts_data(node: onnx.NodeProto, data: set[str]) -> bool:
    """Does the data decide how many trips a Loop makes? Its count or first condition is data, or its
    body's condition is reached by data: the outer values it reads, or a loop-carried value whose start
    (or update, to a fixpoint) is."""
    if node.input[0] in data or (len(node.input) > 1 and node.input[1] in data):
        return True
    body = next(a.g for a in node.attribute if a.name == "body")
    carried = [i.name for i in body.input[2:]]
    inside = {carried[k] for k, v in enumerate(node.input[2:]) if v in data}
    while True:
        reached = _valued(body.node, data | inside, set())
        more = {carried[k] for k, o in enumerate(body.output[1:len(carried) + 1]) if o.name in reached} - inside
        if not more:
            return body.output[0].name in reached
        inside |= more


def _scans_vary(node: onnx.NodeProto, data: set[str]) -> bool:
    """A Loop with scan outputs (one row per trip) whose trip count the data decides."""
    return (node.op_type == "Loop" and any(o for o in node.output[len(node.input) - 2:])
            and _loop_counts_data(node, data))


def _tail(model: onnx.ModelProto) -> dict[int, str]:
    """Node index -> why, for the tail (module doc): each DATA_SHAPED node whose output size shape
    inference cannot fix, and every node downstream of one."""
    nodes = list(model.graph.node)
    known = _known_specs(model)
    static = {n for n, (dims, _) in known.items() if dims is not None and None not in dims}
    data = _valued(nodes, {i.name for i in model.graph.input}, static)
    seeds = {k: n.op_type for k, n in enumerate(nodes) if n.domain in ("", "ai.onnx") and (
        (n.op_type in DATA_SHAPED and any(o not in static for o in n.output if o)) or _scans_vary(n, data))}
    if not seeds:
        return {}
    out = {k: ("its output size depends on the data; the bundle runs it, and what follows it, in onnxruntime "
               "after the TVM part") for k in seeds}
    first = nodes[min(seeds)].op_type
    made = {o for k in seeds for o in nodes[k].output if o}
    for k, n in enumerate(nodes):           # nodes are sorted (normalise.sort_nodes): one pass finds them all
        if k not in out and any(i in made for i in reads(n)):
            out[k] = f"after {first}, whose output size depends on the data"
            made |= {o for o in n.output if o}
    return out


def _size(model: onnx.ModelProto, groups: list[Group], inputs: list[dict]) -> None:
    """Each group's boundary tensors get a static shape and a dtype, or the compile is refused; the
    tail's outputs may be any size (-1 for a dim that varies)."""
    known = _known_specs(model)
    unknown = [n for g in groups for n in g.inputs + g.outputs
               if known.get(n, (None, 0))[0] is None or None in known[n][0] or known[n][1] not in _DTYPES]
    runs = _run_for_shapes(model, unknown, inputs, [t for g in groups for t in g.op_types]) if unknown else []
    for g in groups:
        for n in g.inputs + g.outputs:
            if n in unknown:
                seen = {tuple(r[n][0]) for r in runs}
                op = next((x.op_type for x in g.nodes if n in x.output), g.nodes[0].op_type)
                if g.tail and n in g.outputs:
                    dims = known.get(n, (None, 0))[0] or [None] * len(runs[0][n][0])
                    g.specs[n] = ([-1 if d is None else int(d) for d in dims], runs[0][n][1])
                    continue
                if len(seen) > 1 or op in DATA_SHAPED:   # two probes agreeing proves nothing for these
                    sizes = " vs ".join("x".join(map(str, s)) for s in sorted(seen))
                    raise CompileError(f"{op} ({n}) gives outputs whose size depends on the input data ({sizes}) "
                                       "and feeds the rest of the model; a Tandoor bundle runs such an op only "
                                       "at the model's end (after it, only ops on its outputs): end the model "
                                       "there, or report the model")
                g.specs[n] = (list(runs[0][n][0]), runs[0][n][1])
            else:
                dims, et = known[n]
                g.specs[n] = ([int(d) for d in dims], _DTYPES[et])


def _render(model: onnx.ModelProto, g: Group, inits: dict[str, onnx.TensorProto]) -> bytes:
    """The group as a standalone ONNX model: its nodes, the initializers they read, its tensors as
    graph inputs/outputs with the static shapes the order promises."""
    codes = {v: k for k, v in _DTYPES.items()}
    vi = lambda n: helper.make_tensor_value_info(  # noqa: E731
        n, codes[g.specs[n][1]], [None if d < 0 else d for d in g.specs[n][0]])
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
    position of the group's last node (all of its inputs exist there); without the tail's nodes, and
    returning what the tail reads instead of what it makes (``vm_outputs``)."""
    last = {id(g.nodes[-1]): g for g in groups if not g.tail}
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
    # a node reading an earlier member's output may stand before the last one (a dynamically
    # quantized net: one DynamicQuantizeLinear feeding two ConvIntegers, the first one's Cast
    # between them); groups are convex (merge), so a stable topological sort orders them
    sort_nodes(out, Context(Path(model.graph.name or "model"), {}))
    tail = next((g for g in groups if g.tail), None)
    if tail is not None:
        codes = {v: k for k, v in _DTYPES.items()}
        declared = {o.name: o for o in model.graph.output}
        del out.graph.output[:]
        for name in vm_outputs(model, groups):
            out.graph.output.append(declared[name] if name in declared else helper.make_tensor_value_info(
                name, codes[tail.specs[name][1]], tail.specs[name][0]))
    return out


def vm_outputs(model: onnx.ModelProto, groups: list[Group]) -> list[str]:
    """What the TVM part returns: the model's outputs the tail does not make, then the tensors the
    tail reads from it (not the model's inputs), each once."""
    tail = next((g for g in groups if g.tail), None)
    if tail is None:
        return [o.name for o in model.graph.output]
    made = {o for n in tail.nodes for o in n.output if o}
    fed = {i.name for i in model.graph.input}
    out = [o.name for o in model.graph.output if o.name not in made]
    return out + [n for n in tail.inputs if n not in fed and n not in out]


def tail_entry(model: onnx.ModelProto, groups: list[Group]) -> dict | None:
    """The manifest's ``tail`` (contract/tail.py): where each of the tail's inputs comes from (the
    model's inputs or the VM's outputs), and each model output (the VM's or the tail's)."""
    tail = next((g for g in groups if g.tail), None)
    if tail is None:
        return None
    vm = vm_outputs(model, groups)
    fed = [i.name for i in model.graph.input]
    ops = Counter(tail.op_types)
    return {"symbol": tail.symbol, "kind": backends.ONNX, "onnx": f"orders/{tail.symbol}.onnx",
            "ops": [f"onnx.{o}" for o in tail.op_types],
            "reason": "onnxruntime after the TVM part: " + "; ".join(f"{o}: {tail.why[o]}" for o in ops),
            "why": dict(tail.why),
            "nodes": [n.name or n.output[0] for n in tail.nodes],
            "feeds": [{"name": n, **({"input": fed.index(n)} if n in fed else {"vm": vm.index(n)})} for n in tail.inputs],
            "outputs": [{"tail": tail.outputs.index(o.name)} if o.name in tail.outputs else {"vm": vm.index(o.name)}
                        for o in model.graph.output],
            "tail_outputs": [{"name": n, "shape": tail.specs[n][0], "dtype": tail.specs[n][1]} for n in tail.outputs]}


CODEGEN = "onnxruntime"   # the placeholder functions' Codegen attr: RunCodegen calls relax.ext.onnxruntime


def converter(groups: list[Group]):
    """The importer's converter class for the placeholder (compiler/stages/importer.py): a call to an
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
