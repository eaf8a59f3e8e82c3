"""install-on-board.sh says what it found for the agent's GPU path on an NVIDIA Jetson (issue 43):
the L4T release and its JetPack, the CUDA runtimes, the driver, TVM's CUDA runtime in the venv, and
one verdict line. Each case is a fake board root in tmp_path with files in the formats JetPack
writes, read by the real script (`--print-gpu`, TANDOOR_BOARD_ROOT)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tandoor_agent.run import gpu as agent_gpu
from tandoor_compiler.targets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "board" / "install-on-board.sh"
VENV_SITE = "opt/tandoor/venv/lib/python3.12/site-packages"   # the script's default venv, under the root
# /etc/nv_tegra_release's first lines as L4T writes them (JetPack 6.2 is L4T 36.4.3)
TEGRA_RELEASE = {
    "jetpack6": "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
                "DATE: Wed Jan  8 01:49:37 UTC 2025\n# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n"
                "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n",
    "jetpack7": "# R38 (release), REVISION: 4.0, GCID: 42000000, BOARD: generic, EABI: aarch64, "
                "DATE: Mon Jan 12 00:00:00 UTC 2026\n# KERNEL_VARIANT: oot\nTARGET_USERSPACE_LIB_DIR=nvidia\n"
                "TARGET_USERSPACE_LIB_DIR_PATH=usr/lib/aarch64-linux-gnu/nvidia\n",
}
# an Orin Nano developer kit's device tree (NUL-separated, as the kernel exposes it)
ORIN_NANO_DT = b"nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0"


def _touch(root: Path, rel: str, data: bytes | str = b"") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)


def _jetson(root: Path, jetpack: str, cuda: str, *, driver: bool = True, tvm_cuda: bool = True) -> Path:
    """A Jetson Orin Nano's files: L4T's release, the device tree, CUDA `cuda` under /usr/local, the
    driver (L4T 36+ keeps it in .../nvidia), and the agent's venv with apache-tvm's package."""
    major = cuda.split(".")[0]
    _touch(root, "etc/nv_tegra_release", TEGRA_RELEASE[jetpack])
    _touch(root, "proc/device-tree/compatible", ORIN_NANO_DT)
    lib = f"usr/local/cuda-{cuda}/targets/aarch64-linux/lib"
    _touch(root, f"{lib}/libcudart.so.{major}")
    _touch(root, f"{lib}/libcudart.so.{cuda}.48")
    _touch(root, "usr/local/cuda/version.json",
           f'{{\n   "cuda" : {{\n      "name" : "CUDA SDK",\n      "version" : "{cuda}.48"\n   }},\n'
           f'   "cuda_cudart" : {{\n      "name" : "CUDA Runtime (cudart)",\n      "version" : "{cuda}.39"\n   }}\n}}\n')
    if driver:
        _touch(root, "usr/lib/aarch64-linux-gnu/nvidia/libcuda.so.1")
    _touch(root, f"{VENV_SITE}/apache_tvm-0.27.0.post1.dist-info/METADATA", "Name: apache-tvm\n")
    _touch(root, f"{VENV_SITE}/tvm/lib/libtvm_runtime.so")
    if tvm_cuda:
        _touch(root, f"{VENV_SITE}/tvm/lib/libtvm_runtime_cuda.so")
    return root


def _report(root: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "TANDOOR_VENV"}
    res = subprocess.run(["bash", str(SCRIPT), "--print-gpu"], capture_output=True, text=True, timeout=30,
                         env={**env, "TANDOOR_BOARD_ROOT": str(root)})
    assert res.returncode == 0 and res.stderr == "", (res.returncode, res.stderr)
    lines = res.stdout.splitlines()
    assert lines and all(ln.startswith("GPU: ") for ln in lines), res.stdout
    return lines


def _verdict(lines: list[str]) -> str:
    assert lines[-1].startswith("GPU: verdict: ") and sum("verdict" in ln for ln in lines) == 1, lines
    return lines[-1]


def test_a_complete_jetpack_7_orin_runs_the_gpu_part(tmp_path):
    lines = _report(_jetson(tmp_path, "jetpack7", "13.0"))
    assert lines[0] == ("GPU: NVIDIA Jetson Orin (device tree nvidia,tegra234, sm_87): L4T 38.4.0 "
                        "(/etc/nv_tegra_release), JetPack 7 (its driver serves CUDA 13)")
    assert "GPU: driver: /usr/lib/aarch64-linux-gnu/nvidia/libcuda.so.1" in lines
    assert ("GPU: CUDA runtime: libcudart.so.13 (/usr/local/cuda-13.0/targets/aarch64-linux/lib/libcudart.so.13); "
            "/usr/local/cuda/version.json: CUDA 13.0.48") in lines
    assert "GPU: TVM's CUDA runtime: libtvm_runtime_cuda.so in /opt/tandoor/venv (apache-tvm 0.27.0.post1)" in lines
    assert _verdict(lines).startswith("GPU: verdict: the agent runs the GPU part of bundles built with "
                                      "--target jetson-orin (sm_87)")


def test_jetpack_6_says_the_gpu_part_is_skipped_for_cuda_12(tmp_path):
    lines = _report(_jetson(tmp_path, "jetpack6", "12.6"))
    assert "L4T 36.4.3 (/etc/nv_tegra_release), JetPack 6 (its driver serves CUDA 12)" in lines[0]
    assert any(ln.startswith("GPU: CUDA runtime: libcudart.so.12 (") and ln.endswith("CUDA 12.6.48") for ln in lines)
    verdict = _verdict(lines)
    assert "skips bundles' GPU part and runs their CPU library" in verdict
    assert "JetPack 6's driver serves CUDA 12; TVM 0.27's CUDA runtime needs CUDA 13 and libcudart.so.13" in verdict
    assert "flash JetPack 7" in verdict and "docs/gpu.md" in verdict
    assert "libtvm_runtime_cuda.so" not in verdict     # the venv has it: only the true cause is named


def test_a_jetson_without_the_driver_library_says_so(tmp_path):
    lines = _report(_jetson(tmp_path, "jetpack7", "13.0", driver=False))
    assert any(ln.startswith("GPU: driver: libcuda.so.1 not found (in /usr/lib/aarch64-linux-gnu/nvidia ")
               for ln in lines), lines
    verdict = _verdict(lines)
    assert "skips bundles' GPU part" in verdict and "no NVIDIA driver libcuda.so.1" in verdict
    assert "CUDA 12" not in verdict


def test_a_jetpack_7_venv_without_tvms_cuda_runtime_and_pypis_cudart(tmp_path):
    """libcudart.so.13 from PyPI's nvidia-cuda-runtime in the venv counts (the agent loads it from
    there); a TVM package without libtvm_runtime_cuda.so is named with the fix."""
    root = _jetson(tmp_path, "jetpack7", "13.0", tvm_cuda=False)
    for p in (root / "usr/local").glob("cuda-13.0/targets/aarch64-linux/lib/libcudart.so*"):
        p.unlink()
    _touch(root, f"{VENV_SITE}/nvidia/cu13/lib/libcudart.so.13")
    lines = _report(root)
    assert any(f"libcudart.so.13 (/{VENV_SITE}/nvidia/cu13/lib/libcudart.so.13)" in ln for ln in lines), lines
    assert "GPU: TVM's CUDA runtime: libtvm_runtime_cuda.so not in /opt/tandoor/venv's tvm (apache-tvm 0.27.0.post1)" in lines
    verdict = _verdict(lines)
    assert "no libtvm_runtime_cuda.so: reinstall the agent" in verdict and "libcudart" not in verdict


def test_a_board_without_an_nvidia_gpu_says_one_line(tmp_path):
    _touch(tmp_path, "proc/device-tree/compatible", b"radxa,rock-5b\0rockchip,rk3588\0")
    _touch(tmp_path, f"{VENV_SITE}/tvm/lib/libtvm_runtime_cuda.so")   # the wheel has it everywhere
    assert _report(tmp_path) == ["GPU: no NVIDIA Jetson or driver found: bundles run their CPU library"]


def test_the_scripts_tables_agree_with_the_compiler_and_the_agent():
    """The SMs the script names a target for are the aarch64 targets' GPU SMs; the CUDA major it
    needs is the agent's (libcudart.so.13, a driver serving CUDA 13)."""
    text = SCRIPT.read_text()
    table = dict(re.findall(r"\[(sm_\d+)\]=([\w-]+)", re.search(r"GPU_TARGETS=\(([^)]*)\)", text).group(1)))
    assert table == {sm: p.name for p in PRESETS.values() if p.arch == "aarch64" for sm in p.gpu}
    need = int(re.search(r"^NEED_CUDA=(\d+)", text, re.M).group(1))
    assert agent_gpu.CUDART == f"libcudart.so.{need}" and agent_gpu.NEED_DRIVER // 1000 == need
