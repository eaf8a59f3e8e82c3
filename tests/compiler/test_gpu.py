"""The GPU part (compiler/backends/cuda): --target jetson-orin and cuda-sm90 build the TVM side as
one library per SM whose kernels are cubins made here without a GPU (no CUDA source, no PTX), and
inspect reads them back from the code."""

from __future__ import annotations

import json
import struct

import pytest

from support.cli import run_cli
from support.gpu import gpu_bundle
from tandoor_contract import gpu, hmod


@pytest.fixture(scope="module")
def bundle(bundles_dir):
    return gpu_bundle(bundles_dir)[0]


@pytest.mark.parametrize("target, sm", [("jetson-orin", 87), ("cuda-sm90", 90)])
def test_each_gpu_target_carries_cubins_for_its_sm_and_no_cuda_source_or_ptx(bundle, target, sm):
    with hmod.open_bundle(bundle) as b:
        entry = b.manifest["targets"][target]
        assert entry["gpu"]["libs"] == {f"sm_{sm}": f"gpu/{target}.sm_{sm}.so.z"}
        assert entry["gpu"]["orders"] == []    # ACL's regions run inside it: no order is called out to
        lib = b.library(entry["gpu"]["libs"][f"sm_{sm}"])
        assert b.library(entry["lib"])[:4] == gpu.ELF_MAGIC     # the CPU lib stays: the fallback
    at = lib.find(gpu.ELF_MAGIC, 1)
    while struct.unpack_from("<H", lib, at + 18)[0] != gpu.EM_CUDA:
        at = lib.find(gpu.ELF_MAGIC, at + 1)
    # the header itself: NVIDIA's machine (190), ELF ABI version 8, the SM in e_flags bits 8-15
    assert lib[at + 8] >= 8 and (struct.unpack_from("<I", lib, at + 48)[0] >> 8) & 0xFF == sm
    assert gpu.cubins(lib) == [(f"sm_{sm}", entry["gpu"]["cubin_bytes"][f"sm_{sm}"])]
    for text in (b"__global__", b'extern "C"', b".target sm_", b".version "):    # no source, no PTX
        assert text not in lib


def test_sm_of_reads_the_sm_from_either_elf_abi():
    def header(abi: int, flags: int, machine: int = gpu.EM_CUDA) -> bytes:
        h = bytearray(64)
        h[:4], h[4], h[5], h[7], h[8] = gpu.ELF_MAGIC, 2, 1, 0x41, abi
        struct.pack_into("<H", h, 18, machine)
        struct.pack_into("<I", h, 48, flags)
        return bytes(h)

    assert gpu.sm_of(header(8, 0x6005704)) == "sm_87"      # NVRTC 13.5's, as measured
    assert gpu.sm_of(header(8, 0x6005A04)) == "sm_90"
    assert gpu.sm_of(header(7, 0x570057)) == "sm_87"       # before ABI 8: the SM in bits 0-7
    assert gpu.sm_of(header(8, 0x6005704, machine=62)) is None   # an x86-64 ELF


def test_inspect_shows_each_gpu_part_from_its_cubins(bundle):
    info = json.loads(run_cli("tandoor", "inspect", str(bundle), "--json", check=True).stdout)
    part = info["targets"]["jetson-orin"]["gpu"]
    assert part["kind"] == "cuda" and part["runtime"] == gpu.RUNTIME
    assert part["libs"]["sm_87"]["cubins"] == ["sm_87"] and part["libs"]["sm_87"]["kernel_bytes"] > 0
    assert "gpu" not in info["targets"]["host"]
    text = run_cli("tandoor", "inspect", str(bundle), check=True).stdout
    assert "gpu (jetson-orin): cuda sm_87 (sm_87:" in " ".join(text.split())
    sizes = json.loads(run_cli("tandoor", "inspect", str(bundle), "--sizes", "--json", check=True).stdout)
    assert {k["kind"]: k["members"] for k in sizes["kinds"]}["GPU libraries"] == 2     # sm_87 and sm_90


def test_the_gpu_checks_compile_half_passes_here_on_both_sms(bundles_dir):
    """scripts/gpu_check.py check: what scripts/gpu-check.sh prepare checks of every bundle it stages
    (cubins by their ELF headers, the CPU fallback within promise against onnxruntime, its reason)."""
    import subprocess
    import sys

    from support.cli import ROOT

    bundle, model = gpu_bundle(bundles_dir)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "check", str(bundle), str(model)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(facts["cubins"]) == ["cuda-sm90/sm_90", "jetson-orin/sm_87"]
    assert facts["gpu"] == "unavailable (no NVIDIA driver here: libcuda.so.1 not found)"


def test_the_gpu_parts_weights_are_the_models_read_from_bytes_the_bundle_had_already(bundle, bundles_dir):
    """The GPU libraries take the whole model (ACL's regions too), so their weights are the orders':
    byte ranges of the orders' blobs (the dense kernel transposed), not a second copy."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(gpu_bundle(bundles_dir)[1]))
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    with hmod.open_bundle(bundle) as b:
        specs = b.manifest["targets"]["jetson-orin"]["gpu"]["lib_params"]
        arrays = hmod.param_arrays(b.read, specs)
        assert gpu.PARAMS not in b.manifest["files"]
    assert all(s["member"].startswith("orders/") for s in specs) and any(s.get("perm") for s in specs)
    got = {a.shape: a for a in arrays}
    # the conv kernel as the NHWC pass lays it out for the TVM side (OHWI), the dense kernel as given
    np.testing.assert_array_equal(got[(8, 3, 3, 3)], init["w"].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(got[(8, 5)], init["m"])
