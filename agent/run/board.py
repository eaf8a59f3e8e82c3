"""Facts about the board the agent runs on, and the process set-up they call for.

    board_model()             the device-tree model ("Radxa ROCK 5B") or platform + CPU name
    configure_tvm_threads()   TVM's thread pool sized to this board's CPUs, before it starts
    ort_session_config()      onnxruntime's worker threads set to share the cores with TVM's
    DEFAULT_ARMNN_BACKENDS    the Arm NN backends an order asks for, best first
"""

from __future__ import annotations

import os

from tandoor_contract.profile import board_model  # noqa: F401  (one description of a machine)

DEFAULT_ARMNN_BACKENDS = ("CpuAcc", "GpuAcc", "CpuRef")
ACCELERATED_ARMNN = ("CpuAcc", "GpuAcc")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def configure_tvm_threads() -> dict:
    """TVM's runtime reads TVM_NUM_THREADS when its pool starts, and counts 1 on a 2-vCPU VM
    when unset; unbound threads (TVM_BIND_THREADS=0) survive other processes on the same cores
    far better (measured 3-5x less latency under load); idle workers spin or sleep by the load
    (:func:`spin_count`). Sets each unless the user did; must run before the first parallel TVM
    call. Returns the values in force."""
    if not os.environ.get("TVM_NUM_THREADS"):
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:
            n = os.cpu_count() or 1
        os.environ["TVM_NUM_THREADS"] = str(max(n, 1))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", spin_count(int(os.environ["TVM_NUM_THREADS"])))
    return {k: os.environ[k] for k in ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")}


# Idle TVM workers spin between kernels (TVM's own default, 300000 turns) when the cores are this
# process's, and sleep when other work already keeps them busy. Measured on 2 cores: quiet
# (load 0.7-1.0), spinning took PP-LCNet's TVM-only run 4.76 -> 2.73 ms and YOLOv8n's 17.2 -> 13.8 ms;
# at load 6 from other jobs, spinning workers stalled each other (PP-LCNet 8.5 ms vs 2.8 asleep).
SPINNING, SLEEPING = "300000", "0"
BUSY_LOAD_PER_THREAD = 0.5      # 1-minute load average per TVM thread from which the cores count as shared


def spin_count(threads: int, load: float | None = None) -> str:
    """TVM_THREAD_POOL_SPIN_COUNT for a pool of ``threads`` when the load average (default: this
    machine's now) is ``load``."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:      # no load average (some containers): the cores are taken to be ours
            load = 0.0
    return SLEEPING if load >= BUSY_LOAD_PER_THREAD * max(threads, 1) else SPINNING


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
