"""Run a bundle on given inputs the way the device does: what `tandoor verify` compares with
onnxruntime.

``python -m tandoor_agent.run.replay BUNDLE --inputs IN.npz --out OUT.npz --delegate auto`` loads
TVM's runtime only (agent/run/lean.py), builds the bundle's executors as the agent does and runs
every case of IN.npz (arrays ``c{case}_{input}``) into OUT.npz (``c{case}_{output}``). Its last
stdout line is JSON: ``{"executors": [...]}`` (the module's ``describe()``), or ``{"error": "..."}``
when the bundle cannot be opened, loaded or run (exit 4), in one line.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

EXIT_FAILED = 4


def cases_of(npz) -> list[list[np.ndarray]]:
    """IN.npz's cases in order: ``c{case}_{input}`` arrays."""
    keys = sorted((tuple(int(x) for x in k[1:].split("_")), k) for k in npz.files if k.startswith("c"))
    cases: list[list[np.ndarray]] = []
    for (c, _), k in keys:
        while len(cases) <= c:
            cases.append([])
        cases[c].append(npz[k])
    return cases


def replay(bundle_path: str, cases: list[list[np.ndarray]], delegate: str, trusted_keys=()) \
        -> tuple[list[list[np.ndarray]], list[dict], str | None]:
    from tandoor_contract import hmod
    from .runtime import HybridModule

    with hmod.open_bundle(bundle_path, trusted_keys) as bundle:
        module = HybridModule(bundle, delegate=delegate)
        try:
            outs = [[np.array(o, copy=True) for o in module.run(ins)] for ins in cases]
            return outs, module.describe(), module.gpu()
        finally:
            module.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandoor_agent.run.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--delegate", default="auto")
    ap.add_argument("--trusted-key", action="append", default=[])
    args = ap.parse_args(argv)
    try:
        with np.load(args.inputs, allow_pickle=False) as z:
            cases = cases_of(z)
        outs, described, gpu = replay(args.bundle, cases, args.delegate, args.trusted_key)
    except Exception as e:    # one line for the caller, whatever the runtime raised
        print(json.dumps({"error": " ".join(str(e).split())[:500] or type(e).__name__}), flush=True)
        return EXIT_FAILED
    np.savez(args.out, **{f"c{c}_{j}": o for c, os_ in enumerate(outs) for j, o in enumerate(os_)})
    print(json.dumps({"executors": described, **({"gpu": gpu} if gpu else {})}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    from tandoor_agent.run import lean; lean.runtime_only()  # an agent process: TVM's runtime only, no torch
    sys.exit(main())
