"""Snapshots: a frame with its result drawn on it, as a JPEG on ``<base>/snapshot`` (retained),
like Frigate's snapshot topics: every ``snapshot.period_s`` the best frame of the period (the one
with the highest-scoring detection; the latest when nothing was detected), and on the
``snapshot`` command the latest frame, what the camera sees now.

The loop hands every processed frame to :meth:`Snapshots.offer` (references kept, nothing
copied); only a frame that is published is drawn and encoded (a few ms for 640x480 on a
desktop core), so frames in between cost a comparison.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from . import draw


#: payloads above this are re-encoded at half the size (the broker config caps packets at 1 MiB)
MAX_BYTES = 900 * 1024


def encode(rgb: np.ndarray, summary: dict, quality: int = 80, max_bytes: int = MAX_BYTES) -> bytes:
    """The frame with ``summary`` drawn on it, as JPEG bytes of at most ``max_bytes`` (halving
    the size until it fits)."""
    import cv2

    img = draw.draw(rgb, summary)
    data = draw.jpeg(img, quality)
    while len(data) > max_bytes and min(img.shape[:2]) > 16:
        img = cv2.resize(img, (img.shape[1] // 2, img.shape[0] // 2), interpolation=cv2.INTER_AREA)
        data = draw.jpeg(img, quality)
    return data


class Snapshots:
    """``publish(jpeg, seq, detections) -> bool`` is the MQTT link's ``publish_snapshot``;
    ``connected()`` says whether publishing can work now (nothing is drawn while it cannot)."""

    def __init__(self, publish: Callable[[bytes, int, int], bool], period_s: float, quality: int = 80,
                 connected: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.monotonic) -> None:
        self.publish, self.period_s, self.quality, self.clock = publish, period_s, quality, clock
        self.connected = connected
        self._latest = None  # (frame, result)
        self._best = None    # (score, frame, result): the best-scoring detection of this period
        self._next = 0.0
        self.sent = 0

    def offer(self, frame, result) -> None:
        """A processed frame: kept as the latest, and as the period's best when its top detection
        beats the best so far; the period's snapshot is published when the period is up."""
        self._latest = (frame, result)
        dets = result.outputs.get("detections")
        if dets:
            top = max(d["score"] for d in dets)
            if self._best is None or top > self._best[0]:
                self._best = (top, frame, result)
        if self.period_s > 0 and self.clock() >= self._next and self.connected():
            best = self._best
            if self.send(best[1:] if best else None) is not None:
                self._next = self.clock() + self.period_s
                self._best = None

    def send(self, which: tuple | None = None) -> dict | None:
        """Publish ``which`` ((frame, result); default the latest frame) now; what was sent (None:
        no frame yet, or not connected)."""
        which = which or self._latest
        if which is None or not self.connected():
            return None
        frame, result = which
        dets = len(result.outputs.get("detections") or [])
        data = encode(frame.image, result.outputs, self.quality)
        if not self.publish(data, result.seq, dets):
            return None
        self.sent += 1
        return {"seq": result.seq, "bytes": len(data), "detections": dets, "frame": [int(frame.image.shape[1]),
                                                                                  int(frame.image.shape[0])]}
