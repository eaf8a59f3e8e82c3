"""What the RK3588's NPU takes (through rknn-toolkit2 2.5.0), as data: one :class:`NpuOp` per ONNX
op type, with a check that returns None when the NPU can take a node or a one-line reason when it
cannot (the style of compiler/backends/acl/). ``pick`` applies the table to a loaded model; the nodes it
takes are cut out like the escape hatch's (compiler/backends/onnx/hatch.py) and become orders of kind "rknn"
(contract/orders.py), converted by the toolkit in its own venv (compiler/backends/rknn/toolkit.py).

The table works on ONNX nodes, before TVM sees the model: the toolkit converts ONNX, and the
order's ONNX rendering (its fallback) is the original nodes. Constraints kept here are the ones
this slice verified or that the toolkit's op support list states for rk3588:

  - float32 tensors of rank <= 4 with static shapes and batch 1 (the NPU's tensors are NC1HWC2);
  - convolutions 2-D with constant weights (grouped and depthwise included);
  - MatMul/Gemm with a constant weight operand (two activations stay on the CPU);
  - shape-giving inputs (Reshape's shape, Resize's scales, Slice's starts, Clip's bounds) constant.

Ops not in the table stay on the CPU (ACL/TVM/onnxruntime, as without --npu), with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from tandoor_contract import backends

from ..onnx import hatch


@dataclass
class Ctx:
    """What a check may ask about a node's tensors."""

    shapes: dict[str, list | None]       # tensor name -> static dims, or None where unknown
    dtypes: dict[str, int]               # tensor name -> ONNX elem type
    consts: set[str]                     # initializer names
    ranges: dict[str, float] = field(default_factory=dict)   # INT8: largest |value| seen in calibration

    def dims(self, name: str) -> list | None:
        return self.shapes.get(name)


Check = Callable[[onnx.NodeProto, Ctx], "str | None"]


@dataclass(frozen=True)
class NpuOp:
    op: str
    doc: str
    check: Check = lambda n, c: None
    compute: bool = False        # a matrix engine op: a region without one is not worth the NPU


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _const_inputs(*positions: int) -> Check:
    def check(node, ctx):
        for p in positions:
            if p < len(node.input) and node.input[p] and node.input[p] not in ctx.consts:
                return f"its input {p} ({node.input[p]}) is computed in the graph; the NPU needs it constant"
        return None
    return check


def _all(*checks: Check) -> Check:
    def check(node, ctx):
        for c in checks:
            if (why := c(node, ctx)) is not None:
                return why
        return None
    return check


def _conv(node, ctx):
    w = node.input[1]
    if w not in ctx.consts:
        return "its weight is computed in the graph; the NPU's convolution takes constant weights"
    d = ctx.dims(w)
    if d is None or len(d) != 4:
        return f"a {len(d) - 2 if d else '?'}-D convolution; the NPU takes 2-D ones"
    return None


def _matmul(node, ctx):
    b = node.input[1]
    if b not in ctx.consts:
        return "both operands are activations; the NPU's matmul takes a constant weight here"
    d = ctx.dims(b)
    if d is None or len(d) != 2:
        return "its weight is not a matrix (rank 2)"
    if node.op_type == "Gemm" and _attr(node, "transA", 0):
        return "transA=1"
    return None


def _pool(node, ctx):
    k = _attr(node, "kernel_shape") or []
    if len(k) != 2:
        return f"a {len(k)}-D pool; the NPU pools 2-D"
    if _attr(node, "dilations") and any(v != 1 for v in _attr(node, "dilations")):
        return "dilated pooling"
    return None


def _resize(node, ctx):
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in ("nearest", "linear"):
        return f"mode {mode}; the NPU resizes nearest or (bi)linear"
    if len(ctx.dims(node.input[0]) or []) != 4:
        return "not a 4-D (NCHW) resize"
    return _const_inputs(1, 2, 3)(node, ctx)


def _pad(node, ctx):
    mode = _attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return f"{mode} padding; the NPU pads with a constant"
    return _const_inputs(1, 2)(node, ctx)


# INT8 gives a tensor one scale: a concat of inputs whose ranges are this far apart leaves the
# smaller with 256 / ratio levels (16: four bits). YOLOv8's last concat joins box coordinates (to
# the input size) and class scores (0..1); Rockchip's model zoo re-exports it with split heads for
# this; leaving the concat on the CPU splits them here.
CONCAT_RANGE_RATIO = 16.0


def _concat(node, ctx):
    seen = [ctx.ranges[i] for i in node.input if i in ctx.ranges]
    if len(seen) < 2 or min(seen) <= 0:
        return None
    if max(seen) / min(seen) > CONCAT_RANGE_RATIO:
        return (f"INT8 would give it one scale for inputs up to {max(seen):.3g} and up to {min(seen):.3g} "
                f"({max(seen) / min(seen):.0f}x apart, > {CONCAT_RANGE_RATIO:.0f}x): the smaller would keep a few "
                "levels; the NPU's outputs stay apart and the CPU joins them")
    return None


def _softmax(node, ctx):
    rank = len(ctx.dims(node.input[0]) or [])
    axis = _attr(node, "axis", -1)
    if axis % max(rank, 1) != rank - 1 and rank != 4:
        return "softmax over an inner axis of a tensor of rank < 4"
    return None


OPS: dict[str, NpuOp] = {o.op: o for o in [
    NpuOp("Conv", "2-D convolution, grouped and depthwise included; bias and activation fuse", _conv, True),
    NpuOp("ConvTranspose", "2-D transposed convolution", _conv, True),
    NpuOp("Gemm", "fully connected (constant weight)", _matmul, True),
    NpuOp("MatMul", "matmul with a constant weight", _matmul, True),
    NpuOp("Relu", "fused into the preceding conv"),
    NpuOp("LeakyRelu", "fused into the preceding conv"),
    NpuOp("PRelu", "per-channel slope", _const_inputs(1)),
    NpuOp("Sigmoid", "lookup table"),
    NpuOp("HardSigmoid", "lookup table"),
    NpuOp("HardSwish", "lookup table"),
    NpuOp("Tanh", "lookup table"),
    NpuOp("Clip", "relu6 and friends (constant bounds)", _const_inputs(1, 2)),
    NpuOp("Add", "elementwise, broadcasting"),
    NpuOp("Sub", "elementwise, broadcasting"),
    NpuOp("Mul", "elementwise, broadcasting (SiLU's x*sigmoid(x), squeeze-excite scales)"),
    NpuOp("Div", "elementwise, broadcasting"),
    NpuOp("BatchNormalization", "folded into the conv before it, else a per-channel scale"),
    NpuOp("MaxPool", "2-D", _pool),
    NpuOp("AveragePool", "2-D", _pool),
    NpuOp("GlobalAveragePool", "mean over H, W"),
    NpuOp("GlobalMaxPool", "max over H, W"),
    NpuOp("Concat", "along any axis (INT8: inputs of like ranges)", _concat),
    NpuOp("Split", "constant split sizes", _const_inputs(1)),
    NpuOp("Slice", "constant starts/ends/axes/steps", _const_inputs(1, 2, 3, 4)),
    NpuOp("Reshape", "constant shape", _const_inputs(1)),
    NpuOp("Flatten", "to rank 2"),
    NpuOp("Transpose", "permutes axes"),
    NpuOp("Softmax", "over the last axis (or channels of a 4-D tensor)", _softmax),
    NpuOp("Resize", "nearest or bilinear, constant scales or sizes", _resize),
    NpuOp("Pad", "constant padding, constant pads", _pad),
]}

FLOAT = onnx.TensorProto.FLOAT


def _tensor_reason(node: onnx.NodeProto, ctx: Ctx) -> str | None:
    """The constraints every op shares: float32, static, rank <= 4, batch 1."""
    for name in [i for i in node.input if i and i not in ctx.consts] + [o for o in node.output if o]:
        dims = ctx.dims(name)
        if dims is None or any(not isinstance(d, int) or d <= 0 for d in dims):
            return f"{name} has no static shape"
        if len(dims) > 4:
            return f"{name} has rank {len(dims)}; the NPU's tensors have rank <= 4"
        if ctx.dtypes.get(name, FLOAT) != FLOAT:
            return f"{name} is not float32 ({onnx.TensorProto.DataType.Name(ctx.dtypes[name])})"
        if len(dims) == 4 and dims[0] != 1:
            return f"{name} has batch {dims[0]}; the NPU runs batch 1"
    return None


def refusal(node: onnx.NodeProto, ctx: Ctx) -> str | None:
    """None when the NPU takes ``node``, else why not (one line)."""
    if node.domain not in ("", "ai.onnx"):
        return f"an op of domain {node.domain}"
    entry = OPS.get(node.op_type)
    if entry is None:
        return "not in the NPU's op table (compiler/backends/rknn/npu.py)"
    return _tensor_reason(node, ctx) or entry.check(node, ctx)


def context(model: onnx.ModelProto) -> Ctx:
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes, dtypes = {}, {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        shapes[vi.name] = ([d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
                           if t.HasField("shape") else None)
        dtypes[vi.name] = t.elem_type
    for i in model.graph.initializer:
        shapes[i.name], dtypes[i.name] = list(i.dims), i.data_type
    return Ctx(shapes, dtypes, {i.name for i in model.graph.initializer})


def flops(node: onnx.NodeProto, ctx: Ctx) -> float:
    """Multiply-adds x2 of the matrix ops, one per output element for the rest (compiler/stages/cost.py's
    convention)."""
    out = ctx.dims(node.output[0]) if node.output else None
    n_out = float(np.prod(out)) if out and all(isinstance(d, int) for d in out) else 0.0
    w = ctx.dims(node.input[1]) if len(node.input) > 1 else None
    if node.op_type == "Conv" and w:
        return 2.0 * n_out * float(np.prod(w[1:]))
    if node.op_type == "ConvTranspose" and w:
        x = ctx.dims(node.input[0]) or []
        return 2.0 * float(np.prod(x)) * float(np.prod(w[1:])) if x else 0.0
    if node.op_type in ("Gemm", "MatMul") and w:
        k = w[1] if node.op_type == "Gemm" and _attr(node, "transB", 0) else w[0]
        return 2.0 * n_out * float(k)
    return n_out


@dataclass
class Pick:
    """What ``pick`` decided: node index -> why it goes to the NPU, and why each other node does not."""

    taken: dict[int, str]
    refused: dict[int, str]
    groups: list[list[int]]
    dropped: dict[int, str]              # taken by the table but left out: a group without compute
    flops: dict[int, float]

    def share(self) -> float:
        total = sum(self.flops.values())
        return sum(self.flops[k] for g in self.groups for k in g) / total if total else 0.0


def pick(model: onnx.ModelProto, avoid: set[int] = frozenset(), ranges: dict[str, float] | None = None) -> Pick:
    """Apply the table to every node (``avoid``: nodes already cut for another reason; ``ranges``:
    :func:`ranges` for INT8), merge the taken ones into connected groups (hatch's merge: no cycles
    through the CPU), and keep the groups that hold at least one matrix op (a lone reshape on the
    NPU costs two copies, gains nothing)."""
    ctx = context(model)
    ctx.ranges = dict(ranges or {})
    nodes = list(model.graph.node)
    taken, refused = {}, {}
    for k, n in enumerate(nodes):
        if k in avoid:
            continue
        why = refusal(n, ctx)
        if why is None:
            taken[k] = OPS[n.op_type].doc
        else:
            refused[k] = why
    groups, dropped = [], {}
    for g in (hatch.merge(model, taken) if taken else []):
        if any(OPS[nodes[k].op_type].compute for k in g):
            groups.append(g)
        else:
            dropped.update({k: "no matrix op in its NPU region: two copies for nothing" for k in g})
    return Pick(taken, refused, groups, dropped, {k: flops(n, ctx) for k, n in enumerate(nodes)})


def apply_profile(picked: Pick, measured, model_name: str, nodes: list[onnx.NodeProto]) -> str:
    """Decide each group from a board's profile (compiler/stages/profile.Measured of a bundle of this model
    compiled with --npu) where it measured the group's rknn order: a group the NPU ran slower than
    onnxruntime ran its ONNX rendering leaves the NPU (``picked.refused`` says by how much).
    Returns the manifest's ``source`` of the decision."""
    subs = measured.data.get("subgraphs") or {}
    board = measured.key.get("board") or "the board"
    decided, absent = 0, []
    for k, members in enumerate(list(picked.groups)):
        s = subs.get(hatch.rknn_symbol(model_name, k))
        if s is None or sorted(s.get("ops") or ()) != sorted(f"onnx.{hatch.op_name(nodes[m])}" for m in members):
            continue                           # another pick made that profile: the estimate decides
        exec_us, bridge = s.get("exec_us") or {}, s.get("bridge_us") or {}
        if "rknn" not in exec_us:
            absent.append((s.get("unavailable") or {}).get("rknn", "not measured"))
            continue
        decided += 1
        on_npu = exec_us["rknn"] + bridge.get("rknn", 0.0)
        cpu = {e: exec_us[e] + bridge.get(e, 0.0) for e in exec_us if e != "rknn"}
        best = min(cpu, key=cpu.get) if cpu else None
        if best is not None and cpu[best] < on_npu:
            measured.renumbered = True
            picked.groups.remove(members)
            picked.refused.update({m: f"measured on {board}: {on_npu:.0f} us on the NPU, {cpu[best]:.0f} us on "
                                      f"{best}" for m in members})
    if decided:
        return f"measured (profile of {board})"
    if absent:
        return f"estimate (NPU op table; the profile's board has no NPU: {absent[0][:120]})"
    return "estimate (NPU op table)"


# --- the compile's NPU step: convert each rknn group and prove it in the simulator -------------------

def activations(model: onnx.ModelProto, names: list[str], feeds: list[list[np.ndarray]]) -> list[dict]:
    """The model's tensors ``names`` (fp32, onnxruntime) for each list of model inputs."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inputs = [i.name for i in m.graph.input]
    have = {o.name for o in m.graph.output}
    wanted = [n for n in names if n not in inputs]
    for n in wanted:
        if n not in have:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out = []
    for xs in feeds:
        feed = dict(zip(inputs, xs))
        got = dict(zip(wanted, sess.run(wanted, feed))) if wanted else {}
        out.append({n: (feed[n] if n in feed else got[n]) for n in names})
    return out


def ranges(model: onnx.ModelProto, samples: list[list[np.ndarray]]) -> dict[str, float]:
    """The largest |value| each computed input of a Concat reaches on the calibration part of
    ``samples`` (what INT8's per-tensor scales will be made from)."""
    consts = {i.name for i in model.graph.initializer}
    names = sorted({i for n in model.graph.node if n.op_type == "Concat" for i in n.input if i and i not in consts})
    calib = split_samples(samples)[0]
    if not names or not calib:
        return {}
    acts = activations(model, names, calib)
    return {n: max(float(np.max(np.abs(a[n]), initial=0.0)) for a in acts) for n in names}


def split_samples(samples: list[list[np.ndarray]]) -> tuple[list, list]:
    """(calibration, check): every fifth sample is held out for the check (at least one), so the
    simulator is judged on frames calibration did not see."""
    if len(samples) < 2:
        return samples, samples
    held = set(range(4, len(samples), 5)) or {len(samples) - 1}
    return [s for k, s in enumerate(samples) if k not in held], [s for k, s in enumerate(samples) if k in held]


@dataclass
class Converted:
    """The NPU step's outcome (:func:`convert_groups`)."""

    orders: list[dict]                      # per converted rknn group: its toolkit facts and simulator check
    check: list[list[np.ndarray]]           # the model inputs the simulator was judged on
    held_out: bool                          # ``check`` are held-out calibration frames (else probe inputs)
    failed: dict[str, str]                  # rknn group symbol -> why the toolkit could not convert it

    @property
    def source(self) -> str:
        return (f"{len(self.check)} held-out calibration frame(s)" if self.held_out
                else f"{len(self.check)} probe input(s)")


def convert_groups(model: onnx.ModelProto, groups: list, *, dtype: str, samples: list[list[np.ndarray]] | None,
                   probe_inputs: list[list[np.ndarray]], say, judged: bool = False) -> Converted:
    """Each rknn group (hatch.Group of kind "rknn") -> its .rknn (``g.rknn_blob``), facts
    (``g.rknn``) and the simulator's outputs on the check inputs (``g.simulated``), INT8 calibrated
    on the group's own inputs as the model computes them from ``samples`` (the bundle's
    preprocessing already applied), checked in the toolkit's simulator against onnxruntime on
    held-out samples (or, fp16 without samples, the probe inputs). A group the toolkit cannot
    convert is named in ``failed`` (the caller leaves it on the CPU); one past the tolerance is a
    CompileError: the NPU would run it, and it would be wrong, unless the check inputs are held-out
    real frames on which the model's answers agree (rknn.answers_disagree: top-1 kept, the other
    outputs' cosine), which is what decides there (fp16 too). With ``judged`` (`--max-drop`: the
    caller judges the bundle's answers on real frames) it is said, recorded as ``past``, and kept."""
    from . import toolkit as rknn
    from ...errors import CompileError

    calib, check = split_samples(samples) if samples else ([], probe_inputs)
    done = Converted([], check, bool(samples), {})
    rk = [g for g in groups if g.kind == backends.RKNN]
    if not rk:
        return done
    names = sorted({n for g in rk for n in g.inputs + g.outputs})
    acts_cal = activations(model, names, calib) if dtype == "int8" else []
    acts_chk = activations(model, names, check)
    for g in rk:
        say(f"{g.symbol}: converting {len(g.nodes)} node(s) for the RK3588 NPU ({dtype}) and checking it in the "
            "RKNN simulator")
        try:
            res = rknn.convert(g.onnx_bytes, dtype=dtype, calibration=[[a[n] for n in g.inputs] for a in acts_cal],
                               check=[[a[n] for n in g.inputs] for a in acts_chk], analysis=dtype == "int8")
        except rknn.ConvertFailed as err:
            say(f"{g.symbol}: the RKNN toolkit cannot convert it ({err.why}): it stays on the CPU")
            done.failed[g.symbol] = err.why
            continue
        want = [[a[n] for n in g.outputs] for a in acts_chk]
        agree = rknn.agreement(res["outputs"], want)
        tol = rknn.TOLERANCE[dtype]
        bad = rknn.past(agree, tol)
        worst = sorted((r for r in res.get("report") or [] if r.get("cosine") is not None),
                       key=lambda r: r["cosine"])[:5]
        hurt = "; layers that hurt most: " + ", ".join(f"{r['layer']} ({r['op']}, cosine {r['cosine']:.3f})"
                                                      for r in worst) if worst else ""
        moved = _answers(model, g, res["outputs"], check, dtype) if bad and done.held_out and not judged else None
        if bad and judged:
            say(f"{g.symbol}: past the order's own bound on {done.source} ({'; '.join(bad)}{hurt}): --max-drop "
                "judges it on --validation")
        elif bad and moved == []:
            say(f"{g.symbol}: past the order's own bound on {done.source} ({'; '.join(bad)}), but the model's "
                "answers (top-1, direction of the other outputs) agree with onnxruntime fp32 on them: kept")
        elif bad:
            raise CompileError(f"{g.symbol} on the NPU ({dtype}) does not agree with onnxruntime fp32 on "
                               f"{done.source}: {'; '.join(moved or bad)}{hurt}; nothing was written. "
                               + ("Try --npu-dtype fp16, more calibration frames, or compile without --npu, "
                                  if dtype == "int8" else "Compile without --npu, give --calibration FRAMES (the "
                                  "answers on held-out frames then decide), " if not done.held_out else
                                  "Compile without --npu, ") + rknn.JUDGE_HINT)
        g.rknn_blob = res["blob"]
        g.simulated = res["outputs"]
        g.rknn = {"toolkit_version": res["toolkit_version"], "dtype": dtype, "target_platform": rknn.TARGET_PLATFORM,
                  "tolerance": tol,
                  "check": {"source": done.source, "cosine": [round(c, 6) for c in agree["cosine"]],
                            "max_err": [round(e, 6) for e in agree["max_err"]], "top1": agree["top1"]},
                  **({"past": bad} if bad else {}),
                  **({"answers_agree": True} if bad and moved == [] else {}),
                  "calibration_frames": len(acts_cal),
                  "worst_layers": worst, "seconds": res.get("seconds", {})}
        done.orders.append({"symbol": g.symbol, **g.rknn})
    return done


def _answers(model: onnx.ModelProto, g, simulated: list, check: list[list[np.ndarray]], dtype: str) -> list[str]:
    """How the model's answers on the held-out frames ``check`` move when group ``g`` runs on the NPU
    (its simulator's outputs ``simulated``), against onnxruntime fp32: rknn.answers_disagree."""
    import onnxruntime as ort

    from . import toolkit as rknn

    was, g.simulated = g.simulated, simulated
    try:
        got = simulated_outputs(model, [g], check)
    finally:
        g.simulated = was
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    want = [sess.run(None, dict(zip(inputs, xs))) for xs in check]
    return rknn.answers_disagree(rknn.agreement(got, want), dtype)


def keep_converted(old: list, new: list) -> None:
    """Carry each converted rknn group's results from ``old`` groups to the same nodes in ``new``
    (a second cut, made after a group failed to convert, numbers the groups anew)."""
    def nodes_of(g) -> frozenset:
        return frozenset(o for n in g.nodes for o in n.output)

    by_nodes = {nodes_of(g): g for g in old if g.kind == backends.RKNN and g.rknn_blob}
    for g in new:
        if g.kind == backends.RKNN and (was := by_nodes.get(nodes_of(g))) is not None:
            g.rknn, g.rknn_blob, g.simulated = was.rknn, was.rknn_blob, was.simulated


def simulated_outputs(model: onnx.ModelProto, groups: list, check: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """The model's outputs on ``check`` as the NPU makes them: each rknn group's outputs are the
    simulator's (``g.simulated``, on the same inputs), the rest onnxruntime fp32. Each group was
    simulated on fp32 inputs, so errors of two groups in a row are not compounded here."""
    import onnxruntime as ort

    rk = [g for g in groups if g.kind == backends.RKNN and g.simulated]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    made = {o for g in rk for n in g.nodes for o in n.output}
    kept = [n for n in m.graph.node if not made.intersection(n.output)]
    del m.graph.node[:]
    fed = []
    for g in rk:      # a group's output becomes an input, renamed so that it may also be a graph output
        for o in g.outputs:
            shape, dtype = g.specs[o]
            m.graph.input.append(onnx.helper.make_tensor_value_info(
                f"{o}__npu", onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape))
            fed.append(onnx.helper.make_node("Identity", [f"{o}__npu"], [o]))
    m.graph.node.extend(fed + kept)     # the Identities read only inputs: first keeps the order topological
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    outs = []
    for k, xs in enumerate(check):
        feed = dict(zip(inputs, xs))
        for g in rk:
            feed.update({f"{o}__npu": np.asarray(a, np.dtype(g.specs[o][1])).reshape(g.specs[o][0])
                         for o, a in zip(g.outputs, g.simulated[k])})
        outs.append(sess.run(None, feed))
    return outs


def simulated_runtime(model, samples: list[list[np.ndarray]] | None):
    """The agent's ``executors.rknn_runtime`` on the host: each rknn order's ONNX rendering in the
    toolkit's simulator, INT8 calibrated on the same activations as the compile (``samples``: the
    model inputs the compile had, ``model``: its ONNX model), so a bundle runs here as the NPU
    would run it: `compile --npu --max-drop` and the tests judge it so."""
    from . import toolkit as rknn

    calib = split_samples(samples)[0] if samples else []

    def make(ctx) -> rknn.Simulator:
        names = [i["name"] for i in ctx.order["inputs"]]
        dtype = (ctx.order.get("rknn") or {}).get("dtype", "fp16")
        acts = activations(model, names, calib) if dtype == "int8" else []
        return rknn.Simulator(ctx.bundle.read(ctx.part["onnx"]), dtype, [[a[n] for n in names] for a in acts])

    return make
