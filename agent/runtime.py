"""Run a hybrid module: TVM's VM schedules the graph and calls out, by symbol, to one executor
per delegated order (armnn | onnxruntime | tvm).

The VM resolves call_dps_packed names when it is created, from the process-wide function
registry; so executors are registered first, then the VM is made. A later module registering
the same symbol does not disturb a VM already created (it holds the old function).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import hmod

log = logging.getLogger("tandoor.runtime")

EXECUTORS = ("armnn", "onnxruntime", "tvm")


class RuntimeError_(Exception):
    """Cannot run this bundle here (no usable executor, bad inputs). One-line message."""

    exit_code = 3


@dataclass
class Subgraph:
    symbol: str
    executor: str
    backend: str
    fallback_reason: str | None = None
    calls: int = 0
    seconds: float = 0.0


def _build_executor(kind: str, bundle: hmod.Bundle, symbol: str, order: dict, target: str, workdir: Path,
                    armnn_backends: tuple[str, ...]):
    if kind == "armnn":
        from .executors import armnn

        ok, why = armnn.available()
        if not ok:
            raise RuntimeError_(why)
        return armnn.ArmnnExecutor(order, bundle.weights(symbol), preferred=armnn_backends)
    if kind == "onnxruntime":
        from .executors import ort

        ok, why = ort.available()
        if not ok:
            raise RuntimeError_(why)
        part = next(p for p in bundle.manifest["partitions"] if p["symbol"] == symbol)
        return ort.OrtExecutor(order, bundle.read(part.get("onnx") or f"orders/{symbol}.onnx"))
    if kind == "tvm":
        from .executors.tvm_exec import TvmExecutor

        member = bundle.manifest["targets"][target].get("fallback", {}).get(symbol)
        if not member:
            raise RuntimeError_(f"the bundle has no TVM fallback for {symbol} on {target}")
        path = workdir / member.replace("/", "_")
        path.write_bytes(bundle.read(member))
        return TvmExecutor(order, path)
    raise RuntimeError_(f"unknown executor {kind!r}; choose from auto, {', '.join(EXECUTORS)}")


class HybridModule:
    def __init__(self, bundle: hmod.Bundle, delegate: str = "auto",
                 armnn_backends: tuple[str, ...] = ("CpuAcc", "GpuAcc", "CpuRef"),
                 workdir: Path | None = None) -> None:
        import tvm
        import tvm_ffi
        from tvm import relax

        if delegate not in ("auto", *EXECUTORS):
            raise RuntimeError_(f"unknown --delegate {delegate!r}; choose from auto, {', '.join(EXECUTORS)}")
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.target = bundle.lib_for()
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandoor-run-")
            workdir = Path(self._tmp.name)
        self.workdir = workdir
        self.subgraphs: list[Subgraph] = []
        self._executors = {}
        preference = list(EXECUTORS) if delegate == "auto" else [delegate] + [e for e in EXECUTORS if e != delegate]
        for part in self.manifest.get("partitions", []):
            if not part.get("delegate"):
                continue
            symbol = part["symbol"]
            order = bundle.order(symbol)
            reasons = []
            for kind in preference:
                try:
                    ex = _build_executor(kind, bundle, symbol, order, self.target, workdir, armnn_backends)
                except Exception as err:  # any failure -> next executor, said once
                    reasons.append(f"{kind}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
                    continue
                sg = Subgraph(symbol, kind, getattr(ex, "backend", "?"), "; ".join(reasons) or None)
                if reasons:
                    log.warning("%s runs on %s (fallback: %s)", symbol, kind, sg.fallback_reason)
                self.subgraphs.append(sg)
                self._executors[symbol] = ex
                tvm_ffi.register_global_func(symbol, self._make_delegate(ex, sg, len(order["inputs"])), override=True)
                break
            else:
                raise RuntimeError_(f"no executor can run {symbol}: " + "; ".join(reasons))
        lib_path = workdir / f"{self.target}.so"
        lib_path.write_bytes(bundle.read(self.manifest["targets"][self.target]["lib"]))
        self.dev = tvm.cpu()
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib_path)), self.dev)
        self._tvm = tvm
        self.inputs = self.manifest["inputs"]

    @staticmethod
    def _make_delegate(ex, sg: Subgraph, n_in: int):
        def call(*args):
            # DPS: inputs then outputs; dlpack gives zero-copy numpy views of TVM's buffers.
            t0 = time.perf_counter()
            views = [np.from_dlpack(a) for a in args]
            ex.run_into(views[:n_in], views[n_in:])
            sg.calls += 1
            sg.seconds += time.perf_counter() - t0

        return call

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise RuntimeError_(f"the model takes {len(self.inputs)} input(s), got {len(inputs)}")
        args = []
        for spec, a in zip(self.inputs, inputs):
            a = np.asarray(a)
            if list(a.shape) != list(spec["shape"]):
                raise RuntimeError_(f"input {spec['name']} must have shape {spec['shape']}, got {list(a.shape)}")
            args.append(self._tvm.runtime.tensor(np.ascontiguousarray(a, dtype=spec["dtype"]), self.dev))
        out = self.vm["main"](*args)
        if hasattr(out, "numpy"):
            return [out.numpy()]
        return [o.numpy() for o in out]

    def describe(self) -> list[dict]:
        return [{"symbol": s.symbol, "executor": s.executor, "backend": s.backend,
                 **({"fallback_reason": s.fallback_reason} if s.fallback_reason else {})} for s in self.subgraphs]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
