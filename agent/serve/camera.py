"""Frame sources behind one interface: V4L2/USB cameras and GStreamer pipelines through OpenCV, a
video file, an image folder, synthetic frames.

Every source runs a background capture thread that writes into a one-slot buffer. ``latest()``
hands out the newest frame not yet handed out; a frame replaced by a newer one before anybody took
it is counted in ``dropped``. So a model slower than the camera always works on the freshest frame
and never on a queue of stale ones (latest-frame policy). Counters hold, once stopped::

    captured == handed_out + dropped

(a frame still in the slot at ``stop()`` counts as dropped).

Sources that are not live (``VideoFileSource(realtime=False)``, ``ImageFolderSource(fps=None)``,
``SyntheticSource(fps=None)``) run in lock-step instead: the capture thread waits until the
consumer took the previous frame, so every frame is processed and nothing is dropped (benchmarks,
accuracy runs); their frames are stamped (``t_capture``) when handed out, as the next one is
decoded ahead. ``VideoFileSource(realtime=True)`` paces frames at the file's fps like a camera, so
drops are real.

Frames are HxWx3 uint8 RGB (OpenCV's BGR converted in the capture thread).

Errors: a bad spec or a missing file is a :class:`SourceSpecError` (a ``ValueError``) with one
line naming the spec and the accepted forms; a camera that cannot be opened or stops delivering is
a :class:`CameraError`, raised by ``start()`` or, once running, by ``latest()``.

:class:`Reconnecting` keeps a source going across such faults (a camera unplugged, a video file
or image folder removed): the failed source is closed and a new one made and started with
backoff until it works again; meanwhile ``latest()`` returns None and ``lost`` says why.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


def _to_rgb(img: np.ndarray) -> np.ndarray:
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


# --- OpenCV capture devices ----------------------------------------------------------------------

def _quietly(fn):
    """Call fn with OpenCV's own logging lowered to errors: a failed open is reported by us in one
    line, not by OpenCV's warnings on stderr."""
    import cv2

    try:
        logging_ = cv2.utils.logging
        old = logging_.getLogLevel()
        logging_.setLogLevel(logging_.LOG_LEVEL_ERROR)
    except Exception:  # an OpenCV without the utils.logging binding
        return fn()
    try:
        return fn()
    finally:
        logging_.setLogLevel(old)


class _CvCapture(FrameSource):
    """Shared by the live OpenCV sources: open, read with retry, release."""

    def __init__(self) -> None:
        super().__init__()
        self._cap = None
        self._failures = 0
        self.finite = False  # a failed read means the end, not a fault

    def _make_capture(self):
        raise NotImplementedError

    def _open(self) -> None:
        cap = _quietly(self._make_capture)
        if cap is None or not cap.isOpened():
            if cap is not None:
                cap.release()
            raise CameraError(self._open_error())
        self._cap = cap
        import cv2

        fps = cap.get(cv2.CAP_PROP_FPS)
        if fps and math.isfinite(fps) and fps > 0 and self.fps_nominal is None:
            self.fps_nominal = float(fps)

    def _open_error(self) -> str:
        return f"cannot open {self.name}"

    def _read(self) -> np.ndarray | None:
        while True:
            ok, img = self._cap.read()
            if ok and img is not None:
                self._failures = 0
                return _to_rgb(img)
            if self.finite:  # a pipeline with num-buffers= or a filesrc ends
                return None
            self._failures += 1
            if self._failures >= self.max_read_failures:
                raise CameraError(f"{self.name} stopped delivering frames ({self._failures} failed reads in a row)")
            if self._stop.wait(0.02):
                return None

    def _close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None


class V4l2Source(_CvCapture):
    """A V4L2 camera (USB webcams, most MIPI cameras on Rockchip/RPi) through OpenCV's V4L2 backend.

    ``width``/``height``/``fps`` are requests; the driver picks the nearest mode (see
    ``actual``). ``fourcc`` (e.g. "MJPG") selects the pixel format; MJPG lets USB 2 cameras
    deliver 720p30. The driver queue is set to one buffer so frames are fresh."""

    def __init__(self, device: str | int = 0, width: int | None = None, height: int | None = None,
                 fps: float | None = None, fourcc: str | None = None) -> None:
        super().__init__()
        if isinstance(device, str) and device.isdigit():
            device = int(device)
        self.device = device
        self.width, self.height, self.fps, self.fourcc = width, height, fps, fourcc
        self.name = f"v4l2:{device if isinstance(device, str) else f'/dev/video{device}'}"
        self.actual: dict | None = None

    def _make_capture(self):
        import cv2

        cap = cv2.VideoCapture(self.device, cv2.CAP_V4L2)
        if not cap.isOpened():
            return cap
        if self.fourcc:
            cap.set(cv2.CAP_PROP_FOURCC, cv2.VideoWriter_fourcc(*self.fourcc[:4].ljust(4)))
        if self.width:
            cap.set(cv2.CAP_PROP_FRAME_WIDTH, self.width)
        if self.height:
            cap.set(cv2.CAP_PROP_FRAME_HEIGHT, self.height)
        if self.fps:
            cap.set(cv2.CAP_PROP_FPS, self.fps)
        cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        self.actual = {"width": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
                       "height": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), "fps": cap.get(cv2.CAP_PROP_FPS)}
        if self.fps:
            self.fps_nominal = float(self.actual["fps"] or self.fps)
        return cap

    def _open_error(self) -> str:
        dev = self.device if isinstance(self.device, str) else f"/dev/video{self.device}"
        why = "no such device" if not os.path.exists(dev) else (
            "no permission (add the user to the 'video' group)" if not os.access(dev, os.R_OK | os.W_OK)
            else "busy or not a capture device")
        return f"cannot open V4L2 camera {dev}: {why}"


def opencv_has_gstreamer() -> bool:
    import cv2

    for line in cv2.getBuildInformation().splitlines():
        if line.strip().startswith("GStreamer:"):
            return line.split(":", 1)[1].strip().upper().startswith("YES")
    return False


def jetson_csi_pipeline(sensor_id: int = 0, width: int = 1280, height: int = 720, fps: int = 30,
                        flip: int = 0) -> str:
    """The GStreamer pipeline for a Jetson CSI camera (nvarguscamerasrc), ending in an appsink
    that keeps only the newest buffer."""
    return (f"nvarguscamerasrc sensor-id={sensor_id} ! "
            f"video/x-raw(memory:NVMM),width={width},height={height},framerate={fps}/1,format=NV12 ! "
            f"nvvidconv flip-method={flip} ! video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=BGR ! "
            f"appsink drop=true max-buffers=1 sync=false")


class GstreamerSource(_CvCapture):
    """A GStreamer pipeline string through OpenCV (Jetson CSI cameras: :func:`jetson_csi_pipeline`).
    A pipeline without an appsink gets ``videoconvert ! video/x-raw,format=BGR ! appsink
    drop=true max-buffers=1`` appended. Needs an OpenCV built with GStreamer: PyPI's wheels are
    not, JetPack's system OpenCV is."""

    def __init__(self, pipeline: str, fps: float | None = None) -> None:
        super().__init__()
        pipeline = pipeline.strip()
        if not pipeline:
            raise SourceSpecError("gst: needs a pipeline, e.g. gst:videotestsrc ! videoconvert ! appsink")
        if "appsink" not in pipeline:
            pipeline += " ! videoconvert ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1 sync=false"
        self.pipeline = pipeline
        self.fps_nominal = fps
        self.finite = "num-buffers=" in pipeline or "filesrc" in pipeline
        self.name = "gst:" + pipeline.split("!", 1)[0].strip()
        if not opencv_has_gstreamer():
            import cv2

            where = Path(cv2.__file__).parent
            raise CameraError(f"GStreamer source unavailable: this OpenCV ({cv2.__version__}, {where}) is built "
                              "without GStreamer, as PyPI's opencv wheels are; use the system OpenCV on Jetson "
                              "(python3-opencv from JetPack, with no opencv-python wheel installed in the venv)")

    def _make_capture(self):
        import cv2

        return cv2.VideoCapture(self.pipeline, cv2.CAP_GSTREAMER)

    def _open_error(self) -> str:
        return f"cannot start GStreamer pipeline: {self.pipeline}"


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
        return _to_rgb(img)

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
            return _to_rgb(img)


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


# --- specs ---------------------------------------------------------------------------------------

def _spec_error(spec: str, why: str) -> SourceSpecError:
    return SourceSpecError(f"camera {spec!r}: {why}; accepted forms: {', '.join(SPEC_FORMS)}")


def parse_spec(spec: str) -> tuple[str, dict]:
    """A source spec -> (kind, constructor arguments), without touching devices or files.
    kind: v4l2 | gst | file | images | synthetic."""
    s = str(spec).strip()
    if not s:
        raise _spec_error(spec, "empty")
    low = s.lower()
    if low.startswith("v4l2:"):
        dev = s[5:]
        if not dev:
            raise _spec_error(spec, "no device")
        if dev.isdigit():
            dev = f"/dev/video{dev}"
        return "v4l2", {"device": dev}
    if re.fullmatch(r"/dev/video\d+", s) or s.startswith("/dev/v4l/"):
        return "v4l2", {"device": s}
    if low.startswith("usb:"):
        n = s[4:]
        if not n.isdigit():
            raise _spec_error(spec, "usb: takes a camera index, e.g. usb:0")
        return "v4l2", {"device": f"/dev/video{int(n)}"}
    if low.startswith("csi:"):
        n = s[4:] or "0"
        if not n.isdigit():
            raise _spec_error(spec, "csi: takes a sensor id, e.g. csi:0")
        return "gst", {"pipeline": jetson_csi_pipeline(int(n))}
    if low.startswith("gst:"):
        if not s[4:].strip():
            raise _spec_error(spec, "gst: needs a pipeline")
        return "gst", {"pipeline": s[4:]}
    if low.startswith("file:"):
        if not s[5:]:
            raise _spec_error(spec, "no path")
        return "file", {"path": s[5:]}
    if low.startswith("images:"):
        if not s[7:]:
            raise _spec_error(spec, "no directory")
        return "images", {"path": s[7:]}
    if low == "synthetic" or low.startswith("synthetic:"):
        args: dict = {}
        for part in filter(None, low.split(":")[1:]):
            m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+(?:\.\d+)?))?", part)
            if m:
                args["width"], args["height"] = int(m.group(1)), int(m.group(2))
                if m.group(3):
                    args["fps"] = float(m.group(3))
            elif part in SyntheticSource.PATTERNS:
                args["pattern"] = part
            else:
                raise _spec_error(spec, f"bad synthetic option {part!r} (WxH[@FPS], bars or noise)")
        return "synthetic", args
    if Path(s).suffix.lower() in VIDEO_EXTENSIONS:
        return "file", {"path": s}
    if Path(s).is_dir():
        return "images", {"path": s}
    if re.match(r"^[a-z0-9]+:", low) and not Path(s).exists():
        raise _spec_error(spec, f"unknown kind {s.split(':', 1)[0]!r}")
    if Path(s).exists():
        raise _spec_error(spec, "not a video file (by extension), an image directory or a device")
    raise _spec_error(spec, "no such file, directory or device")


def open_source(spec: str, **opts) -> FrameSource:
    """Make (not start) the source a spec names. ``opts`` go to the constructor (e.g. loop=False,
    realtime=False, fps=10, width=1280, height=720); options that are None count as not given
    (``fps=0`` asks an image folder or synthetic source for lock-step). Raises :class:`SourceSpecError` (ValueError)
    naming the spec for unknown forms and missing files/devices, :class:`CameraError` when a
    GStreamer spec meets an OpenCV without GStreamer."""
    kind, args = parse_spec(spec)
    args.update({k: v for k, v in opts.items() if v is not None})
    try:
        if kind == "v4l2":
            dev = args["device"]
            if isinstance(dev, str) and not os.path.exists(dev):
                raise _spec_error(spec, f"no such device {dev}")
            return V4l2Source(**args)
        if kind == "gst":
            return GstreamerSource(**args)
        if kind == "file":
            if not Path(args["path"]).is_file():
                raise _spec_error(spec, f"no such file {args['path']}")
            return VideoFileSource(**args)
        if kind == "images":
            if not Path(args["path"]).is_dir():
                raise _spec_error(spec, f"no such directory {args['path']}")
            return ImageFolderSource(**args)
        return SyntheticSource(**args)
    except TypeError as err:  # an option this kind of source does not take
        raise SourceSpecError(f"camera {spec!r}: {err}") from None
