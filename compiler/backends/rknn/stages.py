"""What ``compile --npu`` adds to the compile, top to bottom in the order it runs (compiler/api.py
and compiler/pipeline.py call each once, at its place): ``check_options`` before any work; ``pick``
the regions the NPU's table takes (a board's profile over the table's guess); ``cut`` the model
there (the rest stays for ACL, TVM and the escape hatch); ``convert`` them with the RKNN toolkit (a
region it refuses goes back to the CPU and the model is cut again); the manifest's ``npu``
(``manifest``); each output's promise on the ``rknn`` path (``promise``); and, when --max-drop
refuses the NPU's answers, what to try (``npu_fix``). ``loaded`` is frontend.LoadedModel; ``opts``
the pipeline's Options."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from tandoor_contract import backends, probe

from ..onnx import hatch
from . import npu, toolkit



def check_options(opts, targets, *, calibrated: bool) -> None:
    """Refuse --npu options that cannot work, before any work: no rk3588 among the targets, an
    unknown dtype, int8 without calibration frames, or no toolkit venv (the one line saying how)."""
    from ...errors import CompileError

    if not any(t.name == "rk3588" for t in targets):
        raise CompileError("--npu is the RK3588's NPU: give --target rk3588")
    if opts.npu_dtype not in toolkit.DTYPES:
        raise CompileError(f"unknown --npu-dtype {opts.npu_dtype}; choose {', '.join(toolkit.DTYPES)}")
    if opts.npu_dtype == "int8" and not calibrated:
        raise CompileError("--npu converts to INT8 calibrated on your frames: give --calibration DIR|VIDEO, "
                           "or --npu-dtype fp16")
    toolkit.python()      # the toolkit's venv, or the one line saying how to make it


def pick(loaded, opts, say):
    """The NPU's regions of the loaded model: its table's picks (int8: with the activation ranges
    of the calibration inputs), then a board's measured profile over the table's guess. Returns
    (the Pick, where the choice came from, the board profile or None)."""
    from ...stages import profile as profile_mod

    ranges = npu.ranges(loaded.proto, opts.npu_samples) if opts.npu_dtype == "int8" and opts.npu_samples else None
    picked = npu.pick(loaded.proto, avoid=set(hatch.reasons(loaded.proto)), ranges=ranges)
    source, board_profile = "estimate (NPU op table)", None
    if opts.profile is not None:
        say(f"checking the profile {Path(opts.profile).name}")
        board_profile = profile_mod.load_for_compile(opts.profile, loaded, "aarch64")
        source = npu.apply_profile(picked, board_profile, opts.name or loaded.name, list(loaded.proto.graph.node))
    return picked, source, board_profile


def cut(loaded, name: str, picked: npu.Pick | None):
    """hatch.cut with the NPU's groups (``picked.groups``) as rknn groups (none: the escape hatch's
    own groups only)."""
    return hatch.cut(loaded.proto, name, [i.as_dict() for i in loaded.inputs],
                     npu=[(g, picked.taken) for g in picked.groups] if picked else ())


def convert(loaded, opts, picked: npu.Pick, say, golden_pairs: int) -> npu.Converted:
    """Convert the rknn groups; a region the toolkit cannot convert stays on the CPU (ACL/TVM, as
    without --npu): the model is cut again without it, the others keep their conversion."""
    probes = [probe.inputs({"inputs": [i.as_dict() for i in loaded.inputs]}, seed=k + 1) for k in range(golden_pairs)]
    converted = npu.convert_groups(loaded.proto, loaded.hatch, dtype=opts.npu_dtype, samples=opts.npu_samples,
                                   probe_inputs=probes, say=say, judged=opts.npu_judged)
    if converted.failed:
        nodes = list(loaded.proto.graph.node)
        why = {o: converted.failed[g.symbol] for g in loaded.hatch if g.symbol in converted.failed
               for n in g.nodes for o in n.output}
        kept = []
        for members in picked.groups:
            failed = next((why[o] for k in members for o in nodes[k].output if o in why), None)
            if failed is None:
                kept.append(members)
            else:
                picked.refused.update({k: f"the RKNN toolkit could not convert its region ({failed[:160]})"
                                       for k in members})
        picked.groups = kept
        old, (loaded.tvm_proto, loaded.hatch) = loaded.hatch, cut(loaded, opts.name or loaded.name, picked)
        npu.keep_converted(old, loaded.hatch)
        converted.orders = [{"symbol": g.symbol, **g.rknn} for g in loaded.hatch if g.kind == backends.RKNN]
    return converted


def manifest(loaded, picked: npu.Pick, converted: list[dict], source: str) -> dict:
    """The manifest's ``npu``: FLOPs (of the ONNX model, compiler/backends/rknn/npu.py's count) in rknn orders,
    each order's toolkit facts and simulator check, and why the rest stayed on the CPU."""
    nodes = list(loaded.proto.graph.node)
    total = sum(picked.flops.values())
    on_npu = sum(picked.flops[k] for g in picked.groups for k in g)
    why = Counter(f"{nodes[k].op_type}: {r}" for k, r in {**picked.refused, **picked.dropped}.items())
    return {"target_platform": toolkit.TARGET_PLATFORM, "flops_total": round(total), "flops_rknn": round(on_npu),
            "share": round(on_npu / total, 4) if total else 0.0, "source": source,
            "orders": converted,
            "cpu": [{"why": w, "nodes": n} for w, n in why.most_common()]}


def promise(tolerance: dict, loaded, converted: npu.Converted, dtype: str) -> None:
    """Each output's promise on the ``rknn`` path (tandoor_contract.agreement): the worst error the
    simulator's NPU outputs made in the model's outputs on the check inputs, doubled for the NPU's
    own rounding, and never tighter than fp32's."""
    names = [o.name for o in loaded.outputs]
    got = npu.simulated_outputs(loaded.proto, loaded.hatch, converted.check)
    want = [[a[n] for n in names] for a in npu.activations(loaded.proto, names, converted.check)]
    version = converted.orders[0]["toolkit_version"]
    for j, name in enumerate(names):
        err = max(float(np.max(np.abs(np.asarray(g[j], np.float64) - np.asarray(w[j], np.float64)), initial=0.0))
                  for g, w in zip(got, want))
        entry = tolerance["outputs"].setdefault(name, {"atol": tolerance["atol"], "rtol": tolerance["rtol"]})
        entry.setdefault("paths", {})["rknn"] = {
            "atol": float(max(entry["atol"], 2 * err)), "rtol": entry["rtol"],
            "why": f"the NPU's {dtype} in rknn-toolkit2 {version}'s simulator on {converted.source}: worst abs err "
                   f"{err:.3g}, doubled for the NPU's own rounding"}
        tolerance["atol"] = max(tolerance["atol"], entry["paths"]["rknn"]["atol"])


def npu_fix(npu: dict) -> str:
    """What to try when the NPU's answers are past --max-drop: the layers the simulator's per-layer
    report says hurt most (worker.py), then the usual ways out."""
    worst = sorted((r for o in npu.get("orders") or () for r in o.get("worst_layers") or ()),
                   key=lambda r: r["cosine"])[:5]
    hurt = ("Layers that hurt most: " + ", ".join(f"{r['layer']} ({r['op']}, cosine {r['cosine']:.3f})" for r in worst)
            + ". ") if worst else ""
    return hurt + "Try --npu-dtype fp16, more --calibration frames, or compile without --npu"
