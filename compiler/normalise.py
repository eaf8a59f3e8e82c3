"""ONNX-level normalisation: the named steps that turn a file from the wild into what TVM imports.

Each step takes the model and the context (pins, notes) and changes the model in place; it
appends a note for the manifest when it changed something and raises CompileError (one line,
exit 2) when the model cannot be made importable. ``STEPS`` runs in this order:

    upgrade_old_opset           opsets < 7 have ops no onnxruntime runs (AveragePool-1,
                                BatchNormalization-6, Gemm-6): onnx's version converter to 13
                                (first: it needs IR 3's weights still listed as inputs)
    initializers_out_of_inputs  IR-3/IR-4 files list every weight as a graph input too
                                (onnx-simplifier and onnxruntime treat them as constants)
    constants_to_initializers   weights as Constant nodes (paddle2onnx) -> initializers, so that
                                folding and the patterns see constants
    refuse_training_only_ops    BatchNormalization in training mode refused (export in eval mode)
    drop_identity               Identity / inference Dropout removed (consumers rewired)
    tidy_resize_inputs          Resize with both scales and sizes (one empty: tf2onnx, keras):
                                the empty one dropped; a scale that no output size expresses refused
    pin_inputs                  dynamic dims pinned, static dims overwritten by --input (onnxsim's
                                --overwrite-input-shape); stale output shapes cleared
    drop_stale_value_info       converters' value_info and output shapes dropped, shapes inferred
                                again (strict: a pinned shape that breaks the graph is refused)
    decompose_depth_space       DepthToSpace/SpaceToDepth as Reshape-Transpose-Reshape (both modes)
    conv_transpose_output_shape ConvTranspose's output_shape as pads + output_padding (the spec's
                                formula; TVM's importer ignores output_shape)
    fold_with_onnxruntime       onnxruntime's basic level: shape chains, Conv+BN, Pad+Conv folded

onnxruntime's quantization pre-processing (``quant_pre_process``) does the same three things
first (symbolic shape inference, its optimiser, value_info refreshed); onnx-simplifier adds
constant folding of arbitrary subgraphs, which the onnxruntime step covers for shape arithmetic.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import CompileError

MIN_OPSET = 7           # the oldest default-domain opset onnxruntime runs every op of
UPGRADE_TO = 13


@dataclass
class Context:
    path: Path
    pins: dict[str, list[int]]
    notes: list[str] = field(default_factory=list)
    overwritten: bool = False      # --input replaced a static dim: shape inference must then hold


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


def upgrade_old_opset(model: onnx.ModelProto, ctx: Context) -> None:
    if opset(model) < MIN_OPSET:
        ctx.notes.append(upgrade_opset(model, UPGRADE_TO, ctx.path.name,
                                       f"is older than any onnxruntime runs; re-export the model with opset >= {MIN_OPSET}"))


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
                           f"{_first_line(err)})") from None
    model.CopyFrom(up)
    return f"opset {v} upgraded to {to} with onnx's version converter"


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
    inits = _inits(model)

    def empty(name: str) -> bool:
        return not name or (name in inits and int(np.prod(inits[name].dims)) == 0)

    n = 0
    for node in model.graph.node:
        if node.op_type != "Resize" or len(node.input) < 4:
            continue
        scales, sizes = node.input[2], node.input[3]
        if not empty(sizes) and scales and empty(scales):
            node.input[2] = ""
            n += 1
        elif empty(sizes) and not empty(scales):
            del node.input[3]
            n += 1
        if len(node.input) > 1 and node.input[1] and empty(node.input[1]):
            node.input[1] = ""
    if n:
        ctx.notes.append(f"{n} Resize node(s) carried both scales and sizes; the empty one was dropped")


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
                               f"({_first_line(err)}); give the shape the model was built for, or one its "
                               "reshapes accept") from None
        ctx.notes.append(f"ONNX shape inference failed: {_first_line(err)}")
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
            ctx.notes.append(f"onnxruntime could not pre-fold the graph ({_first_line(err)[:160]}); importing it as is")
            return
    model.CopyFrom(folded)


def _first_line(err: Exception) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[0][:240] if lines else type(err).__name__


STEPS: list[Step] = [
    Step("upgrade_old_opset", upgrade_old_opset, f"opset < {MIN_OPSET} upgraded to {UPGRADE_TO}"),
    Step("initializers_out_of_inputs", initializers_out_of_inputs, "weights listed as graph inputs are constants"),
    Step("constants_to_initializers", constants_to_initializers, "Constant nodes become initializers"),
    Step("refuse_training_only_ops", refuse_training_only_ops, "training-mode BatchNormalization refused"),
    Step("drop_identity", drop_identity, "Identity and inference Dropout removed"),
    Step("tidy_resize_inputs", tidy_resize_inputs, "Resize keeps one of scales/sizes"),
    Step("pin_inputs", pin_inputs, "dynamic dims pinned, static ones overwritten by --input"),
    Step("drop_stale_value_info", drop_stale_value_info, "exporter shapes dropped, shapes inferred again"),
    Step("decompose_depth_space", decompose_depth_space, "DepthToSpace/SpaceToDepth as reshapes and a transpose"),
    Step("conv_transpose_output_shape", conv_transpose_output_shape, "ConvTranspose output_shape as pads"),
    Step("fold_with_onnxruntime", fold_with_onnxruntime, "onnxruntime's basic-level folding"),
]


def normalise(model: onnx.ModelProto, ctx: Context, *, until: str | None = None) -> onnx.ModelProto:
    """Run the steps in order (all of them, or up to and including ``until``)."""
    for step in STEPS:
        step.run(model, ctx)
        if step.name == until:
            break
    return model

