"""Sources that are not cameras: a video file (paced like a camera, or lock-step), a folder of
images, synthetic frames (colour bars, noise)."""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

import numpy as np

from .source import IMAGE_EXTENSIONS, CameraError, FrameSource, SourceSpecError, to_rgb

log = logging.getLogger("tandoor.camera")


# --- files ---------------------------------------------------------------------------------------

class VideoFileSource(FrameSource):
    """A video file decoded with OpenCV (FFmpeg). ``realtime``: deliver at the file's fps like a
    camera (a slow consumer gets drops); otherwise lock-step, every frame, as fast as consumed.
    ``loop``: start over at the end; otherwise the source ends (``eof``)."""

    def __init__(self, path: str | os.PathLike, loop: bool = True, realtime: bool = True,
                 fps: float | None = None) -> None:
        super().__init__()
        import cv2

        self.path = Path(path)
        self.name = f"file:{self.path.name}"
        if not self.path.is_file():
            raise SourceSpecError(f"video file {self.path}: no such file")
        cap = cv2.VideoCapture(str(self.path))
        try:
            if not cap.isOpened():
                raise SourceSpecError(f"video file {self.path}: OpenCV cannot decode it")
            file_fps = cap.get(cv2.CAP_PROP_FPS)
            self.width = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH))
            self.height = int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
            n = cap.get(cv2.CAP_PROP_FRAME_COUNT)
            self.frame_count = int(n) if n and math.isfinite(n) and n > 0 else None
        finally:
            cap.release()
        if not (file_fps and math.isfinite(file_fps) and 0 < file_fps < 1000):
            file_fps = 30.0
        self.fps_nominal = float(fps or file_fps)
        self.loop, self.realtime = loop, realtime
        self.paced, self.lockstep = realtime, not realtime
        self._cap = None
        self._in_pass = 0

    def _open(self) -> None:
        import cv2

        if not self.path.is_file():  # removed since (the loop reopens it at every pass)
            raise CameraError(f"video file {self.path}: no such file")
        self._cap = cv2.VideoCapture(str(self.path))
        if not self._cap.isOpened():
            raise CameraError(f"video file {self.path}: OpenCV cannot decode it")
        self._in_pass = 0

    def _read(self) -> np.ndarray | None:
        ok, img = self._cap.read()
        if not ok:
            if not self.loop:
                return None
            if self._in_pass == 0:
                raise CameraError(f"video file {self.path}: no frame could be decoded")
            self._cap.release()
            self._open()  # reopening is more robust than seeking to 0 across containers
            ok, img = self._cap.read()
            if not ok:
                raise CameraError(f"video file {self.path}: no frame could be decoded after looping")
        self._in_pass += 1
        return to_rgb(img)

    def _close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None


def _natural_key(p: Path):
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", p.name)]


class ImageFolderSource(FrameSource):
    """The images of a directory (PNG, JPEG, BMP, WebP, TIFF, PNM) in natural name order
    (frame_2 before frame_10). ``fps``: pace like a camera (drops when the consumer is slower);
    None or 0: lock-step, every image once per pass. Unreadable images are skipped with a warning."""

    def __init__(self, path: str | os.PathLike, loop: bool = True, fps: float | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.name = f"images:{self.path.name or self.path}"
        if not self.path.is_dir():
            raise SourceSpecError(f"image folder {self.path}: no such directory")
        self.files = sorted((p for p in self.path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()),
                            key=_natural_key)
        if not self.files:
            raise SourceSpecError(f"image folder {self.path}: no images ({', '.join(IMAGE_EXTENSIONS)})")
        self.loop = loop
        self.fps_nominal = float(fps) if fps else None
        self.paced, self.lockstep = bool(fps), not fps
        self._i = 0
        self._good_in_pass = 0

    def _read(self) -> np.ndarray | None:
        import cv2

        while True:
            if self._i >= len(self.files):
                if not self.loop:
                    return None
                if self._good_in_pass == 0:
                    raise CameraError(f"image folder {self.path}: none of its images could be read")
                self._i, self._good_in_pass = 0, 0
            p = self.files[self._i]
            self._i += 1
            img = cv2.imread(str(p), cv2.IMREAD_COLOR)
            if img is None:
                if not self.path.is_dir():
                    raise CameraError(f"image folder {self.path}: no such directory (removed?)")
                log.warning("%s: cannot read %s, skipped", self.name, p.name)
                continue
            self._good_in_pass += 1
            return to_rgb(img)


# --- synthetic -----------------------------------------------------------------------------------

#: the eight colour bars, left to right (RGB): white, yellow, cyan, green, magenta, red, blue, black
BARS = np.array([[255, 255, 255], [255, 255, 0], [0, 255, 255], [0, 255, 0],
                 [255, 0, 255], [255, 0, 0], [0, 0, 255], [0, 0, 0]], np.uint8)


def colour_bars(width: int, height: int) -> np.ndarray:
    idx = (np.arange(width) * len(BARS)) // width
    return np.ascontiguousarray(np.broadcast_to(BARS[idx][None], (height, width, 3)))


class SyntheticSource(FrameSource):
    """Generated frames: ``bars`` (eight colour bars, :data:`BARS`) or ``noise`` (uniform random,
    seeded). ``fps`` paces like a camera; None or 0: lock-step. ``count``: end after that many."""

    PATTERNS = ("bars", "noise")

    def __init__(self, width: int = 640, height: int = 480, fps: float | None = 30.0, pattern: str = "bars",
                 seed: int = 0, count: int | None = None) -> None:
        super().__init__()
        if pattern not in self.PATTERNS:
            raise SourceSpecError(f"synthetic pattern {pattern!r}: choose from {', '.join(self.PATTERNS)}")
        if int(width) <= 0 or int(height) <= 0:
            raise SourceSpecError(f"synthetic size {width}x{height}: must be positive")
        self.width, self.height, self.pattern, self.count = int(width), int(height), pattern, count
        self.name = f"synthetic:{self.width}x{self.height}:{pattern}"
        self.fps_nominal = float(fps) if fps else None
        self.paced, self.lockstep = bool(fps), not fps
        self._rng = np.random.default_rng(seed)
        self._bars = colour_bars(self.width, self.height) if pattern == "bars" else None
        self._made = 0

    def _read(self) -> np.ndarray | None:
        if self.count is not None and self._made >= self.count:
            return None
        self._made += 1
        if self._bars is not None:
            return self._bars.copy()
        n = self.width * self.height * 3
        return np.frombuffer(self._rng.bytes(n), np.uint8).reshape(self.height, self.width, 3).copy()
