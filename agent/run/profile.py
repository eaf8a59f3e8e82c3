"""Measure a bundle on this machine: every delegated subgraph on every executor, and the TVM side.

Runs on a board (agent code only: no compiler, no onnx) and on the host (`tandoor profile`). The
profile is keyed by what makes numbers comparable - board model, bundle sha256 (of the manifest
bytes, which pin every member), source model sha256, input shapes and library versions - and
`tandoor compile --profile` refuses a profile whose key does not match the model it compiles.

Profile a bundle compiled with `--policy all`: only delegated subgraphs have orders, so a subgraph
the cost policy refused cannot be measured on an executor.

Per subgraph and executor the measurement repeats what the runtime's delegate does: dlpack views
of TVM tensors (the VM's buffers), then ``run_into``. ``exec_us`` is the library's own run
(``last_run_ns``), ``bridge_us`` the rest of the call (views, bindings, copies). ``tvm_us`` is the
subgraph's TVM fallback (the region compiled by TVM alone): its cost if it stayed in TVM.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from tandoor_contract import durable, hmod, orders, probe
from tandoor_contract import profile as facts
from tandoor_contract.profile import PROFILE_VERSION

from . import board
from . import executors as executors_mod
from .board import board_model, configure_tvm_threads  # noqa: F401  (re-exported for callers)
from .executors import NAMES as EXECUTORS

SLOW_CALL_S = 0.25          # a call slower than this (Arm NN CpuRef) is measured fewer times
MIN_RUNS_SLOW = 3


def library_versions() -> dict:
    """The contract's library versions plus the Arm NN backends this machine really has."""
    try:  # first: the executor imports pyarmnn quietly (23.08's prints on stdout), then it is cached
        from .executors import armnn

        ok, _ = armnn.available()
        have = armnn.backends() if ok else []
    except Exception:
        ok, have = False, []
    out = facts.library_versions()
    out["armnn_backends"] = have
    if not ok:
        out["armnn"] = None
    return out


def bundle_sha256(path: Path) -> str:
    """sha256 of the manifest's bytes: it pins every member's hash, so it names the bundle."""
    with zipfile.ZipFile(path) as z:
        return hashlib.sha256(z.read(hmod.MANIFEST)).hexdigest()


def key_for(bundle_path: Path, manifest: dict) -> dict:
    return {
        "board": board_model(),
        "arch": hmod.machine_arch(),
        "bundle_sha256": bundle_sha256(bundle_path),
        "source_sha256": manifest["model"]["source_sha256"],
        "model": manifest["model"]["name"],
        "inputs": [{"name": i["name"], "shape": list(i["shape"]), "dtype": i["dtype"]} for i in manifest["inputs"]],
        "libraries": library_versions(),
    }


def _median_us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1e3, 2) if ns else float("nan")


def _random(spec: dict, rng) -> np.ndarray:
    """An input for an order tensor: every code of a quantized (int8/uint8) one, noise for floats,
    zeros for the other dtypes an onnx order's tensors may have (int64 indices: 0 is always one)."""
    dtype = spec.get("dtype", "float32")
    if dtype in orders.QUANT_DTYPES and spec.get("quant") is not None:
        lo, hi = orders.QUANT_DTYPES[dtype]
        return rng.integers(lo, hi + 1, spec["shape"]).astype(dtype)
    if np.dtype(dtype).kind != "f":
        return np.zeros(spec["shape"], dtype)
    return rng.standard_normal(spec["shape"]).astype(dtype)


def _measure_executor(ex, order: dict, runs: int, warmup: int, rng) -> dict:
    import tvm

    dev = tvm.cpu()
    ins = [tvm.runtime.tensor(_random(i, rng), dev) for i in order["inputs"]]
    outs = [tvm.runtime.empty(tuple(o["shape"]), o.get("dtype", "float32"), dev) for o in order["outputs"]]
    args = ins + outs
    n_in = len(ins)
    clock = time.perf_counter_ns

    def once() -> tuple[int, int]:
        t0 = clock()
        views = [np.from_dlpack(a) for a in args]   # what the runtime's delegate does
        ex.run_into(views[:n_in], views[n_in:])
        return clock() - t0, ex.last_run_ns

    first, _ = once()
    if first / 1e9 > SLOW_CALL_S:
        runs, warmup = max(MIN_RUNS_SLOW, min(runs, int(10 / (first / 1e9)))), 0
    for _ in range(warmup):
        once()
    total, run = [], []
    for _ in range(runs):
        t, r = once()
        total.append(t)
        run.append(r)
    return {"exec_us": _median_us(run), "bridge_us": _median_us([t - r for t, r in zip(total, run)]),
            "runs": len(run), "backend": str(getattr(ex, "backend", "?")),
            "zero_copy": bool(getattr(ex, "last_zero_copy", False))}


def measure(bundle_path: str | Path, runs: int = 20, warmup: int = 5,
            executors: tuple[str, ...] = EXECUTORS, progress=lambda s: None) -> dict:
    """The profile of one bundle on this machine (see the module docstring)."""

    configure_tvm_threads()
    bundle_path = Path(bundle_path)
    rng = np.random.default_rng(20261129)
    with hmod.open_bundle(bundle_path) as bundle:
        m = bundle.manifest
        target = bundle.lib_for()
        key = key_for(bundle_path, m)
        subgraphs: dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="tandoor-profile-") as tmp:
            workdir = Path(tmp)
            for part in m.get("partitions", []):
                if not part.get("delegate"):
                    continue
                symbol = part["symbol"]
                order = bundle.order(symbol)
                entry = {"ops": part["ops"], "exec_us": {}, "bridge_us": {}, "backend": {}, "runs": {},
                         "unavailable": {}}
                for kind in executors:
                    progress(f"{symbol} on {kind}")
                    try:
                        ex = executors_mod.build(kind, executors_mod.BuildContext(
                            bundle, symbol, order, part, target, workdir, board.DEFAULT_ARMNN_BACKENDS))
                    except hmod.BundleError:
                        raise
                    except Exception as err:
                        entry["unavailable"][kind] = board.first_line(err)
                        continue
                    try:
                        r = _measure_executor(ex, order, runs, warmup, rng)
                    finally:
                        closer = getattr(ex, "close", None)
                        if closer:
                            closer()
                    if kind == "tvm":
                        entry["tvm_us"] = r["exec_us"]
                        entry["tvm_bridge_us"] = r["bridge_us"]
                    else:
                        entry["exec_us"][kind] = r["exec_us"]
                        entry["bridge_us"][kind] = r["bridge_us"]
                    entry["backend"][kind] = r["backend"]
                    entry["runs"][kind] = r["runs"]
                subgraphs[symbol] = entry
            model = _measure_model(bundle, executors, runs, warmup, rng, progress)
    return {"profile_version": PROFILE_VERSION, "key": key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "threads": {"TVM_NUM_THREADS": os.environ.get("TVM_NUM_THREADS"), "cpus": os.cpu_count()},
            "target": target, "subgraphs": subgraphs, "model": model}


def _measure_model(bundle, executors, runs, warmup, rng, progress) -> dict:
    """The whole hybrid module per executor: total, delegated and the TVM side (total minus the
    delegate calls). An executor that cannot build the module, or runs none of its orders, gets
    ``{"error": why}`` instead of numbers, and stays out of the TVM side's median."""
    from . import runtime

    inputs = [probe.random_input(rng, i) for i in bundle.manifest["inputs"]]
    out: dict = {}
    for kind in executors:
        if kind == "armnn":
            from .executors import armnn

            ok, _ = armnn.available()
            if not ok or not set(armnn.backends()) & {"CpuAcc", "GpuAcc"}:
                continue        # CpuRef takes seconds per inference: its subgraph numbers suffice
        progress(f"whole model with {kind}")
        try:
            hm = runtime.HybridModule(bundle, delegate=kind)
        except Exception as err:
            out[kind] = {"error": board.first_line(err)}
            continue
        try:
            ran = {s.executor for s in hm.subgraphs}
            if ran and kind not in ran:
                # every order fell back (rknn with no NPU orders, say): its time is another executor's
                out[kind] = {"error": f"{kind} runs none of this bundle's orders "
                                      f"(they fell back to {', '.join(sorted(ran))})"}
                continue
            for _ in range(warmup):
                hm.run(inputs)
            hm.reset_stats()
            totals = []
            for _ in range(runs):
                t0 = time.perf_counter_ns()
                hm.run(inputs)
                totals.append(time.perf_counter_ns() - t0)
            n = len(totals)
            delegated = sum(sum(s.total_ns) for s in hm.subgraphs) / n
            total = statistics.median(totals)
            out[kind] = {"total_us": round(total / 1e3, 1), "delegated_us": round(delegated / 1e3, 1),
                         "tvm_side_us": round(max(total - delegated, 0.0) / 1e3, 1),
                         "executors": {s.symbol: s.executor for s in hm.subgraphs}}
        finally:
            hm.close()
    sides = [v["tvm_side_us"] for v in out.values() if "tvm_side_us" in v]
    out["tvm_side_us"] = round(statistics.median(sides), 1) if sides else None
    return out


def write(profile: dict, path: str | Path) -> None:
    durable.atomic_write(Path(path), json.dumps(profile, indent=1, sort_keys=True).encode())
