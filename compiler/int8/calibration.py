"""Calibration and evaluation images: a directory of images or a video file -> the model's input
tensors, preprocessed exactly as the bundle's device will preprocess camera frames (the agent's
own :class:`Preprocessor`, from the manifest's ``preprocess`` entry as ``tandoor compile`` makes it
from --mean/--std/--resize/...).

A directory gives its images in name order; a video gives ``count`` frames spread evenly over it
(calibration wants the whole scene, not its first second).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandoor_agent.serve.camera import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from tandoor_compiler.errors import CompileError


@dataclass(frozen=True)
class Source:
    """Where the images come from: the image files of a directory, or frames of a video."""
    path: Path
    files: tuple[Path, ...] = ()       # a directory's images
    frames: int = 0                    # a video's frame count

    @property
    def is_video(self) -> bool:
        return not self.files

    @property
    def size(self) -> int:
        return self.frames if self.is_video else len(self.files)

    def describe(self) -> str:
        return f"{self.path.name} ({self.frames} frames)" if self.is_video else f"{self.path} ({len(self.files)} images)"


def open_source(path: str | Path, what: str = "--calibration") -> Source:
    """A directory of images or a video file; CompileError naming the problem otherwise."""
    p = Path(path)
    if p.is_dir():
        files = tuple(sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS))
        if not files:
            raise CompileError(f"{what} {p}: no images in the directory (looked for "
                               f"{', '.join(IMAGE_EXTENSIONS)}); give a directory of images or a video file")
        return Source(p, files=files)
    if not p.exists():
        raise CompileError(f"{what} {p}: no such file or directory; give a directory of images or a video file")
    if p.suffix.lower() not in VIDEO_EXTENSIONS:
        raise CompileError(f"{what} {p}: not a directory of images or a video ({', '.join(VIDEO_EXTENSIONS)})")
    import cv2

    cap = cv2.VideoCapture(str(p))
    try:
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) if cap.isOpened() else 0
        ok = cap.isOpened() and cap.read()[0]
    finally:
        cap.release()
    if not ok or n <= 0:
        raise CompileError(f"{what} {p}: OpenCV cannot decode this video; give another video or a directory of images")
    return Source(p, frames=n)


def pick(size: int, count: int | None) -> list[int]:
    """Indices of ``count`` items (all when None) spread evenly over ``size``."""
    n = size if count is None else min(count, size)
    if n <= 0:
        return []
    idx = np.linspace(0, size - 1, n).round().astype(int).tolist()
    return sorted(set(idx))


def rgb_frames(src: Source, indices: list[int]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, HxWx3 uint8 RGB) for the chosen images or frames, decoded one at a time."""
    if not src.is_video:
        from tandoor_agent.serve.preprocess import load_image

        for i in indices:
            f = src.files[i]
            try:
                yield f.name, load_image(f)
            except Exception as err:
                raise CompileError(f"image {f}: cannot read it ({type(err).__name__}: {err}); remove it or "
                                   "convert it to JPEG/PNG") from None
        return
    import cv2

    cap = cv2.VideoCapture(str(src.path))
    try:
        want, pos = set(indices), 0
        while want:
            ok, bgr = cap.read()
            if not ok:
                break
            if pos in want:
                want.discard(pos)
                yield f"{src.path.name}#{pos}", cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            pos += 1
    finally:
        cap.release()


def tensors(src: Source, indices: list[int], spec: dict, preprocess: dict | None) -> Iterator[np.ndarray]:
    """The model input for each chosen image, as the device makes it from a frame."""
    from tandoor_agent.serve.preprocess import Preprocessor

    try:
        pre = Preprocessor(spec, preprocess)
    except ValueError as err:
        raise CompileError(f"the model's input cannot take images: {err}") from None
    for _, rgb in rgb_frames(src, indices):
        yield pre(rgb)


# --- calibration runs: what `compile --int8`, `compile --npu` and `tandoor quantize` feed ----------

DEFAULT_VIDEO_FRAMES = 300   # frames of a video calibration spreads over (a directory: all its images)
NPU_FRAMES = 50              # frames of a video for --npu, every fifth held out for the check


def _samples_for(src: Source, n: int, model_inputs, opts) -> tuple[dict | None, Iterator[list[np.ndarray]]]:
    """The manifest's preprocess for ``opts`` (pipeline.Options' preprocessing fields) and the
    model inputs made from ``n`` images of ``src`` by it, as the device will make them."""
    from tandoor_contract import media

    from ..pipeline import preprocess_entry

    if len(model_inputs) != 1:
        raise CompileError(f"the model has {len(model_inputs)} inputs; calibration from images feeds one image input")
    first = model_inputs[0]
    pre = preprocess_entry(opts, list(first.shape), first.dtype)
    spec = {**first.as_dict(), "layout": opts.layout or media.guess_layout(first.shape)}
    return pre, ([x] for x in tensors(src, pick(src.size, n), spec, pre))


def npu_samples(model, calibration, count: int | None, opts) -> list[list[np.ndarray]]:
    """The model inputs --npu calibrates (and checks) on: ``calibration``'s images or video frames
    (``count`` of them; default a directory's all, NPU_FRAMES of a video), preprocessed as the
    device will by ``opts`` (pipeline.Options)."""
    from ..stages import frontend

    loaded = frontend.load(model, list(opts.inputs))
    src = open_source(calibration)
    n = count if count is not None else (min(NPU_FRAMES, src.size) if src.is_video else src.size)
    return list(_samples_for(src, n, loaded.inputs, opts)[1])


def quantize_on_images(model, out, calibration, count: int | None, opts, *, method: str = "minmax",
                       per_channel: bool = True, activations: str | None = None, keep_fp32=(), lead: bool = True,
                       report_samples: int = 4, on_event=None) -> dict:
    """MODEL -> the QDQ model OUT, calibrated on ``count`` images of ``calibration`` preprocessed
    as ``opts`` (pipeline.Options: inputs, targets and the preprocessing fields) says: what
    `tandoor quantize` and `compile --int8` both run. ``on_event(name, data)`` hears
    ("calibrating", {"done", "total"}) and ("say", {"message"}). Returns quantize_model's summary
    with ``preprocess`` (the manifest entry used) and ``source`` (where the images came from)."""
    from .quantize import quantize_model

    tell = on_event or (lambda name, data: None)
    src = open_source(calibration)
    n = count if count is not None else (DEFAULT_VIDEO_FRAMES if src.is_video else src.size)
    if n > src.size:
        raise CompileError(f"--images {n}: {src.describe()} has only {src.size}; give --images {src.size} or "
                           "more images")
    chosen: dict = {"calibration": src.describe()}     # recorded in the model; preprocess once it is known

    def samples(model_inputs):
        chosen["preprocess"], it = _samples_for(src, n, model_inputs, opts)
        return it

    res = quantize_model(model, out, calibration=samples, count=n, inputs=list(opts.inputs), method=method,
                         per_channel=per_channel, activations=activations, targets=list(opts.targets),
                         keep_fp32=keep_fp32, lead=lead, report_samples=report_samples, metadata=chosen,
                         progress=lambda done, total: tell("calibrating", {"done": done, "total": total}),
                         say=lambda m: tell("say", {"message": m}))
    res["preprocess"] = chosen.get("preprocess")
    res["source"] = src.describe()
    return res
