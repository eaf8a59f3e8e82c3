"""The GPU part's weights, stored where the bundle has their bytes already.

The GPU libraries are built from the model with nothing delegated (build.py), so their weights are
the CPU side's plus the ACL orders': stored again they doubled a Jetson bundle (yolov8n: 25.1 MB
against 12.9 MB without the GPU part). Each weight is instead a byte range of an order's weights blob
or of ``lib/params.bin`` when those bytes are there (a conv kernel in another axis order: with
``perm``), as a TVM fallback's weights are (pipeline._fallback_params); only the rest is written to
``gpu/lib_params.bin``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable

import numpy as np


def _le(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _known(members: dict, lib_params: list[dict]) -> dict[bytes, tuple[str, int]]:
    """sha256 of every weight the bundle stores -> (member, offset)."""
    known: dict[bytes, tuple[str, int]] = {}
    for name, data in members.items():
        blob = members.get(name[:-len(".json")] + ".bin")
        if not (name.startswith("orders/") and name.endswith(".json") and isinstance(blob, bytes)):
            continue
        for w in (json.loads(data).get("weights") or {}).values():
            off, n = int(w["offset"]), int(w["nbytes"])
            known.setdefault(_digest(blob[off:off + n]), (name[:-len(".json")] + ".bin", off))
    for spec in lib_params or ():
        blob, off = members[spec["member"]], int(spec["offset"])
        known.setdefault(_digest(blob[off:off + int(spec["nbytes"])]), (spec["member"], off))
    return known


def shared_params(values: list[np.ndarray], members: dict, lib_params: list[dict],
                  write_rest: Callable[[list[np.ndarray]], list[dict]]) -> list[dict]:
    """Parameter specs (hmod.param_arrays) for ``values``: ranges of members already in the bundle
    where their bytes are, the rest written by ``write_rest`` (a list of values -> their specs)."""
    known = _known(members, lib_params)
    out: list[dict | None] = []
    rest: list[tuple[int, np.ndarray]] = []
    for a in values:
        hit, spec = None, {"shape": list(a.shape), "dtype": str(a.dtype), "nbytes": a.nbytes}
        for perm in itertools.permutations(range(a.ndim)) if a.ndim in (2, 4) else [tuple(range(a.ndim))]:
            stored = a.transpose(perm)       # what the order may hold; reading it back takes the inverse
            hit = known.get(_digest(_le(stored)))
            if hit is not None:
                if list(perm) != sorted(perm):
                    spec.update(shape=list(stored.shape), perm=[int(i) for i in np.argsort(perm)])
                break
        if hit is None:
            rest.append((len(out), a))
            out.append(None)
        else:
            out.append({**spec, "member": hit[0], "offset": hit[1]})
    for (i, _), s in zip(rest, write_rest([a for _, a in rest]) if rest else []):
        out[i] = s
    return out   # type: ignore[return-value]
