"""A small classifier the NPU's table takes whole (conv, relu, pool, gemm) and frames to calibrate
it on: the NPU's deploy tests on the host (tests/agent/test_npu_agent.py) and on the boards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh


def npu_cnn(path: Path) -> Path:
    rng = np.random.default_rng(3104)
    w = nh.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    fc = nh.from_array((rng.standard_normal((5, 8)) * 0.3).astype(np.float32), "fc")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
                           helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)],
                          "npu_cls", [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 5])], [w, fc])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def npu_frames(n: int = 10) -> list[list[np.ndarray]]:
    """INT8 calibration inputs for :func:`npu_cnn` (every fifth is held out: the golden pairs)."""
    rng = np.random.default_rng(5)
    return [[rng.uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)] for _ in range(n)]
