"""The tvm executor: the order's region compiled by TVM into the bundle, for boards that have
neither Arm NN nor onnxruntime. Slow (untuned loops) but always there."""

from __future__ import annotations

from pathlib import Path

import numpy as np


class TvmExecutor:
    name = "tvm"

    def __init__(self, order: dict, lib_path: Path) -> None:
        import tvm
        from tvm import relax

        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib_path)), self.dev)
        self.backend = "llvm"
        self._tvm = tvm

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        args = [self._tvm.runtime.tensor(np.ascontiguousarray(a), self.dev) for a in inputs]
        out = self.vm["main"](*args)
        outs = list(out) if isinstance(out, (list, tuple)) or hasattr(out, "__len__") and not hasattr(out, "numpy") else [out]
        return [o.numpy() for o in outs]

    def run_into(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        for dst, src in zip(outputs, self.run(inputs)):
            np.copyto(dst, src.reshape(dst.shape))
