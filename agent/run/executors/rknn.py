"""The rknn executor: an order of kind "rknn" (contract/orders.py) on the RK3588's NPU through
rknn-toolkit-lite2's ``RKNNLite`` (the board's Python API over ``librknnrt.so``).

At build it checks what the NPU needs and raises Unavailable with the reason on the first that
fails, so the runtime falls back to the order's ONNX rendering through onnxruntime (the order's
other runner) and ``status`` says ``npu: unavailable (<reason>)``:

    rknnlite       the rknn-toolkit-lite2 wheel (install-on-board.sh installs it on rk3588)
    librknnrt.so   the runtime library: not in any registry package; vendor board images carry it
                   (/usr/lib/librknnrt.so), else Rockchip's rknn-toolkit2 repository's
                   rknpu2/runtime/Linux/librknn_api/aarch64/librknnrt.so
    the NPU        the rknpu kernel driver (/sys/module/rknpu or /dev/dri/renderD129 ... )
    the version    librknnrt's major.minor must be the toolkit's that made the .rknn (the toolkit
                   writes models the matching runtime reads: "Invalid RKNN model version")

``runtime`` injects an RKNNLite-shaped object (load_rknn, init_runtime(core_mask=),
inference(inputs=, data_format=), get_sdk_version, release): on the host, the toolkit's simulator
(tandoor_compiler.backends.rknn.toolkit.Simulator) drives this same code in tests.
"""

from __future__ import annotations

import ctypes.util
import re
import time
from pathlib import Path

import numpy as np

RUNTIME_LIB = "librknnrt.so"
LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib")
NPU_MARKERS = ("/sys/module/rknpu", "/sys/kernel/debug/rknpu", "/proc/device-tree/npu@fdab0000")
CORES = (0, 1, 2)          # the RK3588's three NPU cores; a core mask has bit k for core k
WHERE = ("vendor board images carry it as /usr/lib/librknnrt.so; else copy rknpu2/runtime/Linux/librknn_api/"
         "aarch64/librknnrt.so from Rockchip's rknn-toolkit2 repository (the release matching the toolkit)")

# Tests point these at fake trees.
lib_dirs: tuple[str, ...] = LIB_DIRS
npu_markers: tuple[str, ...] = NPU_MARKERS


def _lib() -> str | None:
    for d in lib_dirs:
        p = Path(d) / RUNTIME_LIB
        if p.exists():
            return str(p)
    return ctypes.util.find_library("rknnrt") if lib_dirs == LIB_DIRS else None


def available() -> tuple[bool, str]:
    """(True, "") when RKNNLite, librknnrt.so and the NPU are all here, else (False, why)."""
    try:
        from rknnlite.api import RKNNLite  # noqa: F401
    except Exception as err:
        return False, f"rknn-toolkit-lite2 not importable ({type(err).__name__}: {err})"
    if _lib() is None:
        return False, f"{RUNTIME_LIB} not found ({WHERE})"
    if not any(Path(m).exists() for m in npu_markers):
        return False, "no NPU here (no rknpu driver: /sys/module/rknpu absent)"
    return True, ""


def core_mask(cores: tuple[int, ...] | list[int]) -> int:
    bad = [c for c in cores if c not in CORES]
    if bad or not cores:
        raise ValueError(f"NPU cores {list(cores)}: choose from {list(CORES)}")
    return sum(1 << c for c in set(cores))


def major_minor(text: str) -> tuple[int, int] | None:
    m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


class RknnExecutor:
    name = "rknn"

    def __init__(self, order: dict, rknn_bytes: bytes, workdir: Path, cores=CORES, runtime=None) -> None:
        from .errors import Unavailable

        facts = order.get("rknn") or {}
        if runtime is None:
            ok, why = available()
            if not ok:
                raise Unavailable(why)
            from rknnlite.api import RKNNLite

            runtime = RKNNLite(verbose=False)
        self.rt = runtime
        self.in_names = [i["name"] for i in order["inputs"]]
        self.in_ranks = [len(i["shape"]) for i in order["inputs"]]
        self.out_shapes = [tuple(int(d) for d in o["shape"]) for o in order["outputs"]]
        mask = core_mask(tuple(cores))
        path = Path(workdir) / f"{order.get('symbol', 'order')}.rknn"
        path.write_bytes(rknn_bytes)
        try:
            if self.rt.load_rknn(str(path)) != 0:
                raise Unavailable(f"RKNNLite cannot load the order's .rknn (made by toolkit "
                                  f"{facts.get('toolkit_version')})")
            if self.rt.init_runtime(core_mask=mask) != 0:
                raise Unavailable("RKNNLite's init_runtime failed (no NPU, or the driver refused the model)")
            have = str(self.rt.get_sdk_version() or "")
            want = str(facts.get("toolkit_version") or "")
            m = re.search(r"librknnrt version:\s*([\d.]+)", have)
            rt_version = m.group(1) if m else have
            if major_minor(rt_version) is None or major_minor(rt_version) != major_minor(want):
                raise Unavailable(f"librknnrt {rt_version or '(unknown)'} does not match the order's toolkit {want}")
        except BaseException:
            self.close()
            raise
        self.runtime_version = rt_version
        self.cores = tuple(sorted(set(cores)))
        self.backend = f"NPU cores {','.join(map(str, self.cores))} (librknnrt {rt_version})"
        self.last_run_ns = 0
        self.last_zero_copy = False

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        fmt = ["nchw" if r == 4 else "nhwc" for r in self.in_ranks]
        outs = self.rt.inference(inputs=[np.ascontiguousarray(a, np.float32) for a in inputs], data_format=fmt)
        if outs is None:
            raise RuntimeError("RKNNLite inference returned nothing")
        return [np.asarray(o, np.float32).reshape(s) for o, s in zip(outs, self.out_shapes)]

    def run_into(self, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> None:
        t0 = time.perf_counter_ns()
        results = self.run(inputs)
        self.last_run_ns = time.perf_counter_ns() - t0
        for dst, src in zip(outputs, results):
            np.copyto(dst, src.reshape(dst.shape))

    def close(self) -> None:
        rt, self.rt = getattr(self, "rt", None), None
        if rt is not None:
            try:
                rt.release()
            except Exception:
                pass
