"""uint8 camera inputs (TF/MediaPipe exports: NHWC uint8, Cast and Sub/Div normalisation inside the
graph) through the real CLI: compile for host + aarch64 records ``dtype: uint8`` and no mean/std,
``tandoor verify`` matches onnxruntime, and the agent (``tandoor-agent run`` on an image, the serve
pipeline on video frames) gives onnxruntime's outputs for the same uint8 frame, resized here with
OpenCV independently of the agent's preprocessing. Other integer inputs and --mean/--std with a uint8
input are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import manifest_of, run_cli
from support.detectors import image

RNG = np.random.default_rng(20261204)
H, W = 64, 80
MEAN = np.array([123.7, 116.3, 103.5], np.float32)    # per channel, so a swapped colour order shows
STD = np.array([58.4, 57.1, 57.4], np.float32)


def _w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def camera_model(elem: int = TensorProto.UINT8, shape=(1, H, W, 3)):
    """image (NHWC, ``elem``) -> Cast -> Sub mean -> Div std -> NCHW -> Conv+Relu -> pool -> dense."""
    N = helper.make_node
    inits = {"mean": MEAN, "std": STD, "k": _w(8, 3, 3, 3), "b": _w(8), "fc": _w(8, 5), "fcb": _w(5)}
    nodes = [N("Cast", ["image"], ["f"], to=TensorProto.FLOAT), N("Sub", ["f", "mean"], ["c"]),
             N("Div", ["c", "std"], ["n"]), N("Transpose", ["n"], ["t"], perm=[0, 3, 1, 2]),
             N("Conv", ["t", "k", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]), N("Relu", ["y"], ["r"]),
             N("GlobalAveragePool", ["r"], ["p"]), N("Flatten", ["p"], ["fl"]),
             N("MatMul", ["fl", "fc"], ["m"]), N("Add", ["m", "fcb"], ["scores"])]
    g = helper.make_graph(nodes, "camera", [helper.make_tensor_value_info("image", elem, list(shape))],
                          [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 5])],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def reference_input(rgb: np.ndarray) -> np.ndarray:
    """The uint8 input the agent should make of a frame (stretch, --bgr), written out with OpenCV."""
    import cv2

    return np.ascontiguousarray(cv2.resize(rgb, (W, H), interpolation=cv2.INTER_LINEAR)[:, :, ::-1][None])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("uint8")
    src, out = tmp / "camera.onnx", tmp / "camera.hmod"
    src.write_bytes(camera_model().SerializeToString())
    # policy all: the normalisation and conv go to an order, so the executors meet the uint8 model too
    run_cli("tandoor", "compile", str(src), "-o", str(out), "--target", "aarch64", "--bgr", "--policy", "all", "-q",
            check=True)
    return src, out


def test_a_uint8_camera_input_compiles_for_host_and_aarch64_and_the_manifest_says_uint8_raw_pixels(compiled):
    _, out = compiled
    m = manifest_of(out)
    assert set(m["targets"]) == {"host", "aarch64"}
    assert m["inputs"] == [{"name": "image", "shape": [1, H, W, 3], "dtype": "uint8", "layout": "NHWC"}]
    pre = m["preprocess"]
    assert pre["mean"] is None and pre["std"] is None and pre["scale"] == 1.0 and pre["bgr"] is True
    assert any(p["delegate"] for p in m["partitions"])
    info = json.loads(run_cli("tandoor", "inspect", str(out), "--json", check=True).stdout)
    assert info["inputs"][0]["dtype"] == "uint8"


@pytest.mark.parametrize("delegate", ["onnxruntime", "tvm"])
def test_verify_matches_onnxruntime_on_golden_and_random_uint8_inputs(compiled, delegate):
    src, out = compiled
    res = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--delegate", delegate, "--json")
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-800:]
    report = json.loads(res.stdout)
    assert report["ok"] and [c["kind"] for c in report["cases"]].count("random") == 3


def test_verify_on_images_preprocesses_them_as_the_device_does_and_agrees_with_onnxruntime(compiled, tmp_path):
    from PIL import Image

    src, out = compiled
    for name in ("astronaut", "coffee", "chelsea"):
        Image.fromarray(image(name)).save(tmp_path / f"{name}.png")
    res = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--images", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-800:]
    report = json.loads(res.stdout)
    assert report["ok"] and report["images"] == 3 and report["top1_agreement_all"] == 1.0
    assert report["outputs"][0]["cosine_min"] > 0.99999


def test_quantize_calibrates_a_uint8_input_on_uint8_frames_and_the_int8_bundle_agrees_with_fp32(compiled, tmp_path):
    from PIL import Image

    from support.detectors import IMAGES

    src, _ = compiled
    for name in IMAGES:
        Image.fromarray(image(name)).save(tmp_path / f"{name}.png")
    q, out = tmp_path / "camera.int8.onnx", tmp_path / "camera.int8.hmod"
    run_cli("tandoor", "quantize", str(src), "--calibration", str(tmp_path), "-o", str(q), "--bgr", check=True)
    run_cli("tandoor", "compile", str(q), "-o", str(out), "--bgr", "-q", check=True)
    assert manifest_of(out)["inputs"][0]["dtype"] == "uint8"
    res = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--images", str(tmp_path), "--json")
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-800:]
    report = json.loads(res.stdout)
    assert report["ok"] and report["images"] == len(IMAGES) and report["top1_agreement_all"] >= 0.9


def _onnxruntime(src: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    return sess.run(None, {"image": x})[0]


def test_agent_run_on_an_image_gives_onnxruntime_s_outputs_for_the_same_uint8_frame(compiled, tmp_path):
    from PIL import Image

    src, out = compiled
    rgb = image("chelsea")
    Image.fromarray(rgb).save(tmp_path / "chelsea.png")
    res = run_cli("tandoor-agent", "run", str(out), "--input", str(tmp_path / "chelsea.png"), "--delegate", "auto",
                  "--save-outputs", str(tmp_path / "outs"))
    assert res.returncode == 0, res.stderr[-1500:]
    got = np.load(tmp_path / "outs" / "output_0.npy")
    want = _onnxruntime(src, reference_input(rgb))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the colour order matters to this model: the frame in RGB gives other scores
    assert np.abs(_onnxruntime(src, reference_input(rgb)[..., ::-1].copy()) - want).max() > 1e-2


def test_the_serve_pipeline_feeds_video_frames_as_uint8_and_matches_onnxruntime(compiled):
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_agent.serve.pipeline import Pipeline
    from tandoor_contract import hmod

    src, out = compiled
    with hmod.open_bundle(out) as b:
        module = HybridModule(b, delegate="onnxruntime")
        try:
            pipe = Pipeline(module, keep_raw=True)
            for name in ("bikes30", "bikes80"):
                rgb = image(name)
                x = pipe.preprocess(rgb)
                assert x.dtype == np.uint8 and np.array_equal(x, reference_input(rgb))
                r = pipe.process_image(rgb)
                np.testing.assert_allclose(r.raw[0], _onnxruntime(src, reference_input(rgb)), rtol=1e-4, atol=1e-4)
        finally:
            module.close()


def test_uint8_ops_before_the_cast_stay_in_tvm_and_the_bundle_matches_onnxruntime(tmp_path):
    """tf2onnx's order: the uint8 NHWC image transposed to NCHW first, then cast; ACL's kernels are float."""
    N = helper.make_node
    m = camera_model()
    g = m.graph
    del g.node[:4]
    g.node.insert(0, N("Transpose", ["image"], ["t8"], perm=[0, 3, 1, 2]))
    g.node.insert(1, N("Cast", ["t8"], ["f"], to=TensorProto.FLOAT))
    g.node.insert(2, N("Div", ["f", "d"], ["t"]))
    g.initializer.append(numpy_helper.from_array(np.array(255.0, np.float32), "d"))
    res, out = _compile(tmp_path, m, "--policy", "all")
    assert res.returncode == 0, res.stderr[-1500:]
    man = manifest_of(out)
    assert any(o["op"] == "permute_dims" and "uint8" in o["reason"] for o in man["tvm_ops"])
    assert any(p["delegate"] and "nn.conv2d" in p["ops"] for p in man["partitions"])
    for delegate in ("onnxruntime", "tvm"):
        v = run_cli("tandoor", "verify", str(out), "--reference", str(tmp_path / "m.onnx"), "--delegate", delegate)
        assert v.returncode == 0, v.stdout[-1500:]


def _compile(tmp: Path, m, *args: str):
    src, out = tmp / "m.onnx", tmp / "m.hmod"
    src.write_bytes(m.SerializeToString())
    return run_cli("tandoor", "compile", str(src), "-o", str(out), "-q", *args), out


def _one_line_refusal(res, out: Path) -> str:
    assert res.returncode == 2, res.stderr[-1500:]
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandoor: error: "), res.stderr
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("flags,names", [(("--mean", "127,127,127", "--std", "128,128,128"), "--mean and --std"),
                                         (("--pixel-range", "0-1"), "--pixel-range")])
def test_mean_std_with_a_uint8_input_are_refused_because_the_graph_normalises(tmp_path, flags, names):
    line = _one_line_refusal(*_compile(tmp_path, camera_model(), *flags))
    assert names in line and "uint8" in line and "inside its graph" in line


@pytest.mark.parametrize("elem,says", [(TensorProto.INT8, "quantized tensor"), (TensorProto.INT32, "not images"),
                                       (TensorProto.INT64, "not images"), (TensorProto.UINT16, "float32 or uint8")])
def test_other_integer_inputs_are_refused_in_one_line(tmp_path, elem, says):
    line = _one_line_refusal(*_compile(tmp_path, camera_model(elem)))
    assert "input 'image' is " in line and says in line
