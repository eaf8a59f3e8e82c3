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
import os
import re
from pathlib import Path

# the sources, by the module that holds each (re-exported: callers import them from here)
from .camera_devices import GstreamerSource, V4l2Source, jetson_csi_pipeline, opencv_has_gstreamer  # noqa: F401
from .file_sources import BARS, ImageFolderSource, SyntheticSource, VideoFileSource, colour_bars  # noqa: F401
from .reconnect import Reconnecting  # noqa: F401
from .source import (IMAGE_EXTENSIONS, SPEC_FORMS, VIDEO_EXTENSIONS, CameraError, Frame,  # noqa: F401
                     FrameSource, SourceSpecError)

log = logging.getLogger("tandoor.camera")


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
