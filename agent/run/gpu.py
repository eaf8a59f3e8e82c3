"""The GPU part of a bundle on this device: can it run here, and on which SM's library.

A manifest target's ``gpu`` entry (contract/gpu.py) names one library per SM, the TVM side with its
kernels as cubins. :func:`probe` checks, in this order, what running one needs, and says the first
thing missing, as the NPU's executor does; the runtime then runs the CPU library and ``status``,
``run --json`` and ``verify`` say ``gpu: unavailable (<why>)``:

    switch         TANDOOR_GPU=0 turns the GPU off (a comparison, or a GPU that misbehaves)
    entry          the bundle's GPU part is a kind and version this agent reads
    the driver     libcuda.so.1 (NVIDIA's driver; JetPack on a Jetson) loads and cuInit succeeds
    the driver's   CUDA version at least the runtime's: TVM 0.27's libtvm_runtime_cuda.so links
      CUDA         libcudart.so.13, so the driver must serve CUDA 13 (JetPack 7.2 on Orin; JetPack 6
                   is CUDA 12.6 and would need a TVM runtime built for it)
    the SM         a device whose SM the bundle has cubins for
    the runtime    TVM's libtvm_runtime_cuda.so (in the apache-tvm wheel) and libcudart.so.13 load

Nothing here imports the compiler; the driver is asked through ctypes, without TVM.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandoor_contract import gpu as gpu_contract

DRIVER = "libcuda.so.1"
CUDART = "libcudart.so.13"
TVM_CUDA = "libtvm_runtime_cuda.so"
NEED_DRIVER = 13000         # cuDriverGetVersion's 1000 * major + 10 * minor the runtime needs
_CC_MAJOR, _CC_MINOR = 75, 76   # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR

#: tests point these elsewhere (a host without NVIDIA's driver has none of them anyway)
driver_names: tuple[str, ...] = (DRIVER,)


@dataclass(frozen=True)
class Found:
    sm: str | None      # the library to run, or None
    why: str            # why not (when sm is None), else what was found ("sm_87, driver CUDA 13.0")
    device: str = ""    # the GPU's name


def _driver() -> tuple[Any, str]:
    last = "not found"
    for name in driver_names:
        try:
            return ctypes.CDLL(name), ""
        except OSError as err:
            last = str(err).split(":")[-1].strip() or "not found"
    return None, f"no NVIDIA driver here: {DRIVER} {'not found' if 'No such file' in last else last}"


def _sm_of_device(cuda) -> tuple[str | None, int, str, str]:
    """(sm, driver version, name, why) of device 0 through the driver API."""
    if cuda.cuInit(0) != 0:
        return None, 0, "", "the NVIDIA driver's cuInit failed (no GPU visible to this process?)"
    version = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None, version.value, "", "the NVIDIA driver sees no GPU"
    dev = ctypes.c_int(0)
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)
    name = ctypes.create_string_buffer(256)
    cuda.cuDeviceGetName(name, 256, dev)
    return f"sm_{major.value}{minor.value}", version.value, name.value.decode(errors="replace"), ""


def _tvm_lib_dir() -> Path | None:
    spec = importlib.util.find_spec("tvm")
    return Path(spec.submodule_search_locations[0]) / "lib" if spec and spec.submodule_search_locations else None


def _cudart_candidates() -> list[str]:
    """libcudart.so.13 as the loader finds it, else from PyPI's nvidia-cuda-runtime wheel."""
    out = [CUDART]
    for base in sys.path:
        p = Path(base) / "nvidia" / "cu13" / "lib" / CUDART
        if p.is_file():
            out.append(str(p))
    return out


_RUNTIME_LOADED: str | None = None      # "" when loaded, else why not (loading is once per process)


def load_tvm_cuda() -> str:
    """Load TVM's CUDA runtime (it registers the loader of the libraries' CUDA modules); "" or why not."""
    global _RUNTIME_LOADED
    if _RUNTIME_LOADED is not None:
        return _RUNTIME_LOADED
    lib_dir = _tvm_lib_dir()
    path = lib_dir / TVM_CUDA if lib_dir else None
    if path is None or not path.is_file():
        _RUNTIME_LOADED = f"TVM's CUDA runtime {TVM_CUDA} is not installed (it comes with apache-tvm 0.27's wheel)"
        return _RUNTIME_LOADED
    import tvm  # noqa: F401  libtvm_runtime.so first, global: the CUDA runtime links against it

    why = ""
    for cudart in _cudart_candidates():
        try:
            ctypes.CDLL(cudart, mode=ctypes.RTLD_GLOBAL)
            why = ""
            break
        except OSError as err:
            why = f"{CUDART} not found ({str(err).split(':')[-1].strip()}): install the CUDA 13 runtime"
    if not why:
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            why = f"TVM's CUDA runtime does not load ({' '.join(str(err).split())[:200]})"
    _RUNTIME_LOADED = why
    return why


def probe(entry: Mapping[str, Any]) -> Found:
    """Which of ``entry``'s libraries this device runs (Found.sm), or why none (Found.why)."""
    if os.environ.get("TANDOOR_GPU", "1") == "0":
        return Found(None, "turned off (TANDOOR_GPU=0)")
    why = gpu_contract.readable(entry)
    if why:
        return Found(None, why)
    cuda, why = _driver()
    if cuda is None:
        return Found(None, why)
    try:
        sm, version, name, why = _sm_of_device(cuda)
    except (AttributeError, OSError) as err:
        return Found(None, f"the NVIDIA driver lacks the call {err}")
    if sm is None:
        return Found(None, why)
    if version < NEED_DRIVER:
        return Found(None, f"the driver serves CUDA {version // 1000}.{version % 1000 // 10}; the bundle's GPU part "
                           f"needs CUDA 13 (JetPack 7.2 on a Jetson)", name)
    libs = entry["libs"]
    if sm not in libs:
        return Found(None, f"the GPU {name} is {sm}; the bundle has cubins for {', '.join(sorted(libs))}", name)
    why = load_tvm_cuda()
    if why:
        return Found(None, why, name)
    return Found(sm, f"{sm}, driver CUDA {version // 1000}.{version % 1000 // 10}", name)
