"""The health gate: is a candidate bundle fit to serve? Run before a trial slot is committed.

A bundle is healthy when it
1. opens and verifies (signature against the trusted keys, hashes, format, a lib for here),
2. loads (every order gets an executor, the lib loads),
3. reproduces its golden outputs within the manifest's tolerance for each output on the path it
   ran (tandoor_contract.agreement: the rule the compile's check and `tandoor verify` apply),
4. runs N frames (golden and seeded random inputs) with no exception and no non-finite output,
5. has a p95 latency over those frames within the budget (when one is given), and a p99 within
   its own budget (when one is given: a camera pipeline is judged by its worst frames; there is
   no default p99 budget, as over the default 20 frames the p99 is nearly the slowest frame, and
   a multiple of the p95 budget would roll a model back for one stall of a loaded board).

The first failing check gives ``reason`` as one line, e.g. ``golden self-test failed: pair 0: output
logits on the onnxruntime path: max abs err 0.31 exceeds its tolerance (atol 0.001, rtol 0.001;
...)``, ``p95 latency 52.1 ms over budget 40 ms`` or ``p99 latency 90.3 ms over budget 60 ms``.

:func:`health_check` runs in this process. A native library can crash or hang the process that
loads a bad model, so the gate uses :func:`health_check_isolated`, which runs
``python -m tandoor_agent.update.health BUNDLE --json`` in a child process with a timeout (a crash or a
timeout is a failed check with the signal or the time in the reason; the update job sizes the
timeout from measured load times, update/deadlines.py). :func:`gate` runs the check on the trial slot of a :class:`~tandoor_agent.update.slots.SlotStore` and commits or rolls it back.

CLI exit codes: 0 healthy, 4 unhealthy (the report says why), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandoor_contract import agreement, durable, hmod, probe
from .. import failpoints
from ..run import executors

DEFAULT_FRAMES = 20
DEFAULT_TIMEOUT_S = 300.0
EXIT_UNHEALTHY = 4
_RUNNING: set[subprocess.Popen] = set()  # isolated checks in progress (stop_running ends them)
_ENDED: set[int] = set()                 # pids stop_running killed


class CheckStopped(Exception):
    """The check was ended because the agent is stopping: no verdict on the model."""


@dataclass
class HealthReport:
    ok: bool
    reason: str | None = None             # the first failed check, one line; None when ok
    golden_max_abs_err: float | None = None
    golden_ok: bool | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0                        # frames that raised or gave non-finite outputs
    frames: int = 0                        # frames run (after the golden self-test)
    median_ms: float | None = None
    golden_pairs: int = 0
    path: str | None = None                # the executors the golden pairs ran on (agreement.path_of)
    atol: float | None = None
    rtol: float | None = None
    latency_budget_ms: float | None = None  # the p95 budget
    p99_budget_ms: float | None = None
    first_error: str | None = None
    executors: list[dict[str, Any]] = field(default_factory=list)
    model: dict[str, Any] | None = None
    seconds: float = 0.0
    load_s: float | None = None           # opening the bundle and building the model (the swap's deadline is sized from it)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HealthReport:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def summary(self) -> str:
        if not self.ok:
            return f"unhealthy: {self.reason}"
        bits = [f"golden max abs err {self.golden_max_abs_err:.3g}"]
        if self.p95_ms is not None:
            bits.append(f"p95 {self.p95_ms:.2f} ms" + (f", p99 {self.p99_ms:.2f} ms" if self.p99_ms is not None else "")
                        + f" over {self.frames} frames")
        return "healthy: " + ", ".join(bits)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def _random_like(rng: np.random.Generator, a: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.floating):
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 1.0)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo == hi:
            lo, hi = -1.0, 1.0
        return rng.uniform(lo, hi, a.shape).astype(a.dtype)
    if np.issubdtype(a.dtype, np.integer):
        info = np.iinfo(a.dtype)
        lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 1)
        return rng.integers(max(lo, info.min), min(hi, info.max) + 1, a.shape, dtype=a.dtype)
    return a.copy()


def _inputs_from_manifest(manifest: dict[str, Any], rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for spec in manifest.get("inputs") or ():
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec.get("shape") or ()]
        out.append(probe.random_input(rng, {"shape": shape, "dtype": spec.get("dtype", "float32")}, -1.0, 1.0))
    return out


def health_check(bundle_path: str | os.PathLike, trusted_keys: Iterable[hmod.KeySource] = (),
                 delegate: str = "auto", latency_budget_ms: float | None = None,
                 frames: int = DEFAULT_FRAMES, make_module: Callable[..., Any] | None = None,
                 seed: int = 0, p99_budget_ms: float | None = None) -> HealthReport:
    """Check a bundle in this process (see the module doc). Never raises for a bad bundle or
    model: every failure is a report with ok=False and the reason."""
    t_start = time.perf_counter()
    rep = HealthReport(ok=False, latency_budget_ms=latency_budget_ms, p99_budget_ms=p99_budget_ms)

    def done(reason: str | None) -> HealthReport:
        rep.ok = reason is None
        rep.reason = reason
        rep.seconds = round(time.perf_counter() - t_start, 3)
        return rep

    try:
        bundle = hmod.open_bundle(bundle_path, trusted_keys)
    except hmod.BundleError as e:
        return done(f"bundle refused: {e}")
    module = None
    try:
        m = bundle.manifest
        rep.model = {"name": (m.get("model") or {}).get("name"), "version": (m.get("model") or {}).get("version")}
        try:
            bundle.lib_for()
        except hmod.BundleError as e:
            return done(f"bundle refused: {e}")
        top = agreement.tolerance(m.get("tolerance"), "", "")   # the bundle-wide pair, for the report
        rep.atol, rep.rtol = top.atol, top.rtol
        try:
            golden = bundle.golden()
            ties = agreement.golden_ties(bundle)
        except (hmod.BundleError, ValueError, OSError) as e:
            return done(f"golden self-test failed: cannot read the golden pairs ({_one_line(e)})")
        rep.golden_pairs = len(golden)
        if not golden:
            return done("golden self-test failed: the bundle has no golden pairs to test with")

        failpoints.hit("health-load", lambda: durable.sha256_file(bundle_path))
        if make_module is None:
            from ..run.runtime import HybridModule as make_module
        try:
            module = make_module(bundle, delegate=delegate)
        except Exception as e:
            return done(f"cannot load the model: {_one_line(e)}")
        rep.load_s = round(time.perf_counter() - t_start, 3)
        describe = getattr(module, "describe", None)

        # -- golden self-test: the contract's comparison, with the promise for the path this run took
        path = agreement.path_of(describe() if callable(describe) else [])
        rep.path = path
        worst = 0.0
        problem = None
        for k, (ins, wants) in enumerate(golden):
            try:
                outs = module.run(ins)
            except Exception as e:
                problem = f"golden self-test failed: pair {k} raised: {_one_line(e)}"
                break
            verdict = agreement.compare(outs, wants, m, path, ties[k] if k < len(ties) else None)
            if math.isfinite(verdict.max_abs_err):    # a shape or non-finite miss has no number (JSON has no inf)
                worst = max(worst, verdict.max_abs_err)
            if not verdict.ok:
                problem = f"golden self-test failed: pair {k}: {verdict.reason}"
                break
        rep.golden_max_abs_err = worst
        rep.golden_ok = problem is None
        if problem:
            return done(problem)

        # -- N frames: golden inputs and seeded random inputs alternately
        rng = np.random.default_rng(seed)
        base = golden[0][0] if golden[0][0] else _inputs_from_manifest(m, rng)
        times: list[float] = []
        clock = time.perf_counter
        for i in range(max(0, int(frames))):
            ins = golden[(i // 2) % len(golden)][0] if i % 2 == 0 else [_random_like(rng, a) for a in base]
            t0 = clock()
            try:
                outs = module.run(ins)
            except Exception as e:
                rep.errors += 1
                rep.first_error = rep.first_error or f"frame {i}: {_one_line(e)}"
                continue
            finally:
                rep.frames += 1
            dt = (clock() - t0) * 1e3
            if not all(np.all(np.isfinite(np.asarray(o))) for o in outs
                       if np.issubdtype(np.asarray(o).dtype, np.inexact)):
                rep.errors += 1
                rep.first_error = rep.first_error or f"frame {i}: non-finite output"
                continue
            times.append(dt)
        if times:
            rep.p95_ms = round(float(np.percentile(times, 95)), 4)
            rep.p99_ms = round(float(np.percentile(times, 99)), 4)
            rep.median_ms = round(float(np.median(times)), 4)
        if callable(describe):
            try:
                rep.executors = describe()
            except Exception:
                pass
        if rep.errors:
            return done(f"{rep.errors} of {rep.frames} inference(s) failed (first: {rep.first_error})")
        if latency_budget_ms is not None and rep.p95_ms is not None and rep.p95_ms > latency_budget_ms:
            return done(f"p95 latency {rep.p95_ms:.4g} ms over budget {latency_budget_ms:g} ms")
        if p99_budget_ms is not None and rep.p99_ms is not None and rep.p99_ms > p99_budget_ms:
            return done(f"p99 latency {rep.p99_ms:.4g} ms over budget {p99_budget_ms:g} ms")
        return done(None)
    finally:
        if module is not None:
            try:
                module.close()
            except Exception:
                pass
        bundle.close()


def _key_paths(keys: Iterable[hmod.KeySource], tmpdir: Path) -> list[str]:
    """Trusted keys as file paths for the child (key objects are written as PEM)."""
    from cryptography.hazmat.primitives import serialization

    out = []
    for i, k in enumerate(keys):
        if isinstance(k, (str, os.PathLike)):
            out.append(os.fspath(k))
            continue
        p = tmpdir / f"trusted{i}.pub.pem"
        p.write_bytes(k.public_bytes(serialization.Encoding.PEM,
                                     serialization.PublicFormat.SubjectPublicKeyInfo))
        out.append(str(p))
    return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and anything it started
    except ProcessLookupError:
        pass


def stop_running() -> int:
    """Kill the isolated checks in progress (the agent is stopping: its own session keeps a child
    alive past the agent otherwise). Returns how many."""
    procs = list(_RUNNING)
    for p in procs:
        _ENDED.add(p.pid)
        _kill(p)
    return len(procs)


def health_check_isolated(bundle_path: str | os.PathLike, trusted_keys: Iterable[hmod.KeySource] = (),
                          delegate: str = "auto", latency_budget_ms: float | None = None,
                          frames: int = DEFAULT_FRAMES, timeout_s: float = DEFAULT_TIMEOUT_S,
                          python: str | None = None, env: dict[str, str] | None = None,
                          p99_budget_ms: float | None = None) -> HealthReport:
    """:func:`health_check` in a child process (``python -m tandoor_agent.update.health``), so that a
    segfault or a hang in a native library fails the check instead of taking the agent down."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tandoor-health-") as td:
        cmd = [python or sys.executable, "-m", "tandoor_agent.update.health", os.fspath(bundle_path), "--json",
               "--delegate", delegate, "--frames", str(frames)]
        for k in _key_paths(trusted_keys, Path(td)):
            cmd += ["--trusted-key", k]
        if latency_budget_ms is not None:
            cmd += ["--latency-budget-ms", repr(float(latency_budget_ms))]
        if p99_budget_ms is not None:
            cmd += ["--p99-budget-ms", repr(float(p99_budget_ms))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=env)
        _RUNNING.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            return HealthReport(ok=False, reason=f"health check timed out after {timeout_s:g} s",
                                latency_budget_ms=latency_budget_ms,
                                seconds=round(time.perf_counter() - t0, 3))
        finally:
            _RUNNING.discard(proc)
    if proc.pid in _ENDED:
        raise CheckStopped("the health check was ended: the agent is stopping")
    rc = proc.returncode
    report = None
    for line in reversed(out.strip().splitlines()):
        try:
            report = HealthReport.from_dict(json.loads(line))
            break
        except (ValueError, TypeError):
            continue
    if report is not None and rc in (0, EXIT_UNHEALTHY):
        return report
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = f"health check process was killed by {name}"
    else:
        last = next((ln for ln in reversed(err.strip().splitlines()) if ln.strip()), "no output")
        why = f"health check process exited {rc} without a report: {last.strip()}"
    return HealthReport(ok=False, reason=why, latency_budget_ms=latency_budget_ms,
                        seconds=round(time.perf_counter() - t0, 3))


def gate(store, trusted_keys: Iterable[hmod.KeySource] = (), latency_budget_ms: float | None = None,
         frames: int = DEFAULT_FRAMES, delegate: str = "auto", isolated: bool = True,
         timeout_s: float = DEFAULT_TIMEOUT_S, check: Callable[..., HealthReport] | None = None,
         p99_budget_ms: float | None = None) -> HealthReport:
    """The health gate on a SlotStore's trial: its verdict (the report), nothing changed. The
    update job commits or rolls the trial back on it (``jobs.settle``, a step of the job itself).
    Raises CheckStopped when :func:`stop_running` ended the check."""
    from .slots import TransitionError

    trial = store.trial()
    if trial is None:
        raise TransitionError("no trial in progress: nothing to health-check")
    path = store.bundle_path(trial["slot"])
    if check is None:
        check = health_check_isolated if isolated else health_check
    kw: dict[str, Any] = dict(delegate=delegate, latency_budget_ms=latency_budget_ms, frames=frames)
    if check is health_check_isolated:
        kw["timeout_s"] = timeout_s
    if p99_budget_ms is not None:        # a check that predates the p99 budget is called as before
        kw["p99_budget_ms"] = p99_budget_ms
    try:
        return check(path, list(trusted_keys), **kw)
    except CheckStopped:
        raise  # the trial stays as it is: recover_on_start rolls it back at the next start
    except Exception as e:  # the checker itself broke: that is not a healthy model either
        return HealthReport(ok=False, reason=f"health check error: {_one_line(e)}",
                            latency_budget_ms=latency_budget_ms, p99_budget_ms=p99_budget_ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandoor_agent.update.health",
                                 description="Health-check a bundle: golden self-test, N frames, p95 and p99 latency.")
    ap.add_argument("bundle")
    ap.add_argument("--trusted-key", action="append", default=[], help="public key (PEM); repeatable")
    ap.add_argument("--delegate", default="auto", choices=executors.CHOICES)
    ap.add_argument("--latency-budget-ms", type=float, default=None, help="the p95 budget")
    ap.add_argument("--p99-budget-ms", type=float, default=None, help="the p99 budget (none by default)")
    ap.add_argument("--frames", type=int, default=DEFAULT_FRAMES)
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = ap.parse_args(argv)
    rep = health_check(args.bundle, args.trusted_key, delegate=args.delegate,
                       latency_budget_ms=args.latency_budget_ms, frames=args.frames, p99_budget_ms=args.p99_budget_ms)
    if args.json:
        print(json.dumps(rep.to_dict(), allow_nan=False, default=str), flush=True)
    else:
        print(rep.summary(), flush=True)
    return 0 if rep.ok else EXIT_UNHEALTHY


if __name__ == "__main__":
    from tandoor_agent.run import lean; lean.runtime_only()  # an agent process: TVM's runtime only, no torch
    sys.exit(main())
