#!/usr/bin/env python3
"""The agent's footprint serving a bundle: memory, time to the first result, import cost.

    .venv/bin/python scripts/bench-footprint.py BUNDLE [--seconds 30] [--json]
    .venv/bin/python scripts/bench-footprint.py BUNDLE --board bookworm|trixie [--seconds 30] [--json]

Without --board it measures here, with the agent of this Python's environment (on the host: the
.venv, which also holds the compiler and torch: the agent must leave both alone). With --board
it copies the bundle and itself to an emulated board (scripts/board/run.sh) and measures there,
with the board's agent (/opt/tandoor/venv): under qemu-user, so times are emulation's and the
RSS includes qemu's own (its translated code and bookkeeping), both larger than on a real board.

What it measures, each in fresh processes started the way a user or systemd starts them:

* serve: `tandoor-agent --config CFG` (the service: a synthetic 640x480 camera at 30 fps ->
  model -> results and telemetry over MQTT to a local mosquitto when there is one here, else
  offline). Time from the process's start to its first result (sd_notify READY=1, which the
  service sends after the first frame went through the model, read from a NOTIFY_SOCKET here);
  RSS and PSS then ("after load": bundle verified, executors built, first inference done); RSS
  sampled every 0.5 s for --seconds afterwards (steady state: the median of the second half, and
  the peak); which libraries the process maps (libtvm_compiler.so and torch must not be there).
* run: `tandoor-agent run BUNDLE --json` once: wall time from spawn to exit (the result is
  printed just before), and peak RSS (the kernel's ru_maxrss for that child).
* imports: one fresh Python importing, in the agent's order, each dependency after the ones
  before it (with the agent's runtime-only TVM set-up first): seconds and RSS added by each.
  And, for comparison, a plain `import tvm` (what the agent did before: the compiler library and
  torch, when installed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# in the order the agent imports them; tvm is the runtime library alone (agent/run/lean.py)
DEPS = ("numpy", "psutil", "click", "paho.mqtt.client", "PIL.Image", "cv2", "onnxruntime", "tvm",
        "tvm.runtime.vm", "pyarmnn", "tandoor_agent.cli")
READY_TIMEOUT_S = 900  # emulated boards load a bundle in tens of seconds; a real failure ends sooner

_IMPORTS_CHILD = r"""
import importlib, json, logging, os, sys, time
logging.disable(logging.WARNING)       # pyarmnn warns once per parser it lacks
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
mode, deps = sys.argv[1], sys.argv[2:]
if mode == "lean":
    from tandoor_agent.run import lean
    lean.runtime_only()
out, t_all, r0 = [], time.perf_counter(), rss()
for d in deps:
    r, t = rss(), time.perf_counter()
    try:
        importlib.import_module(d)
        ok = True
    except Exception as e:
        ok = f"{type(e).__name__}: {e}"
    out.append({"module": d, "s": round(time.perf_counter() - t, 3), "rss_mb": round(rss() - r, 1), "ok": ok})
maps = open("/proc/self/maps").read()
print(json.dumps({"imports": out, "total_s": round(time.perf_counter() - t_all, 3),
                  "total_rss_mb": round(rss() - r0, 1), "rss_mb": round(rss(), 1),
                  "tvm_compiler_mapped": "libtvm_compiler.so" in maps,
                  "torch_imported": sys.modules.get("torch") is not None}))
"""


def _agent() -> str:
    exe = Path(sys.executable).with_name("tandoor-agent")
    if not exe.exists():
        sys.exit(f"bench-footprint: no tandoor-agent beside {sys.executable}; run it with the agent's Python")
    return str(exe)


def _status_kb(pid: int, key: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith(key))
    except (OSError, StopIteration):
        return None


def _pss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) / 1024
    except (OSError, StopIteration):
        return None


def _rss_mb(pid: int) -> float | None:
    kb = _status_kb(pid, "VmRSS:")
    return None if kb is None else kb / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broker(work: Path):
    """The tests' real mosquitto (tests/support/mosquitto.py) when this checkout and mosquitto are
    here, else None (an emulated board has neither: the agent then runs offline)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from support.mosquitto import Broker, available
    except ImportError:
        return None
    return Broker(work / "mosquitto").start() if available() else None


def serve(bundle: Path, seconds: float, work: Path) -> dict:
    from tandoor_agent.run.lean import footprint_facts

    broker = _broker(work)
    port = broker.port if broker else None
    slots = work / "slots"
    slots.mkdir()
    cfg = work / "agent.toml"
    cfg.write_text("\n".join([
        'device_id = "bench-footprint"', f'slot_dir = "{slots}"', f'bundle = "{bundle}"',
        "telemetry_period_s = 1.0", 'log_level = "warning"',
        "[broker]", 'host = "127.0.0.1"', f"port = {port or _free_port()}",   # no broker: it runs offline
        "[camera]", 'source = "synthetic:640x480@30:noise"', ""]))
    sock_path = work / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    env = dict(os.environ, NOTIFY_SOCKET=str(sock_path))
    t0 = time.monotonic()
    proc = subprocess.Popen([_agent(), "--config", str(cfg)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t_ready = None
        while t_ready is None:
            left = READY_TIMEOUT_S - (time.monotonic() - t0)
            if left <= 0 or proc.poll() is not None:
                err = proc.stderr.read() if proc.poll() is not None else ""
                sys.exit(f"bench-footprint: the agent sent no READY=1 within {READY_TIMEOUT_S} s "
                         f"(exit {proc.poll()}): {err.strip()[-2000:]}")
            sock.settimeout(min(left, 1.0))
            try:
                msg = sock.recv(4096).decode(errors="replace")
            except TimeoutError:
                continue
            if "READY=1" in msg.split("\n"):
                t_ready = time.monotonic() - t0
        at_ready = {"rss_mb": _rss_mb(proc.pid), "pss_mb": _pss_mb(proc.pid)}
        samples, t_end = [], time.monotonic() + seconds
        while time.monotonic() < t_end and proc.poll() is None:
            samples.append(_rss_mb(proc.pid))
            time.sleep(0.5)
        if proc.poll() is not None:
            sys.exit(f"bench-footprint: the agent exited ({proc.returncode}) while serving: {proc.stderr.read()[-2000:]}")
        facts = footprint_facts(proc.pid)
        late = [s for s in samples[len(samples) // 2:] if s is not None]
        out = {"first_result_s": round(t_ready, 2), "after_load_rss_mb": round(at_ready["rss_mb"], 1),
               "after_load_pss_mb": round(at_ready["pss_mb"], 1) if at_ready["pss_mb"] else None,
               "steady_rss_mb": round(statistics.median(late), 1), "peak_rss_mb": round(max(late), 1),
               "steady_pss_mb": round(_pss_mb(proc.pid) or 0, 1), "served_s": seconds,
               "broker": f"mosquitto 127.0.0.1:{port}" if broker else "none (the agent runs offline)", **facts}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        sock.close()
        if broker:
            broker.stop()
    return out


def one_shot_peak(bundle: Path) -> dict:
    """tandoor-agent run, reaped with wait4 for its own rusage (peak RSS of exactly that child)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([_agent(), "run", str(bundle), "--json"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"bench-footprint: tandoor-agent run failed ({proc.returncode}): "
                 f"{proc.stderr.read().decode(errors='replace').strip()[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def imports() -> dict:
    def child(mode: str, deps: tuple[str, ...]) -> dict:
        res = subprocess.run([sys.executable, "-c", _IMPORTS_CHILD, mode, *deps], capture_output=True,
                             text=True, timeout=READY_TIMEOUT_S)
        if res.returncode != 0:
            sys.exit(f"bench-footprint: the import probe failed: {res.stderr.strip()[-2000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    lean = child("lean", DEPS)
    # the same process as far as onnxruntime, then a plain `import tvm` (no runtime-only set-up)
    before = DEPS[:DEPS.index("tvm")]
    plain = child("plain", (*before, "tvm"))
    return {"lean": lean, "plain_tvm": plain["imports"][-1] | {"tvm_compiler_mapped": plain["tvm_compiler_mapped"],
                                                                "torch_imported": plain["torch_imported"]}}


def here(bundle: Path, seconds: float) -> dict:
    import numpy

    with tempfile.TemporaryDirectory(prefix="tandoor-footprint-") as td:
        work = Path(td)
        return {"machine": f"{platform.system()} {platform.machine()}", "python": platform.python_version(),
                "cpus": len(os.sched_getaffinity(0)), "numpy": numpy.__version__,
                "bundle": bundle.name, "serve": serve(bundle.resolve(), seconds, work),
                "run": one_shot_peak(bundle.resolve()), "imports": imports()}


def on_board(bundle: Path, board: str, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandoor-footprint-board-") as td:
        share = Path(td)
        shutil.copy2(bundle, share / bundle.name)
        shutil.copy2(__file__, share / "bench-footprint.py")
        res = subprocess.run([str(ROOT / "scripts/board/run.sh"), "--board", board, "--share", str(share), "--",
                              "python", "/work/bench-footprint.py", f"/work/{bundle.name}", "--seconds", str(seconds),
                              "--json"], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"bench-footprint: on the {board} board (exit {res.returncode}): {res.stderr.strip()[-3000:]}")
        out = json.loads(res.stdout)
        out["board"] = f"emulated {board} (qemu-user)"
        return out


def table(r: dict) -> str:
    s, run, imp = r["serve"], r["run"], r["imports"]
    where = r.get("board") or "here"
    rows = [f"{where}: {r['machine']}, Python {r['python']}, {r['cpus']} CPUs; bundle {r['bundle']}",
            f"serve: first result {s['first_result_s']} s after start; RSS after load {s['after_load_rss_mb']} MB "
            f"(PSS {s['after_load_pss_mb']}); steady state {s['steady_rss_mb']} MB (peak {s['peak_rss_mb']}, "
            f"PSS {s['steady_pss_mb']}) over {s['served_s']:g} s; broker: {s['broker']}",
            f"       maps libtvm_compiler.so: {s['tvm_compiler_mapped']}, torch: {s['torch_mapped']}, "
            f"libtvm_runtime.so: {s['tvm_runtime_mapped']}",
            f"run:   {run['wall_s']} s from spawn to exit, peak RSS {run['peak_rss_mb']} MB",
            "imports (agent order, runtime-only TVM):", "  | module | s | +RSS MB |", "  |---|---|---|"]
    for i in imp["lean"]["imports"]:
        flag = "" if i["ok"] is True else f" ({i['ok']})"
        rows.append(f"  | {i['module']}{flag} | {i['s']} | {i['rss_mb']} |")
    rows.append(f"  | total | {imp['lean']['total_s']} | {imp['lean']['total_rss_mb']} |")
    p = imp["plain_tvm"]
    rows.append(f"plain `import tvm` after the same: {p['s']} s, +{p['rss_mb']} MB (libtvm_compiler.so mapped: "
                f"{p['tvm_compiler_mapped']}, torch imported: {p['torch_imported']})")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--board", choices=("bookworm", "trixie"), help="measure on this emulated board instead")
    ap.add_argument("--seconds", type=float, default=30.0, help="serving time sampled for the steady state")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not a.bundle.is_file():
        sys.exit(f"bench-footprint: {a.bundle}: no such bundle (scripts/demo.sh writes out/efficientnet_lite0.hmod)")
    r = on_board(a.bundle, a.board, a.seconds) if a.board else here(a.bundle, a.seconds)
    print(json.dumps(r, indent=2) if a.json else table(r))


if __name__ == "__main__":
    main()
