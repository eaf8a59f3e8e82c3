"""One frame through the model: preprocess (from the manifest) -> module.run -> postprocess.

    with hmod.open_bundle(path) as b:
        module = HybridModule(b, delegate="onnxruntime")
        pipe = Pipeline(module, module.manifest)          # labels read from the bundle
        with open_source("file:clip.mp4") as cam:
            for frame in cam.frames(timeout=5):
                r = pipe.process(frame)                   # Result: r.top, r.timings, r.to_json()

Per-frame cost outside ``module.run`` is one ``cv2.resize``, one fused normalisation per channel
into a reused input buffer, and the decoder (a top-k, or vectorised box decoding and OpenCV NMS).
:func:`decode` runs the decoder alone on outputs computed elsewhere (`tandoor-agent run`, a board).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandoor_contract import media

from . import postprocess as post
from .camera import Frame, FrameSource
from .preprocess import Geometry, Preprocessor, input_geometry

log = logging.getLogger("tandoor.pipeline")

STAGES = ("capture", "preprocess", "inference", "postprocess")


@dataclass
class Result:
    seq: int
    t_capture: float  # time.monotonic() of the frame's capture
    timings: dict[str, float]  # seconds: capture (frame age when processing began), preprocess, inference, postprocess
    outputs: dict  # the postprocessor's summary: kind, top / detections / outputs
    source: str = ""
    frame_hw: tuple[int, int] = (0, 0)
    raw: list[np.ndarray] | None = field(default=None, repr=False)  # with keep_raw=True

    @property
    def top(self) -> list[tuple[str, float]] | None:
        return self.outputs.get("top")

    @property
    def latency(self) -> float:
        """Capture to result, seconds."""
        return sum(self.timings.get(k, 0.0) for k in STAGES)

    def to_json(self) -> dict:
        """JSON-ready: the summary's keys plus seq, source, frame size, t_capture and timings_ms."""
        d = {k: ([list(t) for t in v] if k == "top" else v) for k, v in self.outputs.items()}
        d.update(seq=self.seq, source=self.source, frame=[int(self.frame_hw[1]), int(self.frame_hw[0])],
                 t_capture=round(self.t_capture, 6),
                 timings_ms={k: round(v * 1e3, 3) for k, v in self.timings.items()})
        return d


def _labels_of(module, manifest: dict) -> list[str] | None:
    member = manifest.get("labels")
    bundle = getattr(module, "bundle", None)
    if not member or bundle is None:
        return None
    try:
        return bundle.read(member).decode("utf-8", "replace").splitlines()
    except Exception as err:
        log.warning("cannot read labels %s from the bundle: %s", member, err)
        return None


class Decoding:
    """The postprocessing half of a pipeline: a decoder (by name, or a callable) with its context
    and options resolved once: the manifest's ``postprocess`` under ``options`` (the agent config,
    the command line). Also used alone on outputs computed elsewhere (:func:`decode`)."""

    def __init__(self, manifest: dict, postprocessor=None, labels: list[str] | None = None, top_k: int = 5,
                 options: dict | None = None, input_hw: tuple[int, int] = (0, 0)) -> None:
        given = {k: v for k, v in (media.read_postprocess(manifest.get("postprocess")) or {}).items()
                 if k != "decoder"}
        overrides = {k: v for k, v in (options or {}).items() if v is not None}
        if callable(postprocessor):
            self.name = getattr(postprocessor, "__name__", "custom")
            self.fn = postprocessor
        else:
            self.name = post.resolve(postprocessor, manifest)
            self.fn = post.get(self.name)
        if self.name in media.DECODERS:
            hinted = (manifest.get("postprocess") or {}).get("decoder")
            # options recorded for another decoder (the config chose a different one) do not apply
            opts = media.decoder_options(self.name, {**(given if hinted in (None, self.name) else {}), **overrides})
        else:
            opts = {**given, **overrides}
        self.ctx = post.Context(manifest=manifest, labels=labels, top_k=top_k, input_hw=tuple(input_hw),
                                options=opts)

    def __call__(self, outputs: list[np.ndarray], geometry: Geometry) -> dict:
        self.ctx.frame_hw = tuple(geometry.frame_hw)
        self.ctx.geometry = geometry
        return self.fn(outputs, self.ctx)


def decode(manifest: dict, outputs: list[np.ndarray], *, frame_hw: tuple[int, int] | None = None,
           labels: list[str] | None = None, postprocessor=None, options: dict | None = None,
           top_k: int = 5) -> dict:
    """One frame's summary (what the service publishes on ``results``, less seq and timings)
    from outputs computed elsewhere: ``tandoor-agent run``, a board's saved outputs. ``frame_hw``:
    the image the input was made from (default: the input's own size, boxes in input pixels)."""
    spec = (manifest.get("inputs") or [{}])[0]
    try:
        layout, _, h, w = input_geometry(spec, manifest.get("preprocess"))
    except ValueError:
        if media.read_postprocess(manifest.get("postprocess")):
            raise  # a box decoder needs the image input's size
        h, w = frame_hw or (1, 1)  # not an image input: raw outputs or scores, no geometry to map
    pre = media.read_preprocess(manifest.get("preprocess"))
    geometry = Geometry.of(tuple(frame_hw or (h, w)), (h, w), pre["resize"], pre["align"])
    dec = Decoding(manifest, postprocessor, labels, top_k, options, (h, w))
    return dec([np.asarray(o) for o in outputs], geometry)


def decode_saved(bundle: str | Path, outputs_dir: str | Path, *, frame_hw: tuple[int, int] | None = None,
                 options: dict | None = None, top_k: int = 5) -> dict:
    """:func:`decode` of ``tandoor-agent run --save-outputs DIR``'s ``output_<j>.npy`` files
    with the bundle's manifest and labels: a board's outputs decoded anywhere (tests/board)."""
    from tandoor_contract import hmod

    with hmod.open_bundle(bundle) as b:
        m = b.manifest
        labels = b.read(m["labels"]).decode("utf-8", "replace").splitlines() if m.get("labels") else None
    d = Path(outputs_dir)
    outs = [np.load(d / f"output_{j}.npy", allow_pickle=False) for j in range(len(m["outputs"]))]
    return decode(m, outs, frame_hw=frame_hw, labels=labels, options=options, top_k=top_k)


class Pipeline:
    """Preprocess -> ``module.run`` -> postprocess for frames, with per-stage timings.

    ``module``: anything with ``run(list[np.ndarray]) -> list[np.ndarray]`` (a
    :class:`runtime.HybridModule`); ``manifest``: its bundle manifest (default ``module.manifest``);
    ``postprocessor``: a registered name (``auto``, ``classifier``, ``yolov8``, ``raw``, ...) or a
    callable ``fn(outputs, ctx) -> dict``; ``labels``: default the bundle's labels.txt (read once,
    here); ``resize``: see :data:`preprocess.RESIZE_METHODS`; ``options``: for the decoder, over
    the manifest's (conf, iou, max_det, ...: tandoor_contract.media.DECODERS).

    The input tensor is one buffer reused for every frame (``module.run`` copies it into the
    runtime's own buffer); not thread-safe, one Pipeline per inference thread.
    """

    def __init__(self, module, manifest: dict | None = None, postprocessor=None, top_k: int = 5,
                 labels: list[str] | None = None, resize: str = "linear", keep_raw: bool = False,
                 options: dict | None = None) -> None:
        manifest = manifest if manifest is not None else getattr(module, "manifest", None)
        if not isinstance(manifest, dict):
            raise ValueError("Pipeline needs the bundle manifest (pass manifest=, or a module with .manifest)")
        inputs = manifest.get("inputs") or []
        if len(inputs) != 1:
            raise ValueError(f"the model has {len(inputs)} inputs; the camera pipeline feeds one image input")
        self.module = module
        self.manifest = manifest
        self.pre = Preprocessor(inputs[0], manifest.get("preprocess"), resize=resize)
        self._input = self.pre.new_output()
        self.labels = labels if labels is not None else _labels_of(module, manifest)
        self.decoding = Decoding(manifest, postprocessor, self.labels, top_k, options, (self.pre.height, self.pre.width))
        self.postprocessor_name = self.decoding.name
        self.ctx = self.decoding.ctx
        self.keep_raw = keep_raw
        self.frames = 0

    def preprocess(self, image: np.ndarray) -> np.ndarray:
        """The model input for an RGB uint8 frame (the pipeline's reused buffer)."""
        return self.pre(image, self._input)

    def process(self, frame: Frame) -> Result:
        clock = time.perf_counter
        t_begin = time.monotonic()
        t0 = clock()
        x = self.pre(frame.image, self._input)
        t1 = clock()
        outs = self.module.run([x])
        t2 = clock()
        summary = self.decoding(outs, self.pre.geometry(frame.image.shape[:2]))
        t3 = clock()
        self.frames += 1
        timings = {"capture": max(0.0, t_begin - frame.t_capture), "preprocess": t1 - t0,
                   "inference": t2 - t1, "postprocess": t3 - t2}
        return Result(frame.seq, frame.t_capture, timings, summary, frame.source, self.ctx.frame_hw,
                      list(outs) if self.keep_raw else None)

    def process_image(self, image: np.ndarray, seq: int = 0, source: str = "image") -> Result:
        """One RGB uint8 image, not from a source."""
        return self.process(Frame(image, seq, time.monotonic(), source))

    def warmup(self, runs: int = 2) -> None:
        """Run the model on a mid-grey frame: first runs allocate and bind buffers."""
        grey = np.full((self.pre.height, self.pre.width, 3), 128, np.uint8)
        for _ in range(runs):
            self.module.run([self.pre(grey, self._input)])

    def results(self, source: FrameSource, max_frames: int | None = None, timeout: float | None = 5.0):
        """Process the newest frames of a started source until it ends, is stopped, times out
        (``timeout`` seconds without a frame) or ``max_frames`` were processed."""
        n = 0
        while max_frames is None or n < max_frames:
            frame = source.latest(timeout)
            if frame is None:
                return
            yield self.process(frame)
            n += 1
