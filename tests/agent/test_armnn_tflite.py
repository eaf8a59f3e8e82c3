"""agent/run/executors/armnn_tflite.py: a per-channel order's per-axis quantization as a TFLite model (made
by the Arm NN executor at load), written with flatbuffers' Builder and read back with the tflite
package's own reader (the schema's generated classes). That Arm NN's TfLite parser takes it and
the order then agrees with onnxruntime: tests/agent/test_quantized_orders.py."""

from __future__ import annotations

import numpy as np
import tflite

from tandoor_agent.run.executors import armnn_tflite
from tandoor_contract import orders


def _order(depthwise: bool, per_channel: bool = True) -> dict:
    oc = 8
    ks = np.linspace(0.001, 0.004, oc) if per_channel else np.full(1, 0.002)
    axis = {"axis": 0} if per_channel else {}
    kshape = [oc, 3, 3, 1] if depthwise else [oc, 3, 3, 4]
    kernel = {"shape": kshape, "dtype": "int8", "offset": 0, "nbytes": int(np.prod(kshape)),
              "quant": {"scale": ks.tolist(), "zero_point": [0] * len(ks), **axis}}
    bias = {"shape": [oc], "dtype": "int32", "offset": 128, "nbytes": 4 * oc,
            "quant": {"scale": (0.05 * ks).tolist(), "zero_point": [0] * len(ks), **axis}}
    cin = oc if depthwise else 4
    t = lambda c, s, z: {"shape": [1, 8, 8, c], "dtype": "int8", "quant": {"scale": [s], "zero_point": [z]}}  # noqa: E731
    return {"order_version": 2, "symbol": "m_acl_0", "inputs": [{"name": "x", **t(cin, 0.05, -3)}],
            "outputs": [{"name": "y", **t(oc, 0.1, 5)}], "tensors": {"x": t(cin, 0.05, -3), "y": t(oc, 0.1, 5)},
            "weights": {"k": kernel, "b": bias},
            "ops": [{"type": "conv2d", "inputs": ["x"], "output": "y", "weights": {"kernel": "k", "bias": "b"},
                     "attrs": {"groups": cin if depthwise else 1, "depthwise": depthwise, "padding": [1, 1, 1, 1]}}]}


def _tensors(data: bytes) -> dict[str, dict]:
    m = tflite.Model.GetRootAs(data, 0)
    assert m.SubgraphsLength() == 1 and m.OperatorCodesLength() == 0
    g = m.Subgraphs(0)
    assert g.OperatorsLength() == 0 and m.BuffersLength() == 1 and m.Buffers(0).DataLength() == 0   # no data
    out = {}
    for i in range(g.TensorsLength()):
        t = g.Tensors(i)
        q = t.Quantization()
        out[t.Name().decode()] = {"shape": t.ShapeAsNumpy().tolist(), "type": t.Type(), "dim": q.QuantizedDimension(),
                                  "scale": q.ScaleAsNumpy().tolist(),
                                  "zero_point": q.ZeroPointAsNumpy().tolist() if q.ZeroPointLength() else []}
    assert sorted(g.InputsAsNumpy().tolist()) == list(range(g.TensorsLength()))
    return out


def test_a_conv_kernel_and_its_bias_are_tensors_with_their_per_axis_scales():
    order = _order(depthwise=False)
    data = armnn_tflite.quant_model(order)
    assert data == armnn_tflite.quant_model(order) and data[4:8] == b"TFL3"     # the same bytes every time
    got = _tensors(data)
    assert set(got) == {"k", "b"}
    ks = np.float32(order["weights"]["k"]["quant"]["scale"])
    assert got["k"]["shape"] == [8, 3, 3, 4] and got["k"]["dim"] == 0 and got["k"]["type"] == tflite.TensorType.INT8
    np.testing.assert_array_equal(np.float32(got["k"]["scale"]), ks)
    assert got["k"]["zero_point"] == got["b"]["zero_point"] == []   # all 0: left out (Arm NN reads QSymmS8)
    # the bias: the float32 products of the input's scale and the kernel's, as Arm NN checks them
    assert got["b"]["type"] == tflite.TensorType.INT32 and got["b"]["dim"] == 0
    np.testing.assert_array_equal(np.float32(got["b"]["scale"]), np.float32(0.05) * ks)


def test_a_depthwise_kernel_is_also_in_tflites_own_layout_along_dim_3():
    got = _tensors(armnn_tflite.quant_model(_order(depthwise=True)))
    assert set(got) == {"k", "k" + armnn_tflite.TFLITE_1HWO, "b"}
    assert (got["k"]["shape"], got["k"]["dim"]) == ([8, 3, 3, 1], 0)
    assert (got["k:1HWO"]["shape"], got["k:1HWO"]["dim"]) == ([1, 3, 3, 8], 3)
    assert got["k:1HWO"]["scale"] == got["k"]["scale"]      # (one vector in the file, both tensors name it)


def test_a_per_tensor_order_has_no_model():
    assert armnn_tflite.quant_model(_order(depthwise=False, per_channel=False)) is None
    same = _order(depthwise=False)       # per-axis scales all equal: one per tensor, the same reals
    same["weights"]["k"]["quant"]["scale"] = [0.002] * 8
    assert armnn_tflite.quant_model(same) is None


def test_the_order_as_stored_gives_the_model_the_compiler_saw():
    """The agent makes the model from the order it reads (order_version 5: scale lists in the blob
    as float32), the compiler had the order before; the bytes must be the same."""
    order = _order(depthwise=True)
    blob = bytes(256)
    stored, blob2 = orders.scale_refs_out(order, blob, min_count=2)
    assert stored["order_version"] == orders.SCALE_REF_ORDER_VERSION and not isinstance(
        stored["weights"]["k"]["quant"]["scale"], list)
    assert armnn_tflite.quant_model(orders.resolve_scales(stored, blob2)) == armnn_tflite.quant_model(order)


def test_nonzero_zero_points_are_written_per_channel():
    order = _order(depthwise=False)
    order["weights"]["k"]["quant"]["zero_point"] = list(range(8))
    got = _tensors(armnn_tflite.quant_model(order))
    assert got["k"]["zero_point"] == list(range(8)) and got["b"]["zero_point"] == []
