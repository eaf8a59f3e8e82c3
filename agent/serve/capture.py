"""Calibration frames from the deployment: the ``capture`` command saves the camera's next frames.

INT8 calibration wants images like the ones the camera will see (its light, its lens, its scene),
so the agent saves them on request: ``{"cmd": "capture", "args": {"frames": 100, "interval_s":
0.5}}`` writes the next ``frames`` camera frames, at least ``interval_s`` apart, as lossless PNGs
(the frame as the camera gave it, nothing drawn, before preprocessing) under
``<capture_dir>/<id>/``, and answers once they are written, with the directory and the files:
fetch it (scp, rsync) and ``tandoor quantize MODEL.onnx --calibration DIR``.

One capture at a time. Each file is written beside its final name and renamed into place, so
the directory never holds a half-written image; a disk nearly full ends the capture with what it
has (the answer says so), and a camera that gives no frame for ``timeout_s`` ends it likewise.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MAX_FRAMES = 1000          # per capture: 1000 VGA PNGs are ~500 MB
MIN_FREE_BYTES = 64 << 20  # stop before the state disk fills (slots and state.json live there too)
DEFAULTS = {"frames": 100, "interval_s": 0.5}


class CaptureError(ValueError):
    """A capture request that cannot be taken (the answer's error)."""


@dataclass
class Capture:
    root: Path
    frames: int
    interval_s: float
    timeout_s: float
    req: Any = None                      # the request to answer when done
    clock: Callable[[], float] = time.monotonic
    id: str = ""
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    stopped: str | None = None           # why it ended early
    _next: float = 0.0
    _last_frame: float = 0.0

    @classmethod
    def start(cls, capture_dir: Path, args: dict | None, req=None, clock: Callable[[], float] = time.monotonic) -> "Capture":
        """Check ``args`` (``frames``, ``interval_s``, ``timeout_s``), make the capture's directory."""
        a = {**DEFAULTS, **(args or {})}
        unknown = sorted(set(a) - {"frames", "interval_s", "timeout_s"})
        if unknown:
            raise CaptureError(f"capture takes frames, interval_s and timeout_s, not {', '.join(unknown)}")
        frames, interval = a["frames"], a["interval_s"]
        if isinstance(frames, bool) or not isinstance(frames, int) or not 1 <= frames <= MAX_FRAMES:
            raise CaptureError(f"capture frames must be a whole number 1..{MAX_FRAMES}, not {frames!r}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= 3600:
            raise CaptureError(f"capture interval_s must be 0..3600 seconds, not {interval!r}")
        timeout = a.get("timeout_s", max(30.0, 4.0 * interval))
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= 86400:
            raise CaptureError(f"capture timeout_s must be 1..86400 seconds, not {timeout!r}")
        capture_dir = Path(capture_dir)
        try:
            capture_dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(capture_dir).free
        except OSError as err:
            raise CaptureError(f"capture_dir {capture_dir}: {err.strerror or err}") from None
        if free < MIN_FREE_BYTES:
            raise CaptureError(f"capture_dir {capture_dir} has {free >> 20} MiB free; a capture needs "
                               f"{MIN_FREE_BYTES >> 20} MiB at least")
        cid = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        root, n = capture_dir / cid, 1
        while root.exists():
            n += 1
            root = capture_dir / f"{cid}-{n}"
        root.mkdir()
        now = clock()
        return cls(root, frames, float(interval), float(timeout), req, clock, root.name, _next=now, _last_frame=now)

    @property
    def done(self) -> bool:
        return self.stopped is not None or len(self.files) >= self.frames

    def offer(self, image_rgb, seq: int) -> bool:
        """A camera frame (HxWx3 RGB): saved when the interval is up. True when the capture is done."""
        now = self.clock()
        self._last_frame = now
        if self.done or now < self._next:
            return self.done
        import cv2

        if shutil.disk_usage(self.root).free < MIN_FREE_BYTES:
            self.stopped = f"the disk is nearly full ({MIN_FREE_BYTES >> 20} MiB left)"
            return True
        name = f"frame_{len(self.files):04d}_seq{seq}.png"
        ok, png = cv2.imencode(".png", cv2.cvtColor(image_rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            self.stopped = "the frame could not be encoded as PNG"
            return True
        tmp = self.root / f".{name}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(png.tobytes())
            os.replace(tmp, self.root / name)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            self.stopped = f"writing {name} failed: {err.strerror or err}"
            return True
        self.files.append(name)
        self.bytes += len(png)
        self._next = now + self.interval_s
        return self.done

    def tick(self) -> bool:
        """Called each loop turn, frame or not: ends a capture the camera starves. True when done."""
        if not self.done and self.clock() - self._last_frame > self.timeout_s:
            self.stopped = f"no camera frame for {self.timeout_s:g} s"
        return self.done

    def result(self) -> dict:
        r = {"capture": self.id, "dir": str(self.root), "frames": len(self.files), "asked": self.frames,
             "bytes": self.bytes, "files": list(self.files)}
        if self.stopped:
            r["stopped"] = self.stopped
        return r
