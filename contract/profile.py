"""The profile file's contract: its version and the facts of the machine it was measured on.

A board measures its subgraphs with ``tandoor-agent profile`` (tandoor_agent.run.profile, which
writes the file); ``tandoor compile --profile`` reads it (tandoor_compiler.stages.profile) and refuses a
profile whose key does not match what it compiles. Both sides describe a machine the same way,
with the functions here.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

PROFILE_VERSION = 1


def board_model(root: str | Path = "/") -> str:
    """The device-tree model on ARM boards ("Radxa ROCK 5B"), else platform and CPU model name."""
    root = Path(root)
    try:
        text = (root / "proc/device-tree/model").read_bytes().rstrip(b"\0").decode(errors="replace").strip()
        if text:
            return text
    except OSError:
        pass
    cpu = ""
    try:
        for line in (root / "proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()} {cpu or platform.processor() or 'unknown cpu'}".strip()


def library_versions() -> dict:
    """tvm, onnxruntime and Arm NN as this machine has them (None when absent)."""
    out: dict = {}
    try:
        import tvm

        out["tvm"] = str(tvm.__version__)
    except Exception:
        out["tvm"] = None
    try:
        import onnxruntime

        out["onnxruntime"] = str(onnxruntime.__version__)
    except Exception:
        out["onnxruntime"] = None
    log = logging.getLogger("pyarmnn")
    level = log.level
    log.setLevel(logging.ERROR)      # pyarmnn warns once per parser it lacks
    try:
        import pyarmnn

        out["armnn"] = str(getattr(pyarmnn, "ARMNN_VERSION", "?"))
    except Exception:
        out["armnn"] = None
    finally:
        log.setLevel(level)
    return out
