"""A target's GPU part in the bundle: the TVM side compiled for CUDA, one library per SM.

A manifest target may carry ``gpu`` (additive: an agent that does not know it runs the target's
CPU ``lib`` as before, and the CPU lib always stays in the bundle as the fallback)::

    "gpu": {"version": 1, "kind": "cuda", "runtime": "cuda13",
            "libs": {"sm_87": "gpu/jetson-orin.sm_87.so.z"},     # member per SM (packed as lib is)
            "cubin_bytes": {"sm_87": 51656},                      # the kernels' size, for inspect
            "lib_params": [{"member": "gpu/lib_params.bin", ...}], # their weights (hmod.param_arrays)
            "orders": ["m_onnx_0"]}                               # the orders they call (the rest:
                                                                  # the CPU lib's, built only for it)

Each library is the whole TVM side (ACL's regions included: a Jetson's GPU outruns ACL on its CPU
cores; only onnxruntime orders are called out to), with its own weights (``lib_params``), its kernels
cubins for that SM, made on the workstation (never CUDA source, never PTX only: a device's runtime
cannot compile, and PTX from a newer NVRTC is refused by an older driver). An agent that cannot use
any of them says why (``gpu: unavailable (<why>)``) and runs ``lib``.

:func:`cubins` finds the kernels inside a library by their ELF headers (NVIDIA's machine 190) and
:func:`sm_of` reads the SM a cubin was made for: checks and ``tandoor inspect`` read the code itself,
not the manifest's word.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

#: the ``gpu`` entry's version an agent reads; a higher one is said unavailable, not guessed at
GPU_VERSION = 1
KIND = "cuda"
#: what the libraries need on the device: TVM 0.27's libtvm_runtime_cuda.so links libcudart.so.13
RUNTIME = "cuda13"
#: the GPU libraries' weights (their module is not the CPU lib's: ACL's regions run in it too), shared
#: by every GPU target as LIB_PARAMS is by the CPU libs; named by the entry's ``lib_params``
PARAMS = "gpu/lib_params.bin"
ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
_ELFOSABI_CUDA = (0x33, 0x41)   # the two OS/ABI bytes NVIDIA's cubins carry (old ABI, ABI version >= 8)


def member(target: str, sm: str, packed: bool) -> str:
    from .hmod import PACKED

    return f"gpu/{target}.{sm}.so{PACKED if packed else ''}"


def sm_of(cubin: bytes) -> str | None:
    """``sm_87`` for a cubin made for SM 8.7, else None (not a 64-bit little-endian CUDA ELF).

    The SM sits in e_flags: bits 0-7 before ELF ABI version 8, bits 8-15 from 8 on (CUDA 12.8's
    new ABI; NVRTC 13.5 writes 0x6005704 for sm_87, 0x6005a04 for sm_90)."""
    if len(cubin) < 52 or cubin[:4] != ELF_MAGIC or cubin[4] != 2 or cubin[5] != 1:
        return None
    (machine,) = struct.unpack_from("<H", cubin, 18)
    if machine != EM_CUDA:
        return None
    (flags,) = struct.unpack_from("<I", cubin, 48)
    sm = (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF
    return f"sm_{sm}" if sm else None


def _elf_size(data: bytes, at: int) -> int:
    """An embedded ELF64's size: the end of its section header table."""
    shoff, = struct.unpack_from("<Q", data, at + 40)
    shentsize, shnum = struct.unpack_from("<HH", data, at + 58)
    return shoff + shentsize * shnum


def cubins(lib: bytes) -> list[tuple[str, int]]:
    """(SM, size) of every cubin embedded in a library's bytes (its packed imports)."""
    out, at = [], lib.find(ELF_MAGIC, 1)
    while at >= 0:
        head = lib[at:at + 64]
        sm = sm_of(head) if len(head) == 64 else None
        if sm is not None:
            size = _elf_size(lib, at)
            out.append((sm, size))
            at = lib.find(ELF_MAGIC, at + max(size, 1))
        else:
            at = lib.find(ELF_MAGIC, at + 1)
    return out


def entry_of(target_entry: Mapping[str, Any]) -> dict | None:
    """A manifest target's ``gpu`` entry, or None."""
    g = target_entry.get("gpu") if isinstance(target_entry, Mapping) else None
    return dict(g) if isinstance(g, Mapping) else None


def readable(g: Mapping[str, Any]) -> str | None:
    """Why this agent cannot read the entry ``g`` (None: it can)."""
    if g.get("kind") != KIND:
        return f"the bundle's GPU part is {g.get('kind')!r}; this agent runs {KIND!r}"
    if not isinstance(g.get("version"), int) or g["version"] > GPU_VERSION:
        return f"the bundle's GPU part is version {g.get('version')}; this agent reads {GPU_VERSION}: update the agent"
    if not isinstance(g.get("libs"), Mapping) or not g["libs"]:
        return "the bundle's GPU part names no library"
    return None


def describe(g: Mapping[str, Any]) -> str:
    """One line for inspect: ``cuda sm_87 (51.7 KB of kernels)``."""
    sizes = g.get("cubin_bytes") or {}
    parts = [f"{sm} ({sizes[sm] / 1e3:.1f} KB of kernels)" if sm in sizes else sm for sm in sorted(g.get("libs") or {})]
    return f"{g.get('kind', '?')} {', '.join(parts)}, runtime {g.get('runtime', '?')}"
