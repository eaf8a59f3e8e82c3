"""The tvm executor: the order's region compiled by TVM into the bundle, for boards that have
neither Arm NN nor onnxruntime. Slow (untuned loops) but always there.

Inputs are handed to the fallback VM as dlpack views of the caller's buffers (no copy) when they
have the order's dtype (float32, or int8/uint8 codes); the fallback function allocates its own
result (it is not in DPS form), which is copied once into the caller's output buffer.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from tandoor_contract import hmod

from .errors import Unavailable


class TvmExecutor:
    name = "tvm"

    def __init__(self, order: dict, lib_path: Path, params: list[np.ndarray] | None = None, *,
                 entry: str = "main") -> None:
        """``params``: the weights the fallback was compiled without (manifest fallback_params),
        turned once here into what ``entry`` takes (``<entry>_transform_params``: kernel layouts).
        ``entry``: the subgraph's function in the library (hmod.fallback_function)."""
        import tvm
        from tvm.runtime.vm import VirtualMachine  # not tvm.relax: the agent has TVM's runtime only

        self.dev = tvm.cpu()
        self.vm = VirtualMachine(tvm.runtime.load_module(str(lib_path)), self.dev)
        self._main = self.vm[entry]
        self._params: list = []
        if params:
            raw = [tvm.runtime.tensor(np.ascontiguousarray(p), self.dev) for p in params]
            self._params = list(self.vm[f"{entry}_transform_params"](raw))
        # the order's input dtypes: what the fallback's main takes (int8 codes stay int8)
        self._in_dtypes = [np.dtype(str(i.get("dtype", "float32"))) for i in order["inputs"]]
        self.backend = "llvm"
        self.last_run_ns = 0
        self.last_zero_copy = False  # the fallback function allocates its result: one copy out
        self._tvm = tvm
        self._from_dlpack = tvm.runtime.from_dlpack

    def _call(self, args):
        t0 = time.perf_counter_ns()
        out = self._main(*args, *self._params)
        self.last_run_ns = time.perf_counter_ns() - t0
        return list(out) if not hasattr(out, "numpy") else [out]

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        args = [self._tvm.runtime.tensor(np.ascontiguousarray(a, dtype=d), self.dev)
                for a, d in zip(inputs, self._in_dtypes)]
        return [o.numpy() for o in self._call(args)]

    def run_into(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        # a view needs the order's dtype and the 64-byte alignment TVM's from_dlpack insists on
        # (the VM's buffers have it; numpy's own allocations often do not): else one copy
        args = [self._from_dlpack(a) if a.flags.c_contiguous and a.dtype == d and a.ctypes.data % 64 == 0
                else self._tvm.runtime.tensor(np.ascontiguousarray(a, dtype=d), self.dev)
                for a, d in zip(inputs, self._in_dtypes)]
        for dst, src in zip(outputs, self._call(args)):
            np.copyto(dst, np.from_dlpack(src).reshape(dst.shape))


def fallback_params(bundle, part: dict) -> list[np.ndarray]:
    """The TVM fallback's weights (compiled out of its lib): byte ranges of bundle members, each
    transposed by ``perm`` when given."""
    try:
        return hmod.param_arrays(bundle.read, part.get("fallback_params") or ())
    except ValueError as err:
        raise Unavailable(f"fallback_params{err} of {part.get('symbol')}; recompile the model") from None
