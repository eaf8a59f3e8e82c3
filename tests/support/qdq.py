"""A small CNN quantized by onnxruntime's own quantizer (QDQ): the test model for quantized orders
on the host and on the boards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def small_cnn(seed: int = 20261202) -> onnx.ModelProto:
    """conv 3->16 s2 + ReLU, depthwise 3x3 + ReLU6, 1x1 conv 16->16, residual add, global pool,
    Gemm 16->10: the quantized kernels and what stays float between them."""
    rng = np.random.default_rng(seed)

    def w(*s):
        return (rng.standard_normal(s) * (2.0 / np.prod(s[1:])) ** 0.5).astype(np.float32)

    inits = {"w1": w(16, 3, 3, 3), "b1": rng.normal(0, 0.1, 16).astype(np.float32), "w2": w(16, 1, 3, 3),
             "b2": rng.normal(0, 0.1, 16).astype(np.float32), "w3": w(16, 16, 1, 1),
             "b3": rng.normal(0, 0.1, 16).astype(np.float32), "wf": w(10, 16),
             "bf": rng.normal(0, 0.1, 10).astype(np.float32), "lo": np.float32(0), "hi": np.float32(6)}
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]), N("Relu", ["c1"], ["r1"]),
             N("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=16), N("Clip", ["c2", "lo", "hi"], ["r2"]),
             N("Conv", ["r2", "w3", "b3"], ["c3"]), N("Add", ["c3", "r1"], ["a"]),
             N("GlobalAveragePool", ["a"], ["p"]), N("Flatten", ["p"], ["f"]),
             N("Gemm", ["f", "wf", "bf"], ["logits"], transB=1)]
    return _classifier("small_cnn", nodes, inits)


def mbconv_cnn(seed: int = 20261205) -> onnx.ModelProto:
    """conv 3->16 s2 + ReLU, then an inverted residual block without its residual (1x1 expand to 64
    + ReLU6, depthwise 3x3 s2 + ReLU6, 1x1 project to 24: EfficientNet-Lite's and MobileNet v2's),
    global pool, Gemm 24->10. Quantized, the four convolutions are one int8 order in which the
    depthwise reads what a convolution wrote (what Arm NN 20.08 computed wrongly per channel)."""
    rng = np.random.default_rng(seed)

    def w(*s):
        return (rng.standard_normal(s) * (2.0 / np.prod(s[1:])) ** 0.5).astype(np.float32)

    def b(n):
        return rng.normal(0, 0.1, n).astype(np.float32)

    inits = {"w1": w(16, 3, 3, 3), "b1": b(16), "w2": w(64, 16, 1, 1), "b2": b(64), "w3": w(64, 1, 3, 3),
             "b3": b(64), "w4": w(24, 64, 1, 1), "b4": b(24), "wf": w(10, 24), "bf": b(10),
             "lo": np.float32(0), "hi": np.float32(6)}
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]), N("Relu", ["c1"], ["r1"]),
             N("Conv", ["r1", "w2", "b2"], ["c2"]), N("Clip", ["c2", "lo", "hi"], ["r2"]),
             N("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1], strides=[2, 2], group=64),
             N("Clip", ["c3", "lo", "hi"], ["r3"]), N("Conv", ["r3", "w4", "b4"], ["c4"]),
             N("GlobalAveragePool", ["c4"], ["p"]), N("Flatten", ["p"], ["f"]),
             N("Gemm", ["f", "wf", "bf"], ["logits"], transB=1)]
    return _classifier("mbconv_cnn", nodes, inits)


def _classifier(name: str, nodes: list, inits: dict) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` from x (1x3x32x32) to logits (1x10)."""
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def quantized_small_cnn(out_dir: Path, per_channel: bool = True, activations: str = "int8",
                        model: onnx.ModelProto | None = None) -> tuple[Path, Path]:
    """(fp32 model, its QDQ model) written to ``out_dir``: onnxruntime's quantize_static on 16
    random calibration inputs, int8 weights, ``activations`` int8 or uint8; ``model`` (a 1x3x32x32
    input x): another than small_cnn()."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(7)

    class Frames(CalibrationDataReader):
        def __init__(self) -> None:
            self.data = iter([{"x": rng.random((1, 3, 32, 32), dtype=np.float32)} for _ in range(16)])

        def get_next(self):
            return next(self.data, None)

    fp32, q = Path(out_dir) / "small.onnx", Path(out_dir) / "small.qdq.onnx"
    onnx.save(model or small_cnn(), str(fp32))
    quantize_static(str(fp32), str(q), Frames(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    activation_type=QuantType.QInt8 if activations == "int8" else QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return fp32, q
