"""`tandoor bench --kernels`: where the time goes, TVM kernel by kernel beside onnxruntime node by node.

TVM: the whole model compiled for the host as `--policy none` compiles it (the same passes and
schedule rules, compiler/stages/schedule.py), run in a Relax VM whose instrument times every call. Each
fused PrimFunc is one kernel; its time is the median over the runs of its calls' sum in a run.
Its pattern and the rule that scheduled it come from its TIR.

onnxruntime: the same model in a session with ``enable_profiling`` at the same thread count and
in the configuration bench took as the baseline; per node the median over runs of its kernel
time in the session's own trace; the pattern from its op type and shapes.

Both sides share one pattern vocabulary (`conv 1x1`, `conv 3x3 s2`, `depthwise 5x5 s2`,
`grouped 3x3 g4`, `matmul`, `pool`, `global mean`, `elementwise`, `concat`, `resize`, `layout`,
`shape/copy`, `softmax`, ...). TVM fuses a conv's epilogue (bias, activation, residual add) into
the conv's kernel; onnxruntime fuses some activations into its Conv (Relu, Clip, HardSigmoid ...)
but runs HardSwish, SiLU's Sigmoid and Mul, or squeeze-excite's Mul as nodes of their own, which
its side counts under `elementwise`: compare the groups' sum, not each group alone.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

# --- patterns ------------------------------------------------------------------------------------

# leading op of a fused PrimFunc's name (TVM's FuseOps names it after its ops, in order) -> pattern
_TVM_NAMES = (("transpose", "layout"), ("layout_transform", "layout"),
              ("concatenate", "concat"), ("resize2d", "resize"), ("image_resize", "resize"),
              ("max_pool2d", "pool"), ("avg_pool2d", "pool"), ("adaptive_avg_pool2d", "global mean"),
              ("mean", "global mean"), ("matmul", "matmul"), ("dense", "matmul"), ("softmax", "softmax"),
              ("split", "shape/copy"), ("strided_slice", "shape/copy"), ("reshape", "shape/copy"),
              ("squeeze", "shape/copy"), ("expand_dims", "shape/copy"), ("take", "shape/copy"),
              ("broadcast_to", "shape/copy"))

_ORT_OPS = {
    "conv transpose": ("ConvTranspose",),
    "pool": ("MaxPool", "AveragePool", "GlobalMaxPool"),
    "global mean": ("GlobalAveragePool", "ReduceMean"),
    "concat": ("Concat",),
    "resize": ("Resize", "Upsample"),
    "layout": ("Transpose", "ReorderInput", "ReorderOutput", "DepthToSpace", "SpaceToDepth"),
    "matmul": ("Gemm", "MatMul", "FusedGemm", "FusedMatMul"),
    "softmax": ("Softmax", "LogSoftmax"),
    "shape/copy": ("Reshape", "Split", "Slice", "Gather", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity",
                   "Shape", "Cast", "Tile", "Pad"),
}
_ORT_PATTERN = {op: pattern for pattern, ops in _ORT_OPS.items() for op in ops}
_ORT_CONVS = ("Conv", "FusedConv", "NhwcConv", "NhwcFusedConv")


def relax_module(model, delegate: dict[str, bool]):
    """The TVM side of a bundle as compile_model builds it: `delegate` says which regions stay."""
    from tandoor_compiler.stages import codegen, importer, partition, passes

    mod, _ = passes.optimise(importer.to_relax(model))
    result = partition.partition(mod, model.name, lambda p: (delegate.get(p.symbol, False), "bench"))
    return codegen.lower_regions(result.mod)


def conv_pattern(kh: int, kw: int, stride: int, groups: int, cin: int, cout: int) -> str:
    """One name for a conv on both sides: kind, kernel, stride (s1 left out)."""
    s = f" s{stride}" if stride > 1 else ""
    if groups == 1:
        return f"conv {kh}x{kw}{s}"
    if groups == cin and cout % cin == 0:
        return f"depthwise {kh}x{kw}{s}"
    return f"grouped {kh}x{kw}{s} g{groups}"


def _stride(size_in: int, size_out: int, k: int) -> int:
    if size_out <= 1:
        return 1
    return max(1, round((size_in - k) / (size_out - 1))) if size_in > k else max(1, round(size_in / size_out))


# --- TVM side ------------------------------------------------------------------------------------

def _tir_blocks(func) -> list:
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    return [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def _kinds(block) -> str:
    return "".join("S" if int(iv.iter_type) == 0 else "R" for iv in block.iter_vars)


def _extents(block) -> list[int]:
    return [int(iv.dom.extent) for iv in block.iter_vars]


def tvm_pattern(name: str, func) -> tuple[str, str, float]:
    """(pattern, shape text, FLOPs) of a fused PrimFunc, from its name and its TIR blocks."""
    base = name.removeprefix("fused_")
    if base.startswith("conv2d_transpose"):   # NCHW between transposes (passes.legalise_for_tvm)
        return "conv transpose", "", 0.0
    try:
        blocks = _tir_blocks(func)
    except Exception:
        blocks = []
    flops = 0.0
    for b in blocks:
        if "R" in _kinds(b):
            flops += 2.0 * float(np.prod(_extents(b)))
    for b in blocks:
        if _kinds(b) == "SSSSRRR":      # conv2d NHWC: n, h, w, co | kh, kw, ci
            n, h, w, co, kh, kw, rc = _extents(b)
            src = [r.source for r in b.reads if len(r.source.shape) == 4]
            hp, wp, cin = (int(d) for d in src[0].shape[1:]) if src else (h, w, rc)
            groups = max(cin // rc, 1) if rc else 1
            stride = _stride(hp, h, kh)
            return (conv_pattern(kh, kw, stride, groups, cin, co),
                    f"{hp}x{wp}x{cin} -> {h}x{w}x{co}", flops)
    for prefix, pattern in _TVM_NAMES:
        if base.startswith(prefix):
            return pattern, "", flops
    if any("R" in _kinds(b) for b in blocks):
        return "reduction", "", flops
    return "elementwise", "", 0.0


def _tvm_build(model, progress):
    """The TVM-only module built in process, with each PrimFunc's pattern and schedule rule."""
    import tvm

    from tandoor_compiler.stages import schedule
    from tandoor_compiler.stages.passes import legalise_for_tvm


    seen: dict = {}
    mod = legalise_for_tvm(relax_module(model, {}))
    t = tvm.target.Target(schedule.host_target({"kind": "llvm"}))
    progress("compiling the TVM-only module for per-kernel timing")
    ex = tvm.compile(mod, target=t, relax_pipeline=schedule.cpu_pipeline(t, observe=seen.update))
    info = {}
    for name, (func, rule) in seen.items():
        pattern, shape, flops = tvm_pattern(name, func)
        info[name] = {"pattern": pattern, "shape": shape, "flops": flops, "rule": rule}
    return ex, info


def tvm_kernels(model, inputs, runs: int, warmup: int, progress=lambda s: None) -> list[dict]:
    """Per fused TVM kernel: calls per run, median microseconds per run, pattern, rule, GFLOP/s."""
    import tvm
    from tvm import relax

    ex, info = _tvm_build(model, progress)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs]
    for _ in range(warmup):
        vm["main"](*args)
    clock = time.perf_counter_ns
    per_run: list[dict[str, list[int]]] = []
    started: dict[str, int] = {}

    def instrument(func, symbol, before, ret, *rest):
        if before:
            started[symbol] = clock()
        else:
            per_run[-1][symbol].append(clock() - started.pop(symbol, clock()))
        return 0

    vm.set_instrument(instrument)
    progress(f"timing TVM's kernels, {runs} runs")
    for _ in range(runs):
        per_run.append(defaultdict(list))
        vm["main"](*args)
    names = sorted({k for r in per_run for k in r})
    out = []
    for k in names:
        totals = [sum(r.get(k, [])) for r in per_run]
        us, best = statistics.median(totals) / 1e3, min(totals) / 1e3
        meta = info.get(k) or {"pattern": "runtime (VM)" if k.startswith("vm.") else "other", "shape": "",
                               "flops": 0.0, "rule": ""}
        calls = round(statistics.median(len(r.get(k, [])) for r in per_run))
        row = {"name": k, "calls": calls, "us": round(us, 2), "min_us": round(best, 2), **meta,
               "gflops": round(meta["flops"] * calls / (best * 1e3), 1) if meta["flops"] and best > 0 else None}
        out.append(row)
    return sorted(out, key=lambda r: -r["us"])


# --- onnxruntime side ----------------------------------------------------------------------------

def ort_pattern(op: str, in_shapes: list[list[int]], out_shapes: list[list[int]]) -> tuple[str, str]:
    if op in _ORT_CONVS and len(in_shapes) >= 2 and len(in_shapes[0]) == 4 and len(in_shapes[1]) == 4:
        _, cin, h, w = in_shapes[0]
        co, cpg, kh, kw = in_shapes[1]
        ho = out_shapes[0][2] if out_shapes and len(out_shapes[0]) == 4 else h
        wo = out_shapes[0][3] if out_shapes and len(out_shapes[0]) == 4 else w
        groups = max(cin // cpg, 1) if cpg else 1
        return conv_pattern(kh, kw, _stride(h, ho, kh), groups, cin, co), f"{h}x{w}x{cin} -> {ho}x{wo}x{co}"
    return _ORT_PATTERN.get(op, "elementwise"), ""


def _shapes(v) -> list[list[int]]:
    return [next(iter(d.values())) for d in v or [] if isinstance(d, dict) and d]


def ort_nodes(model, inputs, runs: int, warmup: int, threads: int, spinning: bool) -> list[dict]:
    """Per onnxruntime node: median microseconds per run from the session's own profile."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with tempfile.TemporaryDirectory(prefix="tandoor-ortprof-") as tmp:
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "ort")
        sess = ort.InferenceSession(model.proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds = {i.name: a for i, a in zip(model.inputs, inputs)}
        for _ in range(warmup + runs):
            sess.run(None, feeds)
        trace = json.loads(Path(sess.end_profiling()).read_text())
    durs: dict[str, list[int]] = defaultdict(list)
    meta: dict[str, dict] = {}
    for e in trace:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        durs[name].append(int(e.get("dur", 0)))
        if name not in meta:
            a = e.get("args", {})
            op = str(a.get("op_name", "?"))
            pattern, shape = ort_pattern(op, _shapes(a.get("input_type_shape")), _shapes(a.get("output_type_shape")))
            meta[name] = {"op": op, "pattern": pattern, "shape": shape}
    out = []
    for name, ds in durs.items():
        timed = ds[warmup:] if len(ds) > warmup else ds
        out.append({"name": name, "us": float(statistics.median(timed)), "min_us": float(min(timed)), **meta[name]})
    return sorted(out, key=lambda r: -r["us"])


# --- both ----------------------------------------------------------------------------------------

def groups(tvm_rows: list[dict], ort_rows: list[dict]) -> list[dict]:
    """Per pattern: TVM kernels and time, onnxruntime nodes and time, biggest first."""
    acc: dict[str, dict] = defaultdict(lambda: {"tvm_us": 0.0, "tvm_min_us": 0.0, "tvm_n": 0,
                                                "ort_us": 0.0, "ort_min_us": 0.0, "ort_n": 0})
    for side, rows in (("tvm", tvm_rows), ("ort", ort_rows)):
        for r in rows:
            g = acc[r["pattern"]]
            g[f"{side}_us"] += r["us"]
            g[f"{side}_min_us"] += r["min_us"]
            g[f"{side}_n"] += r.get("calls", 1)
    rows = [{"pattern": k, **{f: round(v, 1) if isinstance(v, float) else v for f, v in g.items()},
             "ratio": round(g["tvm_us"] / g["ort_us"], 2) if g["ort_us"] > 0 else None,
             "ratio_min": round(g["tvm_min_us"] / g["ort_min_us"], 2) if g["ort_min_us"] > 0 else None}
            for k, g in acc.items()]
    return sorted(rows, key=lambda r: -max(r["tvm_us"], r["ort_us"]))


def measure(model, inputs, runs: int, warmup: int, threads: int, ort_spinning: bool, progress=lambda s: None) -> dict:
    t = tvm_kernels(model, inputs, runs, warmup, progress)
    progress(f"profiling onnxruntime's nodes, {runs} runs")
    o = ort_nodes(model, inputs, runs, warmup, threads, ort_spinning)
    return {"threads": threads, "runs": runs, "onnxruntime_config": "default" if ort_spinning else "no spinning",
            "tvm_total_us": round(sum(r["us"] for r in t), 1), "onnxruntime_total_us": round(sum(r["us"] for r in o), 1),
            "tvm_total_min_us": round(sum(r["min_us"] for r in t), 1),
            "onnxruntime_total_min_us": round(sum(r["min_us"] for r in o), 1),
            "groups": groups(t, o), "tvm": t, "onnxruntime": o}


def print_tables(k: dict, console=None, top: int = 15) -> None:
    from rich.console import Console
    from rich.table import Table

    c = console or Console()
    t = Table(title=f"kernels by pattern over {k['runs']} runs, {k['threads']} thread(s), onnxruntime "
                    f"{k['onnxruntime_config']}: sums of per-kernel medians (and of per-kernel bests)")
    for col in ("pattern", "TVM kernels", "TVM ms", "ort nodes", "ort ms", "TVM / ort"):
        t.add_column(col, justify="left" if col == "pattern" else "right")
    x = lambda r: f"{r:.2f}x" if r is not None else "-"  # noqa: E731
    for g in k["groups"]:
        t.add_row(g["pattern"], str(g["tvm_n"]), f"{g['tvm_us'] / 1e3:.3f} ({g['tvm_min_us'] / 1e3:.3f})",
                  str(g["ort_n"]), f"{g['ort_us'] / 1e3:.3f} ({g['ort_min_us'] / 1e3:.3f})",
                  f"{x(g['ratio'])} ({x(g['ratio_min'])})")
    tot = lambda a, b: a / b if b else None  # noqa: E731
    t.add_row("total", str(sum(g["tvm_n"] for g in k["groups"])),
              f"{k['tvm_total_us'] / 1e3:.3f} ({k['tvm_total_min_us'] / 1e3:.3f})",
              str(sum(g["ort_n"] for g in k["groups"])),
              f"{k['onnxruntime_total_us'] / 1e3:.3f} ({k['onnxruntime_total_min_us'] / 1e3:.3f})",
              f"{x(tot(k['tvm_total_us'], k['onnxruntime_total_us']))} "
              f"({x(tot(k['tvm_total_min_us'], k['onnxruntime_total_min_us']))})")
    c.print(t)
    tk = Table(title=f"TVM's {top} slowest kernels (epilogues fused in)")
    for col in ("kernel", "pattern", "shape", "rule", "calls", "us", "best us", "GFLOP/s"):
        tk.add_column(col, justify="right" if col in ("calls", "us", "best us", "GFLOP/s") else "left")
    for r in k["tvm"][:top]:
        tk.add_row(r["name"][:48], r["pattern"], r["shape"], r["rule"], str(r["calls"]), f"{r['us']:.1f}",
                   f"{r['min_us']:.1f}", f"{r['gflops']:.1f}" if r["gflops"] else "")
    c.print(tk)
    to = Table(title=f"onnxruntime's {top} slowest nodes")
    for col in ("node", "op", "pattern", "shape", "us", "best us"):
        to.add_column(col, justify="right" if col in ("us", "best us") else "left")
    for r in k["onnxruntime"][:top]:
        to.add_row(r["name"][:48], r["op"], r["pattern"], r["shape"], f"{r['us']:.1f}", f"{r['min_us']:.1f}")
    c.print(to)
