"""`tandoor bench`: onnxruntime, TVM only and the hybrid module per executor, in one process.

Paths measured, on the same seeded input:

* onnxruntime  the (shape-pinned, folded) ONNX model in an onnxruntime CPU session at TVM's thread
               count, twice: its defaults (spinning worker threads) and without spinning
               (``session.intra_op.allow_spinning=0``). The baseline is the better of the two medians
               (which one is said in the output); every ratio is against it, so neither side gains
               from the other's threads fighting a busy machine
* tvm          the whole model compiled by TVM for the host (compile policy "none": no delegation)
* hybrid       the bundle as `tandoor compile` makes it (policy cost by default; on the host its
               decisions are measured here, ``--measure auto``), run by the agent runtime with each
               available executor for its delegated subgraphs, and as the agent runs it (delegate
               auto: the executor the compile measured): the compile's *choice*
* all delegated  every candidate region delegated (policy all), delegate auto: with TVM only, the
               two fixed alternatives the choice must not be slower than (``ratio_choice_vs_best``)

Timing: after a warm-up, rounds of interleaved blocks (one discarded run, then about three timed
runs per path) so that slow drifts of a shared machine's load hit every path alike, while a
library's spinning threads cannot leak into the next path's timed run. Medians are reported,
best runs beside them (details.spread), and per path p50/p95/p99 and the run-to-run spread
(``latency``, host/latency.py): with ``blocks`` > 1 the whole timing is repeated that many times
(``runs`` runs per path each), and ``block_spread`` is the worst block's median over the best's.

Breakdown of the median hybrid run, L_total = L_pre + delegated + TVM + bridge: L_pre is staging
the input into the VM's buffer (measured apart); delegated and bridge come from the runtime's
per-subgraph timings of that very run (the library's own run, and the rest of each delegate call);
TVM is what remains (VM and TVM kernels).

Memory per path: the process's RSS growth while building and warming the path up, and for TVM
modules the static memory plan: Relax's StaticPlanBlockMemory gives intermediates whose lifetimes
do not overlap one storage (inference keeps no activations for a backward pass), so the planned
activation memory (sum of alloc_storage) is compared with one buffer per intermediate tensor.

Arm NN's CpuRef backend is a reference implementation (seconds per CNN inference on x86): armnn is
benchmarked only where an accelerated backend (CpuAcc/GpuAcc) exists, or when asked (--armnn).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tandoor_contract import orders, probe

from .latency import summary

ACCELERATED = ("CpuAcc", "GpuAcc")


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _trim() -> None:
    """Give freed heap back to the OS so RSS growth is this path's, not an earlier path's garbage."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


# --- the static memory plan ----------------------------------------------------------------------

def _dtype_bytes(dt) -> int:
    import tvm

    d = tvm.DataType(str(getattr(dt, "value", dt)))
    return max(d.bits * d.lanes // 8, 1)


def _shape_values(e) -> list[int] | None:
    vals = getattr(e, "values", None)
    if vals is None:
        return None
    try:
        return [int(v) for v in vals]
    except Exception:
        return None


def memory_plan(mod, target_dict: dict) -> dict:
    """Activation memory of a Relax module's main: one buffer per intermediate vs. the static plan.

    Runs the CPU pipeline up to the point where intermediates are explicit allocations, counts
    them, then applies StaticPlanBlockMemory and counts the storages it keeps. Tensors whose size
    is not static, and main's results (they escape), stay unplanned and are counted on both sides."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    from tandoor_compiler.stages import schedule

    t = tvm.target.Target(target_dict)
    with t:
        lowered = tvm.transform.Sequential(
            schedule.prepare_passes() + cpu.library_dispatch_passes(t) + cpu.legalize_passes(t) + cpu.dataflow_lower_passes(t))(mod)
        planned = relax.transform.StaticPlanBlockMemory()(lowered)

    def count(func) -> dict:
        storages, tensors, largest, n = 0, 0, 0, 0

        def visit(e):
            nonlocal storages, tensors, largest, n
            if not (isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)):
                return
            if e.op.name == "relax.memory.alloc_storage":
                v = _shape_values(e.args[0])
                if v:
                    storages += v[0]
            elif e.op.name == "relax.builtin.alloc_tensor":
                v = _shape_values(e.args[0])
                if v is not None:
                    size = int(np.prod(v)) * _dtype_bytes(e.args[1])
                    tensors += size
                    largest = max(largest, size)
                    n += 1

        relax.analysis.post_order_visit(func.body, visit)
        return {"storage": storages, "tensors": tensors, "largest": largest, "n": n}

    before = count(lowered["main"])
    after = count(planned["main"])
    unplanned_mb = before["tensors"] / 2**20
    planned_mb = (after["storage"] + after["tensors"]) / 2**20
    return {
        "intermediates": before["n"],
        "unplanned_activation_mb": round(unplanned_mb, 3),
        "planned_activation_mb": round(planned_mb, 3),
        "largest_tensor_mb": round(before["largest"] / 2**20, 3),
        "plan_saves_pct": round(100.0 * (1 - planned_mb / unplanned_mb), 1) if unplanned_mb else 0.0,
    }


# --- the paths -----------------------------------------------------------------------------------

class _Path:
    def __init__(self, name: str, run, close=lambda: None, hybrid=None):
        self.name, self.run, self.close, self.hybrid = name, run, close, hybrid
        self.times: list[float] = []
        self.blocks: list[int] = []       # timed runs per block, in order (host/latency.py)
        self.per_run: list[list[tuple[int, int, int]]] = []
        self.rss_growth = 0
        self.runs_total = 0


def ort_path(model, inputs, threads: int, spinning: bool = True, name: str | None = None) -> _Path:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads        # TVM's count: the same cores for both
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {i.name: a for i, a in zip(model.inputs, inputs)}
    return _Path(name or ("onnxruntime" if spinning else "onnxruntime-nospin"), lambda: sess.run(None, feeds))


def hybrid_path(name: str, bundle_path: Path, delegate: str, inputs) -> _Path:
    from tandoor_contract import hmod
    from tandoor_agent.run.runtime import HybridModule

    b = hmod.open_bundle(bundle_path)
    hm = HybridModule(b, delegate=delegate)

    def close():
        hm.close()
        b.close()

    return _Path(name, lambda: hm.run(inputs), close, hm)


def available_executors(include_armnn: bool) -> tuple[list[str], dict[str, str]]:
    """Executors to benchmark here, and why any other is skipped."""
    from tandoor_agent.run.executors import armnn, ort

    use, skipped = [], {}
    ok, why = armnn.available()
    if not ok:
        skipped["armnn"] = why
    else:
        have = armnn.backends()
        if include_armnn or set(have) & set(ACCELERATED):
            use.append("armnn")
        else:
            skipped["armnn"] = (f"Arm NN has only {', '.join(have)} here: CpuRef is a reference implementation "
                                "(seconds per inference), not an accelerator; pass --armnn to include it")
    ok, why = ort.available()
    (use.append("onnxruntime") if ok else skipped.__setitem__("onnxruntime", why))
    use.append("tvm")
    return use, skipped


def _input_staging_ms(inputs, n: int = 50) -> float:
    """L_pre: copying the inputs into the VM's argument buffers (what HybridModule.run does first)."""
    import tvm

    dev = tvm.cpu()
    bufs = [tvm.runtime.empty(a.shape, str(a.dtype), dev) for a in inputs]
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        for buf, a in zip(bufs, inputs):
            buf.copyfrom(np.ascontiguousarray(a))
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e6


def _breakdown(p: _Path, pre_ms: float) -> dict:
    """The median run's own split (its delegate calls as the runtime timed them), so that the parts
    add up to the total of one real run rather than mixing medians of different runs."""
    k = sorted(range(len(p.times)), key=p.times.__getitem__)[(len(p.times) - 1) // 2]
    total_ms = p.times[k]
    subgraphs, delegated, bridge = [], 0.0, 0.0
    for sg, (run_ns, call_ns, calls) in zip(p.hybrid.subgraphs, p.per_run[k]):
        run_ms, br_ms = run_ns / 1e6, (call_ns - run_ns) / 1e6
        delegated += run_ms
        bridge += br_ms
        subgraphs.append({"symbol": sg.symbol, "executor": sg.executor, "backend": sg.backend, "calls": calls,
                          "run_ms": round(run_ms, 3), "bridge_ms": round(br_ms, 4),
                          **({"fallback_reason": sg.fallback_reason} if sg.fallback_reason else {})})
    tvm_ms = max(total_ms - pre_ms - delegated - bridge, 0.0)
    return {"total_ms": round(total_ms, 3), "pre_ms": round(pre_ms, 3), "delegated_ms": round(delegated, 3),
            "tvm_ms": round(tvm_ms, 3), "bridge_ms": round(bridge, 4), "subgraphs": subgraphs}


def load_paths(builders, warmup: int, progress, paths: list[_Path]) -> None:
    """Build each path into ``paths`` (the caller closes them, also when one fails), warm it up
    and record the RSS its building and warm-up added."""
    for name, build in builders:
        progress(f"loading {name}")
        _trim()
        r0 = _rss()
        p = build()
        paths.append(p)
        for _ in range(warmup):
            p.run()
        p.rss_growth = _rss() - r0
        if p.hybrid is not None:
            p.hybrid.reset_stats()


def close_paths(paths: list[_Path]) -> None:
    """Close every path, whatever one of them raises: the bench's result is already taken."""
    for p in paths:
        try:
            p.close()
        except Exception:
            pass


def time_paths(paths: list[_Path], runs: int, rounds: int, progress) -> None:
    """Interleaved blocks (the module doc): each path gets ``runs`` timed runs in ``rounds`` blocks."""
    progress(f"timing {len(paths)} paths, {runs} runs each")
    per_round = [runs // rounds + (1 if k < runs % rounds else 0) for k in range(rounds)]
    for n in per_round:
        if n == 0:
            continue
        for p in paths:
            p.run()                       # discarded: lets the previous path's threads settle
            p.runs_total += 1
            for _ in range(n):
                marks = [len(sg.total_ns) for sg in p.hybrid.subgraphs] if p.hybrid else []
                t0 = time.perf_counter_ns()
                p.run()
                p.times.append((time.perf_counter_ns() - t0) / 1e6)
                p.runs_total += 1
                if p.hybrid:     # this run's delegate calls: (library run, whole call) per subgraph
                    p.per_run.append([(sum(sg.run_ns[k:]), sum(sg.total_ns[k:]), len(sg.total_ns) - k)
                                      for sg, k in zip(p.hybrid.subgraphs, marks)])


def time_blocks(paths: list[_Path], runs: int, rounds: int, blocks: int, progress) -> None:
    """``blocks`` repetitions of :func:`time_paths`, each path's runs per block recorded, so that a
    stall that hits one block and not the next shows as the spread between their medians."""
    for b in range(blocks):
        if blocks > 1:
            progress(f"block {b + 1} of {blocks}")
        time_paths(paths, runs, rounds, progress)
        for p in paths:
            p.blocks.append(len(p.times) - sum(p.blocks))


# baseline configurations of onnxruntime: path name -> (spinning, what the output calls it)
ORT_CONFIGS = {"onnxruntime": (True, "default"), "onnxruntime-nospin": (False, "no spinning")}


def run(model_path: str | Path, input_specs=(), runs: int = 20, warmup: int = 5, rounds: int | None = None,
        blocks: int = 1, policy: str = "cost", include_armnn: bool = False, executors: tuple[str, ...] | None = None,
        kernels: bool = False, progress=lambda s: None) -> dict:
    """Time every path (see the module docstring); ``kernels`` adds `host/kernels.py`'s per-kernel
    tables (TVM's kernels beside onnxruntime's nodes in the baseline's configuration)."""
    from tandoor_agent.run.board import configure_tvm_threads

    threads = configure_tvm_threads()      # before anything starts TVM's thread pool
    load = round(os.getloadavg()[0], 2)    # for the record; the spin rule saw threads['busy_elsewhere']
    n_threads = int(threads["TVM_NUM_THREADS"])

    import onnxruntime

    from tandoor_compiler.stages import frontend, schedule
    from tandoor_compiler.errors import CompileError
    from tandoor_compiler.pipeline import Options, compile_model

    if runs < 1:
        raise CompileError("--runs must be at least 1")
    if blocks < 1:
        raise CompileError("--blocks must be at least 1")
    # blocks of about three runs: a burst of load on a shared machine lasts seconds, and longer
    # blocks let one burst land on one path's runs alone (YOLOv8n: a path with nothing delegated,
    # the same module as TVM only, measured 2.3x TVM only's median with blocks of 7-8)
    rounds = rounds or max(4, runs // 3)
    model = frontend.load(model_path, list(input_specs))
    rng = np.random.default_rng(20261129)
    inputs = [probe.random_input(rng, i.as_dict()) for i in model.inputs]
    if executors:
        unknown = set(executors) - set(orders.EXECUTORS)
        if unknown:
            raise CompileError(f"unknown executor(s) {', '.join(sorted(unknown))}; choose armnn, onnxruntime or tvm")
    # naming armnn explicitly is asking for it, as --armnn is
    use, skipped = available_executors(include_armnn or "armnn" in (executors or ()))
    if executors:
        use = [e for e in use if e in executors]

    with tempfile.TemporaryDirectory(prefix="tandoor-bench-") as tmp:
        tmpd = Path(tmp)
        specs = [f"{i.name}={'x'.join(str(d) for d in i.shape)}" for i in model.inputs]
        progress("compiling the TVM-only module (policy none)")
        tvm_bundle = tmpd / "tvm_only.hmod"
        compile_model(model_path, tvm_bundle, Options(specs, policy="none"))
        progress(f"compiling the hybrid module (policy {policy})")
        hyb_bundle = tmpd / "hybrid.hmod"
        hyb_manifest = compile_model(model_path, hyb_bundle, Options(specs, policy=policy))
        all_bundle = hyb_bundle
        if policy != "all":
            progress("compiling the all-delegated module (policy all)")
            all_bundle = tmpd / "all_delegated.hmod"
            compile_model(model_path, all_bundle, Options(specs, policy="all"))

        paths: list[_Path] = []
        try:
            # onnxruntime as a user gets it (its defaults: spinning worker threads), and without
            # spinning (as the hybrid's executor runs it on a loaded machine); the baseline is the better
            builders = [(name, lambda spin=spin: ort_path(model, inputs, n_threads, spinning=spin))
                        for name, (spin, _) in ORT_CONFIGS.items()]
            builders += [("tvm", lambda: hybrid_path("tvm", tvm_bundle, "tvm", inputs))]
            builders += [(f"hybrid:{e}", lambda e=e: hybrid_path(f"hybrid:{e}", hyb_bundle, e, inputs)) for e in use]
            builders += [("choice", lambda: hybrid_path("choice", hyb_bundle, "auto", inputs)),
                         ("all-delegated", lambda: hybrid_path("all-delegated", all_bundle, "auto", inputs))]
            load_paths(builders, warmup, progress, paths)
            time_blocks(paths, runs, rounds, blocks, progress)

            # median_low: the median is one real run, whose own breakdown is reported
            med = {p.name: statistics.median_low(p.times) for p in paths}
            base_name = min(ORT_CONFIGS, key=med.__getitem__)
            ort_ms = med[base_name]
            pre_ms = _input_staging_ms(inputs)
            breakdown = {"onnxruntime": {"total_ms": round(ort_ms, 3)},
                         "tvm": {"total_ms": round(med["tvm"], 3), "pre_ms": round(pre_ms, 3), "delegated_ms": 0.0,
                                 "tvm_ms": round(max(med["tvm"] - pre_ms, 0.0), 3), "bridge_ms": 0.0, "subgraphs": []},
                         "hybrid": {}}
            for p in paths:
                if p.name.startswith("hybrid:"):
                    breakdown["hybrid"][p.name.split(":", 1)[1]] = _breakdown(p, pre_ms)
                elif p.name in ("choice", "all-delegated"):
                    breakdown[p.name] = _breakdown(p, pre_ms)
            rss = {p.name: round(p.rss_growth / 2**20, 1) for p in paths}
            spread = {p.name: {"min_ms": round(min(p.times), 3), "max_ms": round(max(p.times), 3),
                               "n": len(p.times)} for p in paths}
            latency = {p.name: summary(p.times, p.blocks) for p in paths}
        finally:
            close_paths(paths)

    progress("reading the static memory plans")
    host = schedule.host_target({"kind": "llvm"})
    from .kernels import relax_module

    plan_tvm = memory_plan(relax_module(model, {}), host)
    plan_hyb = memory_plan(relax_module(model, {p["symbol"]: p["delegate"] for p in hyb_manifest["partitions"]}), host)

    kern = None
    if kernels:
        from . import kernels as kernels_mod

        kern = kernels_mod.measure(model, inputs, runs=runs, warmup=warmup, threads=n_threads,
                                   ort_spinning=ORT_CONFIGS[base_name][0], progress=progress)

    hybrid_ms = {e: round(med[f"hybrid:{e}"], 3) for e in use}
    best_fixed = min(med["tvm"], med["all-delegated"])
    memory = {"onnxruntime": {"rss_growth_mb": rss["onnxruntime"]},
              "onnxruntime-nospin": {"rss_growth_mb": rss["onnxruntime-nospin"]},
              "tvm": {"rss_growth_mb": rss["tvm"], **plan_tvm},
              "hybrid": {e: {"rss_growth_mb": rss[f"hybrid:{e}"], **plan_hyb} for e in use}}
    import tvm

    return {
        "onnxruntime_ms": round(ort_ms, 3),
        "onnxruntime_baseline": ORT_CONFIGS[base_name][1],
        "tvm_ms": round(med["tvm"], 3),
        "hybrid_ms": hybrid_ms,
        "ratio_hybrid_vs_ort": {e: round(v / ort_ms, 3) for e, v in hybrid_ms.items()},
        "ratio_tvm_vs_ort": round(med["tvm"] / ort_ms, 3),
        "choice_ms": round(med["choice"], 3),
        "all_delegated_ms": round(med["all-delegated"], 3),
        "ratio_choice_vs_ort": round(med["choice"] / ort_ms, 3),
        # the compile's measured choice against the better of its two fixed alternatives
        "ratio_choice_vs_best": round(med["choice"] / best_fixed, 3),
        # the same ratios from each path's best run: on a loaded shared machine the medians carry
        # the other jobs' bursts, the best runs what the code does when it has the cores
        "best": _best_ratios({p.name: min(p.times) for p in paths}),
        # per path: p50/p95/p99, p99/p50 and the run-to-run spread over the blocks (host/latency.py)
        "latency": latency,
        "memory": memory,
        "breakdown": breakdown,
        **({"kernels": kern} if kern is not None else {}),
        "details": {
            "model": model.name, "inputs": [i.as_dict() for i in model.inputs], "runs": runs, "warmup": warmup,
            "rounds": rounds, "blocks": blocks, "policy": policy, "spread": spread, "skipped": skipped,
            "onnxruntime_default_ms": round(med["onnxruntime"], 3),
            "onnxruntime_nospin_ms": round(med["onnxruntime-nospin"], 3),
            "delegated_subgraphs": sum(1 for p in hyb_manifest["partitions"] if p["delegate"]),
            "ops_delegated": hyb_manifest["ops_delegated"], "ops_total": hyb_manifest["ops_total"],
            "choice_executors": [s["executor"] for s in breakdown["choice"]["subgraphs"]],
            "threads": {**threads, "onnxruntime": n_threads, "load_1min": load},
            "host_target": host, "versions": {"tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__},
        },
    }


def _best_ratios(best: dict[str, float]) -> dict:
    ort = min(best[n] for n in ORT_CONFIGS)
    fixed = min(best["tvm"], best["all-delegated"])
    return {"onnxruntime_ms": round(ort, 3), "tvm_ms": round(best["tvm"], 3), "choice_ms": round(best["choice"], 3),
            "all_delegated_ms": round(best["all-delegated"], 3), "ratio_tvm_vs_ort": round(best["tvm"] / ort, 3),
            "ratio_choice_vs_ort": round(best["choice"] / ort, 3),
            "ratio_choice_vs_best": round(best["choice"] / fixed, 3)}


# --- output --------------------------------------------------------------------------------------

def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    d = res["details"]
    ort = res["onnxruntime_ms"]
    blocks = d.get("blocks", 1)
    runs = f"{blocks} blocks of {d['runs']} runs" if blocks > 1 else f"{d['runs']} runs"
    t = Table(title=f"{d['model']}: median of {runs} after {d['warmup']} warm-up, one process")
    for col in ("path", "ms", "vs ort", "L_pre", "deleg.", "TVM", "bridge", "RSS+MB", "act. MB plan/all"):
        t.add_column(col, justify="right" if col != "path" else "left")
    # the tail of each path's runs, a table of its own (one row per path, in the same order)
    tails = Table(title="the same runs' percentiles (ms)" + (f" and the spread over the {blocks} blocks" if blocks > 1
                                                              else ": --blocks N adds the run-to-run spread"))
    for col in ("path", "p50", "p95", "p99", "p99/p50", *(("worst/best block median",) if blocks > 1 else ())):
        tails.add_column(col, justify="right" if col != "path" else "left")

    def tail(label: str, path: str) -> None:
        q = res["latency"][path]
        tails.add_row(label, f"{q['p50_ms']:.2f}", f"{q['p95_ms']:.2f}", f"{q['p99_ms']:.2f}", f"{q['p99_over_p50']:.2f}x",
                      *((f"{q['block_spread']:.2f}x",) if blocks > 1 else ()))

    for name, (_, label) in ORT_CONFIGS.items():
        ms = d["onnxruntime_default_ms"] if label == "default" else d["onnxruntime_nospin_ms"]
        mark = " (baseline)" if label == res["onnxruntime_baseline"] else ""
        t.add_row(f"ort {label}{mark}", f"{ms:.2f}", f"{ms / ort:.2f}x", "", "", "", "",
                  f"{res['memory'][name]['rss_growth_mb']:.0f}", "")
        tail(f"ort {label}", name)
    mem_hyb = next(iter(res["memory"]["hybrid"].values()), {})
    rows = [("TVM only", "tvm", res["tvm_ms"], res["breakdown"]["tvm"], res["memory"]["tvm"])]
    rows += [(f"hybrid {e}", f"hybrid:{e}", ms, res["breakdown"]["hybrid"][e], res["memory"]["hybrid"][e])
             for e, ms in res["hybrid_ms"].items()]
    rows += [("hybrid auto (choice)", "choice", res["choice_ms"], res["breakdown"]["choice"], mem_hyb),
             ("all delegated, auto", "all-delegated", res["all_delegated_ms"], res["breakdown"]["all-delegated"], {})]
    for name, key, ms, b, mem in rows:
        tail(name, key)
        t.add_row(name, f"{ms:.2f}", f"{ms / ort:.2f}x", f"{b['pre_ms']:.2f}", f"{b['delegated_ms']:.2f}",
                  f"{b['tvm_ms']:.2f}", f"{b['bridge_ms']:.3f}",
                  f"{mem['rss_growth_mb']:.0f}" if "rss_growth_mb" in mem else "",
                  f"{mem['planned_activation_mb']:.1f}/{mem['unplanned_activation_mb']:.1f}" if mem else "")
    c.print(t)
    c.print(tails)
    c.print(f"baseline: onnxruntime {res['onnxruntime_baseline']} ({ort:.2f} ms), the better of its default "
            f"({d['onnxruntime_default_ms']:.2f} ms) and no spinning ({d['onnxruntime_nospin_ms']:.2f} ms) at "
            f"{d['threads']['onnxruntime']} thread(s); every 'vs ort' is against it")
    c.print(f"compile's choice (hybrid, delegate auto: {', '.join(d['choice_executors']) or 'nothing delegated'}): "
            f"{res['ratio_choice_vs_best']:.2f}x the better of TVM only and all delegated")
    bst = res["best"]
    c.print(f"best runs: onnxruntime {bst['onnxruntime_ms']:.2f} ms, TVM only {bst['ratio_tvm_vs_ort']:.2f}x, "
            f"choice {bst['ratio_choice_vs_ort']:.2f}x, choice vs the better fixed path {bst['ratio_choice_vs_best']:.2f}x")
    m = res["memory"]["tvm"]
    c.print(f"static memory plan (TVM only): {m['intermediates']} intermediates, {m['unplanned_activation_mb']:.1f} MB "
            f"as separate buffers -> {m['planned_activation_mb']:.1f} MB planned ({m['plan_saves_pct']:.0f}% saved; "
            f"largest single tensor {m['largest_tensor_mb']:.1f} MB)")
    for e, why in d["skipped"].items():
        c.print(f"[dim]skipped {e}: {why}[/]")
    idle = "spin" if d["threads"].get("TVM_THREAD_POOL_SPIN_COUNT", "0") != "0" else "sleep"
    c.print(f"[dim]threads: TVM {d['threads']['TVM_NUM_THREADS']} (bind {d['threads']['TVM_BIND_THREADS']}, "
            f"idle workers {idle}: TVM_THREAD_POOL_SPIN_COUNT={d['threads'].get('TVM_THREAD_POOL_SPIN_COUNT')}), "
            f"onnxruntime {d['threads']['onnxruntime']}; hybrid: {d['delegated_subgraphs']} subgraph(s), "
            f"{d['ops_delegated']}/{d['ops_total']} ops delegated (policy {d['policy']})[/]")
    if "kernels" in res:
        from . import kernels as kernels_mod

        kernels_mod.print_tables(res["kernels"], console=c)


def plot(res: dict, out: Path) -> None:
    """Stacked bars (L_pre, delegated, TVM, bridge) per path, PNG via Pillow."""
    from PIL import Image, ImageDraw

    d = res["details"]
    rows = [("ort default", {"total": d["onnxruntime_default_ms"]}, "onnxruntime"),
            ("ort no spinning", {"total": d["onnxruntime_nospin_ms"]}, "onnxruntime-nospin"),
            ("TVM only", res["breakdown"]["tvm"], "tvm")]
    rows += [(f"hybrid {e}", res["breakdown"]["hybrid"][e], f"hybrid:{e}") for e in res["hybrid_ms"]]
    rows += [("choice (auto)", res["breakdown"]["choice"], "choice"),
             ("all delegated", res["breakdown"]["all-delegated"], "all-delegated")]
    lat = res.get("latency", {})
    colors = {"pre_ms": (186, 176, 172), "delegated_ms": (78, 121, 167), "tvm_ms": (225, 87, 89),
              "bridge_ms": (237, 201, 72), "total": (89, 161, 79)}
    label_w, bar_h, gap, width = 150, 28, 14, 900
    height = gap + len(rows) * (bar_h + gap) + 60
    scale_max = max(r[1].get("total_ms", r[1].get("total", 0)) for r in rows) or 1.0
    px = (width - label_w - 260) / scale_max
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 4), f"{res['details']['model']}: latency (ms), median of {res['details']['runs']} "
                    f"x {res['details'].get('blocks', 1)} block(s); p99 and the blocks' spread after each bar", fill="black")
    y = gap + 14
    for name, b, key in rows:
        d.text((10, y + 8), name, fill="black")
        x = label_w
        if "total" in b:
            segs = [("total", b["total"])]
            total = b["total"]
        else:
            segs = [(k, b[k]) for k in ("pre_ms", "delegated_ms", "tvm_ms", "bridge_ms")]
            total = b["total_ms"]
        for k, v in segs:
            w = max(int(v * px), 0)
            if w:
                d.rectangle([x, y, x + w, y + bar_h], fill=colors[k])
            x += w
        q = lat.get(key)
        said = f"{total:.2f} ms" + (f"  p99 {q['p99_ms']:.2f}, spread {q['block_spread']:.2f}x" if q else "")
        d.text((x + 6, y + 8), said, fill="black")
        y += bar_h + gap
    lx = label_w
    for k, name in (("total", "onnxruntime"), ("pre_ms", "L_pre"), ("delegated_ms", "delegated"),
                    ("tvm_ms", "TVM"), ("bridge_ms", "bridge")):
        d.rectangle([lx, y + 4, lx + 12, y + 16], fill=colors[k])
        d.text((lx + 16, y + 4), name, fill="black")
        lx += 110
    img.save(out, format="PNG")
