"""The agent's process carries TVM's runtime only: never libtvm_compiler.so, never torch.

apache-tvm's wheel ships ``libtvm_runtime.so`` (3.4 MB) beside ``libtvm_compiler.so`` (259 MB, LLVM
inside). A plain ``import tvm`` loads both, and ``tvm_ffi`` imports torch whenever torch is
installed (its DLPack interop): measured on the host, +490 MB RSS and 2.2 s with torch in the venv,
against +63 MB and 0.8 s for the runtime alone. The agent needs only ``tvm.runtime``
(``load_module``, ``vm.VirtualMachine``, tensors) and ``tvm_ffi.register_global_func``.

:func:`runtime_only` makes that so; the agent's entry points call it before anything imports tvm
(``tandoor-agent``: agent/cli.py; the health gate's child: agent/update/health.py). Library code
(agent/run/runtime.py...) does not call it: the host's tools (`tandoor verify`, `bench`, compile's
golden replay) run the same code in a process that needs the full compiler.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

# what the agent's process must never map or import (tests and scripts/bench-footprint.py check it)
COMPILER_LIB = "libtvm_compiler.so"
BLOCKED_MODULES = ("torch",)


class _Blocked(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` fail as if torch were not installed (tvm_ffi then skips it)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in BLOCKED_MODULES:
            raise ModuleNotFoundError(f"No module named {name!r} (the Tandoor agent does not import it)", name=name)
        return None


def runtime_only() -> bool:
    """Before the first ``import tvm``: load TVM's runtime library only and keep torch out.
    Returns False (and changes nothing) when tvm is already imported: that process chose already."""
    if "tvm" in sys.modules or "tvm_ffi" in sys.modules:
        return False
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"   # read by tvm/base.py when tvm is imported
    if not any(isinstance(f, _Blocked) for f in sys.meta_path):
        sys.meta_path.insert(0, _Blocked())
    return True


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
