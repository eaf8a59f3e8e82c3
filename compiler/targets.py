"""Named compile targets. Presets set the CPU so LLVM schedules for the board's cores."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from .errors import CompileError

AARCH64_CC = "aarch64-linux-gnu-g++"


@dataclass(frozen=True)
class TargetPreset:
    name: str
    arch: str                  # as hmod.machine_arch() reports it on the device
    llvm: dict
    cross_cc: str | None
    about: str
    gpu: tuple[str, ...] = ()   # NVIDIA SMs the TVM side is also built for (compiler/backends/cuda)


_A64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}

PRESETS: dict[str, TargetPreset] = {
    "host": TargetPreset("host", "x86_64", {"kind": "llvm"}, None, "this x86_64 workstation (for verify)"),
    "aarch64": TargetPreset("aarch64", "aarch64", {**_A64, "mattr": ["+neon"]}, AARCH64_CC, "any ARMv8-A board"),
    "rk3588": TargetPreset("rk3588", "aarch64", {**_A64, "mcpu": "cortex-a76", "mattr": ["+neon"]}, AARCH64_CC,
                           "Rockchip RK3588 (4x Cortex-A76 + 4x A55, Mali-G610)"),
    "jetson-orin": TargetPreset("jetson-orin", "aarch64", {**_A64, "mcpu": "cortex-a78ae", "mattr": ["+neon"]}, AARCH64_CC,
                                "NVIDIA Jetson Orin (Cortex-A78AE; its GPU: sm_87 cubins)", gpu=("sm_87",)),
    "rpi5": TargetPreset("rpi5", "aarch64", {**_A64, "mcpu": "cortex-a76", "mattr": ["+neon"]}, AARCH64_CC,
                         "Raspberry Pi 5 (Cortex-A76)"),
    # a data-centre GPU to check the GPU part on (H100: sm_90); generic x86-64 for its CPU lib
    "cuda-sm90": TargetPreset("cuda-sm90", "x86_64", {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}, "g++",
                              "an x86_64 machine with an NVIDIA sm_90 GPU (H100), for GPU checks", gpu=("sm_90",)),
}


def resolve(names: list[str] | tuple[str, ...]) -> list[TargetPreset]:
    """Targets asked for, always with `host` so a bundle can be verified on the workstation."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        # On an ARM workstation the host lib is an aarch64 lib.
        PRESETS["host"] = TargetPreset("host", "aarch64", {"kind": "llvm"}, None, "this workstation")
    out: list[TargetPreset] = []
    for n in ["host", *names]:
        if n not in PRESETS:
            raise CompileError(f"unknown target '{n}'; choose from: {', '.join(PRESETS)}")
        p = PRESETS[n]
        if p not in out:
            out.append(p)
    for p in out:
        if p.cross_cc and not shutil.which(p.cross_cc):
            raise CompileError(
                f"target {p.name} needs the cross compiler {p.cross_cc}; install it with "
                "'apt-get install g++-aarch64-linux-gnu' (scripts/setup.sh does)"
            )
    return out
