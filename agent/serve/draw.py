"""Results a person can see: a frame with its detections drawn on it, as JPEG (OpenCV).

    rgb = draw(frame_rgb, summary)          # boxes, "label 0.93", landmarks; classifiers: top-k text
    data = jpeg(rgb, quality=85)            # bytes a browser opens (the MQTT snapshot, --draw)

``summary`` is a decoder's result (agent/serve/postprocess.py): boxes are in the frame's pixels.
"""

from __future__ import annotations

import numpy as np

# one colour per class id (RGB), repeating; distinct on a street scene and on paper
PALETTE = np.array([(255, 56, 56), (56, 168, 255), (72, 220, 72), (255, 178, 29), (207, 56, 255),
                    (0, 212, 187), (255, 112, 31), (146, 204, 23), (255, 55, 199), (52, 69, 147)], np.uint8)


def colour(class_id: int) -> tuple[int, int, int]:
    return tuple(int(v) for v in PALETTE[int(class_id) % len(PALETTE)])


def _label(img: np.ndarray, text: str, x: int, y: int, col: tuple[int, int, int], scale: float, thick: int) -> None:
    """``text`` on a filled box of ``col`` whose bottom-left is (x, y); below the point when it
    would leave the image."""
    import cv2

    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, thick)
    h, w = img.shape[:2]
    x = int(min(max(x, 0), max(w - tw - 2, 0)))
    top = y - th - base - 2
    if top < 0:
        top = min(y, h - th - base - 2)
    top = int(max(top, 0))
    cv2.rectangle(img, (x, top), (x + tw + 2, top + th + base + 2), col, -1)
    dark = sum(col) > 384
    cv2.putText(img, text, (x + 1, top + th + 1), cv2.FONT_HERSHEY_SIMPLEX, scale,
                (0, 0, 0) if dark else (255, 255, 255), thick, cv2.LINE_AA)


def draw(rgb: np.ndarray, summary: dict) -> np.ndarray:
    """A copy of the RGB uint8 frame with the summary drawn on it."""
    import cv2

    img = np.ascontiguousarray(rgb).copy()
    h, w = img.shape[:2]
    scale = max(0.4, min(h, w) / 900)
    thick = max(1, int(round(min(h, w) / 400)))
    if summary.get("kind") == "detector":
        for d in summary.get("detections", []):
            x1, y1, x2, y2 = (int(round(v)) for v in d["box"])
            col = colour(d.get("class_id", 0))
            cv2.rectangle(img, (x1, y1), (x2, y2), col, thick + 1)
            if min(x2 - x1, y2 - y1) >= 40:  # on a small face the dots would hide it
                for px, py in d.get("landmarks") or []:
                    cv2.circle(img, (int(round(px)), int(round(py))), thick + 1, col, -1)
            _label(img, f"{d.get('label', d.get('class_id'))} {d['score']:.2f}", x1, y1, col, scale, thick)
    elif summary.get("kind") == "classifier":
        y = 0
        for i, (label, score) in enumerate(summary.get("top") or []):
            (tw, th), base = cv2.getTextSize("Ag", cv2.FONT_HERSHEY_SIMPLEX, scale, thick)
            y += th + base + 4
            _label(img, f"{label} {score:.2f}", 4, y, colour(i), scale, thick)
    return img


def jpeg(rgb: np.ndarray, quality: int = 85) -> bytes:
    """JPEG bytes of an RGB uint8 image."""
    import cv2

    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    if not ok:
        raise ValueError("OpenCV could not encode the image as JPEG")
    return buf.tobytes()


def write(path, rgb: np.ndarray, quality: int = 90) -> None:
    """The image to ``path`` (JPEG or PNG by its suffix), atomically: a failed write leaves no
    half-written file in place of a good one."""
    from pathlib import Path

    import cv2

    from tandoor_contract import durable

    p = Path(path)
    ext = p.suffix.lower()
    if ext not in (".jpg", ".jpeg", ".png"):
        raise ValueError(f"{p}: write .jpg or .png")
    if ext == ".png":
        ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            raise ValueError("OpenCV could not encode the image as PNG")
        data = buf.tobytes()
    else:
        data = jpeg(rgb, quality)
    durable.atomic_write(p, data)
