"""Model outputs -> a small, JSON-able result summary. Postprocessors (decoders) by name.

A decoder is ``fn(outputs: list[np.ndarray], ctx: Context) -> dict``: the model's raw outputs in
manifest order, and the context of the run (labels, top-k, input size, the frame's size and
preprocessing geometry, options). It returns a dict with at least ``kind``:

- ``classifier``: ``{"kind": "classifier", "top": [(label, score), ...], "class_ids": [...]}``
- detectors: ``{"kind": "detector", "detections": [{"box": [x1, y1, x2, y2], "score", "class_id",
  "label"[, "landmarks": [[x, y], ...]]}, ...]}``, boxes in *frame* pixels: ``ctx.to_frame`` maps
  input-pixel boxes back through the exact stretch or letterbox (:class:`preprocess.Geometry`)
- ``raw``: shapes and value ranges of every output (models nobody registered a decoder for)

Built in, one per name of ``tandoor_contract.media.DECODERS`` (their options and defaults are
there): ``classifier``, ``raw``, ``yolov5`` / ``yolox`` (objectness x class, the grid decoded here
for YOLOX), ``yolov8``, ``gfl`` (PicoDet), ``centernet`` (CenterNet, CenterFace with landmarks),
``ssd`` (priors + variances, as Caffe's DetectionOutput). NMS is OpenCV's (class-aware unless
``agnostic``). ``register_decoder(name, fn)`` adds one (also as a decorator);
``resolve("auto", manifest)`` picks the manifest's ``postprocess.decoder`` when a compiler
recorded one, else ``classifier`` when the first output is ``(1, N)``, else ``raw``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tandoor_contract import media

from .preprocess import Geometry


@dataclass
class Context:
    manifest: dict
    labels: list[str] | None = None
    top_k: int = 5
    input_hw: tuple[int, int] = (0, 0)  # model input (height, width)
    frame_hw: tuple[int, int] = (0, 0)  # the frame being processed (height, width)
    options: dict = field(default_factory=dict)  # decoder options, e.g. conf, iou (tandoor_contract.media)
    geometry: Geometry | None = None  # how this frame was put into the input (the preprocessor's)

    def label(self, i: int) -> str:
        i = int(i)
        return self.labels[i] if self.labels and 0 <= i < len(self.labels) else str(i)

    def _geometry(self) -> Geometry | None:
        g = self.geometry
        if g is not None and tuple(g.frame_hw) == tuple(self.frame_hw):
            return g
        (ih, iw), (fh, fw) = self.input_hw, self.frame_hw
        if not (ih and iw and fh and fw):
            return None
        return Geometry.of((fh, fw), (ih, iw))  # no preprocessor said otherwise: a stretch

    def to_frame(self, boxes: np.ndarray) -> np.ndarray:
        """x1, y1, x2, y2 boxes in input pixels -> frame pixels, clipped to the frame, through
        the exact stretch or letterbox the frame went through."""
        g = self._geometry()
        return np.asarray(boxes, np.float32) if g is None else g.to_frame(boxes)

    def points_to_frame(self, pts: np.ndarray) -> np.ndarray:
        g = self._geometry()
        return np.asarray(pts, np.float32) if g is None else g.points_to_frame(pts)


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


def is_classifier_output(shape) -> bool:
    """One row of scores: (1, N), or (1, N, 1, 1) as a classifier ending in a 1x1 conv and a
    global pool writes it (SqueezeNet); two axes over 1 are a map, not scores."""
    rest = [int(d) for d in shape[1:]]
    return len(shape) >= 2 and shape[0] == 1 and sum(d > 1 for d in rest) == 1 and max(rest) > 1


def resolve(name: str | None, manifest: dict) -> str:
    """The decoder name to use: ``name`` itself, or for ``auto``/None what the manifest implies."""
    if name and name != "auto":
        get(name)
        return name
    hint = (manifest.get("postprocess") or {}).get("decoder") if isinstance(manifest.get("postprocess"), dict) else None
    if hint and hint in _REGISTRY:
        return hint
    outs = manifest.get("outputs") or []
    if outs and is_classifier_output(outs[0].get("shape") or []) and not _per_anchor(outs):
        return "classifier"
    return "raw"


def _per_anchor(outs: list[dict]) -> bool:
    """The first output is one score per anchor, not per class: another output has as many rows
    and several values in each (BlazeFace: scores (1, 512, 1) beside boxes (1, 512, 16); SSD's
    (1, N) beside (1, N, 4)). MTCNN's R-Net, (1, 2) beside (1, 4), stays a classifier."""
    first = [int(d) for d in outs[0].get("shape") or []]
    if len(first) < 2 or first[1] <= 1:
        return False
    for o in outs[1:]:
        shape = [int(d) for d in o.get("shape") or []]
        if len(shape) >= 3 and shape[1] == first[1] and math.prod(shape[2:]) > 1:
            return True
    return False


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
#
# Every detector decoder ends in _finish: candidate boxes in input pixels -> class-aware (or
# agnostic) NMS in OpenCV (C++, vectorised over the candidates) -> max_det -> frame pixels through
# the exact preprocessing geometry. Nothing loops per box in Python except building the JSON.

PRE_NMS_MAX = 30000  # candidates handed to NMS at most (the best scores), as Ultralytics caps them


def _options(name: str, ctx: Context) -> dict:
    return media.decoder_options(name, ctx.options)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float = 0.45, max_det: int = 300,
        class_ids: np.ndarray | None = None) -> np.ndarray:
    """Greedy non-maximum suppression (OpenCV's ``dnn.NMSBoxes``; per class with ``class_ids``,
    ``NMSBoxesBatched``). boxes: Nx4 x1, y1, x2, y2; returns the kept indices, best first (ties:
    lower index first). A box is suppressed when its IoU with a better one exceeds ``iou``."""
    import cv2

    n = len(boxes)
    if n == 0:
        return np.zeros(0, np.int64)
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    xywh = np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], 1)
    sc = np.asarray(scores, np.float32).reshape(-1)
    floor = float(sc.min())
    if floor <= 0:  # OpenCV keeps scores above its threshold (>= 0): shift so that none is dropped
        sc = sc - floor + 1.0
    if class_ids is None:
        keep = cv2.dnn.NMSBoxes(xywh, sc, 0.0, float(iou))
    else:
        keep = cv2.dnn.NMSBoxesBatched(xywh, sc, np.asarray(class_ids, np.int32).reshape(-1), 0.0, float(iou))
    return np.asarray(keep, np.int64).reshape(-1)[:max_det]


def _finish(ctx: Context, o: dict, boxes: np.ndarray, scores: np.ndarray, cls: np.ndarray,
            extra: dict[str, np.ndarray] | None = None) -> dict:
    """Candidates (input pixels) -> NMS -> the detector summary in frame pixels."""
    if len(scores) > PRE_NMS_MAX:
        top = np.argpartition(-scores, PRE_NMS_MAX - 1)[:PRE_NMS_MAX]
        boxes, scores, cls = boxes[top], scores[top], cls[top]
        extra = {k: v[top] for k, v in (extra or {}).items()}
    keep = nms(boxes, scores, o["iou"], o["max_det"], None if o["agnostic"] else cls)
    return detections(boxes[keep], scores[keep], cls[keep], ctx,
                      {k: v[keep] for k, v in (extra or {}).items()})


def detections(boxes: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, ctx: Context,
               extra: dict[str, np.ndarray] | None = None) -> dict:
    """The detector summary from input-pixel boxes (mapped to the frame here). ``extra``:
    per-box arrays carried along; ``landmarks`` (N x K x 2 input pixels) are mapped too."""
    fb = ctx.to_frame(np.asarray(boxes, np.float32).reshape(-1, 4)).astype(np.float64).round(1)
    seen = (fb[:, 2] > fb[:, 0]) & (fb[:, 3] > fb[:, 1])  # a box wholly outside the frame is no detection
    extra = {k: np.asarray(v)[seen] for k, v in (extra or {}).items()}
    fb = fb[seen].tolist()
    sc = np.asarray(scores, np.float64).reshape(-1)[seen].round(5).tolist()
    ci = np.asarray(class_ids).reshape(-1)[seen].astype(int).tolist()
    dets = [{"box": b, "score": s, "class_id": c, "label": ctx.label(c)} for b, s, c in zip(fb, sc, ci)]
    lm = (extra or {}).get("landmarks")
    if lm is not None and len(dets):
        for d, pts in zip(dets, ctx.points_to_frame(lm).astype(np.float64).round(1).tolist()):
            d["landmarks"] = pts
    return {"kind": "detector", "detections": dets}


def _empty() -> dict:
    return {"kind": "detector", "detections": []}


def _head(p: np.ndarray, name: str, rows_min: int, layout: str) -> np.ndarray:
    """One (1, A, K) or (1, K, A) head as (A, K): anchors are the longer axis."""
    p = np.asarray(p)
    if p.ndim == 2:
        p = p[None]
    if p.ndim != 3 or p.shape[0] != 1 or min(p.shape[1:]) < rows_min:
        raise ValueError(f"{name} decoder: expected a {layout} output, got {tuple(p.shape)}")
    return p[0].T if p.shape[1] < p.shape[2] else p[0]


def _xywh_to_xyxy(b: np.ndarray) -> np.ndarray:
    half = b[:, 2:4] / 2
    return np.concatenate([b[:, :2] - half, b[:, :2] + half], 1)


@register_decoder("yolov8")
def yolov8(outputs: list[np.ndarray], ctx: Context) -> dict:
    """Ultralytics YOLOv8/YOLO11 head: (1, 4 + classes, anchors) (or transposed), rows cx, cy, w,
    h in input pixels then per-class scores (sigmoid applied in the graph), no objectness."""
    o = _options("yolov8", ctx)
    p = _head(outputs[0], "yolov8", 5, "(1, 4 + classes, anchors)")
    cls_scores = p[:, 4:]
    cls = cls_scores.argmax(1)
    score = np.take_along_axis(cls_scores, cls[:, None], 1)[:, 0]
    m = score > o["conf"]
    if not m.any():
        return _empty()
    return _finish(ctx, o, _xywh_to_xyxy(p[m, :4]), score[m], cls[m])


@functools.lru_cache(maxsize=16)
def _grid(h: int, w: int, strides: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(cells Nx2 x, y; stride Nx1) of an anchor-free head, level by level, row-major."""
    cells, st = [], []
    for s in strides:
        ys, xs = np.mgrid[0:h // s, 0:w // s]
        cells.append(np.stack([xs.ravel(), ys.ravel()], 1))
        st.append(np.full((xs.size, 1), s))
    return np.concatenate(cells).astype(np.float32), np.concatenate(st).astype(np.float32)


def _yolo_objectness(name: str, outputs: list[np.ndarray], ctx: Context) -> dict:
    o = _options(name, ctx)
    p = _head(outputs[0], name, 6, "(1, anchors, 5 + classes)")
    obj_cls = p[:, 5:] * p[:, 4:5]
    cls = obj_cls.argmax(1)
    score = np.take_along_axis(obj_cls, cls[:, None], 1)[:, 0]
    m = score > o["conf"]
    if not m.any():
        return _empty()
    xywh = p[m, :4].astype(np.float32)
    if o["grid"]:
        h, w = ctx.input_hw
        cells, stride = _grid(int(h), int(w), tuple(int(s) for s in o["strides"]))
        if len(cells) != len(p):
            raise ValueError(f"{name} decoder: {len(p)} anchors, but strides {o['strides']} on a {w}x{h} input "
                             f"make {len(cells)} cells; set the decoder option strides")
        xywh[:, :2] = (xywh[:, :2] + cells[m]) * stride[m]
        xywh[:, 2:4] = np.exp(xywh[:, 2:4]) * stride[m]
    return _finish(ctx, o, _xywh_to_xyxy(xywh), score[m], cls[m])


@register_decoder("yolov5")
def yolov5(outputs: list[np.ndarray], ctx: Context) -> dict:
    """YOLOv5-style head (1, anchors, 5 + classes): cx, cy, w, h, objectness, class scores
    (sigmoid applied); score = objectness x class. With ``grid`` the box is decoded here from the
    anchor-free stride grid, as YOLOX exports leave it: (xy + cell) x stride, exp(wh) x stride."""
    return _yolo_objectness("yolov5", outputs, ctx)


@register_decoder("yolox")
def yolox(outputs: list[np.ndarray], ctx: Context) -> dict:
    """YOLOX exports: :func:`yolov5` with the grid decoded here (strides 8, 16, 32)."""
    return _yolo_objectness("yolox", outputs, ctx)


def _level_strides(counts: list[int], h: int, w: int, given: list[int]) -> list[int]:
    """Each level's stride: the given one when its ceil grid has that many cells, else the power
    of two that has."""
    out = []
    for i, n in enumerate(counts):
        cand = ([int(given[i])] if i < len(given) else []) + [4, 8, 16, 32, 64, 128]
        s = next((s for s in cand if math.ceil(h / s) * math.ceil(w / s) == n), None)
        if s is None:
            raise ValueError(f"gfl decoder: level {i} has {n} locations; no stride makes that many cells on a "
                             f"{w}x{h} input")
        out.append(s)
    return out


@register_decoder("gfl")
def gfl(outputs: list[np.ndarray], ctx: Context) -> dict:
    """PicoDet / GFL head: L class-score outputs (1, N_l, C) (sigmoid applied), then L box
    outputs (1, N_l, 4 x (reg_max + 1)) of distribution bins. Per level: centres (cell + 0.5) x
    stride on the ceil grid, the best ``level_top_k`` locations, distances = softmax(bins) .
    arange(bins) x stride, box = centre -/+ (left, top, right, bottom). A location may give several
    classes (one candidate per class above conf), as PicoDet's per-class NMS does."""
    o = _options("gfl", ctx)
    if len(outputs) < 2 or len(outputs) % 2:
        raise ValueError(f"gfl decoder: expected score and box outputs per level (an even number), got {len(outputs)}")
    L = len(outputs) // 2
    scores = [np.asarray(x).reshape(x.shape[-2], x.shape[-1]) for x in outputs[:L]]
    dists = [np.asarray(x).reshape(x.shape[-2], x.shape[-1]) for x in outputs[L:]]
    if any(s.shape[0] != d.shape[0] or d.shape[1] % 4 for s, d in zip(scores, dists)):
        raise ValueError("gfl decoder: score and box outputs do not pair up level by level "
                         f"({[s.shape for s in scores]} vs {[d.shape for d in dists]})")
    h, w = (int(v) for v in ctx.input_hw)
    strides = _level_strides([s.shape[0] for s in scores], h, w, list(o["strides"]))
    k = int(o["level_top_k"])
    boxes, sc, cl = [], [], []
    for s, d, stride in zip(scores, dists, strides):
        best = s.max(1)
        idx = np.argpartition(-best, k - 1)[:k] if len(best) > k else np.arange(len(best))
        loc, c = np.nonzero(s[idx] > o["conf"])
        if not len(loc):
            continue
        rows = idx[loc]
        bins = d[rows].reshape(len(rows), 4, -1).astype(np.float64)
        e = np.exp(bins - bins.max(2, keepdims=True))
        dist = (e / e.sum(2, keepdims=True)) @ np.arange(bins.shape[2], dtype=np.float64) * stride
        gw = math.ceil(w / stride)
        centre = np.stack([(rows % gw + 0.5) * stride, (rows // gw + 0.5) * stride], 1)
        boxes.append(np.concatenate([centre - dist[:, :2], centre + dist[:, 2:]], 1).astype(np.float32))
        sc.append(s[rows, c])
        cl.append(c)
    if not boxes:
        return _empty()
    b = np.concatenate(boxes)
    np.clip(b, 0, [w, h, w, h], out=b)  # PicoDet clips in input pixels
    return _finish(ctx, o, b, np.concatenate(sc), np.concatenate(cl))


@register_decoder("centernet")
def centernet(outputs: list[np.ndarray], ctx: Context) -> dict:
    """CenterNet-style maps at one stride: heatmap (1, C, h, w) (sigmoid applied), size (1, 2, h,
    w), offset (1, 2, h, w) [, landmarks (1, 2K, h, w), relative to the box's top left in box
    sizes]. Peaks: every cell above conf then NMS (CenterFace), or 3x3 local maxima (CenterNet)."""
    import cv2

    o = _options("centernet", ctx)
    if len(outputs) < 3:
        raise ValueError(f"centernet decoder: expected heatmap, size and offset outputs, got {len(outputs)}")
    heat, size, off = (np.asarray(x)[0] for x in outputs[:3])
    lmk = np.asarray(outputs[3])[0] if len(outputs) > 3 else None
    if heat.ndim != 3 or size.shape != (2, *heat.shape[1:]) or off.shape != size.shape:
        raise ValueError(f"centernet decoder: heatmap/size/offset shapes {heat.shape}, {size.shape}, {off.shape} "
                         f"do not fit (1, C, h, w), (1, 2, h, w), (1, 2, h, w)")
    stride = ctx.input_hw[0] / heat.shape[1] if ctx.input_hw[0] else 4.0
    peak = heat > o["conf"]
    if o["peaks"] == "maxpool":
        kernel = np.ones((3, 3), np.uint8)
        peak &= np.stack([heat[c] >= cv2.dilate(heat[c], kernel) for c in range(len(heat))])
    c, iy, ix = np.nonzero(peak)
    if not len(c):
        return _empty()
    yx = o["order"] == "yx"
    sy, sx = (size[0], size[1]) if yx else (size[1], size[0])
    oy, ox = (off[0], off[1]) if yx else (off[1], off[0])
    bh, bw = sy[iy, ix], sx[iy, ix]
    if o["size"] == "log":
        bh, bw = np.exp(bh) * stride, np.exp(bw) * stride
    else:
        bh, bw = bh * stride, bw * stride
    cx = (ix + ox[iy, ix] + o["center_offset"]) * stride
    cy = (iy + oy[iy, ix] + o["center_offset"]) * stride
    boxes = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1).astype(np.float32)
    extra = None
    if lmk is not None and lmk.shape[0] % 2 == 0 and lmk.shape[1:] == heat.shape[1:]:
        pts = lmk[:, iy, ix].T.reshape(len(c), -1, 2)  # per box: K pairs in the maps' order
        if yx:
            pts = pts[:, :, ::-1]
        pts = pts * np.stack([bw, bh], 1)[:, None, :] + boxes[:, None, :2]
        extra = {"landmarks": pts.astype(np.float32)}
    ih, iw = ctx.input_hw
    if ih and iw:
        np.clip(boxes, 0, [iw, ih, iw, ih], out=boxes)
    return _finish(ctx, o, boxes, heat[c, iy, ix], c, extra)


# --- SSD --------------------------------------------------------------------------------------------

def prior_boxes(spec: dict, input_hw: tuple[int, int]) -> np.ndarray:
    """Caffe SSD's PriorBox layers, level by level: Nx4 normalised x1, y1, x2, y2. ``spec``:
    min_sizes [[..] per level], max_sizes [[..] or [] per level], aspect_ratios [[..] per level],
    steps [..], feature_maps [[h, w] per level] (default ceil(input / step)), flip (true), clip
    (false), offset (0.5). Per cell: each min size, sqrt(min x max), then each aspect ratio."""
    ih, iw = input_hw
    mins = spec["min_sizes"]
    L = len(mins)
    maxs = spec.get("max_sizes") or [[]] * L
    ars = spec.get("aspect_ratios") or [[]] * L
    steps = spec.get("steps") or [None] * L
    fms = spec.get("feature_maps") or [None] * L
    flip, clip, offset = spec.get("flip", True), spec.get("clip", False), float(spec.get("offset", 0.5))
    out = []
    for lv in range(L):
        step = steps[lv]
        fh, fw = fms[lv] or (math.ceil(ih / step), math.ceil(iw / step))
        sh, sw = (step, step) if step else (ih / fh, iw / fw)
        ratios = [1.0]
        for a in ars[lv]:
            for r in ([a, 1.0 / a] if flip else [a]):
                if all(abs(r - q) > 1e-6 for q in ratios):
                    ratios.append(r)
        wh = []  # the boxes of one cell, in Caffe's order
        for k, m in enumerate(mins[lv]):
            wh.append((m, m))
            if maxs[lv]:
                wh.append((math.sqrt(m * maxs[lv][k]),) * 2)
            wh.extend((m * math.sqrt(r), m / math.sqrt(r)) for r in ratios[1:])
        wh = np.asarray(wh, np.float64)
        ys, xs = np.mgrid[0:fh, 0:fw]
        cx = ((xs.ravel() + offset) * sw)[:, None]
        cy = ((ys.ravel() + offset) * sh)[:, None]
        b = np.stack([(cx - wh[:, 0] / 2) / iw, (cy - wh[:, 1] / 2) / ih,
                      (cx + wh[:, 0] / 2) / iw, (cy + wh[:, 1] / 2) / ih], 2).reshape(-1, 4)
        out.append(b)
    pri = np.concatenate(out).astype(np.float32)
    return np.clip(pri, 0, 1) if clip else pri


def ssd_decode(loc: np.ndarray, priors: np.ndarray, variances, loc_order: str = "xy") -> np.ndarray:
    """Caffe's DecodeBBox (CENTER_SIZE): deltas Nx4 against corner-form priors Nx4 with
    variances (4 or Nx4) -> corner-form boxes Nx4, in the priors' units."""
    d = np.asarray(loc, np.float32).reshape(-1, 4)
    if loc_order == "yx":
        d = d[:, [1, 0, 3, 2]]
    v = np.asarray(variances, np.float32)
    pw, ph = priors[:, 2] - priors[:, 0], priors[:, 3] - priors[:, 1]
    pcx, pcy = (priors[:, 0] + priors[:, 2]) / 2, (priors[:, 1] + priors[:, 3]) / 2
    v = v.reshape(-1, 4)
    cx = v[:, 0] * d[:, 0] * pw + pcx
    cy = v[:, 1] * d[:, 1] * ph + pcy
    w = np.exp(v[:, 2] * d[:, 2]) * pw
    h = np.exp(v[:, 3] * d[:, 3]) * ph
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


@functools.lru_cache(maxsize=8)
def _cached_priors(spec_json: str, h: int, w: int) -> np.ndarray:
    import json

    return prior_boxes(json.loads(spec_json), (h, w))


@register_decoder("ssd")
def ssd(outputs: list[np.ndarray], ctx: Context) -> dict:
    """SSD: box deltas (1, N, 4) and class scores (1, N, C) (class ``background`` dropped), the
    priors either a third output as Caffe's PriorBox writes it ((1, 2, 4N): corner boxes
    normalised to the input, then their variances) or generated from the ``priors`` option.
    Decoded as Caffe's DetectionOutput does (CENTER_SIZE), one candidate per class above conf."""
    import json

    o = _options("ssd", ctx)
    if len(outputs) < 2:
        raise ValueError(f"ssd decoder: expected box deltas and class scores, got {len(outputs)} output(s)")
    loc = np.asarray(outputs[0], np.float32).reshape(-1, 4)
    n = len(loc)
    conf = np.asarray(outputs[1], np.float32).reshape(n, -1) if np.asarray(outputs[1]).size % n == 0 else None
    if conf is None:
        raise ValueError(f"ssd decoder: {n} boxes but a score output of shape {np.asarray(outputs[1]).shape}")
    ih, iw = (int(v) for v in ctx.input_hw)
    if len(outputs) > 2:
        pr = np.asarray(outputs[2], np.float32).reshape(-1)
        if pr.size != 8 * n:
            raise ValueError(f"ssd decoder: the priors output has {pr.size} values, expected 2 x 4 x {n}")
        priors, variances = pr[:4 * n].reshape(n, 4), pr[4 * n:].reshape(n, 4)
    elif o["priors"]:
        priors, variances = _cached_priors(json.dumps(o["priors"], sort_keys=True), ih, iw), o["variances"]
        if len(priors) != n:
            raise ValueError(f"ssd decoder: the priors option makes {len(priors)} boxes, the model gives {n}")
    else:
        raise ValueError("ssd decoder: the model outputs no priors; set the decoder option priors")
    if o["softmax"]:
        e = np.exp(conf - conf.max(1, keepdims=True))
        conf = e / e.sum(1, keepdims=True)
    if 0 <= o["background"] < conf.shape[1]:
        conf = conf.copy()
        conf[:, o["background"]] = 0.0
    rows, c = np.nonzero(conf > o["conf"])
    if not len(rows):
        return _empty()
    boxes = ssd_decode(loc[rows], priors[rows], variances if np.ndim(variances) == 1 else variances[rows],
                       o["loc_order"]) * np.array([iw, ih, iw, ih], np.float32)
    return _finish(ctx, o, boxes.astype(np.float32), conf[rows, c], c)
