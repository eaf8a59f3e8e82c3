"""A frame source that comes back: a failed source is closed and a new one made and started with
backoff (a camera unplugged, a video file or image folder removed)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .source import CameraError, Frame, FrameSource

log = logging.getLogger("tandoor.camera")


# --- a source that comes back ---------------------------------------------------------------------

class Reconnecting:
    """A frame source kept alive across faults: ``make()`` builds a (not yet started) source;
    when the running one fails (:class:`CameraError` from ``latest()``) it is stopped and a new
    one made and started after ``min_s``, then doubling up to ``max_s`` per failed attempt, until
    one starts. Meanwhile ``latest()`` waits its timeout and returns None, and ``lost`` holds the
    reason (None while frames come). The first start is not retried: a camera that cannot be
    opened at start is the caller's error to report. Counters add up over the sources."""

    def __init__(self, make: Callable[[], FrameSource], min_s: float = 1.0, max_s: float = 30.0) -> None:
        self.make, self.min_s, self.max_s = make, min_s, max_s
        self.src: FrameSource | None = None
        self.lost: str | None = None
        self.lost_since: float | None = None  # time.time() of the loss
        self.losses = 0                      # sources that failed while running
        self.attempts = 0                    # reopen attempts since the loss
        self.last_error: str | None = None   # why the last reopen failed
        self._name = ""
        self._next_try = 0.0
        self._delay = min_s
        self._done = {"captured": 0, "handed_out": 0, "dropped": 0}  # of the sources closed
        self._stop = threading.Event()

    @property
    def name(self) -> str:
        return self.src.name if self.src is not None else self._name

    def start(self) -> Reconnecting:
        self.src = self.make()
        self._name = self.src.name
        self.src.start()
        return self

    def latest(self, timeout: float | None = None) -> Frame | None:
        if self.src is None:
            self._reopen()
            if self.src is None:
                self._stop.wait(timeout or 0)
                return None
        try:
            return self.src.latest(timeout)
        except CameraError as err:
            self._lose(str(err))
            return None

    def _lose(self, why: str) -> None:
        src, self.src = self.src, None
        self.losses += 1
        self.lost, self.lost_since, self.attempts, self.last_error = why, time.time(), 0, None
        self._delay = self.min_s
        self._next_try = time.monotonic() + self._delay
        log.error("camera lost: %s; reopening it in %.3g s", why, self._delay)
        self._retire(src)

    def _retire(self, src: FrameSource) -> None:
        try:
            src.stop()
        except Exception as err:  # releasing must never take the caller down
            log.warning("%s: stop failed: %s", src.name, err)
        for k in self._done:
            self._done[k] += getattr(src, k)

    def _reopen(self) -> None:
        now = time.monotonic()
        if now < self._next_try or self._stop.is_set():
            return
        self.attempts += 1
        src = None
        try:
            src = self.make()
            src.start()
        except (CameraError, OSError) as err:  # SourceSpecError too: the file or device is not back
            if src is not None:
                self._retire(src)
            self._delay = min(self._delay * 2, self.max_s)
            self._next_try = now + self._delay
            self.last_error = " ".join(str(err).split())
            log.warning("camera still lost (%s); next try in %.3g s", err, self._delay)
            return
        log.warning("camera back after %.1f s (%s)", time.time() - (self.lost_since or time.time()), src.name)
        self.src, self.lost, self.lost_since, self.last_error = src, None, None, None

    # --- what the service reads, as on a plain source -------------------------------------------
    @property
    def eof(self) -> bool:
        return self.src is not None and self.src.eof

    def _total(self, key: str) -> int:
        return self._done[key] + (getattr(self.src, key) if self.src is not None else 0)

    @property
    def dropped(self) -> int:
        return self._total("dropped")

    @property
    def captured(self) -> int:
        return self._total("captured")

    @property
    def handed_out(self) -> int:
        return self._total("handed_out")

    def lost_info(self) -> dict | None:
        """For the status message while lost: the reason, since when, the reopen attempts."""
        if self.lost is None:
            return None
        return {"reason": self.lost, "since": round(self.lost_since or 0.0, 3), "attempts": self.attempts,
                "last_error": self.last_error, "delay_s": round(self._delay, 3),
                "next_try_s": round(max(0.0, self._next_try - time.monotonic()), 1)}

    def stats(self) -> dict:
        s = self.src.stats() if self.src is not None else {"source": self._name, "fps_nominal": None,
                                                            "fps_captured": None, "eof": False}
        s.update(captured=self.captured, handed_out=self.handed_out, dropped=self.dropped, losses=self.losses,
                 lost=self.lost)
        return s

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.src is not None:
            self.src.stop(timeout)
