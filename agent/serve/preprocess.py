"""Image -> model input, as the bundle's manifest says (stretch or letterbox, colour order,
mean/std, layout), and the geometry that maps input pixels back to the frame's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandoor_contract import media


def load_image(path: str | Path) -> np.ndarray:
    """HxWx3 uint8 RGB."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def to_input(rgb: np.ndarray, spec: dict, pre: dict | None) -> np.ndarray:
    """rgb: HxWx3 uint8. spec: the manifest's input entry. pre: the manifest's preprocess. The
    same tensor the service makes of this frame (:class:`Preprocessor`, its default resize)."""
    return Preprocessor(spec, pre)(rgb)


def softmax_if_logits(x: np.ndarray) -> np.ndarray:
    """Scores for display: the output as is when it already sums to 1, else its softmax."""
    x = x.astype(np.float64).reshape(-1)
    if np.all(x >= 0) and abs(x.sum() - 1.0) < 1e-3:
        return x
    e = np.exp(x - x.max())
    return e / e.sum()


# --- the per-frame fast path ----------------------------------------------------------------------

#: resize methods for :class:`Preprocessor`. "pil" is PIL's bilinear (antialiased when shrinking),
#: what ``zoo.preprocess`` uses; "linear" (OpenCV's INTER_LINEAR, no antialiasing, what the model
#: packages' own preprocessing calls) is ~10x faster and the default.
RESIZE_METHODS = ("linear", "area", "nearest", "cubic", "pil")


@dataclass(frozen=True)
class Geometry:
    """Where a frame's pixels land in the model input: input = frame x (sx, sy) + (left, top).
    Stretch: sx = W / w, sy = H / h, no offset. Letterbox: sx = sy = r = min(W / w, H / h), the
    image (size ``new_w`` x ``new_h``) placed at (left, top) on a ``pad_value`` canvas."""

    frame_hw: tuple[int, int]
    input_hw: tuple[int, int]
    sx: float
    sy: float
    left: int = 0
    top: int = 0
    new_w: int = 0
    new_h: int = 0

    @classmethod
    def of(cls, frame_hw: tuple[int, int], input_hw: tuple[int, int], resize: str = "stretch",
           align: str = "center") -> "Geometry":
        (fh, fw), (ih, iw) = frame_hw, input_hw
        if resize == "stretch":
            return cls((fh, fw), (ih, iw), iw / fw, ih / fh, 0, 0, iw, ih)
        r = min(ih / fh, iw / fw)
        if align == "topleft":  # YOLOX's preproc: int() sizes, image at the top left
            nw, nh = int(fw * r), int(fh * r)
            return cls((fh, fw), (ih, iw), r, r, 0, 0, nw, nh)
        # Ultralytics' LetterBox: rounded sizes, centred, the odd pixel of padding at bottom/right
        nw, nh = int(round(fw * r)), int(round(fh * r))
        left, top = int(round((iw - nw) / 2 - 0.1)), int(round((ih - nh) / 2 - 0.1))
        return cls((fh, fw), (ih, iw), r, r, left, top, nw, nh)

    def to_frame(self, boxes: np.ndarray, clip: bool = True) -> np.ndarray:
        """Nx4 x1, y1, x2, y2 in input pixels -> frame pixels (clipped to the frame)."""
        b = np.asarray(boxes, np.float32).reshape(-1, 4)
        off = np.array([self.left, self.top, self.left, self.top], np.float32)
        out = (b - off) / np.array([self.sx, self.sy, self.sx, self.sy], np.float32)
        if clip:
            fh, fw = self.frame_hw
            np.clip(out, 0, np.array([fw, fh, fw, fh], np.float32), out=out)
        return out

    def points_to_frame(self, pts: np.ndarray) -> np.ndarray:
        """...x2 x, y points in input pixels -> frame pixels (not clipped)."""
        p = np.asarray(pts, np.float32)
        return (p - np.array([self.left, self.top], np.float32)) / np.array([self.sx, self.sy], np.float32)


def input_geometry(spec: dict, pre: dict | None) -> tuple[str, int, int, int]:
    """(layout, channels, height, width) of an image input; ValueError when it is not one."""
    shape = spec.get("shape")
    if not isinstance(shape, (list, tuple)) or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"input {spec.get('name')!r}: shape {shape} is not a static 4-D image shape")
    if shape[0] != 1:
        raise ValueError(f"input {spec.get('name')!r}: batch {shape[0]}; frames are processed one at a time (batch 1)")
    layout = (pre or {}).get("layout") or spec.get("layout")
    if layout is None:
        layout = media.guess_layout(shape)
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"input {spec.get('name')!r}: layout {layout!r} is neither NCHW nor NHWC")
    c, h, w = (shape[1], shape[2], shape[3]) if layout == "NCHW" else (shape[3], shape[1], shape[2])
    if c not in (1, 3):
        raise ValueError(f"input {spec.get('name')!r}: {c} channels; images have 1 or 3")
    return layout, c, h, w


class Preprocessor:
    """RGB uint8 HxWx3 frame -> the model's input tensor, as the manifest says: stretch or
    letterbox to the input size (:class:`Geometry`), colour order (``bgr``),
    ``(pixel / scale - mean) / std`` per channel (no mean/std: ``pixel / scale``), layout, dtype.

    Built once per model; the per-frame work is one ``cv2.resize`` (into a padded canvas kept
    from frame to frame for a letterbox) and one fused normalisation per channel written straight
    into the output (``cv2.addWeighted`` for NCHW planes, a float look-up table for NHWC), no
    float temporaries. A uint8 input takes the resized pixels as they are.
    """

    def __init__(self, spec: dict, pre: dict | None, resize: str = "linear") -> None:
        import cv2

        if resize not in RESIZE_METHODS:
            raise ValueError(f"resize {resize!r}: choose from {', '.join(RESIZE_METHODS)}")
        pre = media.read_preprocess(pre)
        self.layout, self.channels, self.height, self.width = input_geometry(spec, pre)
        self.shape = tuple(spec["shape"])
        self.dtype = np.dtype(spec.get("dtype") or "float32")
        self.resize = resize
        self.mode, self.align, self.pad_value = pre["resize"], pre["align"], pre["pad_value"]
        self._interp = {"linear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA, "nearest": cv2.INTER_NEAREST,
                        "cubic": cv2.INTER_CUBIC, "pil": None}[resize]
        self.bgr = pre["bgr"]
        given = pre["mean"] is not None or pre["std"] is not None
        mean = np.asarray(pre["mean"] if pre["mean"] is not None else [0.0], np.float32).reshape(-1)
        std = np.asarray(pre["std"] if pre["std"] is not None else [1.0], np.float32).reshape(-1)
        scale = np.float32(pre["scale"])
        if mean.size not in (1, self.channels) or std.size not in (1, self.channels):
            raise ValueError(f"preprocess mean/std have {mean.size}/{std.size} values for {self.channels} channel(s)")
        self.mean = np.broadcast_to(mean, (self.channels,)).copy()
        self.std = np.broadcast_to(std, (self.channels,)).copy()
        self.scale = scale
        if media.raw_pixels(self.dtype.name):
            if given and not (np.all(self.mean == 0) and np.all(self.std * self.scale == 1)):
                raise ValueError("a uint8 input takes raw pixels (the model normalises them in its graph); the "
                                 "manifest's mean/std cannot be applied to it")
            self._raw = True
        elif self.dtype.kind == "f":
            self._raw = False
        else:
            raise ValueError(f"input dtype {self.dtype}: only float and uint8 image inputs are supported")
        # pixel -> value, per model channel: (pixel / scale - mean) / std in float32
        levels = np.arange(256, dtype=np.float32)[:, None]
        self._lut = np.ascontiguousarray(((levels / self.scale - self.mean) / self.std).astype(np.float32))  # 256 x C
        self._alpha = (1.0 / (self.scale.astype(np.float64) * self.std.astype(np.float64))).tolist()
        self._beta = (-self.mean.astype(np.float64) / self.std.astype(np.float64)).tolist()
        self._lut_hwc = np.ascontiguousarray(self._lut.reshape(1, 256, self.channels))
        self._cv = cv2
        self._geometry: Geometry | None = None
        self._canvas: np.ndarray | None = None

    def new_output(self) -> np.ndarray:
        return np.empty(self.shape, np.uint8 if self._raw else np.float32)

    def geometry(self, frame_hw: tuple[int, int]) -> Geometry:
        """How a frame of this size maps into the input (cached for the last size seen)."""
        g = self._geometry
        if g is None or g.frame_hw != tuple(frame_hw):
            g = self._geometry = Geometry.of(tuple(frame_hw), (self.height, self.width), self.mode, self.align)
            self._canvas = None
        return g

    def _resize(self, img: np.ndarray, w: int, h: int) -> np.ndarray:
        if img.shape[0] == h and img.shape[1] == w:
            return img
        if self._interp is None:
            from PIL import Image

            return np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))
        return self._cv.resize(img, (w, h), interpolation=self._interp)

    def resized(self, rgb: np.ndarray) -> np.ndarray:
        """The frame at the model's input size (letterboxed onto the padding when the manifest
        says so), uint8, in the model's colour order."""
        cv2 = self._cv
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            raise ValueError(f"expected an HxWx3 uint8 RGB frame, got {rgb.dtype} {rgb.shape}")
        g = self.geometry(rgb.shape[:2])
        img = self._resize(rgb, g.new_w, g.new_h)
        if self.channels == 1:
            img = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)[:, :, None]
        elif self.bgr:
            img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
        if self.mode == "stretch":
            return img
        if self._canvas is None:  # the padding never changes for one frame size: fill it once
            self._canvas = np.full((self.height, self.width, img.shape[2]), self.pad_value, np.uint8)
        self._canvas[g.top:g.top + g.new_h, g.left:g.left + g.new_w] = img
        return self._canvas

    def __call__(self, rgb: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The input tensor for one frame. ``out``: a buffer from :meth:`new_output` to fill
        (reused frame to frame); a new array otherwise. Cast to the input dtype if not float32."""
        cv2 = self._cv
        img = self.resized(rgb)
        if out is None:
            out = self.new_output()
        if self._raw:
            out[...] = img.transpose(2, 0, 1)[None] if self.layout == "NCHW" else img[None]
            return out
        if self.layout == "NCHW":
            planes = cv2.split(img) if self.channels == 3 else [np.ascontiguousarray(img[:, :, 0])]
            for c, plane in enumerate(planes):
                dst = out[0, c]
                r = cv2.addWeighted(plane, self._alpha[c], plane, 0.0, self._beta[c], dst=dst, dtype=cv2.CV_32F)
                if r is not dst and not np.shares_memory(r, dst):  # a binding that did not write in place
                    dst[...] = r
        else:
            if self.channels == 3:
                r = cv2.LUT(img, self._lut_hwc)
            else:
                r = cv2.LUT(np.ascontiguousarray(img[:, :, 0]), np.ascontiguousarray(self._lut[:, 0]))
            out[0] = r.reshape(self.height, self.width, self.channels)
        return out if self.dtype == np.float32 else out.astype(self.dtype)
