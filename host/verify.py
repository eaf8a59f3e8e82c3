"""Run a bundle's host lib against the source model in onnxruntime: golden and random inputs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tandoor_contract import hmod, probe
from tandoor_agent.run.runtime import HybridModule



def compare(got: list[np.ndarray], want: list[np.ndarray], atol: float, rtol: float) -> tuple[float, float, bool]:
    max_abs = max_rel = 0.0
    ok = True
    for g, w in zip(got, want):
        g = np.asarray(g, dtype=np.float64).reshape(np.shape(w))
        w = np.asarray(w, dtype=np.float64)
        diff = np.abs(g - w)
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        max_rel = max(max_rel, float((diff / (np.abs(w) + atol)).max(initial=0.0)))
        ok = ok and bool(np.all(diff <= atol + rtol * np.abs(w))) and bool(np.all(np.isfinite(g)))
    return max_abs, max_rel, ok


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


def verify(bundle_path: str | Path, reference: str | Path, delegate: str = "onnxruntime",
           random_inputs: int = 3, trusted_keys=()) -> dict:
    import onnxruntime as ort

    from tandoor_compiler import frontend

    ref_path = Path(reference)
    with hmod.open_bundle(bundle_path, trusted_keys=trusted_keys) as bundle:
        m = bundle.manifest
        tol = m.get("tolerance", {"atol": 1e-3, "rtol": 1e-3})
        _same_inputs(m, ref_path)
        pins = [f"{i['name']}=" + "x".join(str(d) for d in i["shape"]) for i in m["inputs"]]
        ref = frontend.load(ref_path, pins)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(ref.proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        module = HybridModule(bundle, delegate=delegate)
        try:
            cases = [("golden", ins) for ins, _ in bundle.golden()]
            rng = np.random.default_rng(7)
            for _ in range(random_inputs):
                cases.append(("random", [probe.random_input(rng, i) for i in m["inputs"]]))
            results = []
            worst_abs = worst_rel = 0.0
            all_ok = True
            for kind, ins in cases:
                want = sess.run(None, {i["name"]: a for i, a in zip(m["inputs"], ins)})
                got = module.run(ins)
                a, r, ok = compare(got, want, tol["atol"], tol["rtol"])
                results.append({"kind": kind, "max_abs_err": a, "max_rel_err": r, "ok": ok})
                worst_abs, worst_rel, all_ok = max(worst_abs, a), max(worst_rel, r), all_ok and ok
            subgraphs = module.describe()
        finally:
            module.close()
    return {
        "max_abs_err": worst_abs, "max_rel_err": worst_rel, "ok": all_ok,
        "atol": tol["atol"], "rtol": tol["rtol"], "cases": results, "subgraphs": subgraphs,
        "reference_matches_source": hashlib.sha256(ref_path.read_bytes()).hexdigest() == m["model"]["source_sha256"],
    }
