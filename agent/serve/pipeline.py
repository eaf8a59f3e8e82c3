"""One frame through the model: preprocess (from the manifest) -> module.run -> postprocess.

    with hmod.open_bundle(path) as b:
        module = HybridModule(b, delegate="onnxruntime")
        pipe = Pipeline(module, module.manifest)          # labels read from the bundle
        with open_source("file:clip.mp4") as cam:
            for frame in cam.frames(timeout=5):
                r = pipe.process(frame)                   # Result: r.top, r.timings, r.to_json()

Per-frame cost outside ``module.run`` is one ``cv2.resize``, one fused normalisation per channel
into a reused input buffer, and a top-k over the output (see :class:`preprocess.Preprocessor`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from . import postprocess as post
from .camera import Frame, FrameSource
from .preprocess import Preprocessor

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


class Pipeline:
    """Preprocess -> ``module.run`` -> postprocess for frames, with per-stage timings.

    ``module``: anything with ``run(list[np.ndarray]) -> list[np.ndarray]`` (a
    :class:`runtime.HybridModule`); ``manifest``: its bundle manifest (default ``module.manifest``);
    ``postprocessor``: a registered name (``auto``, ``classifier``, ``yolov8``, ``raw``, ...) or a
    callable ``fn(outputs, ctx) -> dict``; ``labels``: default the bundle's labels.txt (read once,
    here); ``resize``: see :data:`preprocess.RESIZE_METHODS`; ``options``: for the decoder.

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
        if callable(postprocessor):
            self.postprocessor_name = getattr(postprocessor, "__name__", "custom")
            self._post = postprocessor
        else:
            self.postprocessor_name = post.resolve(postprocessor, manifest)
            self._post = post.get(self.postprocessor_name)
        self.keep_raw = keep_raw
        self.ctx = post.Context(manifest=manifest, labels=self.labels, top_k=top_k,
                                input_hw=(self.pre.height, self.pre.width), options=dict(options or {}))
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
        self.ctx.frame_hw = (frame.image.shape[0], frame.image.shape[1])
        summary = self._post(outs, self.ctx)
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
