"""One small ONNX model per op type of the order vocabulary (tandoor_contract.orders.OPS), for the
board: each compiles (policy all) into orders that hold that op type, in every variant the
Arm NN executor builds differently (every activation kind, every binary kind, depthwise and
dilated convolutions, both resize methods, ...), one output per variant.

``MODELS`` is keyed by op type; tests/board/test_board.py checks that its keys are exactly
``OPS`` and that the compiled orders hold every op type, activation kind and binary kind the
vocabulary lists: a new op type (or kind) fails there until it has a model here.

Layout-sensitive ops (pools, global pools, resizes, PRelu, transposed convolutions) sit behind a
1x1 convolution, as in real models: the compiler moves convolutions to NHWC and those ops follow
them there (tests/compiler/test_ops.py says why).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper, numpy_helper, shape_inference

X = [1, 8, 12, 12]  # the usual input: NCHW


class Graph:
    """A small ONNX graph built op by op; every variant ends in its own output."""

    def __init__(self, name: str, inputs: dict[str, list[int]]) -> None:
        self.name, self.inputs = name, inputs
        self.nodes: list = []
        self.inits: dict[str, np.ndarray] = {}
        self.outputs: list[str] = []
        self._rng = np.random.default_rng(zlib.crc32(name.encode()))

    def w(self, *shape: int, scale: float = 0.3, low: float | None = None) -> str:
        """A constant: normal(0, scale), or uniform in [low, low + 1) (a divisor away from 0)."""
        a = (self._rng.uniform(low, low + 1.0, shape) if low is not None
             else self._rng.standard_normal(shape) * scale).astype(np.float32)
        return self.const(a)

    def const(self, a) -> str:
        name = f"c{len(self.inits)}"
        self.inits[name] = np.asarray(a)
        return name

    def op(self, op_type: str, *ins: str, **attrs) -> str:
        out = f"t{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(ins), [out], **attrs))
        return out

    def out(self, t: str) -> None:
        self.outputs.append(t)

    def pre(self, x: str = "x", c: int = 8) -> str:
        """A 1x1 convolution with bias: what puts the op after it in NHWC."""
        return self.op("Conv", x, self.w(c, X[1], 1, 1), self.w(c))

    def onnx_bytes(self) -> bytes:
        vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
        g = helper.make_graph(self.nodes, self.name, [vi(n, s) for n, s in self.inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in self.outputs],
                              [numpy_helper.from_array(a, n) for n, a in self.inits.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        # the compiler wants static output shapes: ONNX's shape inference fills them in
        m = shape_inference.infer_shapes(m, strict_mode=True)
        assert all(d.HasField("dim_value") for o in m.graph.output for d in o.type.tensor_type.shape.dim), self.name
        return m.SerializeToString()


def conv2d() -> Graph:
    g = Graph("conv2d", {"x": X})
    g.out(g.op("Relu", g.op("Conv", "x", g.w(8, 8, 3, 3), g.w(8), pads=[1, 1, 1, 1])))
    # depthwise (ours [C*M, KH, KW, 1] -> Arm NN's per-ABI layout), stride 2, relu6
    g.out(g.op("Clip", g.op("Conv", "x", g.w(8, 1, 3, 3), g.w(8), group=8, strides=[2, 2], pads=[1, 1, 1, 1]),
               g.const(np.float32(0)), g.const(np.float32(6))))
    g.out(g.op("Conv", "x", g.w(16, 1, 3, 3), g.w(16), group=8, pads=[0, 1, 1, 0]))  # depth multiplier 2
    g.out(g.op("Sigmoid", g.op("Conv", "x", g.w(4, 8, 3, 3), dilations=[2, 2], pads=[2, 2, 2, 2])))
    g.out(g.op("Tanh", g.op("Conv", "x", g.w(6, 8, 1, 1), g.w(6), strides=[2, 2])))
    g.out(g.op("LeakyRelu", g.op("Conv", "x", g.w(8, 8, 3, 3), g.w(8), pads=[1, 1, 1, 1]), alpha=0.1))
    # a depthwise 5x5 stride 2 and a 1x1 convolution reading one tensor (PicoDet's neck): Arm NN
    # 20.08 computes the 1x1 wrongly unless the depthwise reads a copy (Api.depthwise_own_input)
    p = g.pre(c=16)
    g.out(g.op("Conv", p, g.w(16, 1, 5, 5), g.w(16), group=16, strides=[2, 2], pads=[2, 2, 2, 2]))
    g.out(g.op("Conv", p, g.w(8, 16, 1, 1), g.w(8)))
    return g


def conv2d_transpose() -> Graph:
    g = Graph("conv2d_transpose", {"x": X})
    p = g.pre()
    g.out(g.op("Relu", g.op("ConvTranspose", p, g.w(8, 4, 3, 3), g.w(4), strides=[2, 2], pads=[1, 1, 1, 1],
                            output_padding=[1, 1])))
    g.out(g.op("ConvTranspose", p, g.w(8, 6, 2, 2), strides=[2, 2]))
    return g


def dense() -> Graph:
    g = Graph("dense", {"v": [1, 32]})
    g.out(g.op("Gemm", "v", g.w(10, 32), g.w(10), transB=1))
    g.out(g.op("MatMul", "v", g.w(32, 7)))
    g.out(g.op("Relu", g.op("Gemm", "v", g.w(5, 32), g.w(5), transB=1)))
    return g


def activation() -> Graph:
    g = Graph("activation", {"x": X})
    g.out(g.op("Relu", "x"))
    g.out(g.op("Clip", "x", g.const(np.float32(-0.5)), g.const(np.float32(0.75))))
    g.out(g.op("Sigmoid", "x"))
    g.out(g.op("Tanh", "x"))
    g.out(g.op("LeakyRelu", "x", alpha=0.2))
    g.out(g.op("HardSwish", "x"))
    g.out(g.op("HardSigmoid", "x", alpha=0.2, beta=0.5))
    g.out(g.op("Mul", "x", g.op("Sigmoid", "x")))   # SiLU written out, as exporters write it
    return g


def layer_norm() -> Graph:
    g = Graph("layer_norm", {"v": [1, 10, 16]})
    # GELU's tanh form written out (BERT-style exports; its erf form has no Arm NN layer before
    # 23.11), here and not in activation(): folding it merges common subexpressions, and the SiLU's
    # Sigmoid(x) would become the Sigmoid output's, an intermediate that escapes its match
    inner = g.op("Add", "v", g.op("Mul", g.op("Pow", "v", g.const(np.float32(3))), g.const(np.float32(0.044715))))
    t = g.op("Tanh", g.op("Mul", inner, g.const(np.float32(np.sqrt(2 / np.pi)))))
    g.out(g.op("Mul", g.op("Mul", "v", g.const(np.float32(0.5))), g.op("Add", t, g.const(np.float32(1)))))
    g.out(g.op("LayerNormalization", "v", g.w(16), g.w(16), axis=-1, epsilon=1e-5))
    # TF style, written out: mean, centre, mean square, + eps, sqrt, reciprocal, * gamma + beta
    d = g.op("Sub", "v", g.op("ReduceMean", "v", axes=[-1]))
    var = g.op("ReduceMean", g.op("Pow", d, g.const(np.float32(2))), axes=[-1])
    r = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const(np.float32(1e-3)))))
    g.out(g.op("Add", g.op("Mul", g.op("Mul", d, r), g.w(16)), g.w(16)))
    return g


def prelu() -> Graph:
    g = Graph("prelu", {"x": X})
    p = g.pre()
    g.out(g.op("PRelu", p, g.w(8, 1, 1)))     # per channel
    g.out(g.op("PRelu", p, g.w(1)))           # one slope
    return g


def pool2d() -> Graph:
    g = Graph("pool2d", {"x": X})
    p = g.pre()
    g.out(g.op("MaxPool", p, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    g.out(g.op("AveragePool", p, kernel_shape=[2, 2], strides=[2, 2]))
    g.out(g.op("AveragePool", p, kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1))
    g.out(g.op("MaxPool", p, kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1))
    return g


def global_pool2d() -> Graph:
    g = Graph("global_pool2d", {"x": X})
    p = g.pre()
    g.out(g.op("GlobalAveragePool", p))
    g.out(g.op("GlobalMaxPool", p))
    return g


def binary() -> Graph:
    g = Graph("binary", {"x": X, "x2": X})
    g.out(g.op("Add", "x", "x2"))
    g.out(g.op("Sub", "x", g.w(1, 8, 1, 1)))
    g.out(g.op("Mul", "x", "x2"))
    g.out(g.op("Div", "x", g.w(1, 8, 1, 1, low=0.5)))
    g.out(g.op("Max", "x", "x2"))
    g.out(g.op("Min", "x", g.w(1, 8, 12, 12)))
    g.out(g.op("Sub", g.w(1, 8, 1, 1), "x"))   # a constant on the left
    return g


def concat() -> Graph:
    g = Graph("concat", {"x": X, "x2": [1, 3, 12, 12]})
    g.out(g.op("Concat", "x", "x2", axis=1))
    g.out(g.op("Concat", "x", "x", axis=2))
    return g


def reshape() -> Graph:
    g = Graph("reshape", {"x": X})
    g.out(g.op("Reshape", "x", g.const(np.array([1, 8, 144], np.int64))))
    g.out(g.op("Flatten", "x", axis=1))
    return g


def transpose() -> Graph:
    g = Graph("transpose", {"x": X})
    g.out(g.op("Transpose", "x", perm=[0, 2, 3, 1]))
    g.out(g.op("Transpose", "x", perm=[0, 3, 1, 2]))
    # what detector heads do, which Arm NN 20.08's NEPermute refuses as one layer: rank 3 (0, 2, 1)
    # (YOLOX, PicoDet), YOLOv8's DFL (0, 2, 1, 3), the innermost pair, and rank 2
    i64 = lambda *v: g.const(np.array(v, np.int64))  # noqa: E731
    g.out(g.op("Transpose", g.op("Reshape", "x", i64(1, 8, 144)), perm=[0, 2, 1]))
    g.out(g.op("Transpose", "x", perm=[0, 2, 1, 3]))
    g.out(g.op("Transpose", "x", perm=[0, 1, 3, 2]))
    g.out(g.op("Transpose", g.op("Reshape", "x", i64(8, 144)), perm=[1, 0]))
    g.out(g.op("Softmax", g.op("Reshape", "x", i64(1, 8, 144)), axis=1))
    return g


def strided_slice() -> Graph:
    g = Graph("strided_slice", {"x": X})
    i64 = lambda *v: g.const(np.array(v, np.int64))  # noqa: E731
    g.out(g.op("Slice", "x", i64(1, 2), i64(7, 12), i64(2, 3), i64(2, 1)))
    g.out(g.op("Slice", "x", i64(0, 4), i64(4, 8), i64(1, 3)))
    return g


def pad() -> Graph:
    g = Graph("pad", {"x": X})
    g.out(g.op("Pad", "x", g.const(np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)), g.const(np.float32(0.5))))
    g.out(g.op("Pad", "x", g.const(np.array([0, 1, 0, 0, 0, 2, 0, 0], np.int64))))
    return g


def softmax() -> Graph:
    g = Graph("softmax", {"x": X, "v": [1, 10]})
    g.out(g.op("Softmax", "v", axis=-1))
    g.out(g.op("Softmax", "x", axis=-1))
    g.out(g.op("Softmax", "x", axis=1))    # not the last axis: permuted there and back
    return g


def resize2d() -> Graph:
    g = Graph("resize2d", {"x": X})
    p = g.pre()
    sizes = lambda h, w: g.const(np.array([1, 8, h, w], np.int64))  # noqa: E731
    g.out(g.op("Resize", p, "", "", sizes(24, 24), mode="nearest", coordinate_transformation_mode="asymmetric",
               nearest_mode="floor"))
    g.out(g.op("Resize", p, "", "", sizes(24, 24), mode="linear", coordinate_transformation_mode="half_pixel"))
    g.out(g.op("Resize", p, "", "", sizes(19, 19), mode="linear", coordinate_transformation_mode="align_corners"))
    return g


MODELS: dict[str, Callable[[], Graph]] = {f.__name__: f for f in (
    conv2d, conv2d_transpose, dense, activation, prelu, pool2d, global_pool2d, binary, concat, reshape,
    transpose, strided_slice, pad, softmax, resize2d, layer_norm)}
