"""Facts about the board the agent runs on, and the process set-up they call for.

    board_model()             the device-tree model ("Radxa ROCK 5B") or platform + CPU name
    configure_tvm_threads()   TVM's thread pool sized to this board's CPUs, before it starts
    ort_session_config()      onnxruntime's worker threads set to share the cores with TVM's
    DEFAULT_ARMNN_BACKENDS    the Arm NN backends an order asks for, best first
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tandoor_contract.profile import board_model  # noqa: F401  (one description of a machine)

DEFAULT_ARMNN_BACKENDS = ("CpuAcc", "GpuAcc", "CpuRef")
ACCELERATED_ARMNN = ("CpuAcc", "GpuAcc")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def configure_tvm_threads() -> dict:
    """TVM's runtime reads TVM_NUM_THREADS when its pool starts, and counts 1 on a 2-vCPU VM
    when unset; unbound threads (TVM_BIND_THREADS=0) survive other processes on the same cores
    far better (measured 3-5x less latency under load); idle workers spin or sleep by what else
    keeps the cores busy (:func:`spin_count`). Sets each unless the user did (or an earlier call
    did); must run before the first parallel TVM call. Returns the values in force."""
    if not os.environ.get("TVM_NUM_THREADS"):
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:
            n = os.cpu_count() or 1
        os.environ["TVM_NUM_THREADS"] = str(max(n, 1))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    global _busy_seen
    if "TVM_THREAD_POOL_SPIN_COUNT" not in os.environ:      # measured once per process
        _busy_seen = busy_elsewhere()
        os.environ["TVM_THREAD_POOL_SPIN_COUNT"] = spin_count(int(os.environ["TVM_NUM_THREADS"]), _busy_seen)
    return {**{k: os.environ[k] for k in ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")},
            **({"busy_elsewhere": round(_busy_seen, 2)} if _busy_seen is not None else {})}


_busy_seen: float | None = None     # what the spin decision saw, for benches to report


# Idle TVM workers spin between kernels when the cores are this process's, and sleep when other
# work already keeps them busy. Measured on 2 cores: quiet (load 0.7-1.0), spinning took PP-LCNet's
# TVM-only run 4.76 -> 2.73 ms and YOLOv8n's 17.2 -> 13.8 ms; at load 6 from other jobs, spinning
# workers stalled each other (PP-LCNet 8.5 ms vs 2.8 asleep). 50000 turns, not TVM's own 300000:
# a worker still spinning (yielding) when a delegated order starts takes a core from the order's
# runtime. open_nsfw's INT8 hybrid (2 onnxruntime orders) ran 11.9 ms at 300000 and 4.5-4.6 at
# 30000-50000 (asleep 6.2); Lite0's hybrid lost 4%, PP-LCNet, MobileNetV2 and ResNet-18 nothing
# (docs/benchmarks.md, "How long idle workers spin").
SPINNING, SLEEPING = "50000", "0"
BUSY_PER_THREAD = 0.5       # cores other work keeps busy, per TVM thread, from which the cores count as shared
# How long the decision watches the cores. Not the 1-minute load average: that still counts a
# process that just ended, so an agent restarted after itself (an update's swap, systemd's restart)
# or a bench after a bench took its own predecessor for other work and slept (EfficientNet-Lite0's
# hybrid 0.66-0.68x of fp32 instead of 0.62-0.65x). 0.1 s is 10 ticks of each core's clock.
BUSY_SAMPLE_S = 0.1


def busy_elsewhere(*, root: str | Path = "/proc", interval: float = BUSY_SAMPLE_S,
                   sleep: Callable[[float], None] = time.sleep) -> float | None:
    """Cores kept busy by other processes over ``interval`` seconds: the busy ticks of
    ``root``/stat less this process's own (``root``/self/stat), per core's elapsed ticks. None
    when they cannot be read (no /proc)."""
    root = Path(root)

    def ticks() -> tuple[int, int, int, int]:
        lines = (root / "stat").read_text().splitlines()
        f = [int(v) for v in lines[0].split()[1:9]]     # user nice system idle iowait irq softirq steal
        cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        own = (root / "self" / "stat").read_text().rsplit(")", 1)[1].split()   # after "pid (comm)"
        return sum(f) - f[3] - f[4], sum(f), max(cores, 1), int(own[11]) + int(own[12])   # busy, all, cores, utime+stime

    try:
        busy0, all0, cores, own0 = ticks()
        sleep(interval)
        busy1, all1, _, own1 = ticks()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = (all1 - all0) / cores         # ticks of one core's clock
    return max(busy1 - busy0 - (own1 - own0), 0) / elapsed if elapsed > 0 else 0.0


def spin_count(threads: int, busy: float | None = None) -> str:
    """TVM_THREAD_POOL_SPIN_COUNT for a pool of ``threads`` when other work keeps ``busy`` cores
    busy (default: :func:`busy_elsewhere` now, else the 1-minute load average)."""
    if busy is None:
        busy = busy_elsewhere()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except OSError:      # neither (some containers): the cores are taken to be ours
            busy = 0.0
    return SLEEPING if busy >= BUSY_PER_THREAD * max(threads, 1) else SPINNING


# onnxruntime's session entries by TVM's spin decision above. Spinning inside a run is most of
# onnxruntime's speed on a VM whose thread wake-ups are slow; spinning *between* runs is what fought
# TVM's pool (docs/benchmarks.md, agent overhead), and session.force_spinning_stop ends it the moment
# a run returns. Measured on 2 vCPUs at load 1.5 (EfficientNet-Lite0 bundles, delegate onnxruntime,
# docs/benchmarks.md "onnxruntime's threads in the hybrid"): fp32 (1 order) 5.36-5.61 -> 4.38-4.60 ms,
# INT8 (11 orders between TVM's adds) 4.44-4.59 -> 3.62-3.82 ms against no spinning at all.
ORT_SPIN = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
ORT_SLEEP = {"session.intra_op.allow_spinning": "0"}


def ort_session_config() -> dict[str, str]:
    """The session config entries for an onnxruntime session that shares this process's cores with
    TVM: its workers spin within a run when TVM's idle workers spin (the cores are this process's,
    :func:`spin_count`) and sleep when TVM's sleep."""
    spin = configure_tvm_threads()["TVM_THREAD_POOL_SPIN_COUNT"]
    return dict(ORT_SLEEP if spin.strip() in ("", "0") else ORT_SPIN)
