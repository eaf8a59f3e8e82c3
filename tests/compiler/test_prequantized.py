"""Models quantized by someone else (issue 40): onnxruntime's own quantizer run on a tiny generated
float net, dynamically (DynamicQuantizeLinear + ConvInteger/MatMulInteger; uint8 per tensor,
int8 per channel) and statically in the operator form (QLinearConv, QLinearMatMul), compiled
for host and aarch64 by the real `tandoor compile` (its golden self-check included) and verified
on both delegates against onnxruntime on the quantized file. The QDQ form has its own tests
(test_qdq_orders.py, test_quantize.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, \
    quantize_static

from test_traits import _w, assert_compiles_and_matches, model

N = helper.make_node


def _float_net():
    """Two convs reading one activation (quantize_dynamic gives them one DynamicQuantizeLinear:
    the PP-OCRv3 detector's trait that left a Cast before its onnxruntime order's placeholder)."""
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["r1"]),
             N("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             N("Conv", ["r1", "w3"], ["c3"], strides=[2, 2]), N("Add", ["c2", "c3"], ["s"]), N("Relu", ["s"], ["r2"]),
             N("GlobalAveragePool", ["r2"], ["g"]), N("Flatten", ["g"], ["f"]), N("MatMul", ["f", "fc"], ["y"])]
    return model(nodes, {"x": [1, 3, 16, 16]}, {"y": [1, 10]},
                 {"w1": _w(8, 3, 3, 3), "b1": _w(8), "w2": _w(16, 8, 3, 3), "b2": _w(16), "w3": _w(16, 8, 1, 1),
                  "fc": _w(16, 10)}, opset=13)


class _Frames(CalibrationDataReader):
    def __init__(self):
        rng = np.random.default_rng(7)
        self.left = iter([{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(8)])

    def get_next(self):
        return next(self.left, None)


QUANTIZERS = {   # name -> (writes the quantized file from the float one, the ops it must hold)
    "dynamic-uint8-per-tensor": (lambda src, dst: quantize_dynamic(src, dst, weight_type=QuantType.QUInt8),
                                 {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"}),
    "dynamic-int8-per-channel": (lambda src, dst: quantize_dynamic(src, dst, weight_type=QuantType.QInt8,
                                                                   per_channel=True),
                                 {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"}),
    "static-qoperator-int8-per-channel": (lambda src, dst: quantize_static(
        src, dst, _Frames(), quant_format=QuantFormat.QOperator, activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8, per_channel=True), {"QLinearConv", "QLinearMatMul"}),
}


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_model_quantized_by_onnxruntime_compiles_and_matches_it(tmp_path, kind):
    import onnx

    quantize, ops = QUANTIZERS[kind]
    src, dst = tmp_path / "f32.onnx", tmp_path / "q.onnx"
    src.write_bytes(_float_net().SerializeToString())
    quantize(str(src), str(dst))
    q = onnx.load(str(dst))
    assert ops <= {n.op_type for n in q.graph.node}
    man = assert_compiles_and_matches(tmp_path, kind, q, "--target", "aarch64")
    to_onnxruntime = {op.removeprefix("onnx.") for p in man["partitions"] if p.get("executor") == "onnxruntime"
                      and p.get("kind") == "onnx" for op in p["ops"]}
    if kind.startswith("dynamic"):   # the quantize beside its integer conv, rounding as the reference does
        assert {"DynamicQuantizeLinear", "ConvInteger"} <= to_onnxruntime, man["partitions"]
