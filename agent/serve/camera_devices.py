"""Live cameras through OpenCV: V4L2/USB devices, GStreamer pipelines (a Jetson's CSI camera
through nvarguscamerasrc)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np

from .source import CameraError, FrameSource, SourceSpecError, to_rgb

log = logging.getLogger("tandoor.camera")


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
                return to_rgb(img)
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
