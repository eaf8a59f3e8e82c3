"""Tiny generated models (onnx.helper) whose outputs the data sizes: the bundle's tail
(contract/tail.py) runs them after the VM. Used by tests/compiler/test_hatch.py and the boards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
N = helper.make_node
RNG = np.random.default_rng(20261204)


def _w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _i64(*v) -> np.ndarray:
    return np.array(v, np.int64)


def _save(path: Path, nodes, inputs, outputs, inits: dict, opset: int = 17) -> Path:
    g = helper.make_graph(nodes, path.stem, inputs, outputs, [numpy_helper.from_array(np.asarray(v), k)
                                                              for k, v in inits.items()])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))
    return path


def e2e_detector(d: Path) -> Path:
    """An end-to-end detector in miniature: a conv head gives 64 boxes and scores, NMS keeps up to 100
    of them (as many as the data says), gathers take the kept boxes and scores; the scores are an
    output too (the VM's, read by the tail as well)."""
    return _save(d / "e2e_nms.onnx", [
        N("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1], strides=[4, 4]), N("Reshape", ["h", "shp"], ["hr"]),
        N("Split", ["hr", "split"], ["box_t", "logit"], axis=1), N("Transpose", ["box_t"], ["raw"], perm=[0, 2, 1]),
        N("Sigmoid", ["raw"], ["boxes"]), N("Sigmoid", ["logit"], ["scores"]),
        N("NonMaxSuppression", ["boxes", "scores", "maxk", "iou", "thr"], ["sel"]),
        N("Gather", ["sel", "two"], ["idx"], axis=1), N("Squeeze", ["boxes", "zero"], ["boxes2"]),
        N("Gather", ["boxes2", "idx"], ["kept_boxes"], axis=0), N("Reshape", ["scores", "flat"], ["s1"]),
        N("Gather", ["s1", "idx"], ["kept_scores"], axis=0)],
        [_vi("x", [1, 3, 32, 32])], [_vi("kept_boxes", ["k", 4]), _vi("kept_scores", ["k"]), _vi("scores", [1, 1, 64])],
        {"w": _w(5, 3, 3, 3), "shp": _i64(1, 5, 64), "split": _i64(4, 1), "maxk": _i64(100),
         "iou": np.array([0.5], np.float32), "thr": np.array([0.3], np.float32), "two": np.array(2, np.int64),
         "zero": _i64(0), "flat": _i64(-1)}, opset=13)


def nonzero_tail(d: Path) -> Path:
    """NonZero's count of hits, then an op on them: the tail starts at the model's first op."""
    i64 = TensorProto.INT64
    return _save(d / "nonzero.onnx", [N("Relu", ["x"], ["r"]), N("NonZero", ["r"], ["nz"]),
                                      N("Transpose", ["nz"], ["y"], perm=[1, 0])],
                 [_vi("x", [4, 6])], [_vi("y", [None, 2], i64)], {})


def loop_of_data(d: Path) -> Path:
    """A Loop whose trip count the input decides (the count of its positive values), one scan row per
    trip: the rows, and their sum (an op after the Loop, which TVM could run, goes with it)."""
    i64 = TensorProto.INT64
    body = helper.make_graph(
        [N("Identity", ["cond_in"], ["cond_out"]), N("Identity", ["v"], ["scan"])], "body",
        [_vi("i", [], i64), _vi("cond_in", [], TensorProto.BOOL)],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("scan", [1])],
        [numpy_helper.from_array(np.array([1.5], np.float32), "v")])
    return _save(d / "loopn.onnx", [
        N("Greater", ["x", "zero"], ["pos"]), N("Cast", ["pos"], ["posf"], to=F),
        N("ReduceSum", ["posf"], ["n"], keepdims=0), N("Cast", ["n"], ["M"], to=i64),
        N("Loop", ["M", "cond"], ["scans"], body=body), N("ReduceSum", ["scans"], ["y"], keepdims=0)],
        [_vi("x", [64])], [_vi("scans", [None, 1]), _vi("y", [])],
        {"zero": np.array(0.0, np.float32), "cond": np.array(True)})
