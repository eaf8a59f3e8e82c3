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
