"""Profiles on the compiler side: check one against the model being compiled, then hand its
measured numbers to the cost policy (compiler/stages/cost.py). Measuring lives in tandoor_agent.run.profile
so that a board without the compiler can run it.

A stale profile silently used is a classic failure (a tuning cache from another model, shape or
library version), so a key that does not match is refused, naming what differs:

* model    the profile's bundle was compiled from another ONNX file (source sha256)
* shapes   other input shapes
* tvm      measured with another TVM: the TVM side's code (and so its times) differ
* onnxruntime / armnn   when the profile was measured on this very machine, its libraries must
           still be the ones installed here (a board's versions cannot be checked from the host;
           the manifest records them for the device to compare)
* subgraph a subgraph of the same name holds other ops (the ACL table or the passes changed)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tandoor_contract import profile as facts

from ..errors import CompileError

VM_CALLBACK_US = 0.7     # call_dps_packed into an empty Python function (notes/tvm-0.27-byoc.md)


class ProfileMismatch(CompileError):
    """The profile's key does not match what is being compiled. exit 2, one line."""


@dataclass
class Measured:
    path: Path
    data: dict
    sha256: str
    # the NPU gave regions back (npu.apply_profile): the partitions are numbered anew, so a symbol
    # holding other ops than the profile's is another region, decided by the estimate
    renumbered: bool = False

    @property
    def key(self) -> dict:
        return self.data["key"]

    @property
    def arch(self) -> str:
        return self.key.get("arch") or "aarch64"

    @property
    def model_tvm_us(self) -> float | None:
        """The whole model on TVM as measured: the hybrid module's TVM side plus every profiled
        subgraph's TVM fallback."""
        side = (self.data.get("model") or {}).get("tvm_side_us")
        subs = [s.get("tvm_us") for s in self.data["subgraphs"].values()]
        if side is None or any(t is None for t in subs):
            return None
        return float(side) + float(sum(subs))

    def subgraph(self, p) -> dict | None:
        """Measured numbers for partition p, or None when the profile does not have it."""
        s = self.data["subgraphs"].get(p.symbol)
        if s is None:
            return None
        ops = [o.removeprefix("relax.") for o in p.ops]
        if list(s.get("ops", [])) != ops and self.renumbered:
            return None
        if list(s.get("ops", [])) != ops:
            raise ProfileMismatch(
                f"profile {self.path.name} does not match: subgraph {p.symbol} holds {_ops(s.get('ops', []))} "
                f"there but {_ops(ops)} here; profile a bundle compiled by this compiler")
        # the profile's bridge starts at the dlpack views; the VM's call into Python comes on top
        bridge = {e: float(v) + VM_CALLBACK_US for e, v in (s.get("bridge_us") or {}).items()}
        return {"tvm_us": s.get("tvm_us"), "exec_us": dict(s.get("exec_us") or {}), "bridge_us": bridge}

    def manifest_entry(self) -> dict:
        k = self.key
        return {"sha256": self.sha256, "board": k.get("board"), "arch": k.get("arch"),
                "bundle_sha256": k.get("bundle_sha256"), "libraries": k.get("libraries"),
                "created": self.data.get("created")}


def _ops(ops) -> str:
    from collections import Counter

    c = Counter(ops)
    return f"{len(ops)} ops (" + ", ".join(f"{k} x{v}" for k, v in c.most_common(3)) + ")"


def _fmt_shapes(inputs) -> str:
    return ", ".join(f"{i['name']}={'x'.join(str(d) for d in i['shape'])}" for i in inputs)


def read(path: str | Path) -> Measured:
    path = Path(path)
    if not path.is_file():
        raise CompileError(f"--profile {path}: no such file; make one with 'tandoor profile BUNDLE -o {path.name}'")
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except ValueError:
        raise CompileError(f"--profile {path}: not a JSON profile (tandoor profile writes them)") from None
    if not isinstance(data, dict) or not isinstance(data.get("key"), dict) or not isinstance(data.get("subgraphs"), dict):
        raise CompileError(f"--profile {path}: not a tandoor profile (no key or subgraphs)")
    if data.get("profile_version") != facts.PROFILE_VERSION:
        raise CompileError(f"--profile {path}: profile version {data.get('profile_version')} is not "
                           f"{facts.PROFILE_VERSION}; measure it again with this tandoor")
    return Measured(path, data, hashlib.sha256(raw).hexdigest())


def check_key(measured: Measured, source_sha256: str, inputs: list[dict], tvm_version: str,
              here: dict | None = None) -> None:
    """Raise ProfileMismatch naming the first difference between the profile's key and this compile."""
    k = measured.key
    name = measured.path.name
    if k.get("source_sha256") != source_sha256:
        raise ProfileMismatch(
            f"profile {name} does not match: model differs (profiled a bundle of {k.get('model')!r}, source sha256 "
            f"{str(k.get('source_sha256'))[:12]}..., this model's is {source_sha256[:12]}...)")
    theirs = [{"name": i["name"], "shape": list(i["shape"]), "dtype": i.get("dtype", "float32")} for i in k.get("inputs", [])]
    ours = [{"name": i["name"], "shape": list(i["shape"]), "dtype": i.get("dtype", "float32")} for i in inputs]
    if theirs != ours:
        raise ProfileMismatch(f"profile {name} does not match: input shapes differ (profile {_fmt_shapes(theirs)}, "
                              f"this compile {_fmt_shapes(ours)})")
    libs = k.get("libraries") or {}
    if libs.get("tvm") != tvm_version:
        raise ProfileMismatch(f"profile {name} does not match: library tvm differs (profile {libs.get('tvm')}, "
                              f"this compiler {tvm_version})")
    here = here if here is not None else {"board": facts.board_model(), "libraries": facts.library_versions()}
    if k.get("board") == here["board"]:
        for lib in ("onnxruntime", "armnn"):
            if libs.get(lib) != here["libraries"].get(lib):
                raise ProfileMismatch(
                    f"profile {name} does not match: library {lib} differs (profile {libs.get(lib)}, "
                    f"installed here {here['libraries'].get(lib)}) on the same board {here['board']!r}")


def load_for_compile(path: str | Path, model, arch: str) -> Measured:
    """Read the profile and check its key against the loaded model (frontend.LoadedModel)."""
    import tvm

    m = read(path)
    check_key(m, model.sha256, [i.as_dict() for i in model.inputs], str(tvm.__version__))
    return m
