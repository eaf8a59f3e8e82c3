"""What `tandoor inspect` shows: a summary of the manifest and the graph coloured by placement."""

from __future__ import annotations

from collections import Counter
from html import escape
from pathlib import Path

import tvm
from tvm import relax

from tandoor_contract import backends, gpu as gpu_contract, hmod

from .backends.onnx import hatch

JSON_KEYS = ("format_version", "model", "targets", "inputs", "outputs", "ops_total", "ops_delegated",
             "delegation_ratio", "predicted_speedup", "boundaries")


def summary(bundle: hmod.Bundle) -> dict:
    m = bundle.manifest
    info = {k: m.get(k) for k in JSON_KEYS}
    info["targets"] = {t: {"arch": v["arch"], **({"gpu": _gpu_part(bundle, g)} if (g := gpu_contract.entry_of(v)) else {})}
                       for t, v in m["targets"].items()}
    info["partitions"] = [{"symbol": p["symbol"], "ops": p["ops"], "delegate": p["delegate"], "reason": p["reason"],
                           "est": p.get("est", {}), **({"kind": p["kind"]} if "kind" in p else {})}
                          for p in m["partitions"]]
    info["tail"] = m.get("tail")      # the model's end, run by onnxruntime after the VM (contract/tail.py)
    info["onnxruntime_ops"] = onnxruntime_ops(m["partitions"] + ([m["tail"]] if m.get("tail") else []))
    info["tvm_ops"] = m.get("tvm_ops", [])
    info["tvm_ops_by_op"] = tvm_ops_by_op(info["tvm_ops"])
    info["layout_transposes"] = m.get("layout_transposes")
    info["flops_total"], info["flops_delegated"] = m.get("flops_total"), m.get("flops_delegated")
    info["flops_share"] = (round(m["flops_delegated"] / m["flops_total"], 4)
                           if m.get("flops_total") and m.get("flops_delegated") is not None else None)
    info["policy"] = m.get("policy")
    info["quantized"], info["tolerance"] = m.get("quantized"), m.get("tolerance")
    info["signed"] = bundle.signed
    info["created"], info["cache"] = m.get("created"), m.get("cache")
    info["npu"] = m.get("npu")     # rknn orders: FLOP share on the NPU, toolkit facts, simulator check
    return info


def runs_on(p: dict) -> str:
    """Where a manifest partition runs: ACL (an order of layers), onnxruntime (an onnx order:
    compiler/backends/onnx/hatch.py) or TVM (kept in the TVM side)."""
    if not p["delegate"]:
        return "TVM"
    return {backends.ONNX: "onnxruntime", backends.RKNN: "NPU"}.get(p.get("kind"), "ACL")


def onnxruntime_ops(partitions: list[dict]) -> list[dict]:
    """The ONNX nodes that went to onnxruntime, one row per op type: how many, in which orders, why."""
    rows: dict[str, dict] = {}
    for p in partitions:
        if p.get("kind") != backends.ONNX:
            continue
        for op in p["ops"]:
            op = op.removeprefix("onnx.")
            row = rows.setdefault(op, {"op": op, "count": 0, "symbols": [], "reason": (p.get("why") or {}).get(op, "")})
            row["count"] += 1
            if p["symbol"] not in row["symbols"]:
                row["symbols"].append(p["symbol"])
    return sorted(rows.values(), key=lambda r: (-r["count"], r["op"]))


def tvm_ops_by_op(tvm_ops: list[dict]) -> list[dict]:
    """The ops left to TVM, one row per op: how many, and each reason with its count."""
    by: dict[str, Counter] = {}
    for o in tvm_ops:
        by.setdefault(o["op"], Counter())[o["reason"]] += 1
    rows = [{"op": op, "count": sum(c.values()), "reasons": [{"reason": r, "count": n} for r, n in c.most_common()]}
            for op, c in by.items()]
    return sorted(rows, key=lambda r: (-r["count"], r["op"]))


def _gpu_part(bundle: hmod.Bundle, g: dict) -> dict:
    """A target's GPU part as its libraries' code says (contract/gpu.py reads their cubins' ELF
    headers), not as the manifest claims: SM -> {cubins: [SM...], kernel_bytes, lib_bytes}."""
    out = {}
    for sm, member in sorted((g.get("libs") or {}).items()):
        found = gpu_contract.cubins(bundle.library(member))
        out[sm] = {"cubins": [s for s, _ in found], "kernel_bytes": sum(n for _, n in found),
                   "lib_bytes": len(bundle.read(member))}
    return {"kind": g.get("kind"), "version": g.get("version"), "runtime": g.get("runtime"),
            "schedules": g.get("schedules"), "libs": out}


def print_summary(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    m = info["model"]
    c.print(f"[bold]{m['name']}[/] v{m['version']}  (source sha256 {m['source_sha256'][:12]}…, "
            f"format {info['format_version']}, {'signed' if info['signed'] else 'unsigned'})")
    c.print("inputs:  " + ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in info["inputs"]))
    c.print("outputs: " + ", ".join(f"{o['name']} {o['dtype']}{o['shape']}" for o in info["outputs"]))
    c.print("targets: " + ", ".join(f"{t} ({v['arch']})" for t, v in info["targets"].items()))
    for t, v in info["targets"].items():
        if g := v.get("gpu"):    # the TVM part on the GPU; delegated orders stay on the CPU
            libs = ", ".join(f"{sm} ({', '.join(x['cubins']) or 'NO cubin'}: {x['kernel_bytes'] / 1e3:.1f} KB of "
                             f"kernels, library {x['lib_bytes'] / 1e3:.1f} KB)" for sm, x in g["libs"].items())
            c.print(f"gpu ({t}): {g['kind']} {libs}, runtime {g['runtime']}, {g['schedules']}; on the GPU runs the "
                    "whole model but its onnxruntime orders (their tensors copied across at each call); the CPU lib "
                    "with its ACL orders is the fallback")
    if (cached := info.get("cache") or {}).get("hit"):
        c.print(f"compiled: {cached['compiled']}, taken from the compile cache {info['created']} "
                f"(entry {cached['key'][:12]}; tandoor compile --no-cache recompiles)")
    elif info.get("created"):
        c.print(f"compiled: {info['created']}")
    share = f"{info['flops_share']:.1%} of the FLOPs, " if info.get("flops_share") is not None else ""
    c.print(f"delegated to ACL: {share}{info['ops_delegated']}/{info['ops_total']} ops "
            f"(ratio {info['delegation_ratio']:.2f}) in {sum(runs_on(p) == 'ACL' for p in info['partitions'])} subgraph(s); "
            f"predicted speedup {info['predicted_speedup']:.2f}x, policy {info['policy']}, "
            f"layout transposes: {info['layout_transposes']}"
            + (f", TVM/order boundaries: {info['boundaries']}" if info.get("boundaries") is not None else ""))
    if q := info.get("quantized"):   # an INT8 QDQ model (compiler/int8/quantize.py)
        c.print(f"INT8 ({q['format']}, {', '.join(f'{k} x{v}' for k, v in q['ops'].items())}): computed in "
                f"{q['compute']} (atol {info['tolerance']['atol']:.3g})")
    for name, e in ((info.get("tolerance") or {}).get("outputs") or {}).items():   # the check's promise per output
        c.print(f"tolerance of {name}: atol {e['atol']:.3g}, rtol {e['rtol']:.3g} ({e.get('why', '')})")
    t = Table(title="subgraphs")
    # the reasons are long sentences: beside the table only on a wide console, else listed below it
    wide = c.width >= 140
    width = max((len(p["symbol"]) for p in info["partitions"]), default=6)
    t.add_column("symbol", no_wrap=True, min_width=width)   # symbols are what logs and profiles name
    t.add_column("runs on")
    t.add_column("ops")
    t.add_column("share", no_wrap=True, justify="right")   # of the model's TVM time (cost.py's p)
    if wide:
        t.add_column("why")
    for p in info["partitions"]:
        ops = Counter(p["ops"])
        share = f"{p['est']['p']:.1%}" if (p.get("est") or {}).get("p") is not None else "-"
        t.add_row(p["symbol"], runs_on(p),
                  f"{len(p['ops'])}: " + ", ".join(f"{k} x{v}" for k, v in ops.most_common(6)), share,
                  *([p["reason"]] if wide else []))
    c.print(t)
    if not wide:
        for p in info["partitions"]:
            c.print(f"[bold]{p['symbol']}[/]: {p['reason']}")
    for p in info["partitions"]:
        err = ((p.get("est") or {}).get("estimated") or {}).get("error")
        if err:   # decided from measurements: how far the estimate was from them
            c.print(f"[bold]{p['symbol']}[/] estimate vs measured: " + ", ".join(
                f"{k} {v:+.0%}" for k, v in sorted(err.items())))
        elif runs_on(p) != "onnxruntime" and (p.get("est") or {}).get("source", "estimate").startswith("estimate"):
            c.print(f"[bold]{p['symbol']}[/] decided from estimates (no measurement: a board target without "
                    "--profile, or --measure off)")
    if info.get("npu"):
        n = info["npu"]
        c.print(f"[bold]NPU ({n['target_platform']})[/]: {n['share']:.1%} of the FLOPs in {len(n['orders'])} rknn "
                f"order(s), {n['source']}")
        t = Table(title="rknn orders (simulator vs onnxruntime fp32)")
        for col in ("order", "dtype", "toolkit", "cosine (min)", "max error", "tolerance", "checked on"):
            t.add_column(col)
        for o in n["orders"]:
            t.add_row(o["symbol"], o["dtype"], o["toolkit_version"], f"{min(o['check']['cosine']):.4f}",
                      f"{max(o['check']['max_err']):.3f}",
                      f"cosine >= {o['tolerance']['cosine']}, error <= {o['tolerance']['max_err']}", o["check"]["source"])
        c.print(t)
        for o in n["orders"]:
            if o.get("past"):      # kept only when the answers on real frames were judged instead
                c.print(f"  {o['symbol']} is past its own bound ({'; '.join(o['past'])}); " + (
                    "the model's answers agreed on the held-out calibration frames" if o.get("answers_agree") else
                    "the bundle's answers on real frames were judged with --max-drop instead"))
            worst = o.get("worst_layers") or []
            if worst:   # the toolkit's accuracy analysis: cosine to fp32 accumulated up to each layer
                c.print(f"  {o['symbol']} layers furthest from fp32: " + ", ".join(
                    f"{r['layer']} ({r['op']}) {r['cosine']:.4f}" for r in worst[:3]))
        for row in n.get("cpu", [])[:8]:
            c.print(f"  on the CPU: {row['nodes']} x {row['why']}")
    if info.get("onnxruntime_ops"):
        t = Table(title="ONNX nodes run by onnxruntime (neither ACL nor the device's TVM runtime runs them)")
        t.add_column("op")
        t.add_column("count")
        t.add_column("orders")
        t.add_column("why")
        for row in info["onnxruntime_ops"]:
            t.add_row(row["op"], str(row["count"]), ", ".join(row["symbols"]), row["reason"])
        c.print(t)
    if info["tvm_ops"]:
        t = Table(title="ops left to TVM")
        t.add_column("op")
        t.add_column("count")
        t.add_column("why")
        for row in info["tvm_ops_by_op"]:
            reasons = row["reasons"]
            why = reasons[0]["reason"] if len(reasons) == 1 else "; ".join(
                f"x{r['count']}: {r['reason']}" for r in reasons)
            t.add_row(row["op"], str(row["count"]), why)
        c.print(t)


# --- the graph -----------------------------------------------------------------------------------

def boundaries(mod: tvm.IRModule) -> int:
    """The tensors that cross between TVM and the delegated orders (ACL, onnxruntime, the NPU):
    every distinct non-constant input and every output of every delegated region called from main.
    Each is one hand-over through the bridge (L_bridge = k * t_copy + t_launch, docs/overview.md): a model cut into more regions, or whose
    regions take and give more tensors, crosses more often."""
    k = 0
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if not (isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar)):
                continue
            func = mod[v.op]
            if not (isinstance(func, relax.Function) and func.attrs is not None and "Codegen" in func.attrs):
                continue
            ins: list = []
            for a in v.args:
                for x in (a.fields if isinstance(a, relax.Tuple) else [a]):
                    if isinstance(x, relax.Var) and not any(x.same_as(y) for y in ins):
                        ins.append(x)
            ty = b.var.ty
            k += len(ins) + (len(ty.fields) if isinstance(ty, relax.TupleType) else 1)
    return k


def graph_of(mod: tvm.IRModule) -> dict:
    """Nodes (one per op, region ops expanded) and edges of the partitioned main function."""
    nodes: list[dict] = []
    edges: list[list[int]] = []
    producer: dict = {}
    main = mod["main"]
    for i, p in enumerate(main.params):
        nodes.append({"label": f"input {p.name}", "where": "input"})
        producer[p] = len(nodes) - 1

    def sources(args) -> list[int]:
        out = []
        for a in args:
            if isinstance(a, relax.Tuple):
                out += sources(a.fields)
            elif a in producer:
                out.append(producer[a])
        return out

    for block in main.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and isinstance(v.op, relax.GlobalVar):
                func = mod[v.op]
                symbol = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else v.op.name_hint
                if func.attrs is not None and func.attrs.get("Codegen") == hatch.CODEGEN:   # an onnxruntime order
                    nodes.append({"label": "onnxruntime", "where": symbol})
                    edges.extend([s, len(nodes) - 1] for s in sources(v.args))
                    producer[b.var] = len(nodes) - 1
                    continue
                inner = _region_nodes(func, symbol, sources(v.args), nodes, edges)
                producer[b.var] = inner
            elif isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op):
                nodes.append({"label": v.op.name.removeprefix("relax."), "where": "tvm"})
                for s in sources(v.args):
                    edges.append([s, len(nodes) - 1])
                producer[b.var] = len(nodes) - 1
            elif isinstance(v, relax.TupleGetItem) and v.tuple_value in producer:
                producer[b.var] = producer[v.tuple_value]
            elif isinstance(v, relax.Var) and v in producer:
                producer[b.var] = producer[v]
    return {"nodes": nodes, "edges": edges}


def _region_nodes(func, symbol, srcs, nodes, edges) -> int:
    local, prod = {}, {}
    for p, s in zip(func.params, srcs):
        prod[p] = s
    last = srcs[0] if srcs else 0
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Function):
                local[b.var] = b.value
            elif isinstance(b.value, relax.Call) and b.value.op in local:
                comp = str(local[b.value.op].attrs["Composite"]).removeprefix("acl.")
                nodes.append({"label": comp, "where": symbol})
                last = len(nodes) - 1
                for a in b.value.args:
                    for x in (a.fields if isinstance(a, relax.Tuple) else [a]):
                        if x in prod:
                            edges.append([prod[x], last])
                prod[b.var] = last
    return last


PALETTE = ["#4e79a7", "#59a14f", "#9c755f", "#edc948", "#b07aa1", "#76b7b2", "#ff9da7", "#af7aa1"]


def draw_svg(bundle: hmod.Bundle, path: Path) -> None:
    g = bundle.manifest.get("graph") or {"nodes": [], "edges": []}
    nodes, edges = g["nodes"], g["edges"]
    # Layer = longest path from an input: a readable top-to-bottom layout without graphviz.
    layer = [0] * len(nodes)
    for s, d in sorted(edges, key=lambda e: e[1]):
        layer[d] = max(layer[d], layer[s] + 1)
    rows: dict[int, list[int]] = {}
    for i, l in enumerate(layer):
        rows.setdefault(l, []).append(i)
    w, h, gx, gy = 150, 26, 20, 22
    pos = {}
    width = max((len(r) for r in rows.values()), default=1) * (w + gx) + gx + 220
    for l, ids in rows.items():
        for k, i in enumerate(ids):
            pos[i] = (gx + k * (w + gx), gy + l * (h + gy))
    height = (max(rows, default=0) + 1) * (h + gy) + gy
    symbols = sorted({n["where"] for n in nodes if n["where"] not in ("tvm", "input")})
    color = {"tvm": "#e15759", "input": "#bab0ac", **{s: PALETTE[i % len(PALETTE)] for i, s in enumerate(symbols)}}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">']
    for s, d in edges:
        (x1, y1), (x2, y2) = pos[s], pos[d]
        out.append(f'<line x1="{x1 + w / 2}" y1="{y1 + h}" x2="{x2 + w / 2}" y2="{y2}" stroke="#888"/>')
    for i, n in enumerate(nodes):
        x, y = pos[i]
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="{color[n["where"]]}"/>'
                   f'<text x="{x + 6}" y="{y + 17}" fill="white">{escape(n["label"][:22])}</text>')
    lx = width - 210
    where = {p["symbol"]: runs_on(p) for p in bundle.manifest.get("partitions") or ()}
    for k, (name, col) in enumerate([("TVM", color["tvm"])] + [(f"{where.get(s, 'ACL')} {s}", color[s]) for s in symbols]):
        out.append(f'<rect x="{lx}" y="{gy + k * 20}" width="14" height="14" fill="{col}"/>'
                   f'<text x="{lx + 20}" y="{gy + k * 20 + 12}">{escape(name)}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out))
