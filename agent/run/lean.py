"""The agent's process carries TVM's runtime only: never libtvm_compiler.so, never torch.

apache-tvm's wheel ships ``libtvm_runtime.so`` (3.4 MB) beside ``libtvm_compiler.so`` (259 MB, LLVM
inside). A plain ``import tvm`` loads both, and ``tvm_ffi`` imports torch whenever torch is
installed (its DLPack interop): measured on the host, +490 MB RSS and 2.2 s with torch in the venv,
against +63 MB and 0.8 s for the runtime alone. The agent needs only ``tvm.runtime``
(``load_module``, ``vm.VirtualMachine``, tensors) and ``tvm_ffi.register_global_func``.

:func:`runtime_only` makes that so; the agent's entry points call it before anything imports tvm
(``tandoor-agent``: agent/cli.py; the health gate's child: agent/update/health.py). Library code
(agent/run/runtime.py...) does not call it: the host's tools (`tandoor verify`, `bench`, compile's
golden replay) run the same code in a process that needs the full compiler; they keep torch out
out of TVM with :func:`tvm_without_torch` (host/cli.py).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

# what the agent's process must never map or import (tests and scripts/bench-footprint.py check it)
COMPILER_LIB = "libtvm_compiler.so"
BLOCKED_MODULES = ("torch",)


class _Blocked(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` fail as if torch were not installed: for everyone, or (``importers``)
    only when a module of those packages asks for it."""

    def __init__(self, importers: tuple[str, ...] | None = None) -> None:
        self.importers = importers

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] not in BLOCKED_MODULES:
            return None
        if self.importers is None:
            raise ModuleNotFoundError(f"No module named {name!r} (the Tandoor agent does not import it)", name=name)
        f = sys._getframe(1)
        while f is not None:
            if str(f.f_globals.get("__name__", "")).split(".", 1)[0] in self.importers:
                raise ModuleNotFoundError(f"No module named {name!r} (hidden from TVM)", name=name)
            f = f.f_back
        return None


def _block(importers: tuple[str, ...] | None) -> None:
    if not any(isinstance(f, _Blocked) and f.importers in (None, importers) for f in sys.meta_path):
        sys.meta_path.insert(0, _Blocked(importers))


def runtime_only() -> bool:
    """Before the first ``import tvm``: load TVM's runtime library only and keep torch out.
    Returns False (and changes nothing) when tvm is already imported: that process chose already."""
    if "tvm" in sys.modules or "tvm_ffi" in sys.modules:
        return False
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"   # read by tvm/base.py when tvm is imported
    keep_torch_out()
    return True


def keep_torch_out() -> None:
    """``import torch`` fails in this process from now on (the agent's processes: nothing in them
    needs torch, and ``importlib.util.find_spec("torch")`` raising is fine there)."""
    _block(None)


def tvm_without_torch() -> None:
    """From now on TVM (tvm, tvm_ffi) cannot import torch; everything else can. TVM imports torch
    for its optional DLPack interop whenever torch is installed, which cost every host
    command that imports tvm 3.5 s (``import tvm, tvm.relax``: 6.5 s with torch, 3.0 s without, on
    this 2-core host); onnxruntime's quantization tools, which look for torch with ``find_spec``,
    must still find it (a block for everyone breaks them)."""
    _block(("tvm", "tvm_ffi"))


def mapped_libraries(pid: int | str = "self") -> set[str]:
    """File names of the shared objects a process maps (Linux /proc/PID/maps)."""
    out = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and ".so" in fields[5]:
                    out.add(os.path.basename(fields[5].strip()))
    except OSError:
        pass
    return out


def footprint_facts(pid: int | str = "self") -> dict:
    """What the lean set-up promises, as seen from outside the process: no compiler library, no
    torch library mapped."""
    libs = mapped_libraries(pid)
    return {"tvm_compiler_mapped": COMPILER_LIB in libs,
            "torch_mapped": any(lib.startswith(("libtorch", "libc10")) for lib in libs),
            "tvm_runtime_mapped": "libtvm_runtime.so" in libs}
