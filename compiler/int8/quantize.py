"""INT8 post-training quantization: an fp32 ONNX model + calibration inputs -> a QDQ INT8 model.

onnxruntime.quantization does the work, as its docs advise for CNNs on CPUs: ``quant_pre_process``
(symbolic shape inference, graph optimisation) first, then ``quantize_static`` in the QDQ format
(QuantizeLinear/DequantizeLinear pairs around fp32 ops, which every runtime reads, ACL's and
TVM's importers included). The model is loaded and normalised as ``tandoor compile`` loads it
(frontend.load: pinned shapes, old opsets upgraded, ...), so the quantized file is what compile
will import. The calibration inputs come from the caller (the host CLI preprocesses images the
way the bundle will, compiler/int8/calibration.py); this module never reads pixels.

For an already-quantized QDQ model (the output here, or a PyTorch/NNCF/ModelOpt export),
:func:`tolerance` is how far the compiled bundle may differ from onnxruntime's QDQ run, in
quantization steps of each output (the scale of the DequantizeLinear that produces it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from tandoor_contract import agreement, durable, probe

from ..stages import frontend, normalise
from ..stages.check_facts import constants
from ..errors import CompileError

METHODS = ("minmax", "entropy", "percentile")
ACTIVATIONS = ("int8", "uint8")

# The activation type each architecture's int8 kernels want, with the reason: `tandoor quantize`'s
# default for the targets it is given (--activations overrides). Weights are int8 either way.
ACTIVATIONS_BY_ARCH: dict[str, tuple[str, str]] = {
    "x86_64": ("uint8", "onnxruntime's x86 int8 convolutions (QLinearConv, u8s8 kernels) take only uint8 "
                        "activations: with int8 ones a QDQ conv stays dequantize -> float conv -> quantize "
                        "(measured 1.6x slower than fp32, uint8 0.71x)"),
    "aarch64": ("int8", "ACL's int8 kernels (Arm NN QAsymmS8) and the Cortex-A76's signed dot-product "
                        "instructions want int8 activations; onnxruntime on Arm fuses either"),
}


@dataclass(frozen=True)
class ConvShape:
    """What the fp32 lead's rules read of a Conv: its weight's shape and group."""
    cin: int        # input channels
    cout: int
    taps: int       # kernel height x width
    group: int
    stride: int     # the largest of its strides

    @property
    def depthwise(self) -> bool:
        return self.group > 1 and self.group == self.cin == self.cout


# The fp32 lead: convolutions that int8 makes slower on an architecture's CPU kernels, kept in fp32
# where they read a float tensor (the model's input, or another such layer's output), so that
# nothing is added: the first quantize moves to where int8 starts to pay. Per architecture whose
# kernels decide (the targets' boards, else this host, as for the activation type): (name, applies
# to the conv, why). Measured with onnxruntime 1.32, 2 threads, by scripts/bench-int8-lead.py
# (docs/int8.md, "The fp32 lead"). aarch64 (the boards, ACL) has none: not measured there, where an
# fp32 lead would also split the first int8 order and its Arm NN network.
FP32_LEAD_BY_ARCH: dict[str, tuple[tuple[str, Callable[[ConvShape], bool], str], ...]] = {
    "x86_64": (
        ("small stem", lambda c: c.group == 1 and c.cin <= 4 and c.taps * c.cin <= 75,
         "a first conv of at most 4 input channels and 75 taps (3x3, 5x5): onnxruntime's int8 conv with its input's "
         "quantize takes 1.3-1.8x the fp32 conv with its output's (a 7x7 stem, ResNet's, is left to int8)"),
        ("depthwise", lambda c: c.depthwise and c.stride == 1,
         "a stride-1 depthwise conv after it: onnxruntime's u8s8 depthwise kernel takes 1.18x its fp32 time over "
         "EfficientNet-Lite0's 16, and keeping its first in fp32 beside the stem saved another 0.4-2.2% of fp32's run"),
    ),
}
# Ops a float tensor passes through on its way to a lead conv (layout, padding, activations, and
# elementwise arithmetic: a normalisation baked into the model, HardSwish written as
# x * HardSigmoid(x)): kept fp32 with the conv they feed.
_LEAD_PASS = frozenset({"Transpose", "Reshape", "Pad", "Relu", "Clip", "LeakyRelu", "HardSigmoid", "HardSwish",
                        "Sigmoid", "Identity", "Add", "Sub", "Mul", "Div"})
MIN_SAMPLES = 10           # fewer gives ranges from a handful of frames; 100-500 is usual
REPORT_SAMPLES = 4         # calibration samples the per-layer report runs (it keeps every tensor of both models)
KEEP_CANDIDATES = 8        # the layers losing most, each tried in fp32 to measure what keeping it would buy
WEAK_OUTPUT_DB = 10.0      # an output this far from fp32 (noise a third of the signal) is worth a warning
QDQ_OPSET = 13            # per-channel DequantizeLinear (its axis attribute) from opset 13 on
METADATA_KEY = "tandoor.quantize"   # in the output's metadata_props: how it was made (JSON)

# ops that mean the model is quantized already (QDQ, QOperator or integer ops)
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                           "QLinearMatMul", "ConvInteger", "MatMulInteger", "QLinearAdd", "QLinearMul",
                           "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool",
                           "QLinearSigmoid", "QLinearLeakyRelu", "QGemm"})

# ops through which a tensor keeps its quantization step (values move or are dropped, never rescaled)
_STEP_PRESERVING = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity",
                              "Concat", "Slice", "Split", "Gather", "MaxPool", "Relu", "Clip"})
FP32_RTOL = 1e-3

# Ops of a constant rewritten before onnxruntime's pre-processing, so that its graph optimiser folds
# them into the Conv before them (ConvAddFusion, ConvMulFusion take Add and Mul, not Sub). A
# BatchNorm an exporter wrote out as (conv - mean) * scale + bias (open_nsfw, from TensorFlow) is
# otherwise three quantized ops per conv: Sub has no int8 kernel in onnxruntime (dequantize -> float
# -> quantize), then a QLinearMul and a QLinearAdd, three roundings and over half of ResNet-50's INT8
# time (measured: 24.7 -> 10.8 ms); folded, the conv alone is quantized. op -> (op it becomes, its constant's rewrite, why).
CONSTANT_REWRITES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray], str]] = {
    "Sub": ("Add", np.negative, "x - c is x + (-c), which onnxruntime's ConvAddFusion folds into a Conv before it"),
}


def _deciding_arch(targets: Iterable[str] = ()) -> tuple[str, str, str, bool]:
    """(target name, its architecture, this host's architecture, whether boards are among the
    targets): the boards decide when there are any (the bundle is made for them; its host lib is
    for `tandoor verify` and the health gate's golden check), else this host does."""
    import platform

    from ..targets import PRESETS

    host_arch = {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
    archs = []
    for name in targets:
        if name not in PRESETS:
            raise CompileError(f"unknown target '{name}'; choose from: {', '.join(PRESETS)}")
        if name != "host":
            archs.append((name, PRESETS[name].arch))
    name, arch = archs[0] if archs else ("host", host_arch)
    return name, arch, host_arch, bool(archs)


def activations_for(targets: Iterable[str] = ()) -> tuple[str, str]:
    """(activation type, why) for a bundle compiled for ``targets`` (as `tandoor compile --target`:
    host is always in it), by the architecture that decides (:func:`_deciding_arch`). One type for
    the whole bundle: its orders are one set of int8 tensors for every target (docs/int8.md, "Which
    activation type")."""
    name, arch, host_arch, boards = _deciding_arch(targets)
    if arch not in ACTIVATIONS_BY_ARCH:
        raise CompileError(f"no activation type is known for {arch} (target {name}); give --activations int8|uint8")
    act, why = ACTIVATIONS_BY_ARCH[arch]
    also = "" if not boards else f"; the {host_arch} host lib runs it for checks only"
    return act, f"for {name} ({arch}): {why}{also}"


def _conv_shape(node: onnx.NodeProto, weight: onnx.TensorProto) -> ConvShape | None:
    dims = list(weight.dims)
    if len(dims) < 3:
        return None
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    strides = next((list(a.ints) for a in node.attribute if a.name == "strides"), [1])
    return ConvShape(cin=dims[1] * group, cout=dims[0], taps=int(np.prod(dims[2:])), group=group,
                     stride=max(strides or [1]))


def _lead_why(arch: str, led: list[tuple[str, str | None]]) -> str:
    used = {r for _, r in led if r}
    return f"{arch}: " + "; ".join(why for name, _, why in FP32_LEAD_BY_ARCH[arch] if name in used)


def fp32_lead(model: onnx.ModelProto, arch: str) -> list[tuple[str, str | None]]:
    """The nodes of ``model`` (after onnxruntime's pre-processing) to keep in fp32 at its start on
    ``arch``: [(node name, the FP32_LEAD_BY_ARCH rule that keeps it, None for an op on the way to
    one)], in graph order. Empty when no rule applies, which leaves the model as it was."""
    rules = FP32_LEAD_BY_ARCH.get(arch, ())
    g = model.graph
    consts = constants(model)
    floats = {i.name for i in g.input if i.name not in consts}
    taken: list[tuple[onnx.NodeProto, str | None]] = []
    for n in g.node if rules else ():
        data = [x for x in n.input if x and x not in consts]
        if not n.name or not data or not all(x in floats for x in data):
            continue
        rule = None
        if n.op_type == "Conv":
            shape = _conv_shape(n, consts[n.input[1]]) if n.input[1] in consts else None
            rule = next((name for name, applies, _ in rules if shape is not None and applies(shape)), None)
            if rule is None:
                continue
        elif n.op_type not in _LEAD_PASS:
            continue
        taken.append((n, rule))
        floats.update(o for o in n.output if o)
    # an op on the way stays fp32 only where it feeds a kept conv (else its tensor is quantized as before)
    kept, feeds = [], set()
    for n, rule in reversed(taken):
        if rule is not None or any(o in feeds for o in n.output):
            kept.append((n.name, rule))
            feeds.update(n.input)
    return kept[::-1]


def activations_of(model: onnx.ModelProto) -> str | None:
    """The activation type of a QDQ model, read from its activation QuantizeLinear zero points
    (uint8 or int8; None for a float model or one without zero points)."""
    inits = {i.name: i for i in model.graph.initializer}
    seen = set()
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in inits:
            seen.add(numpy_helper.to_array(inits[n.input[2]]).dtype)
    if seen == {np.dtype(np.uint8)}:
        return "uint8"
    if seen == {np.dtype(np.int8)}:
        return "int8"
    return None


def quantized_nodes(model: onnx.ModelProto) -> dict[str, int]:
    """{op type: count} of the quantization ops in ``model`` (empty: a float model)."""
    out: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type in QUANTIZED_OPS:
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _calibrate_method(method: str):
    from onnxruntime.quantization import CalibrationMethod

    table = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
             "percentile": CalibrationMethod.Percentile}
    if method not in table:
        raise CompileError(f"unknown calibration method {method!r}; choose {', '.join(METHODS)}")
    return table[method]


def _feed_dtype(a: np.ndarray) -> np.dtype:
    """uint8 camera pixels stay uint8 (the model casts them: contract/media.INPUT_DTYPES); floats are float32."""
    return np.dtype(np.uint8) if np.asarray(a).dtype == np.uint8 else np.dtype(np.float32)


class _Reader:
    """onnxruntime's CalibrationDataReader over the caller's samples, counting them as the
    calibrator consumes each (its progress is this progress: one inference per sample)."""

    def __init__(self, names: list[str], samples: Iterable[list[np.ndarray]], total: int,
                 progress: Callable[[int, int], None] | None, keep: int = REPORT_SAMPLES) -> None:
        self.names, self.total, self.progress, self.keep = names, total, progress, keep
        self._it = iter(samples)
        self.seen = 0
        self.kept: list[dict] = []    # ``keep`` of them, for the per-layer report

    def get_next(self) -> dict | None:
        if self.seen >= self.total:
            return None
        try:
            arrays = next(self._it)
        except StopIteration:
            return None
        self.seen += 1
        if self.progress:
            self.progress(self.seen, self.total)
        feed = {n: np.ascontiguousarray(a, dtype=_feed_dtype(a)) for n, a in zip(self.names, arrays)}
        if len(self.kept) < self.keep and (self.seen - 1) % max(1, self.total // self.keep) == 0:
            self.kept.append(feed)     # spread over the source: its first frames may be alike
        return feed

    def __len__(self) -> int:
        return self.total

    def rewind(self) -> None:   # the calibrators call it between passes; ours is one pass
        pass


def quantize_model(model: str | Path, out: str | Path, *,
                   calibration: Callable[[list[frontend.TensorSpec]], Iterable[list[np.ndarray]]], count: int,
                   inputs: list[str] | tuple[str, ...] = (), method: str = "minmax", per_channel: bool = True,
                   activations: str | None = None, targets: Iterable[str] = (), keep_fp32: Iterable[str] = (),
                   lead: bool = True, report_samples: int = REPORT_SAMPLES,
                   metadata: dict | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   say: Callable[[str], None] | None = None) -> dict:
    """Quantize ``model`` (fp32 .onnx) to ``out`` (QDQ INT8 .onnx) and return what was done.

    Args:
        calibration: called with the loaded model's inputs, yields one list of arrays (one per
            input, at the input's shape) per calibration sample.
        count: how many samples to calibrate on (at least :data:`MIN_SAMPLES`).
        inputs: ``NAME=1x3x224x224`` pins, as ``tandoor compile --input``.
        method: minmax | entropy | percentile (onnxruntime's calibrators).
        per_channel: per-output-channel weight scales (else one scale per weight tensor).
        activations: int8 (S8S8) or uint8 (U8S8); None: what ``targets`` want (:func:`activations_for`).
        targets: the targets the bundle will be compiled for (`tandoor compile --target`), which
            choose the activation type when ``activations`` is None.
        keep_fp32: node names (of the model after onnxruntime's pre-processing, as the layer report
            names them) to leave in fp32: onnxruntime's ``nodes_to_exclude``.
        lead: keep the model's first layers in fp32 where the deciding architecture's int8 kernels
            are slower for them (:data:`FP32_LEAD_BY_ARCH`); False quantizes every layer.
        report_samples: calibration samples (spread over them) the per-layer report compares on;
            more is steadier and costs memory (every tensor of both models, per sample).
        metadata: recorded beside the settings in the output's metadata_props (e.g. preprocessing),
            read once calibration is done (``calibration`` may fill it in).
        progress: ``progress(done, count)`` after each calibration sample.

    Raises CompileError for a bad input (exit 2). Nothing is written at ``out`` unless it succeeded.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    say = say or (lambda s: None)
    out = Path(out)
    targets = list(targets)
    if activations is None:
        activations, activations_why = activations_for(targets)
    elif activations not in ACTIVATIONS:
        raise CompileError(f"unknown --activations {activations!r}; choose {' or '.join(ACTIVATIONS)}")
    else:
        activations_why = "given (--activations)"
    calibrate_method = _calibrate_method(method)
    if out.suffix != ".onnx":
        raise CompileError(f"output {out} should end in .onnx")
    if not out.parent.is_dir():
        raise CompileError(f"output directory {out.parent} does not exist")
    if count < MIN_SAMPLES:
        raise CompileError(f"{count} calibration sample(s); quantization needs at least {MIN_SAMPLES} "
                           "(100-500 frames like the deployment's are usual): give more images or --images N")
    raw = frontend.read_model(Path(model))
    already = quantized_nodes(raw)
    if already:
        ops = ", ".join(f"{n} {k}" for k, n in sorted(already.items()))
        raise CompileError(f"{Path(model).name} is already quantized ({ops}); compile it as it is: "
                           f"tandoor compile {Path(model).name} -o OUT.hmod")
    say("loading and normalising the ONNX model")
    loaded = frontend.load(model, list(inputs))
    if normalise.opset(loaded.proto) < QDQ_OPSET:
        # per-channel DequantizeLinear takes an axis from opset 13 on; onnxruntime's quantizer
        # writes one into an older model as it is, which then no checker or importer accepts
        say(normalise.upgrade_opset(loaded.proto, QDQ_OPSET, loaded.path.name,
                                    "is too old for QDQ quantization; re-export the model with opset >= 13"))
    _name_nodes(loaded.proto)
    rewritten = rewrite_constant_ops(loaded.proto)
    if rewritten:
        say(f"{rewritten} Sub(x, constant) as Add(x, -constant), for onnxruntime to fold into the conv before it")
    names = [i.name for i in loaded.inputs]
    if not 1 <= report_samples <= count:
        raise CompileError(f"--report-images {report_samples}: give 1 to the {count} calibration image(s)")
    reader = _Reader(names, calibration(loaded.inputs), count, progress, keep=report_samples)
    with tempfile.TemporaryDirectory(prefix="tandoor-quantize-") as tmp:
        pre = Path(tmp) / "pre.onnx"
        say("onnxruntime quantization pre-processing (shape inference, graph optimisation)")
        try:
            quant_pre_process(loaded.proto, str(pre), skip_symbolic_shape=False)
        except Exception:   # symbolic shape inference fails on some exports: the plain onnx one then
            quant_pre_process(loaded.proto, str(pre), skip_symbolic_shape=True)
        keep = list(dict.fromkeys(keep_fp32))
        if keep:
            known = {n.name for n in onnx.load(str(pre)).graph.node if n.name}
            if unknown := [k for k in keep if k not in known]:
                raise CompileError(f"--keep-fp32 {unknown[0]}: the model has no node of that name after onnxruntime's "
                                   "pre-processing; take the names from tandoor quantize's layer report (--report FILE)")
        _, arch, _, _ = _deciding_arch(targets)
        led = fp32_lead(onnx.load(str(pre)), arch) if lead else []
        exclude = keep + [n for n, _ in led if n not in keep]
        if led:
            say(f"the fp32 lead on {arch}: " + ", ".join(f"{n} ({r})" for n, r in led if r))
        staged = Path(tmp) / "q.onnx"
        say(f"calibrating on {count} sample(s) ({method}) and quantizing"
            + (f", {len(keep)} node(s) kept in fp32" if keep else ""))
        act = QuantType.QInt8 if activations == "int8" else QuantType.QUInt8
        ranges = Path(tmp) / "ranges.json"     # calibration's result, reused by the report's trials

        def run_quantizer(dst: Path, exclude: list[str], data) -> Path:
            with contextlib.redirect_stdout(io.StringIO()):   # its calibrators print their steps
                quantize_static(str(pre), str(dst), data, quant_format=QuantFormat.QDQ, per_channel=per_channel,
                                activation_type=act, weight_type=QuantType.QInt8, calibrate_method=calibrate_method,
                                nodes_to_exclude=exclude, calibration_cache_path=str(ranges))
            return dst

        run_quantizer(staged, exclude, reader)
        if reader.seen < count:
            raise CompileError(f"the calibration source gave {reader.seen} sample(s), not the {count} asked for; "
                               "give --images N at most the number of images (or frames) it has")
        say(f"comparing every layer with fp32 on {len(reader.kept)} calibration sample(s)")
        report = layer_report(pre, staged, reader.kept, tmp=Path(tmp),
                              requantize=lambda node: run_quantizer(Path(tmp) / "trial.onnx", exclude + [node], None))
        q = onnx.load(str(staged))
    settings = {"method": method, "per_channel": per_channel, "activations": activations,
                "activations_why": activations_why, "targets": ["host", *(t for t in targets if t != "host")],
                "samples": reader.seen,
                "source": loaded.path.name, "source_sha256": loaded.sha256, **({"keep_fp32": keep} if keep else {}),
                **({"fp32_lead": {n: r or "on the way" for n, r in led},
                    "fp32_lead_why": _lead_why(arch, led)} if led else {}),
                **({"constant_ops_rewritten": rewritten} if rewritten else {}),
                **(metadata or {})}
    del q.metadata_props[:]
    q.metadata_props.add(key=METADATA_KEY, value=json.dumps(settings, sort_keys=True))
    data = q.SerializeToString()
    durable.atomic_write(out, data)
    return {**settings, "output": str(out), "bytes": len(data), "source_bytes": os.path.getsize(loaded.path),
            "quantized": quantized_nodes(q), "nodes": len(q.graph.node), "report": report}


def layer_report(float_model: Path, qdq_model: Path, samples: list[dict], *, tmp: Path,
                 requantize: Callable[[str], Path] | None = None) -> dict:
    """How far each layer of the QDQ model is from the float one on ``samples``, as onnxruntime's
    qdq_loss_debug measures it (every float tensor of both models saved, matched by name).

    Per node of ``float_model`` (the pre-processed model whose node names ``keep_fp32`` takes):
    ``sqnr_db``, its output in the QDQ model against the float model's (what has accumulated up to
    it); ``lost_db``, how much worse that is than its worst input (what this node's quantization
    added: the ranking, most first); ``qdq_db``, its output before against after its own
    QuantizeLinear/DequantizeLinear (the rounding of that one tensor; onnxruntime drops a Relu or
    Clip into the QuantizeLinear's range, so after one it also counts the clipping). With
    ``requantize(node)`` (the QDQ model made again with ``node`` left in fp32), the first
    :data:`KEEP_CANDIDATES` also get ``keep_fp32_output_db``/``keep_fp32_gain_db``: the worst
    output's SQNR with that node in fp32, and its change. Per graph output its SQNR, and ``weak``:
    the outputs under :data:`WEAK_OUTPUT_DB`."""
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        compute_signal_to_quantization_noice_ratio,
        create_activation_matching,
        modify_model_output_intermediate_tensors,
    )

    acts = {}
    for tag, path in (("float", float_model), ("qdq", qdq_model)):
        aug = tmp / f"{tag}.saving.onnx"
        modify_model_output_intermediate_tensors(str(path), str(aug))
        acts[tag] = collect_activations(str(aug), list(samples))
    errors = compute_activation_error(create_activation_matching(acts["qdq"], acts["float"]))
    db = {t: e["xmodel_err"] for t, e in errors.items() if "xmodel_err" in e}
    graph = onnx.load(str(float_model)).graph
    layers = []
    for i, n in enumerate(graph.node):
        outs = [db[o] for o in n.output if o in db]
        if not outs:
            continue
        ins = [db[x] for x in n.input if x in db]
        out_db = min(outs)
        lost = max(0.0, min(ins) - out_db) if ins else max(0.0, -out_db)
        qdq = [errors[o]["qdq_err"] for o in n.output if o in errors]
        layers.append({"node": n.name or f"({n.op_type} #{i}, unnamed)", "op": n.op_type, "tensor": n.output[0],
                       "sqnr_db": round(out_db, 2), "lost_db": round(lost, 2),
                       "qdq_db": round(min(qdq), 2) if qdq else None})
    layers.sort(key=lambda r: -r["lost_db"])
    want = {o.name: acts["float"][o.name] for o in graph.output if o.name in acts["float"]}

    def sqnr(got: dict) -> dict[str, float]:
        return {k: round(compute_signal_to_quantization_noice_ratio(v, got[k]), 2) for k, v in want.items() if k in got}

    outputs = sqnr(acts["qdq"])
    # What keeping a node in fp32 would buy, measured: the model quantized again without it (on the
    # ranges calibration found, so in seconds) and run on the samples. A layer that loses SQNR may
    # only amplify its inputs' noise, which fp32 there does not cure; this says which ones it does.
    base = min(outputs.values(), default=None)
    if requantize is not None and base is not None:
        for r in [r for r in layers if r["lost_db"] > 0 and not r["node"].startswith("(")][:KEEP_CANDIDATES]:
            got = sqnr(_run(onnx.load(str(requantize(r["node"]))), samples, list(want)))
            r["keep_fp32_output_db"] = min(got.values())
            r["keep_fp32_gain_db"] = round(r["keep_fp32_output_db"] - base, 2)
    return {"samples": len(samples), "layers": layers, "outputs": outputs,
            "weak": sorted(k for k, v in outputs.items() if v < WEAK_OUTPUT_DB), "weak_below_db": WEAK_OUTPUT_DB}


def _run(model: onnx.ModelProto, samples: list[dict], names: list[str]) -> dict[str, list[np.ndarray]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # as qdq_loss_debug runs it
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    runs = [sess.run(names, feed) for feed in samples]
    return {n: [r[j] for r in runs] for j, n in enumerate(names)}


def rewrite_constant_ops(model: onnx.ModelProto) -> int:
    """Rewrite each float ``Sub(x, c)`` (:data:`CONSTANT_REWRITES`; ``c`` an initializer) in place as
    the op onnxruntime's optimiser folds into a Conv before it; returns how many were rewritten."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    fed = {i.name for i in g.input}         # an initializer that is also an input may be overridden
    replaced: set[str] = set()
    done = 0
    for n in g.node:
        rule = CONSTANT_REWRITES.get(n.op_type)
        if (rule is None or n.domain not in ("", "ai.onnx") or len(n.input) != 2 or n.input[1] not in inits
                or n.input[1] in fed or n.input[0] in inits):
            continue
        c = numpy_helper.to_array(inits[n.input[1]])
        if c.dtype.kind != "f":
            continue
        name = f"{n.input[1]}_as_{rule[0].lower()}"
        if name not in inits:
            inits[name] = numpy_helper.from_array(rule[1](c).astype(c.dtype), name)
            g.initializer.append(inits[name])
        replaced.add(n.input[1])
        n.op_type, n.input[1] = rule[0], name
        done += 1
    # drop the replaced constants no node reads now, subgraphs included (onnxruntime would warn of each)
    used = {i for n in _all_nodes(g) for i in n.input} | {o.name for o in g.output}
    if dropped := replaced - used:
        kept = [i for i in g.initializer if i.name not in dropped]
        del g.initializer[:]
        g.initializer.extend(kept)
    return done


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    """Every node of ``graph`` and of the subgraphs in its nodes' attributes (If, Loop, Scan bodies)."""
    graphs = [graph]            # a stack, not recursion: bodies nest as deep as the file says
    while graphs:
        for n in graphs.pop().node:
            yield n
            for a in n.attribute:
                graphs.extend(([a.g] if a.HasField("g") else []) + list(a.graphs))


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every unnamed node a name (op type and position, so the same model gets the same
    names on every run): --keep-fp32 and the layer report need one per node (CenterFace's have none)."""
    taken = {n.name for n in model.graph.node if n.name}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            name = f"{n.op_type}_{i}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)


def settings_of(model: onnx.ModelProto) -> dict | None:
    """What :func:`quantize_model` recorded in the model (None for other models)."""
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            try:
                return json.loads(p.value)
            except ValueError:
                return None
    return None


# --- the compiled bundle's tolerance for a QDQ model ---------------------------------------------

def output_steps(model: onnx.ModelProto) -> dict[str, float] | None:
    """{output name: its quantization step} for a QDQ model, None for a float one. An output's
    step is the scale of the DequantizeLinear that makes it, through ops that only move values
    (Reshape, Concat, ...); an output computed in float after the last DequantizeLinear (e.g. a
    Softmax) takes the largest step of the model's output-side dequantizes feeding it."""
    if not quantized_nodes(model):
        return None
    consts = constants(model)
    producer = {o: n for n in model.graph.node for o in n.output}

    def scale_of(name: str) -> float | None:
        t = consts.get(name)
        return None if t is None else float(np.max(np.abs(numpy_helper.to_array(t))))

    def step(name: str) -> float | None:
        """The largest scale among the DequantizeLinears ``name`` is computed from, through the
        inputs that carry a step (the first of a step-preserving op, every input of others). A
        walk with a stack, not recursion: a 10,000-node chain is deeper than Python's stack."""
        found, seen, todo = [], set(), [name]
        while todo:
            t = todo.pop()
            n = producer.get(t)
            if n is None or t in seen:
                continue
            seen.add(t)
            if n.op_type == "DequantizeLinear":
                s = scale_of(n.input[1])
                if s is not None:
                    found.append(s)
                continue
            ins = n.input[:1] if n.op_type in _STEP_PRESERVING and n.op_type != "Concat" else n.input
            todo.extend(i for i in ins if i)
        return max(found) if found else None

    out = {}
    for o in model.graph.output:
        s = step(o.name)
        out[o.name] = s if s is not None else float("nan")
    return out


TOLERANCE_SAMPLES = 4     # random inputs (as the golden pairs') on which onnxruntime is run both ways


def _session(model: onnx.ModelProto, fused: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if fused
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def tolerance(loaded: frontend.LoadedModel) -> dict | None:
    """The manifest's ``tolerance`` for a QDQ model, None for a float one (fp32's then).

    One quantization step is what a single quantized op may differ by (a value on a step's edge
    rounds either way); through a network's dozens of requantizations those flips add up. Two
    spreads, each in whole output steps on random inputs like the golden ones, against onnxruntime's
    plain graph (dequantize, fp32 op, quantize):

    - ``onnxruntime_spread_steps``: onnxruntime's own fused int8 kernels (the golden outputs);
      EfficientNet-Lite0: up to 4;
    - ``rounding_spread_steps``: the plain graph with one float rounding error per op
      (check_facts.rounding_noise), which is what another summation order (TVM's, ACL's) does.
      A flip of one step where a coarse step feeds a fine one (PicoDet's HardSwish: an Add whose
      Clip became the QuantizeLinear's [0, 6] range) is many steps of the output: layout_cdla's
      TVM run is 11 steps off onnxruntime's on a golden pair where fused and plain agree exactly,
      and this spread measures 11-14 on its box outputs.

    Per output ``step x (1 + 2 x spread)`` with the larger spread (the ``outputs`` entries,
    tandoor_contract.agreement), and 0.1% of its elements past it (``outliers``): random inputs
    miss the rare flip a golden pair meets (PP-OCRv4 det: 13 of 307200 elements up to 68 steps off
    where both spreads were 2); ``atol`` is the largest, for readers that know one pair. A wrong
    bundle (a wrong weight, layout or op) misses on most of an output, by a large part of its range."""
    from ..stages.check_facts import rounding_noise

    steps = output_steps(loaded.proto)
    if steps is None or not any(np.isfinite(v) for v in steps.values()):
        return None
    fused, plain = _session(loaded.proto, True), _session(loaded.proto, False)
    try:
        noisy = _session(rounding_noise(loaded.proto), False)
    except Exception:    # a graph the noise cannot be added to: the fused spread alone, as before
        noisy = None
    rng = np.random.default_rng(20261213)
    spread = dict.fromkeys(steps, 0.0)
    rounding = dict.fromkeys(steps, 0.0)

    def steps_apart(name: str, a, b) -> float:
        return float(np.ceil(float(np.abs(np.asarray(a, np.float64) - b).max(initial=0.0)) / steps[name] - 1e-3))

    for _ in range(TOLERANCE_SAMPLES):
        feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) if i.dtype == "float32"
                 else probe.random_input(rng, i.as_dict()) for i in loaded.inputs}   # uint8 pixels: every code
        base = plain.run(None, feeds)
        for name, a, b in zip(steps, fused.run(None, feeds), base):
            if np.isfinite(steps[name]) and steps[name] > 0:
                spread[name] = max(spread[name], steps_apart(name, a, b))
        for name, a, b in zip(steps, noisy.run(None, feeds) if noisy is not None else (), base):
            if np.isfinite(steps[name]) and steps[name] > 0:
                rounding[name] = max(rounding[name], steps_apart(name, a, b))
    outputs = {}
    for k, s in steps.items():
        if not np.isfinite(s):
            continue
        worst = max(spread[k], rounding[k])
        noise = f"{rounding[k]:.0f}" if noisy is not None else "not measured (onnxruntime cannot run the noisy copy)"
        outputs[k] = {"atol": float(s * (1 + 2 * worst)), "rtol": FP32_RTOL, "outliers": agreement.MAX_OUTLIERS,
                      "why": (f"INT8 output, step {s:.3g}: onnxruntime's fused kernels {spread[k]:.0f} step(s) from "
                              f"its plain graph, one float rounding per op {noise}; a flip upstream "
                              f"may move a few elements further")}
    return {"atol": float(max(e["atol"] for e in outputs.values())), "rtol": FP32_RTOL, "outputs": outputs,
            "quantized": {"steps": {k: (float(v) if np.isfinite(v) else None) for k, v in steps.items()},
                          "onnxruntime_spread_steps": spread,
                          "rounding_spread_steps": rounding if noisy is not None else None}}


def compute_note(int8_share: float) -> str:
    """How the bundle computes a QDQ model, for the manifest and `tandoor inspect`."""
    rest = ("float32 between each DequantizeLinear and QuantizeLinear (TVM computes the dequantized values)")
    if int8_share <= 0:
        return f"{rest}, within the recorded tolerance"
    return (f"int8 kernels for {int8_share:.1%} of the FLOPs (the delegated quantized conv2d/dense/add orders: int8 "
            f"weights and activations), the rest in {rest}, within the recorded tolerance")


def manifest_entries(loaded: frontend.LoadedModel, int8_share: float = 0.0) -> dict | None:
    """For a QDQ model, the manifest's ``tolerance`` (:func:`tolerance`) and ``quantized``: the
    quantization ops, how the bundle computes them, and how the model was quantized when
    `tandoor quantize` made it. None for a float model."""
    tol = tolerance(loaded)
    if tol is None:
        return None
    return {"tolerance": tol,
            "quantized": {"format": "QDQ", "ops": quantized_nodes(loaded.proto), "compute": compute_note(int8_share), "int8_flops_share": round(int8_share, 4),
                          "steps": tol["quantized"]["steps"], "by": settings_of(loaded.proto)}}
