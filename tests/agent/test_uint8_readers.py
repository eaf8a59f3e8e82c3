"""The readers of a manifest whose input is uint8 (raw camera pixels the model normalises in its
graph): golden and random inputs are valid uint8 codes, the frame's resized bytes are the input, and
inputs of another dtype, or out of uint8's range, are refused. The same manifest entry every
format-2 reader takes (docs/bundle-format.md: no version of its own)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from tandoor_agent.run.runtime import RuntimeError_, check_inputs
from tandoor_agent.serve.preprocess import Preprocessor
from tandoor_agent.update.health import _inputs_from_manifest
from tandoor_contract import media, probe

INPUT = {"name": "image", "shape": [1, 48, 64, 3], "dtype": "uint8", "layout": "NHWC"}
MANIFEST = {"inputs": [INPUT]}
FRAME = np.random.default_rng(3).integers(0, 256, (120, 200, 3), np.uint8)


def _spans_every_code(a: np.ndarray) -> bool:
    counts = np.bincount(a.reshape(-1), minlength=256)
    return a.dtype == np.uint8 and counts.min() > 0 and counts.max() < 3 * counts.mean()


def test_golden_inputs_of_a_uint8_input_are_every_code_evenly_and_the_same_bits_each_time():
    for seed in (1, 2):
        (x,) = probe.inputs(MANIFEST, seed=seed)
        assert x.shape == (1, 48, 64, 3) and _spans_every_code(x)
        assert x.tobytes() == probe.inputs(MANIFEST, seed=seed)[0].tobytes()
    assert probe.inputs(MANIFEST, seed=1)[0].tobytes() != probe.inputs(MANIFEST, seed=2)[0].tobytes()


def test_random_inputs_are_valid_for_the_dtype_and_floats_are_drawn_as_verify_drew_them():
    rng = np.random.default_rng(7)
    assert _spans_every_code(probe.random_input(rng, INPUT))
    i8 = probe.random_input(rng, {"shape": [4096], "dtype": "int8"})
    assert i8.dtype == np.int8 and i8.min() == -128 and i8.max() == 127
    spec = {"shape": [2, 3], "dtype": "float32"}
    got = probe.random_input(np.random.default_rng(7), spec)
    assert got.tobytes() == np.random.default_rng(7).uniform(-2, 2, (2, 3)).astype(np.float32).tobytes()
    # the health gate's inputs when a bundle has no golden pair: uint8 codes, not zeros
    (h,) = _inputs_from_manifest(MANIFEST, np.random.default_rng(0))
    assert _spans_every_code(h)


@pytest.mark.parametrize("bgr", [False, True])
def test_the_frame_s_resized_bytes_are_the_input_in_the_model_s_colour_order(bgr):
    pre = media.read_preprocess({"resize": "stretch", "mean": None, "std": None, "scale": 1.0, "bgr": bgr,
                                 "layout": "NHWC"})
    p = Preprocessor(INPUT, pre)
    x = p(FRAME, p.new_output())
    want = cv2.resize(FRAME, (64, 48), interpolation=cv2.INTER_LINEAR)
    assert x.dtype == np.uint8 and np.array_equal(x[0], want[:, :, ::-1] if bgr else want)


def test_a_letterboxed_uint8_input_keeps_the_padding_grey_level():
    p = Preprocessor(INPUT, media.preprocess_entry(resize="letterbox", pad_value=0, scale=1.0, layout="NHWC"))
    x = p(FRAME)
    g = p.geometry(FRAME.shape[:2])
    assert x.dtype == np.uint8 and (g.new_w, g.new_h) == (64, 38)
    assert np.all(x[0, :g.top] == 0) and np.all(x[0, g.top + g.new_h:] == 0)
    assert np.array_equal(x[0, g.top:g.top + g.new_h], cv2.resize(FRAME, (64, 38), interpolation=cv2.INTER_LINEAR))


def test_inputs_of_another_dtype_or_out_of_uint8_s_range_are_refused():
    x = np.zeros((1, 48, 64, 3), np.uint8)
    check_inputs(MANIFEST, [x])
    check_inputs(MANIFEST, [x.astype(np.uint16) + 255])       # fits: taken
    with pytest.raises(RuntimeError_, match="must be uint8, got float32"):
        check_inputs(MANIFEST, [x.astype(np.float32)])
    with pytest.raises(RuntimeError_, match=r"uint8 \(0..255\); the uint16 values given span 0..300"):
        check_inputs(MANIFEST, [np.where(np.arange(x.size).reshape(x.shape) == 5, 300, 0).astype(np.uint16)])
