"""A frame source's interface and its capture thread (the one-slot buffer, latest-frame policy,
lock-step for sources that are not live), the frame record and the errors; the sources themselves
are camera_devices.py (OpenCV), file_sources.py (video, images, synthetic) and reconnect.py."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
from tandoor_contract.errors import TandoorError

log = logging.getLogger("tandoor.camera")

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpg", ".mpeg", ".ts", ".wmv", ".flv", ".3gp",
                    ".mjpeg", ".mjpg", ".h264", ".h265", ".y4m")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".ppm", ".pgm", ".pnm", ".tif", ".tiff")

SPEC_FORMS = ("v4l2:/dev/videoN", "/dev/videoN", "usb:N", "csi:N", "gst:<pipeline>", "file:<video>",
              "<path>.mp4|.avi|.mkv|...", "images:<dir>", "<dir>", "synthetic[:WxH[@FPS]][:bars|noise]")



class CameraError(TandoorError):
    """A frame source cannot be opened or stopped delivering frames. One line."""

    exit_code = 4


class SourceSpecError(CameraError, ValueError):
    """A source spec that names nothing usable (unknown form, missing file or device). One line."""

    exit_code = 2


@dataclass
class Frame:
    image: np.ndarray  # HxWx3 uint8 RGB
    seq: int  # 0, 1, 2, ... in capture order, per source (gaps = frames dropped before hand-out)
    t_capture: float  # time.monotonic() when the frame was captured
    source: str


def to_rgb(img: np.ndarray) -> np.ndarray:
    """OpenCV's BGR / gray / BGRA -> HxWx3 uint8 RGB."""
    import cv2

    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    if img.shape[2] == 4:
        return cv2.cvtColor(img, cv2.COLOR_BGRA2RGB)
    if img.shape[2] == 1:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


class FrameSource:
    """Base class: the capture thread, the one-slot buffer and the counters.

    Subclasses implement ``_open()`` (called by ``start()`` in the caller's thread, so opening
    errors surface there), ``_read() -> np.ndarray | None`` (next RGB frame, None at the end of a
    finite source) and ``_close()``. Live or paced sources set ``fps_nominal`` and ``paced``;
    ``lockstep`` sources wait for the consumer instead of dropping.
    """

    name = "source"
    #: consecutive failed reads after which a live source is declared dead
    max_read_failures = 50

    def __init__(self) -> None:
        self.fps_nominal: float | None = None
        self.paced = False  # the thread sleeps to deliver at fps_nominal
        self.lockstep = False  # the thread waits for the consumer (no drops)
        self.captured = 0
        self.dropped = 0
        self.handed_out = 0
        self._cond = threading.Condition()
        self._slot: Frame | None = None
        self._ended = False  # the source ran out (eof before hand-out of the last frame)
        self._error: CameraError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t_start: float | None = None

    # --- public interface ------------------------------------------------------------------

    def start(self) -> FrameSource:
        if self._thread is not None:
            return self
        self._stop.clear()
        self._open()
        self._t_start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"capture-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the capture thread and release the device. Idempotent."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("%s: capture thread did not stop within %.1f s", self.name, timeout)
        if t is None or not t.is_alive():
            try:
                self._close()
            except Exception as err:  # releasing must never take the caller down
                log.warning("%s: close failed: %s", self.name, err)
        self._thread = None
        with self._cond:
            if self._slot is not None:  # captured, never handed out
                self._slot = None
                self.dropped += 1

    def latest(self, timeout: float | None = None) -> Frame | None:
        """The newest frame not yet handed out; waits up to ``timeout`` seconds (None: forever)
        for one. None on timeout, at the end of a finite source, or when stopped. Raises
        :class:`CameraError` when the capture thread failed."""
        with self._cond:
            if self._slot is None and not self._done_locked():
                self._cond.wait_for(lambda: self._slot is not None or self._done_locked(), timeout)
            frame = self._slot
            if frame is None:
                if self._error is not None:
                    raise self._error
                return None
            self._slot = None
            self.handed_out += 1
            if self.lockstep:  # prefetched while the consumer was busy: its age says nothing about a camera
                frame.t_capture = time.monotonic()
            self._cond.notify_all()  # a lock-step producer waits for the slot to empty
            return frame

    def frames(self, timeout: float | None = None):
        """Iterate over ``latest()`` until the source ends or is stopped (or times out)."""
        while True:
            f = self.latest(timeout)
            if f is None:
                return
            yield f

    @property
    def eof(self) -> bool:
        """The source ended (a file with loop=False) and its last frame has been handed out."""
        with self._cond:
            return self._ended and self._slot is None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> CameraError | None:
        return self._error

    def stats(self) -> dict:
        """Counters for telemetry."""
        with self._cond:
            elapsed = (time.monotonic() - self._t_start) if self._t_start is not None else 0.0
            return {"source": self.name, "captured": self.captured, "handed_out": self.handed_out,
                    "dropped": self.dropped, "fps_nominal": self.fps_nominal,
                    "fps_captured": round(self.captured / elapsed, 2) if elapsed > 0 else None,
                    "eof": self._ended and self._slot is None}

    def __enter__(self) -> FrameSource:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} captured={self.captured} dropped={self.dropped}>"

    # --- for subclasses ----------------------------------------------------------------------

    def _open(self) -> None:
        pass

    def _read(self) -> np.ndarray | None:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    # --- the capture thread ------------------------------------------------------------------

    def _done_locked(self) -> bool:
        return self._ended or self._error is not None or self._stop.is_set()

    def _run(self) -> None:
        period = (1.0 / self.fps_nominal) if (self.paced and self.fps_nominal) else 0.0
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                if period:
                    delay = next_t - time.monotonic()
                    if delay > 0:
                        if self._stop.wait(delay):
                            break
                    elif delay < -period:  # fell behind (slow decode): do not burst to catch up
                        next_t = time.monotonic()
                    next_t += period
                img = self._read()
                if img is None:
                    with self._cond:
                        self._ended = True
                        self._cond.notify_all()
                    return
                self._publish(img)
        except CameraError as err:
            self._fail(err)
        except Exception as err:  # anything else from a driver/decoder: one line, not a traceback
            self._fail(CameraError(f"{self.name}: capture failed: {type(err).__name__}: {err}"))

    def _fail(self, err: CameraError) -> None:
        log.error("%s", err)
        with self._cond:
            self._error = err
            self._cond.notify_all()

    def _publish(self, img: np.ndarray) -> None:
        t = time.monotonic()
        with self._cond:
            if self.lockstep:
                self._cond.wait_for(lambda: self._slot is None or self._stop.is_set())
                if self._stop.is_set():
                    return
            if self._slot is not None:
                self.dropped += 1
            self._slot = Frame(img, self.captured, t, self.name)
            self.captured += 1
            self._cond.notify_all()
