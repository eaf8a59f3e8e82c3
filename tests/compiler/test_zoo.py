"""Tests for tandoor_zoo.models: real exports into throw-away caches (no mocks).

Everything is exported twice, into two caches, once per session (about a minute on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torch")
pytest.importorskip("skimage")

from tandoor_zoo import models as zoo  # noqa: E402

EXTRA = {
    "with_unsupported_middle": zoo.with_unsupported_middle,
    "dynamic_batch": zoo.dynamic_batch,
    "unsupported_op": zoo.unsupported_op,
}
OUTPUT_SHAPES = {name: (1, 1000) for name in zoo.ALL_CNNS}
OUTPUT_SHAPES["with_unsupported_middle"] = (1, 10)


def _build_into(cache: Path, fns: dict) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDOOR_CACHE", str(cache))
        return {name: fn() for name, fn in fns.items()}


@pytest.fixture(scope="session")
def cache_a(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo-cache-a")


@pytest.fixture(scope="session")
def models(cache_a) -> dict[str, Path]:
    return _build_into(cache_a, {**zoo.ALL_CNNS, **EXTRA})


@pytest.fixture(scope="session")
def models_b(tmp_path_factory) -> dict[str, Path]:
    return _build_into(tmp_path_factory.mktemp("zoo-cache-b"), {**zoo.ALL_CNNS, **EXTRA})


@pytest.fixture(scope="session")
def labels(cache_a) -> list[str]:
    path = _build_into(cache_a, {"labels": zoo.imagenet_labels})["labels"]
    return path.read_text(encoding="utf-8").splitlines()


def _session(path: Path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _input_shape(path: Path) -> list:
    m = onnx.load(str(path), load_external_data=False)
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim]


def _run(path: Path, seed: int = 0) -> np.ndarray:
    shape = [d if isinstance(d, int) else 2 for d in _input_shape(path)]
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return _session(path).run(None, {"input": x})[0]


@pytest.mark.parametrize("name", [*zoo.ALL_CNNS, "with_unsupported_middle"])
def test_cnn_is_static_single_file_and_runs(models, name):
    path = models[name]
    assert path.parent.name == "models" and path.suffix == ".onnx"
    m = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(m)
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in m.graph.initializer)
    assert [i.name for i in m.graph.input] == ["input"]
    assert [o.name for o in m.graph.output] == ["logits"]
    for v in (*m.graph.input, *m.graph.output):
        dims = v.type.tensor_type.shape.dim
        assert dims and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), f"{v.name} not static"
    in_shape = _input_shape(path)
    assert in_shape[:2] == [1, 3]
    y = _run(path)
    assert y.shape == OUTPUT_SHAPES[name]
    assert np.isfinite(y).all() and y.std() > 1e-3


@pytest.mark.parametrize("name", [*zoo.ALL_CNNS, *EXTRA])
def test_exports_are_deterministic(models, models_b, name):
    a, b = models[name], models_b[name]
    assert a != b
    assert a.read_bytes() == b.read_bytes()
    if name != "unsupported_op":
        np.testing.assert_array_equal(_run(a, seed=1), _run(b, seed=1))


def test_cached_files_are_reused_silently(models, cache_a, capfd):
    before = {n: p.stat().st_mtime_ns for n, p in models.items()}
    again = _build_into(cache_a, {**zoo.ALL_CNNS, **EXTRA})
    assert again == models
    assert {n: p.stat().st_mtime_ns for n, p in again.items()} == before
    assert "[tandoor.zoo]" not in capfd.readouterr().err
    assert not [p for p in (cache_a / "models").iterdir() if p.name.startswith(".")], "temp files left behind"


def test_sizes_stay_small(models):
    for name, path in models.items():
        limit = 20e6 if name == "efficientnet_lite0" else 15e6
        assert path.stat().st_size < limit, name


def test_generated_cnns_keep_nontrivial_batchnorm(models):
    from onnx import numpy_helper

    for name in ("mobilenet_v2", "resnet18", "vgg_small", "with_unsupported_middle"):
        m = onnx.load(str(models[name]))
        inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        bns = [n for n in m.graph.node if n.op_type == "BatchNormalization"]
        assert bns, name
        mean, var = inits[bns[0].input[3]], inits[bns[0].input[4]]
        assert np.abs(mean).max() > 1e-3 and np.abs(var - 1).max() > 1e-3, name


def test_architecture_features(models):
    def ops(name):
        return [n.op_type for n in onnx.load(str(models[name])).graph.node]

    mb = onnx.load(str(models["mobilenet_v2"]))
    assert any(a.name == "group" and a.i > 1 for n in mb.graph.node if n.op_type == "Conv" for a in n.attribute)
    assert {"Clip", "Add", "GlobalAveragePool", "Gemm"} <= set(ops("mobilenet_v2"))
    assert {"MaxPool", "Add", "Relu", "Gemm"} <= set(ops("resnet18"))
    sq = onnx.load(str(models["squeezenet11"]))
    assert ops("squeezenet11").count("Concat") == 8
    assert all(a.i == 1 for n in sq.graph.node if n.op_type == "MaxPool" for a in n.attribute if a.name == "ceil_mode")
    assert ops("vgg_small").count("Gemm") == 3


def test_efficientnet_lite0_sees_espresso(models, labels):
    sess = _session(models["efficientnet_lite0"])
    img = zoo.sample_image("coffee")
    for pre in (zoo.EFFICIENTNET_LITE0_PREPROCESS, zoo.IMAGENET_PREPROCESS):
        logits = sess.run(None, {"input": zoo.preprocess(img, 224, **pre)})[0][0]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        assert int(np.argmax(p)) == 967, [labels[i] for i in np.argsort(-p)[:5]]
        assert p[967] > 0.5
    cat = sess.run(None, {"input": zoo.preprocess(zoo.sample_image("chelsea"))})[0][0]
    assert 281 <= int(np.argmax(cat)) <= 285  # the domestic cats


def test_imagenet_labels(labels):
    assert len(labels) == 1000
    assert labels[967] == "espresso"  # 0-based: line i is class i
    assert labels[0] == "tench" and labels[999] == "toilet tissue"
    assert all(lbl.strip() == lbl and lbl for lbl in labels)


def test_dynamic_batch_has_symbolic_dim(models):
    shape = _input_shape(models["dynamic_batch"])
    assert shape == ["N", 3, 32, 32]
    assert _run(models["dynamic_batch"]).shape == (2, 10)


def test_unsupported_op_is_valid_but_unrunnable(models):
    m = onnx.load(str(models["unsupported_op"]))
    onnx.checker.check_model(m)
    custom = [n for n in m.graph.node if n.domain == "com.example"]
    assert [n.op_type for n in custom] == ["Frobnicate"]
    assert {o.domain for o in m.opset_import} == {"", "com.example"}
    with pytest.raises(Exception):
        _session(models["unsupported_op"])


def test_with_unsupported_middle_has_erf_between_convs(models):
    nodes = [n.op_type for n in onnx.load(str(models["with_unsupported_middle"])).graph.node]
    assert nodes.count("Erf") == 1
    i = nodes.index("Erf")
    assert nodes[:i].count("Conv") == 3 and nodes[i + 1:].count("Conv") == 3


def test_sample_image_and_preprocess():
    img = zoo.sample_image()
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    assert zoo.sample_image("camera").shape[2] == 3  # grayscale made RGB
    x = zoo.preprocess(img, 224)
    assert x.dtype == np.float32 and x.shape == (1, 3, 224, 224)
    assert -1.01 <= x.min() and x.max() <= 1.01
    y = zoo.preprocess(img, (112, 96), **zoo.IMAGENET_PREPROCESS)
    assert y.shape == (1, 3, 112, 96)
    with pytest.raises(ValueError):
        zoo.sample_image("no_such_image")


def test_import_is_lazy():
    code = "import sys, tandoor_zoo.models; assert not {'torch', 'onnx', 'skimage'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
