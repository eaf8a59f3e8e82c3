"""Model outputs -> a small, JSON-able result summary. Postprocessors are looked up by name.

A postprocessor (decoder) is ``fn(outputs: list[np.ndarray], ctx: Context) -> dict``: the model's
raw outputs in manifest order, and the context of the run (labels, top-k, input and frame size,
options). It returns a dict with at least ``kind``; by convention:

- ``classifier``: ``{"kind": "classifier", "top": [(label, score), ...], "class_ids": [...]}``
- detectors: ``{"kind": "detector", "detections": [{"box": [x1, y1, x2, y2], "score", "class_id",
  "label"}, ...]}`` with boxes in *frame* pixels (``ctx.to_frame`` maps input-pixel boxes back:
  the pipeline stretches frames to the input size)
- ``raw``: shapes and value ranges of every output (models nobody registered a decoder for)

``register_decoder(name, fn)`` adds one (also usable as a decorator). ``resolve("auto", manifest)``
picks: the manifest's ``postprocess.decoder`` when a compiler recorded one, else ``classifier`` when
the first output is ``(1, N)``, else ``raw``. Built in: ``classifier``, ``yolov8`` (the raw
``(1, 4 + classes, anchors)`` head of Ultralytics YOLOv8/11 exports, with NMS), ``raw``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np



@dataclass
class Context:
    manifest: dict
    labels: list[str] | None = None
    top_k: int = 5
    input_hw: tuple[int, int] = (0, 0)  # model input (height, width)
    frame_hw: tuple[int, int] = (0, 0)  # the frame being processed (height, width)
    options: dict = field(default_factory=dict)  # decoder options, e.g. conf, iou

    def label(self, i: int) -> str:
        i = int(i)
        return self.labels[i] if self.labels and 0 <= i < len(self.labels) else str(i)

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        """x1, y1, x2, y2 boxes in input pixels -> frame pixels, clipped to the frame."""
        (ih, iw), (fh, fw) = self.input_hw, self.frame_hw
        if not (ih and iw and fh and fw):
            return boxes
        out = boxes.astype(np.float32) * np.array([fw / iw, fh / ih, fw / iw, fh / ih], np.float32)
        np.clip(out, 0, [fw, fh, fw, fh], out=out)
        return out


Decoder = Callable[[list[np.ndarray], Context], dict]
_REGISTRY: dict[str, Decoder] = {}


def register_decoder(name: str, fn: Decoder | None = None, *, replace: bool = False):
    """Register ``fn`` under ``name``; as a decorator when ``fn`` is omitted. Registering a taken
    name raises ValueError unless ``replace``."""

    def add(f: Decoder) -> Decoder:
        if not callable(f):
            raise TypeError(f"decoder {name!r} is not callable")
        if name == "auto":
            raise ValueError("'auto' is reserved")
        if name in _REGISTRY and not replace and _REGISTRY[name] is not f:
            raise ValueError(f"a decoder named {name!r} is already registered (pass replace=True)")
        _REGISTRY[name] = f
        return f

    return add if fn is None else add(fn)


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> Decoder:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown postprocessor {name!r}; choose from auto, {', '.join(names())}") from None


def _is_classifier_output(shape) -> bool:
    return len(shape) == 2 and shape[0] == 1 and shape[1] > 1


def resolve(name: str | None, manifest: dict) -> str:
    """The decoder name to use: ``name`` itself, or for ``auto``/None what the manifest implies."""
    if name and name != "auto":
        get(name)
        return name
    hint = (manifest.get("postprocess") or {}).get("decoder") if isinstance(manifest.get("postprocess"), dict) else None
    if hint and hint in _REGISTRY:
        return hint
    outs = manifest.get("outputs") or []
    if outs and _is_classifier_output(outs[0].get("shape") or []):
        return "classifier"
    return "raw"


# --- classifier ------------------------------------------------------------------------------------

@register_decoder("classifier")
def classifier(outputs: list[np.ndarray], ctx: Context) -> dict:
    """Top-k (label, score): scores are the output itself when it already is a probability
    vector (non-negative, sums to 1), else its softmax (the same rule and numbers as
    ``preprocess.softmax_if_logits``, computed for the top k only). Ties: lower class id first."""
    v = np.asarray(outputs[0]).reshape(-1)
    n = v.size
    k = max(1, min(int(ctx.top_k), n))
    # softmax is monotonic: pick the top k on the raw values, normalise only those
    if k < n:  # the k largest, plus everything tied with the k-th (so ties break by class id)
        idx = np.flatnonzero(v >= v[np.argpartition(v, n - k)[n - k]])
    else:
        idx = np.arange(n)
    top = v[idx].astype(np.float64)
    order = np.lexsort((idx, -top))[:k]
    idx, top = idx[order], top[order]
    if v.min() >= 0 and abs(float(v.sum(dtype=np.float64)) - 1.0) < 1e-3:
        scores = top
    else:
        m = top[0]
        scores = np.exp(top - m) / np.exp(v.astype(np.float64) - m).sum()
    return {"kind": "classifier", "top": [(ctx.label(i), float(sc)) for i, sc in zip(idx.tolist(), scores.tolist())],
            "class_ids": idx.tolist()}


# --- raw ---------------------------------------------------------------------------------------

@register_decoder("raw")
def raw(outputs: list[np.ndarray], ctx: Context) -> dict:
    specs = ctx.manifest.get("outputs") or []
    out = []
    for j, o in enumerate(outputs):
        o = np.asarray(o)
        e = {"name": specs[j]["name"] if j < len(specs) else f"output_{j}", "shape": list(o.shape)}
        if o.size:
            e.update(min=float(o.min()), max=float(o.max()), mean=float(o.mean()))
        out.append(e)
    return {"kind": "raw", "outputs": out}


# --- detectors ---------------------------------------------------------------------------------

def nms(boxes: np.ndarray, scores: np.ndarray, iou: float = 0.45, max_det: int = 300) -> np.ndarray:
    """Greedy non-maximum suppression. boxes: Nx4 x1,y1,x2,y2; returns kept indices, best first."""
    if len(boxes) == 0:
        return np.zeros(0, np.int64)
    x1, y1, x2, y2 = (boxes[:, i].astype(np.float32) for i in range(4))
    area = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size and len(keep) < max_det:
        i = order[0]
        keep.append(i)
        rest = order[1:]
        w = np.maximum(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0)
        h = np.maximum(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0)
        inter = w * h
        union = area[i] + area[rest] - inter
        order = rest[inter <= iou * np.maximum(union, 1e-9)]
    return np.asarray(keep, np.int64)


def detections(boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, ctx: Context) -> dict:
    """The detector summary from input-pixel boxes (mapped to the frame here)."""
    fb = ctx.to_frame(np.asarray(boxes, np.float32).reshape(-1, 4))
    return {"kind": "detector", "detections": [
        {"box": [round(float(v), 1) for v in b], "score": float(s), "class_id": int(c), "label": ctx.label(c)}
        for b, s, c in zip(fb, scores, class_ids)]}


@register_decoder("yolov8")
def yolov8(outputs: list[np.ndarray], ctx: Context) -> dict:
    """Ultralytics YOLOv8/YOLO11 raw head: (1, 4 + classes, anchors), rows cx, cy, w, h in input
    pixels then per-class scores (already sigmoid). Options: conf (0.25), iou (0.45), max_det (100);
    class-aware NMS."""
    p = np.asarray(outputs[0])
    if p.ndim != 3 or p.shape[0] != 1 or p.shape[1] < 5:
        raise ValueError(f"yolov8 decoder: expected a (1, 4 + classes, anchors) output, got {p.shape}")
    if p.shape[1] > p.shape[2]:  # (1, anchors, 4 + classes) exports
        p = p.transpose(0, 2, 1)
    p = p[0]
    conf, iou = float(ctx.options.get("conf", 0.25)), float(ctx.options.get("iou", 0.45))
    max_det = int(ctx.options.get("max_det", 100))
    cls_scores = p[4:]
    cls = cls_scores.argmax(0)
    score = cls_scores[cls, np.arange(p.shape[1])]
    m = score >= conf
    if not m.any():
        return {"kind": "detector", "detections": []}
    cx, cy, w, h = p[0, m], p[1, m], p[2, m], p[3, m]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    score, cls = score[m], cls[m]
    # class-aware: offset boxes per class so different classes never suppress each other
    offset = cls[:, None].astype(np.float32) * (float(max(ctx.input_hw)) + 1.0 if any(ctx.input_hw) else 1e4)
    keep = nms(boxes + offset, score, iou, max_det)
    return detections(boxes[keep], score[keep], cls[keep], ctx)
