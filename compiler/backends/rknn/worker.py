"""The RKNN toolkit's side of `tandoor compile --npu`: a standalone script run by ``.venv-rknn``'s
Python (scripts/setup.sh), never imported by the compiler's own venv (the toolkit pins numpy<=1.26,
onnx<=1.18, protobuf<=4.25 and imports torch).

It speaks a small versioned request/response in JSON (``PROTOCOL``); the compiler's side is
compiler/backends/rknn/toolkit.py. Two ways to run it:

    python worker.py REQUEST.json RESPONSE.json      one request, one response (convert)
    python worker.py --serve                          JSON lines on stdin -> JSON lines on stdout:
                                                           a "build" then any number of "infer"
                                                           (the simulator behind the agent's rknn
                                                           executor on the host)

A convert request::

    {"protocol": 1, "action": "convert", "onnx": "region.onnx", "target_platform": "rk3588",
     "quantize": "int8" | "fp16", "dataset": "calib.txt" | null, "mean": [..] | null, "std": [..] | null,
     "probe_inputs": [["in0.npy", ...], ...], "out_dir": "dir", "analysis": false}

answers::

    {"protocol": 1, "ok": true, "rknn": "dir/model.rknn", "toolkit_version": "2.5.0",
     "outputs": [["dir/out_0_0.npy", ...], ...], "report": [{"layer": .., "cosine": ..}, ...] | null,
     "seconds": {"build": .., "simulate": ..}}

or ``{"protocol": 1, "ok": false, "error": "one line"}``. Tensors travel as .npy files in the
ONNX's own layout (NCHW for rank-4). The toolkit's chatter goes to stderr; in --serve mode stdout
carries the protocol only.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# Run as a script, its directory (the compiler's package, with modules named profile, cache, ...)
# would come first on sys.path and shadow what the toolkit imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

PROTOCOL = 1


def _toolkit_version() -> str:
    from importlib.metadata import version

    return version("rknn-toolkit2")


def _check(ret, what: str) -> None:
    if ret != 0:
        raise RuntimeError(f"the RKNN toolkit's {what} failed (returned {ret}; its log is above)")


def build(req: dict):
    """An RKNN object with the request's model built (and its .rknn exported when ``out_dir``)."""
    from rknn.api import RKNN

    rk = RKNN(verbose=False)
    cfg = {"target_platform": req.get("target_platform", "rk3588")}
    if req.get("mean") is not None:
        cfg["mean_values"] = [list(map(float, req["mean"]))]
    if req.get("std") is not None:
        cfg["std_values"] = [list(map(float, req["std"]))]
    int8 = req.get("quantize", "int8") == "int8"
    if int8:
        cfg.update(quantized_dtype="w8a8", quantized_algorithm=req.get("algorithm", "normal"))
    _check(rk.config(**cfg), "config")
    _check(rk.load_onnx(model=req["onnx"]), "load_onnx")
    if int8 and not req.get("dataset"):
        raise ValueError("int8 needs a calibration dataset list")
    _check(rk.build(do_quantization=int8, dataset=req.get("dataset") if int8 else None), "build")
    return rk


def _load(paths: list[str]):
    import numpy as np

    return [np.load(p) for p in paths]


def _infer(rk, inputs) -> list:
    import numpy as np

    fmt = ["nchw" if np.ndim(a) == 4 else "nhwc" for a in inputs]
    outs = rk.inference(inputs=list(inputs), data_format=fmt)
    if outs is None:
        raise RuntimeError("the simulator's inference returned nothing (its log is above)")
    return [np.asarray(o) for o in outs]


def _report(rk, inputs: list[str], out_dir: str) -> list[dict] | None:
    """The toolkit's per-layer accuracy analysis (simulator vs its own fp32), cosine per layer."""
    d = os.path.join(out_dir, "analysis")
    if rk.accuracy_analysis(inputs=inputs, output_dir=d) != 0:
        return None
    path = os.path.join(d, "error_analysis.txt")
    if not os.path.exists(path):
        return None
    rows = []
    for line in open(path, encoding="utf-8", errors="replace"):
        parts = line.split()
        # "[Conv] name  entire_cos | entire_euc  single_cos | single_euc" (the toolkit's table; a layer
        # fused into the next has no numbers). entire: errors accumulated up to the layer; single:
        # the layer alone on the reference's inputs
        if len(parts) >= 8 and parts[0].startswith("[") and parts[0].endswith("]"):
            try:
                rows.append({"op": parts[0][1:-1], "layer": parts[1], "cosine": float(parts[2]),
                             "single_cosine": float(parts[5])})
            except ValueError:
                continue
    return rows


def convert(req: dict) -> dict:
    import numpy as np

    out_dir = req["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    rk = build(req)
    path = os.path.join(out_dir, "model.rknn")
    _check(rk.export_rknn(path), "export_rknn")
    t1 = time.perf_counter()
    outputs = []
    if req.get("probe_inputs"):
        _check(rk.init_runtime(), "init_runtime (simulator)")
        for k, paths in enumerate(req["probe_inputs"]):
            outs = _infer(rk, _load(paths))
            names = []
            for j, o in enumerate(outs):
                names.append(os.path.join(out_dir, f"out_{k}_{j}.npy"))
                np.save(names[-1], o)
            outputs.append(names)
    t2 = time.perf_counter()
    report = _report(rk, req["probe_inputs"][0], out_dir) if req.get("analysis") and req.get("probe_inputs") else None
    rk.release()
    return {"rknn": path, "toolkit_version": _toolkit_version(), "outputs": outputs, "report": report,
            "seconds": {"build": round(t1 - t0, 3), "simulate": round(t2 - t1, 3)}}


def _answer(fn, req: dict) -> dict:
    try:
        if int(req.get("protocol", 0)) != PROTOCOL:
            raise ValueError(f"request protocol {req.get('protocol')!r}; this worker speaks {PROTOCOL}")
        return {"protocol": PROTOCOL, "ok": True, **fn(req)}
    except Exception as err:
        traceback.print_exc(file=sys.stderr)
        text = " ".join(str(err).split()) or type(err).__name__
        return {"protocol": PROTOCOL, "ok": False, "error": f"{type(err).__name__}: {text[:400]}"}


def serve() -> None:
    """JSON lines: {"action": "build", ...convert's model fields} then {"action": "infer",
    "inputs": [npy...], "out_dir": d} -> {"outputs": [npy...]}; {"action": "release"} ends."""
    import numpy as np

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)        # the toolkit prints: keep it off the protocol
    state: dict = {"rk": None, "n": 0}

    def do_build(req):
        state["rk"] = build(req)
        _check(state["rk"].init_runtime(), "init_runtime (simulator)")
        return {"toolkit_version": _toolkit_version(), "sdk_version": "simulator"}

    def do_infer(req):
        if state["rk"] is None:
            raise RuntimeError("infer before build")
        outs = _infer(state["rk"], _load(req["inputs"]))
        names = []
        for j, o in enumerate(outs):
            state["n"] += 1
            names.append(os.path.join(req["out_dir"], f"sim_{state['n']}_{j}.npy"))
            np.save(names[-1], o)
        return {"outputs": names}

    actions = {"build": do_build, "infer": do_infer}
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("action") == "release":
            break
        fn = actions.get(req.get("action"))
        ans = _answer(fn, req) if fn else {"protocol": PROTOCOL, "ok": False,
                                           "error": f"unknown action {req.get('action')!r}"}
        proto.write(json.dumps(ans) + "\n")
    if state["rk"] is not None:
        state["rk"].release()


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--serve"]:
        serve()
        return 0
    if len(argv) != 3:
        print("usage: worker.py REQUEST.json RESPONSE.json | --serve", file=sys.stderr)
        return 2
    req = json.load(open(argv[1]))
    os.dup2(2, 1)
    ans = _answer({"convert": convert}.get(req.get("action"), lambda r: (_ for _ in ()).throw(
        ValueError(f"unknown action {r.get('action')!r}"))), req)
    with open(argv[2], "w") as f:
        json.dump(ans, f)
    return 0 if ans["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
