"""The onnxruntime executor: runs the compiler's ONNX rendering of an order.

The universal executor and the host stand-in for ACL: any board with onnxruntime runs it.
"""

from __future__ import annotations

import numpy as np


def available() -> tuple[bool, str]:
    try:
        import onnxruntime  # noqa: F401
    except Exception as err:
        return False, f"onnxruntime not importable ({type(err).__name__}: {err})"
    return True, ""


class OrtExecutor:
    name = "onnxruntime"

    def __init__(self, order: dict, onnx_bytes: bytes, threads: int = 0) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])
        self.in_names = [i["name"] for i in order["inputs"]]
        self.out_names = [o["name"] for o in order["outputs"]]
        self.backend = "CPUExecutionProvider"

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.out_names, dict(zip(self.in_names, inputs)))

    def run_into(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for dst, src in zip(outputs, self.run(inputs)):
            np.copyto(dst, src.reshape(dst.shape))
