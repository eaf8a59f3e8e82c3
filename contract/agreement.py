"""When does a bundle's output agree with onnxruntime's? One rule, read by the compile's self-check,
the device's health gate and `tandoor verify`, so that the three cannot disagree about a bundle.

The manifest's ``tolerance`` is the compiler's promise. Bundles before 2026-12 hold one pair for
every output (``{"atol": .., "rtol": ..}``); newer ones add, per output, the pair promised on each
path (the executors that ran the delegated orders: ``onnxruntime``, ``armnn``, ``tvm``, ``rknn``)
and why::

    "tolerance": {"atol": 0.004, "rtol": 0.001,          # the loosest: what old readers apply
                  "outputs": {"maps": {"atol": 0.004, "rtol": 0.001, "why": "...",
                                       "paths": {"tvm": {"atol": 0.004, "rtol": 0.001}}}}}

An element agrees when ``|got - want| <= atol + rtol * |want|`` and ``got`` is finite. An entry may
add ``outliers``, the fraction of an output's elements allowed past that (all finite): an INT8
output's elements sit on rounding edges, and a flip a few layers up moves a handful of them by many
steps (PP-OCRv4's text detector: 13 of 307200 sigmoid outputs 3-68 steps off on one golden pair,
onnxruntime's own fused and plain runs 6 of them), while a wrong bundle is wrong on most. Elements a
tie makes arbitrary (a TopK whose k-th score ties with the next, rows of tied scores taken in
another order, an ArgMax between equal values) are ``free``: the compiler lists them per golden
pair (its ``ties`` entry, flat indices per output) and they are only checked to be finite.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: the most of an output a manifest may excuse (``outliers``): what the agent's probe check allows
MAX_OUTLIERS = 1e-3
DEFAULT = {"atol": 1e-3, "rtol": 1e-3}   # fp32, as TVM's own ACL tests: every output of an old bundle
#: the executors the compile's self-check and `tandoor verify` run the delegated orders with: the
#: device's own choice, and the TVM fallback it takes where Arm NN refuses an order
CHECK_DELEGATES = ("auto", "tvm")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str = ""
    outliers: float = 0.0      # fraction of elements allowed past atol/rtol (finite): INT8 outputs

    def text(self) -> str:
        some = f", up to {self.outliers:.2%} of elements past it" if self.outliers else ""
        return f"atol {self.atol:.3g}, rtol {self.rtol:.3g}{some}" + (f": {self.why}" if self.why else "")


def tolerance(manifest_tolerance: Mapping | None, output: str, path: str) -> Tolerance:
    """What the manifest promises for ``output`` on ``path``: its own entry's path pair, else its
    entry, else the bundle-wide pair (an old bundle), else :data:`DEFAULT`."""
    t = dict(manifest_tolerance or {})
    top = {"atol": float(t.get("atol", DEFAULT["atol"])), "rtol": float(t.get("rtol", DEFAULT["rtol"]))}
    entry = (t.get("outputs") or {}).get(output)
    if not isinstance(entry, Mapping):
        return Tolerance(**top)
    keys = ("atol", "rtol", "outliers")
    pair = {**top, "outliers": 0.0, **{k: float(entry[k]) for k in keys if k in entry}}
    on_path = (entry.get("paths") or {}).get(path)
    if isinstance(on_path, Mapping):
        pair.update({k: float(on_path[k]) for k in keys if k in on_path})
    some = pair["outliers"] if pair["outliers"] > 0 else 0.0          # NaN (JSON reads it) excuses nothing
    return Tolerance(pair["atol"], pair["rtol"], str((on_path or {}).get("why") or entry.get("why") or ""),
                     min(some, MAX_OUTLIERS))


#: the paths in the order they decide a run's: the loosest promise first. An rknn order on the NPU
#: (INT8 or fp16) strays furthest from fp32; its promise is what the compiler measured in the
#: toolkit's simulator on real frames (the bundle's golden pairs are those frames).
PATHS = ("rknn", "tvm", "armnn", "onnxruntime")


def path_of(executors: Sequence[Mapping]) -> str:
    """The path a run took, from the module's ``describe()`` (one entry per delegated order): the
    first of :data:`PATHS` any order ran on; no delegated order at all is TVM alone."""
    used = {str(e.get("executor")) for e in executors}
    for name in PATHS:
        if name in used:
            return name
    return "tvm"


@dataclass
class Agreement:
    ok: bool
    max_abs_err: float = 0.0
    reason: str | None = None      # one line naming the output, the path and the tolerance missed
    free: int = 0                  # elements a tie makes arbitrary (not compared)
    past: int = 0                  # elements past the promise that its ``outliers`` excused


def compare_output(got, want: np.ndarray, tol: Tolerance, name: str, path: str,
                   free: np.ndarray | None = None) -> Agreement:
    """One output against its reference (see the module doc)."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.size != want.size:
        return Agreement(False, float("inf"), f"output {name} has shape {list(got.shape)}, the reference "
                                              f"{list(want.shape)}")
    g = got.reshape(-1).astype(np.float64)
    w = want.reshape(-1).astype(np.float64)
    if not np.all(np.isfinite(g) | ~np.isfinite(w)):
        return Agreement(False, float("inf"), f"output {name} has non-finite values on the {path} path")
    keep = np.ones(w.size, bool)
    if free is not None and len(free):
        keep[np.asarray(free, np.int64)] = False
    diff = np.where(keep, np.abs(g - w), 0.0)
    diff[~np.isfinite(diff)] = 0.0           # inf == inf where the reference has it
    worst = float(diff.max(initial=0.0))
    over = diff - (tol.atol + tol.rtol * np.abs(w))
    n_free = int(w.size - keep.sum())
    n_over = int(np.count_nonzero(over > 0))
    if n_over <= int(tol.outliers * int(keep.sum())):
        return Agreement(True, worst, None, n_free, n_over)
    i = int(np.argmax(over))
    ties = f"; {n_free} tied element(s) not compared" if n_free else ""
    many = f"{n_over} of {int(keep.sum())} elements past it, " if tol.outliers else ""
    return Agreement(False, worst, f"output {name} on the {path} path: max abs err {worst:.3g} exceeds its "
                                   f"tolerance ({tol.text()}; {many}element {i}: {g[i]:.6g} vs {w[i]:.6g}{ties})",
                     n_free)


def compare(outputs: Sequence, wants: Sequence[np.ndarray], manifest: Mapping, path: str,
            free: Mapping[str, Sequence[int]] | None = None) -> Agreement:
    """Every output of one run against the reference's, with the manifest's promise for each
    (its ``outputs`` give the names, its ``tolerance`` the pairs); the first miss is the reason."""
    if len(outputs) != len(wants):
        return Agreement(False, float("inf"), f"{len(outputs)} output(s), the reference has {len(wants)}")
    names = [str(o.get("name", j)) for j, o in enumerate(manifest.get("outputs") or ())]
    names += [str(j) for j in range(len(names), len(wants))]
    worst, n_free, n_past = 0.0, 0, 0
    for name, got, want in zip(names, outputs, wants):
        a = compare_output(got, want, tolerance(manifest.get("tolerance"), name, path), name, path,
                           None if free is None else free.get(name))
        worst, n_free, n_past = max(worst, a.max_abs_err), n_free + a.free, n_past + a.past
        if not a.ok:
            return Agreement(False, worst, a.reason, n_free)
    return Agreement(True, worst, None, n_free, n_past)


def golden_ties(bundle) -> list[dict[str, np.ndarray]]:
    """Per golden pair, {output name: flat indices a tie makes arbitrary} (the manifest's ``ties``
    members; none in a bundle made before them)."""
    out = []
    for g in bundle.manifest.get("golden") or ():
        ties = g.get("ties") or {}
        out.append({name: np.load(io.BytesIO(bundle.read(member)), allow_pickle=False).reshape(-1)
                    for name, member in ties.items()})
    return out
