"""`tandoor verify`: the bundle run the way the device runs it, against the source model in
onnxruntime, on the golden inputs and on random ones.

The bundle runs in a child process that loads TVM's runtime only, with the agent's executors
(tandoor_agent.run.replay), once per delegate of the compile's self-check (the device's ``auto``
and the TVM fallback; ``--delegate`` picks one), and every output is judged by the contract's rule
with the tolerance the manifest promises for it on the path that ran (tandoor_contract.agreement):
a bundle the compile's check accepted passes here on the same inputs, and a miss on a random input
says which output, which path and which tolerance.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tandoor_contract import agreement, hmod, probe

def _same_inputs(manifest: dict, ref_path: Path) -> None:
    """The reference must take the bundle's inputs (by name): another model is said to be
    another model, not a complaint about an --input nobody gave."""
    import onnx

    from tandoor_compiler.errors import CompileError

    try:
        g = onnx.load(str(ref_path), load_external_data=False).graph
    except Exception:
        return  # not readable as ONNX: frontend.load says why, in its words
    inits = {i.name for i in g.initializer}
    theirs = [i.name for i in g.input if i.name not in inits]
    ours = [i["name"] for i in manifest["inputs"]]
    if set(ours) - set(theirs):
        same = ("" if manifest["model"].get("source_sha256") == hashlib.sha256(ref_path.read_bytes()).hexdigest()
                else " (nor its sha256)")
        raise CompileError(f"--reference {ref_path} is not the model this bundle was compiled from: the bundle's "
                           f"inputs are {', '.join(ours)}, its inputs are {', '.join(theirs) or 'none'}{same}; give "
                           f"the ONNX file the bundle was compiled from")


REPLAY_TIMEOUT_S = 3600   # the whole replay of one delegate's cases


def _replay(bundle_path: Path, cases: list[list[np.ndarray]], delegate: str, trusted_keys) \
        -> tuple[list[list[np.ndarray]] | None, list[dict], str | None, str | None]:
    """The cases run by the agent's code in a runtime-only child: (outputs, executors, None, gpu) or
    (None, [], why it could not run, None); ``gpu``: what the runtime says of the GPU part
    ("unavailable (<why>)" where this machine cannot run it), None without one."""
    with tempfile.TemporaryDirectory(prefix="tandoor-verify-") as td:
        ins, out = Path(td) / "in.npz", Path(td) / "out.npz"
        np.savez(ins, **{f"c{c}_{j}": a for c, case in enumerate(cases) for j, a in enumerate(case)})
        cmd = [sys.executable, "-m", "tandoor_agent.run.replay", str(bundle_path), "--inputs", str(ins),
               "--out", str(out), "--delegate", delegate]
        for k in trusted_keys:
            cmd += ["--trusted-key", str(k)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S)
        except subprocess.TimeoutExpired:      # a native hang: a verdict on the bundle, not a crash of verify
            return None, [], (f"the bundle did not run with {delegate} executors: no answer within "
                              f"{REPLAY_TIMEOUT_S} s (a hang in an executor or the TVM lib)"), None
        last = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("{")), None)
        said = json.loads(last) if last else {}
        if res.returncode != 0 or "executors" not in said:
            tail = said.get("error") or " ".join((res.stderr or "").strip().splitlines()[-1:])[:300]
            return None, [], f"the bundle did not run with {delegate} executors: {tail or f'exit {res.returncode}'}", None
        with np.load(out, allow_pickle=False) as z:
            from tandoor_agent.run.replay import cases_of

            return cases_of(z), said["executors"], None, said.get("gpu")


def _rel(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> float:
    """The largest |got - want| / (|want| + atol): for the report only (the verdict is the contract's)."""
    worst = 0.0
    for g, w in zip(got, want):
        w = np.asarray(w, np.float64)
        if np.size(g) != w.size:
            return float("inf")
        d = np.abs(np.asarray(g, np.float64).reshape(w.shape) - w)
        worst = max(worst, float(np.nanmax(d / (np.abs(w) + atol), initial=0.0)))
    return worst


def verify(bundle_path: str | Path, reference: str | Path, delegate: str | None = None,
           random_inputs: int = 3, trusted_keys=()) -> dict:
    """Run the bundle with each of ``delegate`` (default: the self-check's, agreement.CHECK_DELEGATES)
    on its golden inputs and ``random_inputs`` random ones; the verdict per case and delegate."""
    from tandoor_compiler.stages import check_facts, frontend

    ref_path = Path(reference)
    with hmod.open_bundle(bundle_path, trusted_keys=trusted_keys) as bundle:
        m = bundle.manifest
        _same_inputs(m, ref_path)
        golden_inputs = [ins for ins, _ in bundle.golden()]
    top = agreement.tolerance(m.get("tolerance"), "", "")
    pins = [f"{i['name']}=" + "x".join(str(d) for d in i["shape"]) for i in m["inputs"]]
    ref = check_facts.Reference(frontend.load(ref_path, pins).proto)
    cases = [("golden", ins) for ins in golden_inputs]
    rng = np.random.default_rng(7)
    for _ in range(random_inputs):
        cases.append(("random", [probe.random_input(rng, i) for i in m["inputs"]]))
    wants, free = [], []
    for _, ins in cases:
        wants.append(ref.run({i["name"]: a for i, a in zip(m["inputs"], ins)}))
        free.append(check_facts.ties(ref.facts, ref.last))
    results, subgraphs, runs = [], None, []
    for d in ([delegate] if delegate else list(agreement.CHECK_DELEGATES)):
        outs, described, why, gpu = _replay(Path(bundle_path), [ins for _, ins in cases], d, trusted_keys)
        path = agreement.path_of(described)
        runs.append({"delegate": d, "path": path if why is None else None, "executors": described, "error": why,
                     **({"gpu": gpu} if gpu else {})})
        subgraphs = described if subgraphs is None else subgraphs
        for k, (kind, _) in enumerate(cases):
            if outs is None:
                results.append({"kind": kind, "delegate": d, "path": None, "max_abs_err": None,
                                "max_rel_err": None, "ok": False, "reason": why})
                continue
            v = agreement.compare(outs[k], wants[k], m, path, free[k])
            rel = _rel(outs[k], wants[k], top.atol)
            results.append({"kind": kind, "delegate": d, "path": path,   # no number for a shape or non-finite miss
                            "max_abs_err": v.max_abs_err if np.isfinite(v.max_abs_err) else None,
                            "max_rel_err": rel if np.isfinite(rel) else None, "ok": v.ok, "reason": v.reason,
                            "tied": v.free, "past": v.past})
    return {
        "max_abs_err": max((c["max_abs_err"] for c in results if c["max_abs_err"] is not None), default=0.0),
        "max_rel_err": max((c["max_rel_err"] for c in results if c["max_rel_err"] is not None), default=0.0),
        "ok": all(c["ok"] for c in results),
        "reason": next((f"{c['kind']} input, {c['delegate']} executors: {c['reason']}" for c in results
                        if not c["ok"]), None),
        "past": sum(c.get("past", 0) for c in results),
        "atol": top.atol, "rtol": top.rtol, "tolerance": m.get("tolerance"), "cases": results,
        "runs": runs, "subgraphs": subgraphs or [],
        # compile --npu: the NPU's share and what its simulator check found (the rknn orders ran
        # here on whatever this machine has: their ONNX rendering without an NPU)
        "npu": ({k: m["npu"][k] for k in ("share", "flops_rknn", "flops_total")}
                | {"orders": [{"symbol": o["symbol"], "dtype": o["dtype"], "toolkit_version": o["toolkit_version"],
                               "check": o["check"]} for o in m["npu"]["orders"]]} if m.get("npu") else None),
        "reference_matches_source": hashlib.sha256(ref_path.read_bytes()).hexdigest() == m["model"]["source_sha256"],
    }
