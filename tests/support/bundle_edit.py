"""Edits of real bundles for tests: re-written through hmod.write_bundle, as the compiler writes
them, after a change to the manifest or members (a new version, a broken golden pair, a key)."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np

from tandoor_contract import hmod


def sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def members_of(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(manifest, {member: bytes}) of a bundle."""
    with zipfile.ZipFile(path) as z:
        man = json.loads(z.read(hmod.MANIFEST))
        return man, {n: z.read(n) for n in man["files"]}


def rewrite(src: Path, dst: Path, edit=None, key: Path | None = None) -> Path:
    """Re-write a real bundle after edit(manifest, members) changed what it wanted; signed with
    key if given."""
    man, members = members_of(src)
    man.pop("files")
    if edit is not None:
        edit(man, members)
    hmod.write_bundle(dst, man, members, private_key=key)
    return dst


def version(v: str):
    """An edit that sets the model's version."""
    def edit(man, members):
        man["model"]["version"] = v
    return edit


def shift_probe(member: str):
    """An edit that shifts the probe member's recorded values by one element (tandoor_contract.probe):
    what an Arm NN computing rows in the wrong place looks like to the load-time check."""
    def edit(man, members):
        from tandoor_contract import probe

        arrays = {"version": np.int64(1)}   # written back in version 1's form (stored indices)
        for j, (idx, values) in enumerate(probe.unpack(members[member])):
            arrays[f"i{j}"], arrays[f"v{j}"] = idx, np.roll(values, 1)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        members[member] = buf.getvalue()
    return edit


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def stderr_imports(stderr: str) -> tuple[set[str], list[str]]:
    """Split a PYTHONPROFILEIMPORTTIME=1 run's stderr: (top-level packages imported, other lines)."""
    imported, other = set(), []
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            imported.add(line.rsplit("|", 1)[-1].strip().split(".")[0])
        elif line.strip():
            other.append(line)
    return imported, other
