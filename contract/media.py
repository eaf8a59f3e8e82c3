"""What the manifest says about the pixels going in and the numbers coming out, defined once.

The compiler writes ``manifest["preprocess"]`` and ``manifest["postprocess"]`` with
:func:`preprocess_entry` and :func:`postprocess_entry`; the agent reads them back with
:func:`read_preprocess` and :func:`read_postprocess` (old bundles, written before a key existed,
read as its default). Both refuse a bad value with :class:`MediaError`, one line naming it.

preprocess (a frame, RGB uint8 HxWx3 -> the model's input tensor)::

    {"resize": "stretch" | "letterbox",   # letterbox: keep the aspect ratio, pad the rest
     "align": "center" | "topleft",       # where the letterboxed image sits (YOLO: center)
     "pad_value": 114,                    # 0..255, the padding's grey level (YOLO 114, most others 0)
     "mean": [...], "std": [...],         # per model channel, applied to pixel / scale
     "scale": 255.0 | 1.0,                # 255: pixels in 0..1 before mean/std; 1: raw 0..255
     "bgr": false, "layout": "NCHW"}

postprocess (the model's outputs -> detections)::

    {"decoder": "yolov8", "conf": 0.25, "iou": 0.45, ...}   # the decoder, then only the options
                                                             # given at compile time (DECODERS)

``DECODERS`` names every decoder the agent implements (agent/serve/postprocess.py registers one
function per name; a test keeps the two in step) with its options and their defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import TandoorError

RESIZE_MODES = ("stretch", "letterbox")
ALIGNS = ("center", "topleft")


def guess_layout(shape) -> str:
    """NHWC when a 4-D shape's last axis is 1, 3 or 4 channels (grey, RGB, RGBA) and its second is
    not (MTCNN's 1x48x48x3, Keras exports, M-LSD's 1x320x320x4), else NCHW: what compile records
    and the agent assumes when the user gives no --layout."""
    s = list(shape)
    return "NHWC" if len(s) == 4 and s[3] in (1, 3, 4) and s[1] not in (1, 3, 4) else "NCHW"


#: the dtypes a model input may have, each with how a frame becomes it: float32 is normalised as
#: ``preprocess`` says; uint8 is the resized pixels as they are (TF/MediaPipe exports cast and
#: normalise inside the graph), so mean/std/scale never apply to it
INPUT_DTYPES = {"float32": "pixels normalised as the manifest's preprocess says",
                "uint8": "raw pixels 0..255; the model normalises them in its graph"}


def raw_pixels(dtype: str) -> bool:
    """Whether an input of ``dtype`` takes the frame's pixels as they are (no mean/std/scale)."""
    return dtype == "uint8"


class MediaError(TandoorError, ValueError):
    exit_code = 2
    kind = "media"


# --- preprocess -------------------------------------------------------------------------------------

PREPROCESS_DEFAULTS: dict[str, Any] = {"resize": "stretch", "align": "center", "pad_value": 114,
                                       "mean": None, "std": None, "scale": 255.0, "bgr": False, "layout": None}


def _number_list(v: Any, what: str) -> list[float]:
    if not isinstance(v, (list, tuple)) or not v or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v):
        raise MediaError(f"{what}: expected a non-empty list of numbers, got {v!r}")
    return [float(x) for x in v]


def preprocess_entry(*, resize: str = "stretch", align: str = "center", pad_value: int = 114,
                     mean: list[float] | None = None, std: list[float] | None = None, scale: float = 255.0,
                     bgr: bool = False, layout: str | None = None) -> dict:
    """The manifest's ``preprocess``, checked; every key present."""
    if resize not in RESIZE_MODES:
        raise MediaError(f"resize {resize!r}: choose {' or '.join(RESIZE_MODES)}")
    if align not in ALIGNS:
        raise MediaError(f"letterbox align {align!r}: choose {' or '.join(ALIGNS)}")
    if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)) or not 0 <= pad_value <= 255 \
            or int(pad_value) != pad_value:
        raise MediaError(f"pad value {pad_value!r}: a whole grey level in 0..255 (YOLO pads with 114, most others 0)")
    if scale not in (1.0, 255.0):
        raise MediaError(f"pixel scale {scale!r}: 255 (pixels in 0..1) or 1 (raw 0..255)")
    mean = None if mean is None else _number_list(mean, "mean")
    std = None if std is None else _number_list(std, "std")
    if std is not None and any(s == 0 for s in std):
        raise MediaError("std has a zero; standard deviations must be non-zero")
    if layout not in (None, "NCHW", "NHWC"):
        raise MediaError(f"layout {layout!r}: NCHW or NHWC")
    return {"resize": resize, "align": align, "pad_value": int(pad_value), "mean": mean, "std": std,
            "scale": float(scale), "bgr": bool(bgr), "layout": layout}


def read_preprocess(entry: dict | None) -> dict:
    """A manifest's ``preprocess`` (None for bundles that recorded none) with every key filled in.
    No mean/std means plain ``pixel / scale``."""
    if entry is None:
        return dict(PREPROCESS_DEFAULTS)
    if not isinstance(entry, dict):
        raise MediaError(f"manifest preprocess: expected an object, got {type(entry).__name__}")
    unknown = set(entry) - set(PREPROCESS_DEFAULTS)
    if unknown:
        raise MediaError(f"manifest preprocess: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"this agent knows {', '.join(PREPROCESS_DEFAULTS)} (a newer compiler wrote it?)")
    return preprocess_entry(**{**PREPROCESS_DEFAULTS, **entry})


# --- postprocess ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Option:
    default: Any
    doc: str
    kind: type | tuple = float     # the JSON type(s) the value must have


COMMON = {
    "conf": Option(0.25, "score threshold, 0..1"),
    "iou": Option(0.45, "IoU above which NMS suppresses the lower-scored box, 0..1"),
    "max_det": Option(100, "detections kept per frame at most", int),
    "agnostic": Option(False, "NMS across classes (default: class-aware, per class)", bool),
}


@dataclass(frozen=True)
class DecoderSpec:
    name: str
    doc: str
    options: dict[str, Option] = field(default_factory=dict)   # besides COMMON
    defaults: dict[str, Any] = field(default_factory=dict)     # COMMON defaults of this family

    def all_options(self) -> dict[str, Option]:
        return {**COMMON, **self.options}


_STRIDES = Option([8, 16, 32], "feature strides of the head's levels, in input pixels", list)
DECODERS: dict[str, DecoderSpec] = {d.name: d for d in [
    DecoderSpec("classifier", "(1, N) scores: top-k labels"),
    DecoderSpec("raw", "no decoding: each output's shape and value range"),
    DecoderSpec("yolov5", "(1, anchors, 5 + classes): cx, cy, w, h, objectness, class scores; score = obj x class",
                {"grid": Option(False, "decode the grid outside the graph: (xy + cell) x stride, exp(wh) x stride "
                                       "(YOLOX-style exports)", bool),
                 "strides": _STRIDES}),
    DecoderSpec("yolox", "yolov5 with the grid decoded outside the graph (YOLOX exports)",
                {"grid": Option(True, "decode the grid outside the graph", bool), "strides": _STRIDES}),
    DecoderSpec("yolov8", "(1, 4 + classes, anchors): cx, cy, w, h in input pixels, then class scores "
                          "(Ultralytics YOLOv8/11, DFL decoded in the graph)"),
    DecoderSpec("gfl", "PicoDet / GFL: per level class scores (1, N, C) then box distributions (1, N, 4 x bins); "
                       "boxes from the stride grid",
                {"strides": Option([8, 16, 32, 64], "strides of the levels, in output order", list),
                 "level_top_k": Option(1000, "candidates kept per level before NMS (by best class score)", int)},
                {"conf": 0.5, "iou": 0.5}),
    DecoderSpec("centernet", "heatmap (1, C, h, w) + size (1, 2, h, w) + offset (1, 2, h, w) [+ landmarks "
                             "(1, 2K, h, w)] (CenterNet, CenterFace)",
                {"size": Option("log", "size map encoding: log (exp(s) x stride, CenterFace) or linear "
                                       "(s x stride, CenterNet)", str),
                 "order": Option("yx", "channel order of the size/offset/landmark maps: yx (CenterFace) or xy "
                                       "(CenterNet)", str),
                 "peaks": Option("nms", "nms (every cell above conf, then NMS) or maxpool (3x3 local maxima, "
                                        "CenterNet)", str),
                 "center_offset": Option(0.5, "added to a cell's index for its centre: 0.5 (CenterFace), "
                                              "0 (CenterNet)")},
                {"conf": 0.5, "iou": 0.3}),
    DecoderSpec("ssd", "SSD: box deltas (1, N, 4) + class scores (1, N, C, class 0 background) [+ priors "
                       "(1, 2, 4N) as Caffe's PriorBox writes them]",
                {"variances": Option([0.1, 0.1, 0.2, 0.2], "center-size variances (x, y, w, h)", list),
                 "softmax": Option(False, "apply softmax to the scores (exports that leave it out)", bool),
                 "background": Option(0, "background class id, dropped (-1: none)", int),
                 "loc_order": Option("xy", "delta order: xy (dx, dy, dw, dh; Caffe, PyTorch) or yx (TF)", str),
                 "priors": Option(None, "prior boxes when the model does not output them: "
                                        "{min_sizes: [[..]..], max_sizes: [..], aspect_ratios: [[..]..], steps: [..], "
                                        "flip, clip, offset} per level (PriorBox layers)", (dict, type(None)))},
                {"conf": 0.5, "iou": 0.45}),
]}
_CHOICES = {("centernet", "size"): ("log", "linear"), ("centernet", "order"): ("yx", "xy"),
            ("centernet", "peaks"): ("nms", "maxpool"), ("ssd", "loc_order"): ("xy", "yx")}


def _check_option(decoder: str, key: str, opt: Option, v: Any) -> Any:
    kinds = opt.kind if isinstance(opt.kind, tuple) else (opt.kind,)
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise MediaError(f"decoder {decoder} option {key}={v!r}: expected {names} ({opt.doc})")
    if key in ("conf", "iou") and not 0.0 <= v <= 1.0:
        raise MediaError(f"decoder {decoder} option {key}={v:g}: must be in 0..1")
    if key == "max_det" and v < 1:
        raise MediaError(f"decoder {decoder} option max_det={v}: must be >= 1")
    choices = _CHOICES.get((decoder, key))
    if choices and v not in choices:
        raise MediaError(f"decoder {decoder} option {key}={v!r}: choose {' or '.join(choices)}")
    return v


def decoder_options(name: str, given: dict | None = None) -> dict:
    """Every option of decoder ``name``: ``given`` checked, the rest at their defaults."""
    spec = DECODERS.get(name)
    if spec is None:
        raise MediaError(f"unknown decoder {name!r}; choose from {', '.join(DECODERS)}")
    opts = spec.all_options()
    given = dict(given or {})
    unknown = set(given) - set(opts)
    if unknown:
        raise MediaError(f"decoder {name}: unknown option(s) {', '.join(sorted(unknown))}; it takes "
                         f"{', '.join(opts)}")
    out = {k: spec.defaults.get(k, o.default) for k, o in opts.items()}
    out.update({k: _check_option(name, k, opts[k], v) for k, v in given.items() if v is not None})
    return out


def postprocess_entry(*, decoder: str, **options: Any) -> dict:
    """The manifest's ``postprocess``: the decoder and only the options given (the rest are the
    agent's defaults, so an agent with better defaults applies them)."""
    decoder_options(decoder, options)
    return {"decoder": decoder, **{k: v for k, v in options.items() if v is not None}}


def read_postprocess(entry: dict | None) -> dict | None:
    """A manifest's ``postprocess`` checked: ``{"decoder", **given options}``, or None."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("decoder"), str):
        raise MediaError(f"manifest postprocess: expected {{\"decoder\": NAME, ...}}, got {entry!r}")
    rest = {k: v for k, v in entry.items() if k != "decoder"}
    decoder_options(entry["decoder"], rest)
    return dict(entry)
