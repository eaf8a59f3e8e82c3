"""Tiny generated models (onnx.helper) with the traits that made the compile's self-check and
`tandoor verify` disagree (issue 29): many equal scores into TopK (and an ArgMax between equal
maxima), a reduction over a long span, placeholder weights that drive a Softmax's logits to 1e9,
a deep relu6 conv stack that carries and amplifies every layer's rounding (M-LSD's trait)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper


def _save(g: onnx.GraphProto, path: Path) -> Path:
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _const(name: str, a) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


def _topk(path: Path, name: str, scoring: list[onnx.NodeProto], inits: list, n: int, k: int) -> Path:
    """``scoring`` makes scores ``s`` from ``x`` [1, n]; then TopK(k) of them, the indices, and x
    gathered by them (a detector's boxes follow its scores so)."""
    nodes = scoring + [helper.make_node("TopK", ["s", "k"], ["vals", "idx"], axis=1),
                       helper.make_node("GatherElements", ["x", "idx"], ["picked"], axis=1)]
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", T.FLOAT, [1, n])],
                          [helper.make_tensor_value_info("vals", T.FLOAT, [1, k]),
                           helper.make_tensor_value_info("idx", T.INT64, [1, k]),
                           helper.make_tensor_value_info("picked", T.FLOAT, [1, k])],
                          inits + [_const("k", np.array([k], np.int64))])
    return _save(g, path)


def topk_ties(path: Path, n: int = 64, k: int = 16, ceiling: float = 1.0) -> Path:
    """scores = min(x, ceiling): on unit-variance noise ~16% of 64 scores tie at 1.0."""
    return _topk(path, "topk_ties", [helper.make_node("Clip", ["x", "lo", "hi"], ["s"])],
                 [_const("lo", np.float32(-100)), _const("hi", np.float32(ceiling))], n, k)


def topk_near_ties(path: Path, n: int = 1000, k: int = 300, gain: float = 12.0) -> Path:
    """scores = sigmoid(12 x): on unit-variance noise a quarter of 1000 scores are within an ulp of
    1.0, where TVM's sigmoid and onnxruntime's differ by one: TopK(300) orders them otherwise (the
    end-to-end detector of issue 29: 125 of 300 scores tied, refused at 1.44e3)."""
    return _topk(path, "topk_near_ties", [helper.make_node("Mul", ["x", "gain"], ["xs"]),
                                          helper.make_node("Sigmoid", ["xs"], ["s"])],
                 [_const("gain", np.float32(gain))], n, k)


def argmax_ties(path: Path) -> Path:
    """The class map of min(x, 0.5) over 4 channels: where two channels reach 0.5, either is right."""
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["s"]),
             helper.make_node("ArgMax", ["s"], ["cls"], axis=1, keepdims=0)]
    g = helper.make_graph(nodes, "argmax_ties", [helper.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("cls", T.INT64, [1, 8, 8])],
                          [_const("lo", np.float32(-100)), _const("hi", np.float32(0.5))])
    return _save(g, path)


def long_mean(path: Path, hw: int = 256) -> Path:
    """mean(x + 10) - 10 over hw*hw pixels: a sum of 65536 values near 10, cancelled to near 0."""
    nodes = [helper.make_node("Add", ["x", "ten"], ["xp"]), helper.make_node("GlobalAveragePool", ["xp"], ["m"]),
             helper.make_node("Sub", ["m", "ten"], ["y"])]
    g = helper.make_graph(nodes, "long_mean", [helper.make_tensor_value_info("x", T.FLOAT, [1, 4, hw, hw])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 4, 1, 1])], [_const("ten", np.float32(10))])
    return _save(g, path)


def placeholder_softmax(path: Path, layers: int = 10, ch: int = 64) -> Path:
    """A conv stack whose every weight is 0.02 (as onnx's light_* test models): each layer multiplies
    the values by 0.02 * 9 * ch, every class's logit is the same, and a Softmax over them."""
    nodes, inits, prev, cin = [], [], "x", 3
    for i in range(layers):
        inits.append(_const(f"w{i}", np.full((ch, cin, 3, 3), 0.02, np.float32)))
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev, cin = f"r{i}", ch
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["gap"]), helper.make_node("Flatten", ["gap"], ["logits"]),
              helper.make_node("Softmax", ["logits"], ["prob"], axis=1)]
    g = helper.make_graph(nodes, "placeholder_softmax", [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("prob", T.FLOAT, [1, ch])], inits)
    return _save(g, path)


def detector_tail(path: Path, n: int = 64, k: int = 16, gain: float | None = None) -> Path:
    """A detector's tail: TopK(k) of min(x, 1) (or, with ``gain``, of sigmoid(gain x): near ties
    that one rounding reorders), then boxes b [1, n, 4] taken by the indices two ways: squeezed and
    Gather (-> [k, 4]), and unsqueezed, expanded and GatherElements (-> [1, k, 4])."""
    scoring = ([helper.make_node("Clip", ["x", "lo", "hi"], ["s"])] if gain is None else
               [helper.make_node("Mul", ["x", "gain"], ["xs"]), helper.make_node("Sigmoid", ["xs"], ["s"])])
    nodes = scoring + [
             helper.make_node("TopK", ["s", "k"], ["vals", "idx"], axis=1),
             helper.make_node("Squeeze", ["idx", "zero"], ["idx1"]), helper.make_node("Squeeze", ["b", "zero"], ["b1"]),
             helper.make_node("Gather", ["b1", "idx1"], ["boxes"], axis=0),
             helper.make_node("Unsqueeze", ["idx", "two"], ["idx3"]), helper.make_node("Expand", ["idx3", "wide"], ["idx4"]),
             helper.make_node("GatherElements", ["b", "idx4"], ["boxes3"], axis=1)]
    g = helper.make_graph(nodes, "detector_tail", [helper.make_tensor_value_info("x", T.FLOAT, [1, n]),
                                                   helper.make_tensor_value_info("b", T.FLOAT, [1, n, 4])],
                          [helper.make_tensor_value_info("vals", T.FLOAT, [1, k]),
                           helper.make_tensor_value_info("boxes", T.FLOAT, [k, 4]),
                           helper.make_tensor_value_info("boxes3", T.FLOAT, [1, k, 4])],
                          [_const("lo", np.float32(-100)), _const("hi", np.float32(1.0)), _const("k", np.array([k], np.int64)),
                           _const("zero", np.array([0], np.int64)), _const("two", np.array([2], np.int64)),
                           _const("wide", np.array([1, k, 4], np.int64))]
                          + ([] if gain is None else [_const("gain", np.float32(gain))]))
    return _save(g, path)


def deep_relu6(path: Path, layers: int = 20, ch: int = 16, hw: int = 16, gain: float = 4.0) -> Path:
    """``layers`` 3x3 convs (random weights of gain 4, as BatchNorm folded into MobileNet-style
    convs leaves them) each clipped to [0, 6]: every conv's rounding is carried through the rest
    and amplified, so TVM and onnxruntime end 1.6e-2 to 2e-2 apart on outputs up to 60, while each
    conv alone agrees to a few ulps (M-LSD tiny: 7.5e-3 on outputs up to 81)."""
    rng = np.random.default_rng(0)
    nodes, prev, cin = [], "x", 3
    inits = [_const("lo", np.float32(0)), _const("hi", np.float32(6))]
    for i in range(layers):
        inits += [_const(f"w{i}", rng.normal(0, gain / np.sqrt(9 * cin), (ch, cin, 3, 3)).astype(np.float32)),
                  _const(f"b{i}", rng.normal(0, 0.1, ch).astype(np.float32))]
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        if i < layers - 1:
            nodes.append(helper.make_node("Clip", [f"c{i}", "lo", "hi"], [f"r{i}"]))
        prev, cin = f"r{i}", ch
    nodes.append(helper.make_node("Identity", [f"c{layers - 1}"], ["y"]))
    g = helper.make_graph(nodes, "deep_relu6", [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, hw, hw])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, ch, hw, hw])], inits)
    return _save(g, path)
