"""Run a hybrid module: TVM's VM schedules the graph and calls out, by symbol, to one executor
per delegated order (armnn | onnxruntime | tvm).

The VM resolves call_dps_packed names when it is created, from the process-wide function
registry; so executors are registered first, then the VM is made. A later module registering
the same symbol does not disturb a VM already created (it holds the old function).

Executors share one small interface: ``run_into(inputs, outputs)`` with numpy views of the VM's
DPS buffers (outputs written in place where the library allows), ``backend`` (what really runs
it), and ``last_run_ns`` (the time spent inside the library call itself during the last
``run_into``). The delegate wrapper times the whole call; the difference is the bridge overhead
(dlpack views, wrapping buffers for the library, copies), reported per subgraph as ``bridge_us``.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandoor_contract import agreement, backends, gpu as gpu_contract, hmod, orders, tail as tail_mod
from tandoor_contract.errors import TandoorError

from . import executors, gpu as gpu_mod
from .board import ACCELERATED_ARMNN, DEFAULT_ARMNN_BACKENDS, first_line as _first_line

log = logging.getLogger("tandoor.runtime")

EXECUTORS = executors.NAMES


class RuntimeError_(TandoorError):
    """Cannot run this bundle here (no usable executor, bad inputs, inference failed). One line."""

    exit_code = 3


@dataclass
class Subgraph:
    symbol: str
    executor: str
    backend: str
    fallback_reason: str | None = None
    # Arm NN: compute layers per backend after Optimize (a layer CpuAcc lacks lands on CpuRef)
    layers: dict[str, int] | None = None
    # Arm NN: the compute layers that did not land on ``backend``, "name (type) on backend" each
    layers_elsewhere: list[str] | None = None
    calls: int = 0
    seconds: float = 0.0
    zero_copy: bool = False  # outputs written straight into the VM's buffers on the last call
    npu_unavailable: str | None = None   # an rknn order on its fallback: why the NPU could not take it
    # per call, nanoseconds: whole delegate call, and the library's own run inside it
    total_ns: list[int] = field(default_factory=list)
    run_ns: list[int] = field(default_factory=list)

    def record(self, total: int, run: int) -> None:
        self.calls += 1
        self.seconds += total / 1e9
        self.total_ns.append(total)
        self.run_ns.append(run)

    def bridge_us(self) -> float | None:
        """Median per-call overhead of the bridge: delegate call minus the library's run."""
        if not self.total_ns:
            return None
        return statistics.median(t - r for t, r in zip(self.total_ns, self.run_ns)) / 1e3

    def run_us(self) -> float | None:
        return statistics.median(self.run_ns) / 1e3 if self.run_ns else None


def _build_executor(kind: str, bundle: hmod.Bundle, symbol: str, order: dict, target: str, workdir: Path,
                    armnn_backends: tuple[str, ...], npu_cores: tuple[int, ...] = (0, 1, 2)):
    part = next((p for p in bundle.manifest.get("partitions", []) if p.get("symbol") == symbol), {})
    ctx = executors.BuildContext(bundle, symbol, order, part, target, workdir, armnn_backends, npu_cores)
    try:
        return executors.build(kind, ctx)
    except executors.Unavailable as e:
        raise RuntimeError_(str(e)) from None


def check_inputs(manifest: dict, inputs: list[np.ndarray]) -> None:
    """Inputs must match the manifest's count, shapes and dtypes (RuntimeError_ otherwise)."""
    specs = manifest["inputs"]
    if len(inputs) != len(specs):
        raise RuntimeError_(f"the model takes {len(specs)} input(s), got {len(inputs)}")
    for spec, a in zip(specs, inputs):
        a = np.asarray(a)
        if list(a.shape) != list(spec["shape"]):
            raise RuntimeError_(f"input {spec['name']} must have shape {spec['shape']}, got {list(a.shape)}")
        if not np.can_cast(a.dtype, spec["dtype"], "same_kind"):
            raise RuntimeError_(f"input {spec['name']} must be {spec['dtype']}, got {a.dtype}")
        want = np.dtype(spec["dtype"])
        if want.kind in "iu" and a.dtype != want and a.size:   # uint16 -> uint8 would wrap, silently
            info = np.iinfo(want)
            if a.min() < info.min or a.max() > info.max:
                raise RuntimeError_(f"input {spec['name']} is {want} ({info.min}..{info.max}); the {a.dtype} values "
                                    f"given span {a.min()}..{a.max()}")




def _board_model() -> str:
    from .board import board_model

    try:
        return board_model()
    except Exception:
        return ""


def _auto_preference(armnn_backends: tuple[str, ...]) -> list[str]:
    """armnn first only where it brings ACL (CpuAcc/GpuAcc). Its CpuRef backend is a reference
    implementation, seconds per CNN inference, far slower than onnxruntime on the same CPU."""
    try:
        from .executors import armnn

        ok, _ = armnn.available()
        have = set(armnn.backends()) if ok else set()
    except Exception:
        have = set()
    acl = bool(have & set(ACCELERATED_ARMNN) & set(armnn_backends))
    if have and not acl:
        log.info("Arm NN offers only %s here (no ACL backend); auto prefers onnxruntime", ", ".join(sorted(have)))
    return executors.auto_order(acl)


class HybridModule:
    """A verified bundle made runnable: one executor per delegated order, then the VM.

    ``delegate`` is ``auto`` (executors.auto_order: rknn for rknn orders, then armnn where it has ACL, else
    onnxruntime > armnn > tvm; the first that can build each order)
    or one executor name, which is tried first for every order; an order it cannot build falls
    back to the others in the auto order, logged once with the reason and reported in
    ``describe()[i]["fallback_reason"]``.
    """

    def __init__(self, bundle: hmod.Bundle, delegate: str = "auto",
                 armnn_backends: tuple[str, ...] = DEFAULT_ARMNN_BACKENDS,
                 workdir: Path | None = None, npu_cores: tuple[int, ...] = (0, 1, 2)) -> None:
        if delegate not in ("auto", *EXECUTORS):
            raise RuntimeError_(f"unknown --delegate {delegate!r}; choose from auto, {', '.join(EXECUTORS)}")
        self.bundle = bundle
        self.manifest = bundle.manifest
        # First, before anything is written, imported or built: is there a lib for this machine?
        self.target = bundle.lib_for()

        # TVM counts 1 thread on small VMs when TVM_NUM_THREADS is unset: set it (and unbound
        # workers) before the first parallel TVM call starts its pool.
        from .board import configure_tvm_threads

        configure_tvm_threads()
        # tvm.runtime only (the VM included): in the agent's process tvm is the runtime library
        # alone (agent/run/lean.py), where tvm.relax does not even import.
        import tvm
        import tvm_ffi
        from tvm.runtime.vm import VirtualMachine

        self._tmp = None
        self._tail_session = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandoor-run-")
            workdir = Path(self._tmp.name)
        self.workdir = workdir
        self.subgraphs: list[Subgraph] = []
        self.npu_unavailable: str | None = None     # why rknn orders run on their fallback here
        # the target's GPU part (contract/gpu.py): the library of this device's SM, or why not
        self.gpu_unavailable: str | None = None
        self.gpu_found: gpu_mod.Found | None = None
        # delegated orders run on the CPU: with the VM on the GPU their tensors are copied across
        self._copy = [False]
        gpu_entry = gpu_contract.entry_of(self.manifest["targets"][self.target])
        if gpu_entry is not None:
            found = gpu_mod.probe(gpu_entry)
            if found.sm is None:
                self._gpu_off(found.why)
            else:
                self.gpu_found, self._copy[0] = found, True
        elif others := [f"{n} ({v.get('arch')})" for n, v in sorted(self.manifest["targets"].items())
                        if gpu_contract.entry_of(v)]:
            self._gpu_off(f"the bundle's GPU part is for {', '.join(others)}, not this {hmod.machine_arch()} machine")
        self._executors = {}
        preference = _auto_preference(armnn_backends) if delegate == "auto" else \
            [delegate] + [e for e in EXECUTORS if e != delegate]
        # compile --profile recorded a measured executor per subgraph; follow it in auto mode only
        # on the board it was measured on (a profile from another board says nothing here).
        prof = self.manifest.get("profile") or {}
        profiled_here = bool(prof) and prof.get("board") == _board_model()

        def build_orders(parts: list[dict]) -> None:
            """An executor for each of ``parts``' orders, registered under its symbol."""
            for part in parts:
                symbol = part["symbol"]
                order = bundle.order(symbol)
                reasons = []
                hint = part.get("executor") if delegate == "auto" and profiled_here else None
                order_pref = [hint] + [e for e in preference if e != hint] if hint in EXECUTORS else preference
                for executor in order_pref:
                    if executor != delegate and orders.refuses(executor, order):
                        continue    # not one of this order kind's runners, nor asked for: no reason to say
                    try:
                        ex = _build_executor(executor, bundle, symbol, order, self.target, workdir, armnn_backends,
                                             tuple(npu_cores))
                    except hmod.BundleError:
                        raise  # the bundle itself is bad: not a reason to try another executor
                    except Exception as err:  # this executor cannot build it -> the next one
                        reasons.append(f"{executor}: {_first_line(err)}")
                        continue
                    sg = Subgraph(symbol, executor, str(getattr(ex, "backend", "?")), "; ".join(reasons) or None,
                                  getattr(ex, "layer_counts", None))
                    sg.layers_elsewhere = [f"{n} ({t}) on {b}" for n, t, b in getattr(ex, "layer_backends", ())
                                           if t not in ("Input", "Output") and b != sg.backend] or None
                    if orders.kind_of(order) == backends.RKNN and executor != "rknn":
                        sg.npu_unavailable = next((r.removeprefix("rknn: ") for r in reasons
                                                   if r.startswith("rknn: ")), f"not tried: delegate {delegate}")
                        if not self.npu_unavailable:
                            log.warning("npu: unavailable (%s); its orders run their ONNX rendering on %s",
                                        sg.npu_unavailable, executor)
                        self.npu_unavailable = self.npu_unavailable or sg.npu_unavailable
                    if reasons:
                        log.warning("%s runs on %s (fallback: %s)", symbol, executor, sg.fallback_reason)
                    else:
                        log.info("%s runs on %s (%s)", symbol, executor, sg.backend)
                    self.subgraphs.append(sg)
                    self._executors[symbol] = ex
                    tvm_ffi.register_global_func(symbol, self._make_delegate(ex, sg, len(order["inputs"]),
                                                                             self._copy), override=True)
                    break
                else:
                    raise RuntimeError_(f"no executor can run {symbol}: " + "; ".join(reasons))
        # on the GPU path only the orders its library calls (onnxruntime's) are built first; the
        # others (ACL's, for the CPU library) when the GPU part does not load
        delegated = [p for p in self.manifest.get("partitions", []) if p.get("delegate")]
        on_gpu = set(gpu_entry.get("orders") or ()) if self.gpu_found is not None and "orders" in gpu_entry \
            else None
        later = [p for p in delegated if on_gpu is not None and p["symbol"] not in on_gpu]
        try:
            build_orders([p for p in delegated if p not in later])
            self._tail_session = self._tail(bundle)
            self._tvm = tvm
            if self.gpu_found is not None:
                self._load_gpu(bundle, gpu_entry, VirtualMachine)
            if self.gpu_found is None:
                build_orders(later)
                lib_path = workdir / f"{self.target}.so"
                lib_path.write_bytes(bundle.library(self.manifest["targets"][self.target]["lib"]))
                self.dev = tvm.cpu()
                try:
                    self.vm = VirtualMachine(tvm.runtime.load_module(str(lib_path)), self.dev)
                except Exception as err:
                    raise RuntimeError_(f"cannot load the {self.target} lib: {_first_line(err)}") from None
                self._params = self._lib_params(bundle)
        except BaseException:
            self.close()
            raise
        self._args = None
        self.inputs = self.manifest["inputs"]

    def _gpu_off(self, why: str) -> None:
        """The CPU library runs; said once in the log, and by gpu() in status, run --json and verify."""
        self.gpu_unavailable, self.gpu_found, self._copy[0] = why, None, False
        log.warning("gpu: unavailable (%s); the TVM part runs on the CPU", why)

    def _load_gpu(self, bundle: hmod.Bundle, entry: dict, VirtualMachine) -> None:
        """The SM's library on the GPU, its weights moved there, then the load-time check: the first
        golden pair within the bundle's promise, as the armnn executor checks its orders on probes.
        Anything failing: _gpu_off with the reason, and the caller loads the CPU library."""
        sm = self.gpu_found.sm
        try:
            path = self.workdir / f"{self.target}.{sm}.so"
            path.write_bytes(bundle.library(entry["libs"][sm]))
            self.dev = self._tvm.cuda(0)
            self.vm = VirtualMachine(self._tvm.runtime.load_module(str(path)), [self.dev, self._tvm.cpu()])
            self._params = self._lib_params(bundle, entry.get("lib_params") or [])
        except hmod.BundleError:
            raise
        except Exception as err:
            self.vm = None
            self._gpu_off(f"the {sm} library does not load: {_first_line(err)}")
            return
        self.inputs = self.manifest["inputs"]
        self._args = None
        try:
            ins, want = bundle.golden()[0]
            ties = agreement.golden_ties(bundle)
            verdict = agreement.compare(self.run(ins), want, self.manifest, agreement.path_of(self.describe()),
                                        ties[0] if ties else None)
            why = None if verdict.ok else f"computes the first golden pair wrongly: {verdict.reason}"
        except hmod.BundleError:
            raise
        except Exception as err:
            why = f"the first golden pair failed on it: {_first_line(err)}"
        if why:
            self.vm = None
            self._gpu_off(f"{sm}: {why}")
        else:
            log.info("gpu: the TVM part runs on %s (%s)", self.gpu_found.device or "the GPU", self.gpu_found.why)
        self.reset_stats()

    def _lib_params(self, bundle: hmod.Bundle, specs: list | None = None) -> list:
        """The main module's weights (format 4 ``lib_params``: one member for every target's lib;
        ``specs``: the GPU part's own), turned once by ``main_transform_params`` into what ``main``
        takes after its inputs."""
        specs = self.manifest["targets"][self.target].get("lib_params") if specs is None else specs
        if not specs:
            return []
        try:
            arrays = hmod.param_arrays(bundle.read, specs)
        except ValueError as err:
            raise RuntimeError_(f"the {self.target} lib's lib_params{err}; recompile the model") from None
        import tvm

        try:
            raw = [tvm.runtime.tensor(np.ascontiguousarray(a), self.dev) for a in arrays]
            return list(self.vm["main_transform_params"](raw))
        except Exception as err:
            raise RuntimeError_(f"the {self.target} lib does not take its lib_params: {_first_line(err)}; "
                                "recompile the model") from None

    @staticmethod
    def _tail(bundle: hmod.Bundle):
        """The onnxruntime session of the bundle's tail (contract/tail.py), or None."""
        tail = bundle.manifest.get("tail")
        if not tail:
            return None
        ops = ", ".join(sorted({o.removeprefix("onnx.") for o in tail.get("ops") or ()}))
        try:
            import onnxruntime as ort
        except Exception as err:
            raise RuntimeError_(f"this model ends in ops run by onnxruntime after the TVM part ({ops}), and "
                                f"onnxruntime is not importable here ({_first_line(err)}): install onnxruntime") from None
        from .board import ort_session_config

        so = ort.SessionOptions()
        so.log_severity_level = 3
        for key, value in ort_session_config().items():   # as the onnxruntime executor
            so.add_session_config_entry(key, value)
        try:
            session = ort.InferenceSession(bundle.read(tail["onnx"]), so, providers=["CPUExecutionProvider"])
        except hmod.BundleError:
            raise
        except Exception as err:
            raise RuntimeError_(f"onnxruntime cannot load the model's end ({ops}): {_first_line(err)}") from None
        log.info("the model's end (%s) runs on onnxruntime after the TVM part", ops)
        return session

    @staticmethod
    def _make_delegate(ex, sg: Subgraph, n_in: int, copy: list[bool] | None = None):
        """``copy[0]`` (read at each call): the VM's buffers are on the GPU, so the order's inputs
        are copied to host memory and its outputs back (the boundary's cost, in bridge_us)."""
        clock = time.perf_counter_ns

        def call(*args):
            # DPS: inputs then outputs; dlpack gives zero-copy numpy views of the VM's buffers.
            t0 = clock()
            if copy is not None and copy[0]:
                outs = [np.empty(tuple(int(d) for d in a.shape), str(a.dtype)) for a in args[n_in:]]
                ex.run_into([a.numpy() for a in args[:n_in]], outs)
                for a, o in zip(args[n_in:], outs):
                    a.copyfrom(o)
                sg.record(clock() - t0, ex.last_run_ns)
                sg.zero_copy = False
                return
            views = [np.from_dlpack(a) for a in args]
            ex.run_into(views[:n_in], views[n_in:])
            sg.record(clock() - t0, ex.last_run_ns)
            sg.zero_copy = ex.last_zero_copy

        return call

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        check_inputs(self.manifest, inputs)
        if self._args is None:
            # One buffer per input, reused from run to run: the delegates see the same addresses
            # each time, so bindings made on the first call stay valid.
            self._args = [self._tvm.runtime.empty(tuple(spec["shape"]), spec["dtype"], self.dev) for spec in self.inputs]
        inputs = [np.ascontiguousarray(a, dtype=spec["dtype"]) for spec, a in zip(self.inputs, inputs)]
        for t, a in zip(self._args, inputs):     # the tail reads them too: in the manifest's dtypes
            t.copyfrom(a)
        try:
            out = self.vm["main"](*self._args, *self._params)
        except Exception as err:
            raise RuntimeError_(f"inference failed: {_first_line(err)}") from None
        outs = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
        if self._tail_session is None:
            return outs
        try:
            return tail_mod.finish(self.manifest["tail"], inputs, outs, lambda feeds: self._tail_session.run(None, feeds))
        except Exception as err:
            raise RuntimeError_(f"inference failed in the model's end (onnxruntime): {_first_line(err)}") from None

    def describe(self) -> list[dict]:
        out = []
        for s in self.subgraphs:
            d = {"symbol": s.symbol, "executor": s.executor, "backend": s.backend}
            if s.fallback_reason:
                d["fallback_reason"] = s.fallback_reason
            if s.layers:
                d["layers"] = dict(s.layers)
            if s.layers_elsewhere:
                d["layers_elsewhere"] = list(s.layers_elsewhere)
            if s.npu_unavailable:
                d["npu_unavailable"] = s.npu_unavailable
            if s.calls:
                d.update(calls=s.calls, run_us=round(s.run_us(), 1), bridge_us=round(s.bridge_us(), 1),
                         zero_copy=s.zero_copy)
            out.append(d)
        return out

    def npu(self) -> str | None:
        """What ``status`` says of the NPU: None without rknn orders, "rknn (<backend>)" when they run
        on it, "unavailable (<reason>)" when they run on their ONNX rendering."""
        if self.npu_unavailable:
            return f"unavailable ({self.npu_unavailable})"
        on = [s.backend for s in self.subgraphs if s.executor == "rknn"]
        return f"rknn ({on[0]})" if on else None

    def gpu(self) -> str | None:
        """What ``status`` says of the GPU: None when the bundle has no GPU part for this target,
        "cuda <sm> (<device>)" when the TVM part runs there, "unavailable (<reason>)" otherwise."""
        if self.gpu_unavailable:
            return f"unavailable ({self.gpu_unavailable})"
        if self.gpu_found is not None:
            return f"cuda {self.gpu_found.sm} ({self.gpu_found.device or 'GPU'})"
        return None

    def reset_stats(self) -> None:
        for s in self.subgraphs:
            s.calls, s.seconds, s.total_ns, s.run_ns = 0, 0.0, [], []

    def close(self) -> None:
        for ex in self._executors.values():
            closer = getattr(ex, "close", None)
            if closer is not None:
                try:
                    closer()
                except Exception:
                    pass
        self._executors = {}
        self._tail_session = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
