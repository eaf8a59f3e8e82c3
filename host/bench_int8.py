"""`tandoor bench FP32.onnx --int8 INT8.onnx`: what INT8 buys on this host, in one process.

The fp32 model and its QDQ INT8 model (`tandoor quantize`, or the user's own toolchain) on the same
seeded input, timed in bench.py's interleaved blocks:

* onnxruntime    each model in an onnxruntime CPU session, the better of its default and
                 no-spinning configurations (as bench's baseline): what onnxruntime's own INT8
                 kernels give (on x86 it fuses QDQ convs into QLinearConv only for uint8 activations)
* TVM            fp32: the whole model in TVM (policy none); INT8: the INT8 bundle with every order
                 on the TVM fallback (delegate tvm), which dequantizes the orders' int8 weights
* hybrid         each bundle as `tandoor compile` makes it for this host, run as the agent runs it
                 (delegate auto); the INT8 bundle also with every order on onnxruntime

Ratios are INT8 over fp32 per route, so < 1 is a gain. Sizes are the two host bundles' and their
order weights'. With ``images``, the INT8 bundle's agreement with the fp32 model on them
(compiler/int8/accuracy.py, as `tandoor verify --images`), preprocessed as `tandoor quantize` recorded in
the INT8 model.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .bench import ORT_CONFIGS, hybrid_path, ort_path, close_paths, load_paths, time_blocks
from .latency import summary

# route -> (fp32 path, INT8 path); the onnxruntime routes are resolved to the better configuration
ROUTES = {"onnxruntime": ("ort-fp32", "ort-int8"), "TVM": ("tvm-fp32", "int8:tvm"),
          "hybrid (auto)": ("fp32:auto", "int8:auto")}


def _order_bytes(bundle: Path) -> int:
    with zipfile.ZipFile(bundle) as z:
        return sum(i.file_size for i in z.infolist() if i.filename.startswith("orders/") and i.filename.endswith(".bin"))


def run_int8(model_path: str | Path, int8_path: str | Path, input_specs=(), *, runs: int = 20, warmup: int = 5,
             rounds: int | None = None, blocks: int = 1, images: str | Path | None = None, count: int | None = None,
             progress=lambda s: None) -> dict:
    """Time the fp32 and INT8 routes (module doc); returns the report `print_int8` prints."""
    from tandoor_agent.run.board import configure_tvm_threads

    threads = configure_tvm_threads()
    load = round(os.getloadavg()[0], 2)
    n_threads = int(threads["TVM_NUM_THREADS"])

    import onnxruntime
    import tvm

    from tandoor_compiler.stages import frontend
    from tandoor_compiler.errors import CompileError
    from tandoor_compiler.pipeline import Options, compile_model
    from tandoor_compiler.int8.quantize import activations_for, activations_of, quantized_nodes, settings_of

    if runs < 1:
        raise CompileError("--runs must be at least 1")
    if blocks < 1:
        raise CompileError("--blocks must be at least 1")
    rounds = rounds or max(4, runs // 3)
    fp32 = frontend.load(model_path, list(input_specs))
    specs = [f"{i.name}={'x'.join(str(d) for d in i.shape)}" for i in fp32.inputs]
    q = frontend.load(int8_path, specs)
    if not quantized_nodes(q.proto):
        raise CompileError(f"--int8 {Path(int8_path).name} has no QuantizeLinear/DequantizeLinear: give the QDQ "
                           f"model (tandoor quantize {Path(model_path).name} --calibration DIR -o INT8.onnx)")
    if [o.shape for o in q.outputs] != [o.shape for o in fp32.outputs]:
        raise CompileError(f"--int8 {Path(int8_path).name} has output(s) of shape {[o.shape for o in q.outputs]}, "
                           f"{Path(model_path).name} {[o.shape for o in fp32.outputs]}: give the INT8 model "
                           "quantized from this one")
    settings = settings_of(q.proto) or {}
    preprocess = settings.get("preprocess")
    try:
        host_wants, host_why = activations_for(["host"])
    except CompileError as err:          # a host no table row speaks for: nothing to compare with
        host_wants, host_why = None, str(err)
    act = settings.get("activations") or activations_of(q.proto)
    why = settings.get("activations_why") or (
        "recorded by tandoor quantize without a reason (made before the choice by target)" if settings.get("activations")
        else "read from the model's QuantizeLinear zero points (it records no tandoor quantize settings)")
    activations = {"type": act, "why": why, "host_wants": host_wants, "host_why": host_why,
                   **({"fp32_lead": settings["fp32_lead"], "fp32_lead_why": settings.get("fp32_lead_why")}
                      if settings.get("fp32_lead") else {})}
    if images is not None:
        from tandoor_compiler.int8 import calibration as calib

        calib.open_source(images, "--images")      # refused now, not after the compiles
    rng = np.random.default_rng(20261129)
    inputs = [rng.standard_normal(i.shape).astype(i.dtype) for i in fp32.inputs]

    with tempfile.TemporaryDirectory(prefix="tandoor-bench-int8-") as tmp:
        tmpd = Path(tmp)
        bundles = {"tvm-fp32": tmpd / "tvm_fp32.hmod", "fp32": tmpd / "fp32.hmod", "int8": tmpd / "int8.hmod"}
        progress("compiling the fp32 model for TVM only (policy none)")
        compile_model(model_path, bundles["tvm-fp32"], Options(specs, policy="none"))
        progress("compiling the fp32 hybrid module")
        m32 = compile_model(model_path, bundles["fp32"], Options(specs))
        progress("compiling the INT8 hybrid module")
        m8 = compile_model(int8_path, bundles["int8"], Options(specs))
        builders = [(name, lambda model=model, spin=spin, name=name: ort_path(model, inputs, n_threads,
                                                                           spinning=spin, name=name))
                    for tag, model in (("fp32", fp32), ("int8", q)) for name, spin in _ort_names(tag)]
        builders += [("tvm-fp32", lambda: hybrid_path("tvm-fp32", bundles["tvm-fp32"], "tvm", inputs)),
                     ("fp32:auto", lambda: hybrid_path("fp32:auto", bundles["fp32"], "auto", inputs)),
                     ("int8:onnxruntime", lambda: hybrid_path("int8:onnxruntime", bundles["int8"], "onnxruntime", inputs)),
                     ("int8:tvm", lambda: hybrid_path("int8:tvm", bundles["int8"], "tvm", inputs)),
                     ("int8:auto", lambda: hybrid_path("int8:auto", bundles["int8"], "auto", inputs))]
        paths = []
        try:
            load_paths(builders, warmup, progress, paths)
            time_blocks(paths, runs, rounds, blocks, progress)
            med = {p.name: statistics.median_low(p.times) for p in paths}
            latency = {p.name: summary(p.times, p.blocks) for p in paths}
            best = {p.name: min(p.times) for p in paths}
            int8_executors = [sg.executor for sg in next(p for p in paths if p.name == "int8:auto").hybrid.subgraphs]
        finally:
            close_paths(paths)
        sizes = {k: {"bundle_bytes": os.path.getsize(v), **({"order_weight_bytes": _order_bytes(v)} if k != "tvm-fp32" else {})}
                 for k, v in bundles.items()}
        accuracy = None
        if images is not None:
            progress(f"comparing the INT8 bundle with the fp32 model on {images}")
            accuracy = _accuracy(bundles["int8"], model_path, images, count, preprocess)

    configs, ort_pick = {}, {}
    for tag in ("fp32", "int8"):     # the better onnxruntime configuration stands for the route
        pick, spin = min(_ort_names(tag), key=lambda ns: med[ns[0]])
        ort_pick[f"ort-{tag}"] = pick
        med[f"ort-{tag}"], best[f"ort-{tag}"] = med[pick], best[pick]
        configs[tag] = next(label for s, label in ORT_CONFIGS.values() if s == spin)
    routes = {}
    for route, (a, b) in ROUTES.items():
        la, lb = latency[ort_pick.get(a, a)], latency[ort_pick.get(b, b)]
        routes[route] = {"fp32_ms": round(med[a], 3), "int8_ms": round(med[b], 3), "ratio": round(med[b] / med[a], 3),
                         "best_ratio": round(best[b] / best[a], 3),
                         "fp32_p99_ms": la["p99_ms"], "int8_p99_ms": lb["p99_ms"],
                         "fp32_spread": la["block_spread"], "int8_spread": lb["block_spread"]}
    routes["onnxruntime"]["configs"] = configs
    routes["INT8 orders on onnxruntime"] = {"int8_ms": round(med["int8:onnxruntime"], 3),
                                            "ratio_vs_fp32_hybrid": round(med["int8:onnxruntime"] / med["fp32:auto"], 3)}
    fastest32 = min(("ort-fp32", "tvm-fp32", "fp32:auto"), key=med.__getitem__)
    fastest8 = min(("ort-int8", "int8:tvm", "int8:auto", "int8:onnxruntime"), key=med.__getitem__)
    share = m8.get("flops_delegated_int8", 0) / m8["flops_total"] if m8.get("flops_total") else 0.0
    return {
        "model": fp32.name, "int8_model": Path(int8_path).name,
        "routes": routes,
        "fastest": {"fp32": fastest32, "fp32_ms": round(med[fastest32], 3), "int8": fastest8,
                    "int8_ms": round(med[fastest8], 3), "ratio": round(med[fastest8] / med[fastest32], 3)},
        "sizes": {**sizes, "int8_vs_fp32": round(sizes["int8"]["bundle_bytes"] / sizes["fp32"]["bundle_bytes"], 3),
                  "onnx_fp32_bytes": os.path.getsize(model_path), "onnx_int8_bytes": os.path.getsize(int8_path)},
        "int8_flops_delegated_share": round(share, 4),
        "activations": activations,
        "accuracy": accuracy,
        # per path (details.median_ms's names): p50/p95/p99 and the spread over the blocks (host/latency.py)
        "latency": latency,
        "details": {"runs": runs, "warmup": warmup, "rounds": rounds, "blocks": blocks, "inputs": [i.as_dict() for i in fp32.inputs],
                    "median_ms": {k: round(v, 3) for k, v in med.items()},
                    "best_ms": {k: round(v, 3) for k, v in best.items()},
                    "int8_choice_executors": int8_executors,
                    "delegated_subgraphs": {"fp32": sum(1 for p in m32["partitions"] if p["delegate"]),
                                            "int8": sum(1 for p in m8["partitions"] if p["delegate"])},
                    "threads": {**threads, "onnxruntime": n_threads, "load_1min": load},
                    "versions": {"tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__}},
    }


def _ort_names(tag: str) -> list[tuple[str, bool]]:
    """(path name, spinning) of the onnxruntime configurations for the fp32 or the INT8 model. Not
    ``ort-{tag}``: that key is the route's, the better of the two (the default's median once went
    under it and was overwritten by the no-spinning one's, so both read the same)."""
    return [(f"ort-{tag}-" + ("default" if spin else "nospin"), spin) for spin, _ in ORT_CONFIGS.values()]


def _accuracy(bundle: Path, reference, images, count, preprocess) -> dict:
    from tandoor_compiler.errors import CompileError

    from tandoor_compiler.int8.accuracy import compare_on_images

    if preprocess is None:
        raise CompileError("--images: the INT8 model records no preprocessing (it was not made by tandoor quantize); "
                           "compile both with your --mean/--std and run tandoor verify INT8.hmod --reference "
                           "FP32.onnx --images DIR")
    # the bench bundle was compiled without flags: the images take the preprocessing quantize recorded
    res = compare_on_images(bundle, reference, images, count=count, delegate="auto", max_drop=1.0,
                            preprocess=preprocess)
    from tandoor_compiler.int8.accuracy import CLASS_KEYS

    keep = ("images", "source", *CLASS_KEYS, "box_agreement", "sqnr_db", "notes")
    return {k: res[k] for k in keep if k in res}


def print_int8(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    d = res["details"]
    blocks = d.get("blocks", 1)
    t = Table(title=f"{res['model']} fp32 vs {res['int8_model']}: median of {d['runs']} runs"
                    + (f" x {blocks} blocks" if blocks > 1 else "") + ", one process")
    for col in ("route", "fp32 ms", "p99", "INT8 ms", "p99 ", "INT8/fp32", "best runs", "spread fp32/INT8"):
        t.add_column(col, justify="left" if col == "route" else "right")
    for route, r in res["routes"].items():
        if "fp32_ms" not in r:
            continue
        spread = f"{r['fp32_spread']:.2f}x / {r['int8_spread']:.2f}x" if blocks > 1 else ""
        t.add_row(route, f"{r['fp32_ms']:.2f}", f"{r['fp32_p99_ms']:.2f}", f"{r['int8_ms']:.2f}", f"{r['int8_p99_ms']:.2f}",
                  f"{r['ratio']:.2f}x", f"{r['best_ratio']:.2f}x", spread)
    r = res["routes"]["INT8 orders on onnxruntime"]
    q = res["latency"]["int8:onnxruntime"]
    t.add_row("INT8 orders on onnxruntime", "", "", f"{r['int8_ms']:.2f}", f"{q['p99_ms']:.2f}",
              f"{r['ratio_vs_fp32_hybrid']:.2f}x", "", f"{q['block_spread']:.2f}x" if blocks > 1 else "")
    c.print(t)
    f = res["fastest"]
    c.print(f"fastest: fp32 {f['fp32']} {f['fp32_ms']:.2f} ms, INT8 {f['int8']} {f['int8_ms']:.2f} ms: "
            f"INT8 is {f['ratio']:.2f}x fp32")
    cfg = res["routes"]["onnxruntime"]["configs"]
    c.print(f"onnxruntime: the better of default and no spinning (fp32: {cfg['fp32']}, INT8: {cfg['int8']})")
    s = res["sizes"]
    c.print(f"host bundles: fp32 {s['fp32']['bundle_bytes'] / 1e6:.2f} MB (order weights "
            f"{s['fp32']['order_weight_bytes'] / 1e6:.2f} MB), INT8 {s['int8']['bundle_bytes'] / 1e6:.2f} MB "
            f"({s['int8']['order_weight_bytes'] / 1e6:.2f} MB): {s['int8_vs_fp32']:.0%} of fp32; "
            f"{res['int8_flops_delegated_share']:.1%} of the FLOPs delegated as INT8")
    act = res["activations"]
    kind = {"uint8": "uint8 (U8S8)", "int8": "int8 (S8S8)"}.get(act["type"], "of no one type (mixed or no zero points)")
    c.print(f"INT8 activations {kind}: {act['why']}")
    if act["type"] and act["host_wants"] and act["type"] != act["host_wants"]:
        c.print(f"  on this host {act['host_wants']} is wanted {act['host_why']}; the host routes above are slower "
                "than a model quantized for the host alone gets (tandoor quantize without --target)")
    if act.get("fp32_lead"):
        convs = ", ".join(n for n, r in act["fp32_lead"].items() if r != "on the way")
        c.print(f"  kept in fp32 at the start (the fp32 lead): {convs}, as int8 is slower for them on "
                f"{act['fp32_lead_why']}")
    a = res.get("accuracy")
    if a:
        from tandoor_compiler.int8.agreement import describe

        said = [describe(a)] if a.get("confident_images") is not None else []
        said += [f"SQNR {k} {v:.1f} dB" for k, v in a["sqnr_db"].items()]
        c.print(f"accuracy against fp32 on {a['images']} image(s) from {a['source']}: " + ", ".join(said))
        for note in a.get("notes") or ():
            c.print(f"  note: {note}")
    counts = Counter(d["int8_choice_executors"])
    said = ", ".join(f"{e} x{n}" for e, n in counts.most_common()) or "nothing delegated"
    c.print(f"[dim]INT8 choice, executors per subgraph: {said}; "
            f"threads TVM {d['threads']['TVM_NUM_THREADS']}, onnxruntime {d['threads']['onnxruntime']}[/]")
