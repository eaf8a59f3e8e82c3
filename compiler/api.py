"""The compiler's public API: what `tandoor compile` and `tandoor quantize` do, as functions with
keyword arguments (the CLI only parses flags and prints).

    from tandoor_compiler import compile_model
    done = compile_model("m.onnx", "m.hmod", targets=["rk3588"], int8=True, calibration="frames/",
                         validation="held-out/", max_drop=0.02, mean=[0.485, 0.456, 0.406])
    done.manifest["partitions"], done.quantized["report"], done.judged["top1_agreement"]

``compile_model`` runs, top to bottom: the budget checked before any work; for ``npu=True`` the
calibration frames made into model inputs; for ``int8=True`` the model quantized on them
(compiler/int8/); the pipeline (compiler/pipeline.py) into a staged bundle; with ``max_drop`` the
staged bundle judged against the fp32 model on ``validation`` (the NPU's part in the RKNN
simulator); only then the bundle replaces ``out``. Errors are CompileError (bad input, exit 2) or
InternalError (a stage failed, exit 3); past the budget nothing is written.

``on_event(name, data)`` hears what a front end shows: ("stage", {"message"}) as each step starts,
("calibrating", {"done", "total"}), ("say", {"message"}) for lines worth keeping, ("quantized",
summary) and ("judged", report).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CompileError
from .pipeline import Options

Events = Callable[[str, dict], None]


@dataclass(frozen=True)
class Compiled:
    """What compile_model did: the manifest as written, and for ``int8`` the quantizer's summary
    (layer report, the fp32 lead), for ``max_drop`` the judge's report."""
    path: Path
    manifest: dict
    quantized: dict | None = None
    judged: dict | None = None


def compile_model(model: str | Path, out: str | Path, *, int8: bool = False, calibration: str | Path | None = None,
                  images: int | None = None, keep_fp32=(), all_int8: bool = False,
                  validation: str | Path | None = None, max_drop: float | None = None,
                  npu: bool = False, npu_dtype: str = "int8", on_event: Events | None = None,
                  timings: dict | None = None, **options) -> Compiled:
    """Compile ``model`` (.onnx) into the bundle ``out`` (.hmod).

    ``options`` are pipeline.Options' fields (``inputs=["x=1x3x224x224"]``, ``targets=["rk3588"]``,
    ``key=``, ``labels=``, ``mean=``/``std=`` (lists), ``layout=``, ``bgr=``, ``resize=``,
    ``policy=``, ``profile=``, ``name=``, ``version=``, ``build=``, ``check=``, ``measure=``,
    ``decoder=``, ``decoder_options=``, ``cache=``, ``gpu_tuning=``). INT8: ``int8=True`` with
    ``calibration`` (a directory of images or a video), ``images`` (how many), ``keep_fp32``
    (node names), ``all_int8``. The NPU: ``npu=True``, ``npu_dtype="int8"|"fp16"``,
    ``calibration`` (int8). A budget: ``max_drop`` (0.05 = 5%) judged on ``validation``.
    """
    tell = on_event or (lambda name, data: None)
    opts = Options(npu=npu, npu_dtype=npu_dtype, **options)
    if npu and int8:
        raise CompileError("--npu quantizes for the NPU itself: drop --int8 (--npu-dtype int8 is the default)")
    cal, count = (None, None) if npu else (calibration, images)     # the NPU calibrates by itself
    if int8 != (cal is not None) or ((count is not None or keep_fp32 or all_int8) and not int8) \
            or (max_drop is not None and not (int8 or npu)):
        raise CompileError("--int8 and --calibration go together (--images, --keep-fp32, --all-int8 and --max-drop "
                           "with them, or --max-drop with --npu): give both to quantize on your images first, or "
                           "neither")
    from .int8 import accuracy, calibration as calib

    accuracy.check_budget(validation, max_drop, model=model, inputs=opts.inputs, decoder=opts.decoder)
    if npu:
        from . import targets as targets_mod
        from .backends.rknn import stages as npu_stages

        # refused before minutes of reading frames; the pipeline checks again what it is given
        npu_stages.check_options(opts, targets_mod.resolve(opts.targets), calibrated=calibration is not None)
        samples = None
        if calibration is not None:
            tell("stage", {"message": f"reading the NPU's calibration frames from {calibration}"})
            samples = calib.npu_samples(model, calibration, images, opts)
        opts = dataclasses.replace(opts, npu_samples=samples, npu_judged=max_drop is not None)

    source = Path(model)     # the fp32 model: what max_drop judges the bundle against
    out = Path(out)
    quantized = judged = None
    with tempfile.TemporaryDirectory(prefix="tandoor-int8-") as tmp:
        if int8:
            q = Path(tmp) / f"{source.stem}.int8.onnx"
            quantized = calib.quantize_on_images(source, q, calibration, images, opts, keep_fp32=keep_fp32,
                                                 lead=not all_int8, on_event=tell)
            tell("quantized", quantized)
            opts = dataclasses.replace(opts, name=opts.name or source.stem)
            model = q
        # judged before it replaces anything: past the budget, nothing is written
        staged = out.with_name(f".{out.stem}.unjudged{out.suffix}") if max_drop is not None else out
        try:
            from . import pipeline

            manifest = pipeline.compile_model(model, staged, opts, timings=timings,
                                              progress=lambda m: tell("stage", {"message": m}))
            if max_drop is not None:
                judged = _judge(staged, source, validation, max_drop, opts, manifest, tell)
                os.replace(staged, out)
        finally:
            if staged != out:
                staged.unlink(missing_ok=True)
    return Compiled(out, manifest, quantized, judged)


def _judge(staged: Path, source: Path, validation, max_drop: float, opts: Options, manifest: dict,
           tell: Events) -> dict:
    """The staged bundle against the fp32 ``source`` on ``validation``; CompileError past the budget."""
    from .int8 import accuracy

    say = lambda line: tell("say", {"message": line})     # noqa: E731
    if opts.npu:        # the rknn orders as the NPU runs them: in the toolkit's simulator
        from .backends.rknn.stages import npu_fix

        tell("stage", {"message": f"judging the bundle on {validation} with its NPU part in the RKNN simulator"})
        with accuracy.simulated_npu(source, opts.inputs, opts.npu_samples):
            res = accuracy.compare_on_images(staged, source, validation, max_drop=max_drop, delegate="auto")
        tell("judged", res)
        accuracy.verdict(res, max_drop, say=say, what=f"the NPU's {opts.npu_dtype}", fix=npu_fix(manifest["npu"]))
    else:
        tell("stage", {"message": f"judging the INT8 bundle on {validation}"})
        res = accuracy.compare_on_images(staged, source, validation, max_drop=max_drop)
        tell("judged", res)
        accuracy.verdict(res, max_drop, say=say)
    return res


def quantize(model: str | Path, out: str | Path, *, calibration: str | Path, images: int | None = None,
             method: str = "minmax", per_channel: bool = True, activations: str | None = None,
             keep_fp32=(), all_int8: bool = False, report_samples: int = 4,
             validation: str | Path | None = None, max_drop: float | None = None,
             on_event: Events | None = None, **options) -> dict:
    """``tandoor quantize``: the fp32 ``model`` -> the QDQ INT8 model ``out`` (.onnx), calibrated on
    ``calibration``'s images preprocessed as ``options`` (pipeline.Options' fields: ``inputs``,
    ``targets`` (they choose the activation type), ``mean``, ``std``, ``layout``, ``resize``...)
    say; with ``max_drop`` judged on ``validation`` before it replaces ``out``. Returns
    quantize_model's summary (compiler/int8/quantize.py) with ``preprocess``, ``source`` and, when
    judged, ``judged``."""
    from tandoor_contract import media

    from .int8 import accuracy, calibration as calib
    from .stages import frontend

    tell = on_event or (lambda name, data: None)
    opts = Options(**options)
    accuracy.check_budget(validation, max_drop, model=model, inputs=opts.inputs)
    out = Path(out)
    staged = out.with_name(f".{out.stem}.unjudged.onnx") if max_drop is not None else out
    try:
        res = calib.quantize_on_images(model, staged, calibration, images, opts, method=method,
                                       per_channel=per_channel, activations=activations, keep_fp32=keep_fp32,
                                       lead=not all_int8, report_samples=report_samples, on_event=tell)
        tell("quantized", res)
        if max_drop is not None:
            q = frontend.load(staged, list(opts.inputs))
            spec = {**q.inputs[0].as_dict(), "layout": opts.layout or media.guess_layout(q.inputs[0].shape)}
            like = {"inputs": [spec], "outputs": [o.as_dict() for o in q.outputs], "preprocess": res["preprocess"],
                    "postprocess": None}
            tell("stage", {"message": f"judging the INT8 model on {validation}"})
            res["judged"] = accuracy.compare_models(staged, model, validation, like, max_drop=max_drop)
            tell("judged", res["judged"])
            accuracy.verdict(res["judged"], max_drop, say=lambda line: tell("say", {"message": line}))
            os.replace(staged, out)
    finally:
        if staged != out:
            staged.unlink(missing_ok=True)
    return res
