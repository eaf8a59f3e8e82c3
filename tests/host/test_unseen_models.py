"""The real models first tried for issue 29 (zoo/wild.py UNSEEN: recognisers with and without LSTM,
a table decoder with a Loop, tf2onnx face and line detectors), end to end as a new user meets
them: `tandoor compile` for host + aarch64 (its self-check must pass: no --no-check), `tandoor
verify` against onnxruntime (in the runtime-only process, with the auto executors and with the TVM
fallbacks), and `tandoor-agent run` on a real photograph with the device's auto executors, whose
outputs must be onnxruntime's on the source model for the same input.

One compile per model for the whole session (support.cli.compiled, the same key as the board test's,
so the compile cache serves both).
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from skimage import data as skdata

from board.boards import assert_matches
from support.cli import compiled, manifest_of, run_cli
from tandoor_zoo import wild

NAMES = list(wild.UNSEEN)

#: the photograph each model sees and the value range its own preprocessing maps pixels to
INPUTS = {
    "blazeface_front": ("astronaut", -1.0, 1.0),
    "mlsd_tiny": ("rocket", -1.0, 1.0),
    "ppocr_v4_rec": ("page", -1.0, 1.0),
    "ppocr_v2_rec": ("page", -1.0, 1.0),
    "slanet_table": ("page", -1.0, 1.0),
    "ddddocr_ocr": ("text", -1.0, 1.0),
    "captcha_crnn": ("text", 0.0, 1.0),
}


def bundle_of(name: str, bundles_dir: Path) -> Path:
    pins = [a for pin in wild.MODELS[name].inputs for a in ("--input", pin)]
    return compiled(f"wild_{name}", wild.fetch(name), bundles_dir, *pins)


def photo_tensor(image: str, spec: dict, lo: float, hi: float, shift: int = 0) -> np.ndarray:
    """A skimage photograph as the input `spec` (the manifest's) takes it: layout, channel count
    (grey, RGB, RGBA), size, value range; `shift` rolls the image so a pair's second input sees
    another view."""
    rgb = getattr(skdata, image)()
    rgb = np.stack([rgb] * 3, -1) if rgb.ndim == 2 else rgb[..., :3]
    rgb = np.roll(rgb, shift, axis=1)
    shape = spec["shape"]
    nhwc = spec.get("layout") == "NHWC" or (spec.get("layout") is None and shape[1] not in (1, 3, 4))
    h, w, c = (shape[1], shape[2], shape[3]) if nhwc else (shape[2], shape[3], shape[1])
    img = cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA).astype(np.float32)
    if c == 1:
        img = img.mean(-1, keepdims=True)
    elif c == 4:
        img = np.concatenate([img, np.full((h, w, 1), 255, np.float32)], -1)
    img = lo + img / 255.0 * (hi - lo)
    out = img if nhwc else img.transpose(2, 0, 1)
    return np.ascontiguousarray(out[None].reshape(shape), np.float32)


@pytest.fixture(scope="module")
def bundles() -> dict[str, Path | AssertionError]:
    return {}


def _bundle(name, bundles, bundles_dir) -> Path:
    """The model's bundle; a refused compile fails each of its tests with the compiler's message,
    tried once."""
    if name not in bundles:
        try:
            bundles[name] = bundle_of(name, bundles_dir)
        except AssertionError as err:
            bundles[name] = err
    if isinstance(bundles[name], AssertionError):
        raise bundles[name]
    return bundles[name]


@pytest.mark.parametrize("name", NAMES)
def test_a_new_real_model_compiles_for_host_and_aarch64_past_its_self_check(name, bundles, bundles_dir):
    man = manifest_of(_bundle(name, bundles, bundles_dir))
    assert man["model"]["source_sha256"] == wild.MODELS[name].sha256
    assert set(man["targets"]) == {"host", "aarch64"} and man["golden"]
    # each ACL order has its TVM fallback on every target; an onnxruntime order (what neither ACL
    # nor runtime-only TVM runs) has none by design
    delegated = {p["symbol"] for p in man["partitions"] if p["delegate"] and p.get("kind") != "onnx"}
    for target in man["targets"].values():
        assert set(target["fallback"]) == delegated, target["arch"]


@pytest.mark.parametrize("name", NAMES)
def test_a_new_real_model_verifies_against_onnxruntime(name, bundles, bundles_dir):
    res = run_cli("tandoor", "verify", str(_bundle(name, bundles, bundles_dir)), "--reference", str(wild.fetch(name)),
                  "--random", "1", "--json")
    assert res.returncode == 0, f"{name}: {res.stdout[-2000:]} {res.stderr[-1000:]}"
    out = json.loads(res.stdout)
    assert out["ok"] and out["reference_matches_source"]


@pytest.mark.parametrize("delegate", ["auto"])   # verify runs the TVM fallbacks too
@pytest.mark.parametrize("name", NAMES)
def test_the_agent_runs_a_new_real_model_as_onnxruntime_does(name, delegate, bundles, bundles_dir, tmp_path):
    bundle = _bundle(name, bundles, bundles_dir)
    image, lo, hi = INPUTS[name]
    specs = manifest_of(bundle)["inputs"]
    feeds = {s["name"]: photo_tensor(image, s, lo, hi, shift=40 * i) for i, s in enumerate(specs)}
    args = []
    for i, (n, x) in enumerate(feeds.items()):
        np.save(tmp_path / f"in{i}.npy", x)
        args += ["--input", f"{n}={tmp_path / f'in{i}.npy'}"]
    res = run_cli("tandoor-agent", "run", str(bundle), *args, "--delegate", delegate,
                  "--save-outputs", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, f"{name}: exit {res.returncode}: {res.stderr[-1500:]}"
    run = json.loads(res.stdout)
    outs = [np.load(tmp_path / "out" / f"output_{j}.npy") for j in range(len(run["outputs"]))]
    sess = ort.InferenceSession(str(wild.fetch(name)), providers=["CPUExecutionProvider"])
    ref = sess.run(None, feeds)
    ran = {s["executor"] for s in run["subgraphs"]}
    onnx_orders = {p["symbol"] for p in manifest_of(bundle)["partitions"] if p.get("kind") == "onnx"}
    off_tvm = {s["symbol"] for s in run["subgraphs"] if s["executor"] != "tvm"}
    assert delegate == "auto" or off_tvm <= onnx_orders, f"{name}: --delegate tvm ran {off_tvm} elsewhere"
    assert_matches(outs, ref, f"{name} in tandoor-agent run --delegate {delegate} ({', '.join(sorted(ran))})")
