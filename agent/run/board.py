"""Facts about the board the agent runs on, and the process set-up they call for.

    board_model()             the device-tree model ("Radxa ROCK 5B") or platform + CPU name
    configure_tvm_threads()   TVM's thread pool sized to this board's CPUs, before it starts
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
    far better (measured 3-5x less latency under load). Sets both unless the user did; must run
    before the first parallel TVM call. Returns the values in force."""
    if not os.environ.get("TVM_NUM_THREADS"):
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:
            n = os.cpu_count() or 1
        os.environ["TVM_NUM_THREADS"] = str(max(n, 1))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    # Idle workers sleep instead of spinning between kernels (as onnxruntime's executor is set up):
    # spinning ones took the cores from a preempted peer, PP-LCNet 8.5 -> 2.8 ms median at load 6
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    return {k: os.environ[k] for k in ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")}
