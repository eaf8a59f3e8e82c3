"""Image -> model input, as the bundle's manifest says (resize, colour order, mean/std, layout)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_image(path: str | Path) -> np.ndarray:
    """HxWx3 uint8 RGB."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def to_input(rgb: np.ndarray, spec: dict, pre: dict | None) -> np.ndarray:
    """rgb: HxWx3 uint8. spec: the manifest's input entry. pre: the manifest's preprocess."""
    from PIL import Image

    layout = (pre or {}).get("layout") or spec.get("layout") or "NCHW"
    shape = spec["shape"]
    h, w = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    img = np.asarray(Image.fromarray(rgb).resize((w, h), Image.BILINEAR), dtype=np.float32)
    if pre:
        if pre.get("bgr"):
            img = img[..., ::-1]
        img = (img / float(pre.get("scale", 255.0)) - np.asarray(pre["mean"], np.float32)) / np.asarray(pre["std"], np.float32)
    else:
        img = img / 255.0
    img = img[None]
    if layout == "NCHW":
        img = img.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(img, dtype=np.float32)


def softmax_if_logits(x: np.ndarray) -> np.ndarray:
    """Scores for display: the output as is when it already sums to 1, else its softmax."""
    x = x.astype(np.float64).reshape(-1)
    if np.all(x >= 0) and abs(x.sum() - 1.0) < 1e-3:
        return x
    e = np.exp(x - x.max())
    return e / e.sum()


# --- the per-frame fast path ----------------------------------------------------------------------

#: resize methods for :class:`Preprocessor`. "pil" is PIL's bilinear (antialiased when shrinking),
#: what :func:`to_input`, the compiler's golden data and ``zoo.preprocess`` use; "linear" (OpenCV,
#: no antialiasing) is ~10x faster and the default for frames.
RESIZE_METHODS = ("linear", "area", "nearest", "cubic", "pil")


def _input_geometry(spec: dict, pre: dict | None) -> tuple[str, int, int, int]:
    """(layout, channels, height, width) of an image input; ValueError when it is not one."""
    shape = spec.get("shape")
    if not isinstance(shape, (list, tuple)) or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"input {spec.get('name')!r}: shape {shape} is not a static 4-D image shape")
    if shape[0] != 1:
        raise ValueError(f"input {spec.get('name')!r}: batch {shape[0]}; frames are processed one at a time (batch 1)")
    layout = (pre or {}).get("layout") or spec.get("layout")
    if layout is None:  # guess from where a 1- or 3-channel axis is
        layout = "NHWC" if shape[3] in (1, 3) and shape[1] not in (1, 3) else "NCHW"
    if layout not in ("NCHW", "NHWC"):
        raise ValueError(f"input {spec.get('name')!r}: layout {layout!r} is neither NCHW nor NHWC")
    c, h, w = (shape[1], shape[2], shape[3]) if layout == "NCHW" else (shape[3], shape[1], shape[2])
    if c not in (1, 3):
        raise ValueError(f"input {spec.get('name')!r}: {c} channels; images have 1 or 3")
    return layout, c, h, w


class Preprocessor:
    """RGB uint8 HxWx3 frame -> the model's input tensor, as the manifest says: resize (stretch)
    to the input size, colour order (``bgr``), ``(pixel / scale - mean) / std`` per channel
    (no ``preprocess`` in the manifest: ``pixel / 255``, as :func:`to_input`), layout, dtype.

    Built once per model; the per-frame work is one ``cv2.resize`` and one fused normalisation
    per channel written straight into the output (``cv2.addWeighted`` for NCHW planes, a float
    look-up table for NHWC), no float temporaries. With ``resize="pil"`` the result equals
    :func:`to_input` (to float32 rounding). A uint8 input takes the resized pixels as they are.
    """

    def __init__(self, spec: dict, pre: dict | None, resize: str = "linear") -> None:
        import cv2

        if resize not in RESIZE_METHODS:
            raise ValueError(f"resize {resize!r}: choose from {', '.join(RESIZE_METHODS)}")
        self.layout, self.channels, self.height, self.width = _input_geometry(spec, pre)
        self.shape = tuple(spec["shape"])
        self.dtype = np.dtype(spec.get("dtype") or "float32")
        self.resize = resize
        self._interp = {"linear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA, "nearest": cv2.INTER_NEAREST,
                        "cubic": cv2.INTER_CUBIC, "pil": None}[resize]
        pre = pre or {}
        self.bgr = bool(pre.get("bgr"))
        if pre.get("mean") is not None or pre.get("std") is not None:
            mean = np.asarray(pre.get("mean", [0.0]), np.float32).reshape(-1)
            std = np.asarray(pre.get("std", [1.0]), np.float32).reshape(-1)
            scale = np.float32(pre.get("scale", 255.0))
        else:  # no preprocess recorded: pixels / 255, as to_input does
            mean, std, scale = np.zeros(1, np.float32), np.ones(1, np.float32), np.float32(255.0)
        if mean.size not in (1, self.channels) or std.size not in (1, self.channels):
            raise ValueError(f"preprocess mean/std have {mean.size}/{std.size} values for {self.channels} channel(s)")
        if np.any(std == 0) or scale == 0:
            raise ValueError("preprocess std and scale must be non-zero")
        self.mean = np.broadcast_to(mean, (self.channels,)).copy()
        self.std = np.broadcast_to(std, (self.channels,)).copy()
        self.scale = scale
        if self.dtype == np.uint8:
            if pre.get("mean") is not None and not (np.all(self.mean == 0) and np.all(self.std * self.scale == 1)):
                raise ValueError("a uint8 input takes raw pixels; the manifest's mean/std cannot be applied to it")
            self._raw = True
        elif self.dtype.kind == "f":
            self._raw = False
        else:
            raise ValueError(f"input dtype {self.dtype}: only float and uint8 image inputs are supported")
        # pixel -> value, per model channel, computed exactly as to_input computes it
        levels = np.arange(256, dtype=np.float32)[:, None]
        self._lut = np.ascontiguousarray(((levels / self.scale - self.mean) / self.std).astype(np.float32))  # 256 x C
        self._alpha = (1.0 / (self.scale.astype(np.float64) * self.std.astype(np.float64))).tolist()
        self._beta = (-self.mean.astype(np.float64) / self.std.astype(np.float64)).tolist()
        self._lut_hwc = np.ascontiguousarray(self._lut.reshape(1, 256, self.channels))
        self._cv = cv2

    def new_output(self) -> np.ndarray:
        return np.empty(self.shape, np.uint8 if self._raw else np.float32)

    def resized(self, rgb: np.ndarray) -> np.ndarray:
        """The frame at the model's input size, uint8, in the model's colour order."""
        cv2 = self._cv
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            raise ValueError(f"expected an HxWx3 uint8 RGB frame, got {rgb.dtype} {rgb.shape}")
        if rgb.shape[0] == self.height and rgb.shape[1] == self.width:
            img = rgb
        elif self._interp is None:
            from PIL import Image

            img = np.asarray(Image.fromarray(rgb).resize((self.width, self.height), Image.BILINEAR))
        else:
            img = cv2.resize(rgb, (self.width, self.height), interpolation=self._interp)
        if self.channels == 1:
            return cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)[:, :, None]
        if self.bgr:
            return cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
        return img

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
