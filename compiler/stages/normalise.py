"""ONNX-level normalisation: the named steps that turn a file from the wild into what TVM imports.

Each step takes the model and the context (pins, notes) and changes the model in place; it
appends a note for the manifest when it changed something and raises CompileError (one line,
exit 2) when the model cannot be made importable. ``STEPS`` runs in this order:

    sort_nodes                  nodes in topological order, stable (fp16 converters append their
                                input Casts last; frontend runs it before onnx's checker too)
    ir3_weights_not_inputs      IR-3 files whose initializers are not graph inputs (old Caffe/Chainer
                                conversions; onnx's checker refuses them, onnxruntime runs them)
                                read as IR 4 (frontend runs it before the checker too)
    drop_trailing_empty_inputs  optional inputs left empty ("") at the end of a node's inputs
                                dropped (onnxruntime's Squeeze fails on an empty axes)
    upgrade_old_opset           opsets < 7 have ops no onnxruntime runs (AveragePool-1,
                                BatchNormalization-6, Gemm-6), and ops in old attribute forms
                                TVM's importer misreads (Slice-1, Upsample, Resize-10:
                                ATTRIBUTE_FORMS): onnx's version converter to 13 (first: it
                                needs IR 3's weights still listed as inputs)
    initializers_out_of_inputs  IR-3/IR-4 files list every weight as a graph input too
                                (onnx-simplifier and onnxruntime treat them as constants)
    constants_to_initializers   weights as Constant nodes (paddle2onnx) -> initializers, so that
                                folding and the patterns see constants
    refuse_training_only_ops    BatchNormalization in training mode refused (export in eval mode)
    drop_identity               Identity / inference Dropout removed (consumers rewired)
    tidy_resize_inputs          Resize with both scales and sizes (one empty: tf2onnx, keras):
                                the empty one dropped where the opset makes it optional (13 on;
                                only sizes in 11-12); a scale no output size expresses refused
    pin_inputs                  dynamic dims pinned, static dims overwritten by --input (onnxsim's
                                --overwrite-input-shape); stale output shapes cleared
    drop_stale_value_info       converters' value_info and output shapes dropped, shapes inferred
                                again (strict: a pinned shape that breaks the graph is refused)
    decompose_depth_space       DepthToSpace/SpaceToDepth as Reshape-Transpose-Reshape (both modes)
    conv_transpose_output_shape ConvTranspose's output_shape as pads + output_padding (the spec's
                                formula; TVM's importer ignores output_shape)
    fp16_to_fp32                fp16 weights and Cast islands computed in fp32 (ACL orders are
                                fp32); the outputs' drift from the fp16 model measured, recorded
    fold_with_onnxruntime       onnxruntime's basic level: shape chains, Conv+BN, Pad+Conv folded

Every step leaves a model valid for its own opset (onnx's full check, onnxruntime runs it:
tests/compiler/test_normalise.py). When onnxruntime refuses the result but runs the file as
shipped, the steps are replayed to find the one that broke it (StepBrokeModel, exit 3).

onnxruntime's quantization pre-processing (``quant_pre_process``) does the same three things
first (symbolic shape inference, its optimiser, value_info refreshed); onnx-simplifier adds
constant folding of arbitrary subgraphs, which the onnxruntime step covers for shape arithmetic.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import CompileError

MIN_OPSET = 7           # the oldest default-domain opset onnxruntime runs every op of
UPGRADE_TO = 13


@dataclass
class Context:
    path: Path
    pins: dict[str, list[int]]
    notes: list[str] = field(default_factory=list)
    overwritten: bool = False      # --input replaced a static dim: shape inference must then hold
    fp16: dict | None = None       # what fp16_to_fp32 converted, and how far the outputs moved


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[onnx.ModelProto, Context], None]
    doc: str


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in model.graph.initializer}


def opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def dims_of(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in vi.type.tensor_type.shape.dim]


def _fmt(dims) -> str:
    return "x".join(str(d) for d in dims)


# --- the steps ----------------------------------------------------------------------------------

def sort_nodes(model: onnx.ModelProto, ctx: Context) -> None:
    """Nodes in topological order, stable (of the nodes ready, the earliest in the file first, so a
    sorted graph keeps its order): onnx's checker, onnxruntime and TVM's importer need it, and
    fp16 converters append the Casts of the graph inputs after every node."""
    g = model.graph
    nodes = list(g.node)
    made = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    needs = [{made[name] for name in reads(n) if name in made and made[name] != i}
             for i, n in enumerate(nodes)]
    users: dict[int, list[int]] = {}
    for i, deps in enumerate(needs):
        for d in deps:
            users.setdefault(d, []).append(i)
    waiting = [len(d) for d in needs]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(nodes):     # a cycle: left as it is, for onnx's checker to name
        return
    early = sum(1 for i, deps in enumerate(needs) if any(d > i for d in deps))
    if early:
        del g.node[:]
        g.node.extend(nodes[i] for i in order)
        ctx.notes.append(f"{early} node(s) read a tensor made later in the file (fp16 converters append their "
                         "input Casts last); nodes sorted topologically")


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


def ir3_weights_not_inputs(model: onnx.ModelProto, ctx: Context) -> None:
    """IR 3 requires every initializer to be listed as a graph input too; old Caffe/Chainer
    conversions list none, onnx's checker refuses them ("X in initializer but not in graph
    input"), and onnxruntime treats them as constants, as IR 4 on says: the file is marked IR 4,
    which is what it means (frontend runs this before onnx's checker)."""
    if model.ir_version >= 4:
        return
    listed = {i.name for i in model.graph.input}
    n = sum(1 for t in model.graph.initializer if t.name not in listed)
    if n:
        model.ir_version = 4
        ctx.notes.append(f"{n} initializer(s) of an IR-3 file are not listed as graph inputs (IR 3 requires it; "
                         "onnxruntime reads them as constants): the file is read as IR 4")


def initializers_out_of_inputs(model: onnx.ModelProto, ctx: Context) -> None:
    inits = _inits(model)
    keep = [i for i in model.graph.input if i.name not in inits]
    n = len(model.graph.input) - len(keep)
    if n:
        del model.graph.input[:]
        model.graph.input.extend(keep)
        model.ir_version = max(model.ir_version, 4)     # IR 3 required them as inputs; IR 4 does not
        ctx.notes.append(f"{n} initializer(s) were also listed as graph inputs (IR {model.ir_version}); "
                         "treated as constants")


# Ops whose attributes became inputs (or that were replaced) at the opset given, of which TVM
# 0.27's importer reads only the newer form, and picks it for an older model too: its Slice has
# only _impl_v13, which reads starts/ends from inputs an opset-9 Slice does not have ("Cannot
# cast NoneType to list of Expr"); its Upsample only _impl_v9 (scales an input) and its Resize
# only _impl_v18 (which reads Resize-10's scales as roi). A model below the opset for one of its
# ops is upgraded. (Its Pad-2, Clip-6, Split-2, Squeeze/Unsqueeze-1, ReduceX and TopK-1
# converters read the attribute forms: tests/compiler/test_old_forms.py.)
ATTRIBUTE_FORMS: dict[str, int] = {
    "Slice": 10,        # starts/ends/axes attributes -> inputs (steps added)
    "Upsample": 10,     # scales an attribute before 9; deprecated for Resize at 10
    "Resize": 11,       # Resize-10 has no roi input: scales is its second
}


def old_forms(model: onnx.ModelProto) -> list[str]:
    """The ops of ``model`` written in an attribute form older than ATTRIBUTE_FORMS' opset."""
    v = opset(model)
    return sorted({n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")
                   and v < ATTRIBUTE_FORMS.get(n.op_type, 0)})


def drop_trailing_empty_inputs(model: onnx.ModelProto, ctx: Context) -> None:
    """Optional inputs left empty ("") at the end of a node's inputs removed: the spec reads both
    the same, but onnxruntime's Squeeze/Unsqueeze kernels fail on an empty axes ("Axes input is
    null") and converters treat the two forms differently."""
    n = 0
    for node in model.graph.node:
        k = len(node.input)
        while node.input and not node.input[-1]:
            del node.input[-1]
        n += k != len(node.input)
    if n:
        ctx.notes.append(f"{n} node(s) ended in empty optional inputs; dropped")


def upgrade_old_opset(model: onnx.ModelProto, ctx: Context) -> None:
    """Opsets < 7 (ops no onnxruntime runs) and models with an op in an old attribute form
    (ATTRIBUTE_FORMS) upgraded to UPGRADE_TO by onnx's version converter."""
    if opset(model) < MIN_OPSET:
        ctx.notes.append(upgrade_opset(model, UPGRADE_TO, ctx.path.name,
                                       f"is older than any onnxruntime runs; re-export the model with opset >= {MIN_OPSET}"))
        return
    ops = old_forms(model)
    if ops:
        try:
            ctx.notes.append(upgrade_opset(model, UPGRADE_TO, ctx.path.name, "could not be upgraded")
                             + f" (old attribute forms of {', '.join(ops)})")
        except CompileError as err:     # onnxruntime runs it as it is: TVM's import names the op if it must
            ctx.notes.append(f"old attribute forms of {', '.join(ops)} left as they are: {err}")


def upgrade_opset(model: onnx.ModelProto, to: int, name: str, why: str) -> str:
    """Upgrade ``model`` in place to opset ``to`` with onnx's version converter (CompileError
    naming ``why`` when it cannot); the note to show. Callers check that it is older."""
    from onnx import version_converter

    v = opset(model)
    _prelu6_slopes_per_channel(model)
    try:
        up = version_converter.convert_version(model, to)
    except Exception as err:
        raise CompileError(f"{name}: opset {v} {why} (onnx's version converter could not upgrade it: "
                           f"{one_line(err)})") from None
    model.CopyFrom(up)
    if v < 11:
        _resize10_semantics(model)
    return f"opset {v} upgraded to {to} with onnx's version converter"


def _resize10_semantics(model: onnx.ModelProto) -> None:
    """Upsample and Resize-10 map output to input pixels asymmetrically (x_in = x_out / scale) and
    round nearest neighbours down; Resize-11's defaults are half_pixel and round_prefer_floor. onnx's
    version converter writes Resize-11 without saying so (a linear x2 moved by up to 0.96): say it."""
    for node in model.graph.node:
        if node.op_type != "Resize" or any(a.name == "coordinate_transformation_mode" for a in node.attribute):
            continue
        node.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
        if not any(a.name == "nearest_mode" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("nearest_mode", "floor"))


def _prelu6_slopes_per_channel(model: onnx.ModelProto) -> None:
    """PRelu before opset 7 applies a 1-D slope of C values per channel (axis 1); from opset 7 on,
    slopes broadcast from the right. The version converter does not adapt them: reshape such a
    slope to [C, 1, ...] so that it keeps its meaning."""
    inits = _inits(model)
    try:
        ranks = {vi.name: len(vi.type.tensor_type.shape.dim)
                 for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    except Exception:
        ranks = {}
    ranks.update({vi.name: len(vi.type.tensor_type.shape.dim) for vi in model.graph.input})
    for node in model.graph.node:
        if node.op_type != "PRelu" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        t = inits[node.input[1]]
        rank = ranks.get(node.input[0], 0)
        if len(t.dims) == 1 and t.dims[0] > 1 and rank > 2:
            shape = [t.dims[0]] + [1] * (rank - 2)
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).reshape(shape), t.name))
            for vi in model.graph.input:      # IR 3 lists it as an input too, with its old shape
                if vi.name == t.name:
                    vi.type.tensor_type.shape.ClearField("dim")
                    for d in shape:
                        vi.type.tensor_type.shape.dim.add().dim_value = d


def refuse_training_only_ops(model: onnx.ModelProto, ctx: Context) -> None:
    """BatchNormalization in training mode (batch statistics, updated running means) is not
    inference; nor is a Dropout whose mask is used."""
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type == "BatchNormalization" and "training_mode" in attrs and attrs["training_mode"].i:
            raise CompileError(f"{ctx.path.name}: BatchNormalization node '{node.name or node.output[0]}' is in "
                               "training mode; export the model in inference (eval) mode")


def decompose_depth_space(model: onnx.ModelProto, ctx: Context) -> None:
    """DepthToSpace / SpaceToDepth as Reshape -> Transpose -> Reshape, exactly as the ONNX spec
    defines them (TVM's importer ignores SpaceToDepth's newer CRD mode)."""
    shapes = _shapes(model)
    new_nodes, n = [], 0
    for node in model.graph.node:
        if node.op_type not in ("DepthToSpace", "SpaceToDepth") or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        dims = shapes.get(node.input[0])
        if not dims or len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in dims):
            new_nodes.append(node)
            continue
        attrs = {a.name: a for a in node.attribute}
        bs = attrs["blocksize"].i
        mode = attrs["mode"].s.decode() if "mode" in attrs else "DCR"
        b, c, h, w = dims
        if node.op_type == "DepthToSpace":
            first = [b, bs, bs, c // bs ** 2, h, w] if mode == "DCR" else [b, c // bs ** 2, bs, bs, h, w]
            perm = [0, 3, 4, 1, 5, 2] if mode == "DCR" else [0, 1, 4, 2, 5, 3]
            final = [b, c // bs ** 2, h * bs, w * bs]
        else:
            first = [b, c, h // bs, bs, w // bs, bs]
            perm = [0, 3, 5, 1, 2, 4] if mode == "DCR" else [0, 1, 3, 5, 2, 4]
            final = [b, c * bs ** 2, h // bs, w // bs]
        base = (node.name or node.output[0]).replace("/", "_")
        s1, s2 = f"{base}__shape6", f"{base}__shape4"
        model.graph.initializer.extend([numpy_helper.from_array(np.array(first, np.int64), s1),
                                        numpy_helper.from_array(np.array(final, np.int64), s2)])
        new_nodes += [onnx.helper.make_node("Reshape", [node.input[0], s1], [f"{base}__r6"]),
                      onnx.helper.make_node("Transpose", [f"{base}__r6"], [f"{base}__t6"], perm=perm),
                      onnx.helper.make_node("Reshape", [f"{base}__t6", s2], [node.output[0]])]
        n += 1
    if n:
        del model.graph.node[:]
        model.graph.node.extend(new_nodes)
        ctx.notes.append(f"{n} DepthToSpace/SpaceToDepth node(s) written as Reshape-Transpose-Reshape")


def conv_transpose_output_shape(model: onnx.ModelProto, ctx: Context) -> None:
    """ConvTranspose with an output_shape attribute -> the pads and output_padding that give that
    shape (the ONNX spec's formula); TVM's importer ignores output_shape."""
    shapes, inits = _shapes(model), _inits(model)
    for node in model.graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type != "ConvTranspose" or "output_shape" not in attrs:
            continue
        dims = shapes.get(node.input[0])
        wdims = list(inits[node.input[1]].dims) if node.input[1] in inits else shapes.get(node.input[1])
        if not dims or not wdims or not all(isinstance(d, int) for d in list(dims[2:]) + list(wdims[2:])):
            continue
        out = list(attrs["output_shape"].ints)[-len(dims[2:]):]
        k = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else list(wdims[2:])
        nd = len(k)
        st = list(attrs["strides"].ints) if "strides" in attrs else [1] * nd
        dil = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * nd
        op = list(attrs["output_padding"].ints) if "output_padding" in attrs else [0] * nd
        upper = "auto_pad" in attrs and attrs["auto_pad"].s == b"SAME_UPPER"
        begin, end, extra = [], [], []
        for i in range(nd):
            total = st[i] * (dims[2 + i] - 1) + op[i] + ((k[i] - 1) * dil[i] + 1) - out[i]
            if total < 0:           # a larger output than the kernel covers: output padding
                begin.append(0), end.append(0), extra.append(op[i] - total)
                continue
            lo, hi = (total // 2, total - total // 2) if upper else (total - total // 2, total // 2)
            begin.append(lo), end.append(hi), extra.append(op[i])
        for name in ("output_shape", "auto_pad", "pads", "output_padding"):
            if name in attrs:
                node.attribute.remove(attrs[name])
        node.attribute.extend([onnx.helper.make_attribute("pads", begin + end),
                               onnx.helper.make_attribute("output_padding", extra)])
        ctx.notes.append(f"ConvTranspose '{node.name or node.output[0]}': output_shape {out} as pads {begin + end}")


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    try:
        m = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:
        m = model
    return {vi.name: dims_of(vi) for vi in list(m.graph.value_info) + list(m.graph.input) + list(m.graph.output)}


def constants_to_initializers(model: onnx.ModelProto, ctx: Context) -> None:
    g = model.graph
    keep, n = [], 0
    for node in g.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            attr = {a.name: a for a in node.attribute}
            t = None
            if "value" in attr:
                t = onnx.TensorProto()
                t.CopyFrom(attr["value"].t)
            elif "value_float" in attr:
                t = numpy_helper.from_array(np.array(attr["value_float"].f, np.float32))
            elif "value_floats" in attr:
                t = numpy_helper.from_array(np.array(list(attr["value_floats"].floats), np.float32))
            elif "value_int" in attr:
                t = numpy_helper.from_array(np.array(attr["value_int"].i, np.int64))
            elif "value_ints" in attr:
                t = numpy_helper.from_array(np.array(list(attr["value_ints"].ints), np.int64))
            if t is not None:
                t.name = node.output[0]
                g.initializer.append(t)
                n += 1
                continue
        keep.append(node)
    if n:
        del g.node[:]
        g.node.extend(keep)
        ctx.notes.append(f"{n} Constant node(s) turned into initializers")


def drop_identity(model: onnx.ModelProto, ctx: Context) -> None:
    g = model.graph
    outputs = {o.name for o in g.output}
    rename: dict[str, str] = {}
    keep, n = [], 0
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Identity", "Dropout"):
            keep.append(node)
            continue
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
            keep.append(node)           # its mask is used: not an inference Dropout
            continue
        src = rename.get(node.input[0], node.input[0])
        if node.output[0] in outputs:   # a graph output keeps its name: an Identity makes it
            keep.append(onnx.helper.make_node("Identity", [src], [node.output[0]], name=node.name))
        else:
            rename[node.output[0]] = src
        n += 1
    if not n:
        return
    for node in keep:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del g.node[:]
    g.node.extend(keep)
    ctx.notes.append(f"{n} Identity/Dropout node(s) removed")


def tidy_resize_inputs(model: onnx.ModelProto, ctx: Context) -> None:
    """Resize with both scales and sizes, one of them empty (tf2onnx, keras): the empty one left
    out, as far as the model's opset allows. From opset 13 roi, scales and sizes are all optional
    (""); opsets 11-12 require roi and scales (an empty scales when sizes are given), so there only
    an empty sizes goes, and TVM's importer is told that an empty constant means none
    (compiler/stages/importer.py)."""
    inits = _inits(model)

    def empty(name: str) -> bool:
        return bool(name) and name in inits and int(np.prod(inits[name].dims)) == 0

    optional = (1, 2, 3) if opset(model) >= 13 else (3,)
    n = 0
    for node in model.graph.node:
        if node.op_type != "Resize" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
            continue
        both = len(node.input) > 3 and node.input[2] and node.input[3]
        dropped = [k for k in optional if k < len(node.input) and empty(node.input[k])]
        for k in dropped:
            node.input[k] = ""
        while node.input and not node.input[-1]:
            del node.input[-1]
        n += bool(both and set(dropped) & {2, 3})
    if n:
        ctx.notes.append(f"{n} Resize node(s) carried both scales and sizes; the empty one was dropped")
    _drop_unused_initializers(model)


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in reads(node)} | {o.name for o in model.graph.output}
    keep = [i for i in model.graph.initializer if i.name in used]
    if len(keep) < len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)


def _check_resize_scales(model: onnx.ModelProto, ctx: Context) -> None:
    """After shapes are known: a scale whose output size gives another ratio is computed wrongly by
    TVM and ACL (both resize by the size ratio): refuse it instead of shipping wrong numbers."""
    inits = _inits(model)
    shapes = {vi.name: dims_of(vi) for vi in list(model.graph.value_info) + list(model.graph.input)}
    for node in model.graph.node:
        if node.op_type != "Resize" or len(node.input) < 3 or not node.input[2] or node.input[2] not in inits:
            continue
        if len(node.input) > 3 and node.input[3]:
            continue
        scales = numpy_helper.to_array(inits[node.input[2]]).astype(np.float64).reshape(-1)
        dims = shapes.get(node.input[0])
        if not dims or len(dims) != len(scales) or not all(isinstance(d, int) and d > 0 for d in dims):
            continue
        for d, s in zip(dims, scales):
            out = int(np.floor(d * s))
            if out and abs(out / d - s) > 1e-6:
                mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "nearest")
                if mode == "nearest" and s >= 1 and float(s).is_integer():
                    continue
                raise CompileError(
                    f"{ctx.path.name}: Resize node '{node.name or node.output[0]}' scales {d} pixels by {s:g}: the "
                    f"output has {out}, a ratio of {out / d:g}, and TVM and ACL resize by that ratio, so the "
                    f"result would differ from the model's; export the model with Resize sizes (or scales that "
                    f"divide the input evenly)")


def pin_inputs(model: onnx.ModelProto, ctx: Context) -> None:
    inputs = [i for i in model.graph.input if i.name not in _inits(model)]
    names = [i.name for i in inputs]
    for name in ctx.pins:
        if name not in names:
            raise CompileError(f"--input {name}: the model has no input named '{name}'; its inputs are: {', '.join(names)}")
    for vi in inputs:
        dims = dims_of(vi)
        if vi.name in ctx.pins:
            want = ctx.pins[vi.name]
            if len(want) != len(dims):
                raise CompileError(f"--input {vi.name}: rank {len(want)} given but the model's input has rank "
                                   f"{len(dims)} ({_fmt(dims)})")
            if any(isinstance(h, int) and h > 0 and h != w for h, w in zip(dims, want)):
                ctx.notes.append(f"input '{vi.name}': static shape {_fmt(dims)} overwritten with {_fmt(want)} (--input)")
                ctx.overwritten = True
            dims = want
        bad = [i for i, d in enumerate(dims) if not isinstance(d, int) or d <= 0]
        if bad:
            raise CompileError(
                f"input '{vi.name}' has dynamic dims {_fmt(dims)}; pin them with --input {vi.name}="
                + "x".join(str(d) if isinstance(d, int) and d > 0 else ("1" if i == 0 else "N") for i, d in enumerate(dims)))
        tt = vi.type.tensor_type
        tt.shape.ClearField("dim")
        for d in dims:
            tt.shape.dim.add().dim_value = int(d)


def drop_stale_value_info(model: onnx.ModelProto, ctx: Context) -> None:
    n = len(model.graph.value_info)
    del model.graph.value_info[:]
    for o in model.graph.output:  # converters' output shapes can be as stale as their value_info
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    strict = ctx.overwritten
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=strict, data_prop=True)
    except Exception as err:
        if strict:
            raise CompileError(f"{ctx.path.name}: the input shape given with --input does not fit the model "
                               f"({one_line(err)}); give the shape the model was built for, or one its "
                               "reshapes accept") from None
        ctx.notes.append(f"ONNX shape inference failed: {one_line(err)}")
        return
    model.CopyFrom(inferred)
    if n:
        ctx.notes.append(f"{n} value_info entr{'y' if n == 1 else 'ies'} from the exporter dropped; shapes re-inferred")
    _check_resize_scales(model, ctx)


def fold_with_onnxruntime(model: onnx.ModelProto, ctx: Context) -> None:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "folded.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(out)
        so.log_severity_level = 3
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            folded = onnx.load(str(out))
        except Exception as err:
            _blame(ctx, "fold_with_onnxruntime", err)
            ctx.notes.append(f"onnxruntime could not pre-fold the graph ({one_line(err)[:400]}); importing it as is")
            return
    model.CopyFrom(folded)


F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


def fp16_to_fp32(model: onnx.ModelProto, ctx: Context) -> None:
    """fp16 weights and Cast islands (onnxconverter-common's float16 converter, keep_io_types)
    computed in fp32: ACL orders are fp32, and neither TVM's generic ARMv8-A target (no FP16
    arithmetic before ARMv8.2) nor x86 computes fp16 faster than fp32, only rounded more (four
    32-channel 3x3 convs on 64x64, TVM 0.27 llvm on this x86 host: 2906 ms in fp16, 72.5 ms in
    fp32, 2.1e-2 apart; onnxruntime's CPU kernels run such Convs in fp32 too). Casts
    to or from fp16 become no-ops; how far the outputs move from the fp16 model's is measured on
    the probe inputs and recorded (``ctx.fp16``: the manifest's ``fp16``)."""
    g = model.graph
    types = _elem_types(model)
    source = onnx.ModelProto()
    source.CopyFrom(model)
    weights = 0
    for t in g.initializer:
        if t.data_type == F16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
            weights += 1
    casts, nodes = 0, []
    for node in g.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and (to == F16 or (to == F32 and types.get(node.input[0]) == F16)):
            if types.get(node.input[0]) in (F16, F32):   # float to float: nothing left to do
                nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            else:   # a uint8 camera input (or any integer) cast to fp16 still needs its Cast, to fp32
                nodes.append(onnx.helper.make_node("Cast", [node.input[0]], [node.output[0]], name=node.name, to=F32))
            casts += 1
            continue
        for a in node.attribute:    # ConstantOfShape's value, EyeLike's and the Random ops' dtype
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
            elif a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == F16:
                a.i = F32
        nodes.append(node)
    io = [vi for vi in list(g.input) + list(g.output) + list(g.value_info) if vi.type.tensor_type.elem_type == F16]
    if not (weights or casts or io):
        return
    for vi in io:
        vi.type.tensor_type.elem_type = F32
    del g.node[:]
    g.node.extend(nodes)
    drop_identity(model, Context(ctx.path, {}))     # its note would count the Casts as Identities
    abs_err, rel_err = _drift(source, model, ctx)
    fp16_io = sorted(vi.name for vi in io if vi.name in _io_names(source))
    ctx.fp16 = {"weights": weights, "casts": casts, "fp16_io": fp16_io, "computed_in": "float32",
                "max_abs_vs_fp16": abs_err, "max_rel_vs_fp16": rel_err}
    ctx.notes.append(f"fp16 parts computed in fp32 ({weights} fp16 weight(s), {casts} Cast(s) to or from fp16 "
                     "made no-ops" + (f"; fp16 inputs/outputs {', '.join(fp16_io)} are fp32 in the bundle"
                                      if fp16_io else "")
                     + "): ACL orders are fp32; " + (
                         f"the outputs differ from the fp16 model's by at most {abs_err:.2g} (relative "
                         f"{rel_err:.2g}) on the probe inputs" if abs_err is not None else
                         "how far the outputs moved was not measured (the probe inputs do not fit its inputs)")
                     + ", and the golden pairs are the fp32 model's")


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    try:
        m = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:
        m = model
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(m.graph.value_info) + list(m.graph.input)
             + list(m.graph.output)}
    types.update({t.name: t.data_type for t in m.graph.initializer})
    return types


def _io_names(model: onnx.ModelProto) -> set[str]:
    return {vi.name for vi in list(model.graph.input) + list(model.graph.output)}


def _drift(source: onnx.ModelProto, model: onnx.ModelProto, ctx: Context) -> tuple[float | None, float | None]:
    """Max abs and relative (|d| / (|want| + 1e-3), as verify's) difference of ``model``'s outputs
    from ``source``'s, in onnxruntime on the probe inputs (seed 1, as the first golden pair); None
    when the probe inputs are not inputs the model can run on (token ids, say)."""
    from tandoor_contract import probe

    inits = {i.name for i in model.graph.initializer}
    ins = [vi for vi in source.graph.input if vi.name not in inits]
    dtypes = [onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type) for vi in ins]
    specs = [{"name": vi.name, "shape": dims_of(vi), "dtype": np.dtype(dt).name if dt in (np.int8, np.uint8)
              else "float32"} for vi, dt in zip(ins, dtypes)]
    probes = probe.inputs({"inputs": specs}, seed=1)
    new_types = {vi.name: onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type) for vi in model.graph.input}
    runs = []
    for m, types in ((model, [new_types[vi.name] for vi in ins]), (source, dtypes)):
        sess = _session(m, ctx, "fp16_to_fp32")
        try:
            runs.append(sess.run(None, {vi.name: a.astype(t) for vi, a, t in zip(ins, probes, types)}))
        except Exception:
            return None, None
    got, want = runs
    diffs = [np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)) for g, w in zip(got, want)]
    abs_err = max((float(d.max(initial=0.0)) for d in diffs), default=0.0)
    rel_err = max((float((d / (np.abs(np.asarray(w, np.float64)) + 1e-3)).max(initial=0.0))
                   for d, w in zip(diffs, want)), default=0.0)
    return float(f"{abs_err:.3g}"), float(f"{rel_err:.3g}")


def _session(model: onnx.ModelProto, ctx: Context, step: str):
    """An onnxruntime session of ``model`` as step ``step`` left it (a refusal: blamed on the step
    when onnxruntime runs the file as shipped, else the file's)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as err:
        _blame(ctx, step, err)
        raise CompileError(f"{ctx.path.name}: onnxruntime {ort.__version__} cannot run this model "
                           f"({one_line(err)[:400]}); export the model with ops and opsets onnxruntime runs") from None


class StepBrokeModel(Exception):
    """A normalisation step turned a file onnxruntime runs into one it refuses: Tandoor's bug
    (an internal error, exit 3, naming the step), not the exporter's."""


def loads(model: onnx.ModelProto | Path) -> str | None:
    """None when onnxruntime makes a session of ``model``, else why not (one line)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(model) if isinstance(model, Path) else model.SerializeToString(), so,
                             providers=["CPUExecutionProvider"])
    except Exception as err:
        return one_line(err)
    return None


def _blame(ctx: Context, failing: str, err: Exception) -> None:
    """onnxruntime refused the model as step ``failing`` left it. When it runs the file as shipped,
    replay the steps from the file, trying each one's result, and raise StepBrokeModel naming the
    first one after which it refuses; otherwise return (the file's own problem)."""
    import onnxruntime as ort

    if loads(ctx.path) is not None:
        return
    model, replay = onnx.load(str(ctx.path)), Context(ctx.path, dict(ctx.pins))
    culprit, why = failing, one_line(err)
    for step in STEPS:
        if step.name == failing:
            break
        try:
            _run_step(step, model, replay)
        except CompileError:
            return
        problem = loads(model)
        if problem is not None:
            culprit, why = step.name, problem
            break
    raise StepBrokeModel(f"normalisation step {culprit} turned {ctx.path.name}, which onnxruntime "
                         f"{ort.__version__} runs as shipped, into a model it refuses ({why[:400]})") from err


def one_line(err: Exception) -> str:
    """The whole message on one line: onnx's checker spreads one sentence over several."""
    return " ".join(str(err).split()) or type(err).__name__


STEPS: list[Step] = [
    Step("sort_nodes", sort_nodes, "nodes in topological order (stable)"),
    Step("ir3_weights_not_inputs", ir3_weights_not_inputs, "IR-3 initializers not listed as inputs: read as IR 4"),
    Step("drop_trailing_empty_inputs", drop_trailing_empty_inputs, "trailing empty optional inputs dropped"),
    Step("upgrade_old_opset", upgrade_old_opset,
         f"opset < {MIN_OPSET} or old attribute forms upgraded to {UPGRADE_TO}"),
    Step("initializers_out_of_inputs", initializers_out_of_inputs, "weights listed as graph inputs are constants"),
    Step("constants_to_initializers", constants_to_initializers, "Constant nodes become initializers"),
    Step("refuse_training_only_ops", refuse_training_only_ops, "training-mode BatchNormalization refused"),
    Step("drop_identity", drop_identity, "Identity and inference Dropout removed"),
    Step("tidy_resize_inputs", tidy_resize_inputs, "Resize keeps one of scales/sizes"),
    Step("pin_inputs", pin_inputs, "dynamic dims pinned, static ones overwritten by --input"),
    Step("drop_stale_value_info", drop_stale_value_info, "exporter shapes dropped, shapes inferred again"),
    Step("decompose_depth_space", decompose_depth_space, "DepthToSpace/SpaceToDepth as reshapes and a transpose"),
    Step("conv_transpose_output_shape", conv_transpose_output_shape, "ConvTranspose output_shape as pads"),
    Step("fp16_to_fp32", fp16_to_fp32, "fp16 weights and Cast islands computed in fp32"),
    Step("fold_with_onnxruntime", fold_with_onnxruntime, "onnxruntime's basic-level folding"),
]


# run by frontend before onnx's checker, which refuses what they fix (and again as steps, a no-op then)
BEFORE_CHECK: tuple[Callable[[onnx.ModelProto, Context], None], ...] = (sort_nodes, ir3_weights_not_inputs)


def normalise(model: onnx.ModelProto, ctx: Context, *, until: str | None = None) -> onnx.ModelProto:
    """Run the steps in order (all of them, or up to and including ``until``)."""
    for step in STEPS:
        _run_step(step, model, ctx)
        if step.name == until:
            break
    return model


def _run_step(step: Step, model: onnx.ModelProto, ctx: Context) -> None:
    """``step`` on ``model``; TANDOOR_FAILPOINT=normalise:<step> makes it write a model onnxruntime
    refuses (tests of the blame)."""
    step.run(model, ctx)
    if os.environ.get("TANDOOR_FAILPOINT") == f"normalise:{step.name}":
        model.graph.node[0].op_type = "NoSuchOp"

