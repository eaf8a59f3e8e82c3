"""The compiler, start to finish: ONNX model -> signed hybrid module bundle (.hmod).

    frontend.load     pin shapes, fold shape arithmetic (onnxruntime basic level), check ops
    frontend.to_relax import with weights as constants, Clip as a clip op
    passes.optimise   fold constants/BatchNorm, conv to NHWC
    partition         ACL table (acl.py) -> merged regions -> cost policy -> unique symbols
    codegen           regions -> orders (+ ONNX rendering, + TVM fallback); rest -> TVM per target
    golden            onnxruntime on the source model: what the device replays in its self-test
    hmod.write_bundle manifest + members + sha256s + signature, written atomically
"""

from __future__ import annotations

import datetime as _dt
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandoor_contract import hmod, media

from . import cost, frontend, importer, targets as targets_mod
from .errors import CompileError

TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}   # fp32, as TVM's own ACL tests
GOLDEN_PAIRS = 2


@dataclass
class Options:
    input_specs: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    key: Path | None = None
    labels: Path | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    layout: str = "NCHW"
    bgr: bool = False
    policy: str = "cost"          # cost | all | none (none: everything in TVM, for benchmarks)
    name: str | None = None
    version: str = "1"
    profile: Path | None = None   # tandoor profile output: measured numbers over estimates
    # how frames become the input and what decodes the outputs (tandoor_contract.media)
    resize: str = "stretch"       # stretch | letterbox
    letterbox_align: str = "center"
    pad_value: int = 114
    pixel_range: str | None = None  # "0-1" | "0-255"; None: from the mean/std units
    decoder: str | None = None
    decoder_options: dict = field(default_factory=dict)  # conf, iou, max_det and the decoder's own


def _tandoor_version() -> str:
    try:
        from importlib.metadata import version

        return version("tandoor")
    except Exception:
        return "0"


def _preprocess(opts: Options, inputs: list[frontend.TensorSpec]) -> dict | None:
    if opts.mean is None and opts.std is None and not opts.bgr and opts.resize == "stretch" \
            and opts.pixel_range is None:
        return None
    chans = inputs[0].shape[1 if opts.layout == "NCHW" else -1]
    mean = opts.mean or [0.0] * chans
    std = opts.std or [1.0] * chans
    for label, v in (("--mean", mean), ("--std", std)):
        if len(v) not in (1, chans):
            raise CompileError(f"{label} has {len(v)} values; the input has {chans} channels (give 1 or {chans})")
    if any(s == 0 for s in std):
        raise CompileError("--std has a zero; standard deviations must be non-zero")
    # Values above 1 mean the user gave them in 0..255 pixel units, unless --pixel-range says.
    if opts.pixel_range is not None:
        scale = {"0-1": 255.0, "0-255": 1.0}[opts.pixel_range]
    else:
        scale = 1.0 if max(mean + std) > 1.0 else 255.0
    try:
        return media.preprocess_entry(resize=opts.resize, align=opts.letterbox_align, pad_value=opts.pad_value,
                                      mean=mean, std=std, scale=scale, bgr=opts.bgr, layout=opts.layout)
    except media.MediaError as err:
        raise CompileError(str(err)) from None


def _postprocess(opts: Options) -> dict | None:
    given = {k: v for k, v in opts.decoder_options.items() if v is not None}
    if opts.decoder is None:
        if given:
            raise CompileError(f"decoder options ({', '.join(given)}) need --decoder NAME")
        return None
    try:
        return media.postprocess_entry(decoder=opts.decoder, **given)
    except media.MediaError as err:
        raise CompileError(str(err)) from None


def _golden(model: frontend.LoadedModel, n: int) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(20261129)
    pairs = []
    for _ in range(n):
        feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in model.inputs}
        outs = sess.run(None, feeds)
        pairs.append(([feeds[i.name] for i in model.inputs], [np.asarray(o) for o in outs]))
    return pairs


def _npy(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def compile_model(model_path: str | Path, out_path: str | Path, opts: Options,
                  progress: Callable[[str], None] = lambda s: None) -> dict:
    """Compile and write the bundle. Returns the manifest as written."""
    import tvm

    from . import codegen, order_onnx, partition, passes

    out_path = Path(out_path)
    if out_path.suffix != hmod.SUFFIX:
        raise CompileError(f"output {out_path} should end in {hmod.SUFFIX}")
    if not out_path.parent.is_dir():
        raise CompileError(f"output directory {out_path.parent} does not exist")
    if opts.policy not in ("cost", "all", "none"):
        raise CompileError(f"unknown --policy {opts.policy}; choose cost, all or none")
    tgts = targets_mod.resolve(opts.targets)
    key = hmod.load_private_key(opts.key) if opts.key else None
    if opts.labels is not None and not Path(opts.labels).is_file():
        raise CompileError(f"--labels {opts.labels}: no such file")

    progress("loading and folding the ONNX model")
    model = frontend.load(model_path, opts.input_specs)
    name = opts.name or model.name
    preprocess = _preprocess(opts, model.inputs)
    postprocess = _postprocess(opts)
    progress("importing into TVM Relax")
    mod = importer.to_relax(model)
    progress("optimising the graph (constants, BatchNorm, NHWC)")
    mod, facts = passes.optimise(mod)

    # --- the keep policy (compiler/cost.py): per subgraph, does its gain beat its boundary? ---
    from . import profile as profile_mod

    total_flops = _flops(mod["main"])
    arch = cost.arch_of(tgts)
    measured = None
    if opts.profile is not None:
        progress(f"checking the profile {Path(opts.profile).name}")
        measured = profile_mod.load_for_compile(opts.profile, model, arch)
        arch = measured.arch
    model_us = measured.model_tvm_us if measured and measured.model_tvm_us else cost.model_tvm_us(mod["main"], arch)

    def keep(p: partition.Partition) -> tuple[bool, str]:
        f = sum(cost.op_flops(c) for c in partition._calls(p.func))
        share = f / total_flops if total_flops else 0.0
        est = cost.estimate(p.func, arch)
        m = measured.subgraph(p) if measured else None
        ok, reason, nums = cost.decide(est, model_us, m)
        p.est = {"flops": f, "share": round(share, 6), "bytes": est["bytes"],
                 "boundary_bytes": est["boundary_bytes"], "arch": arch, **nums}
        if measured and m is None:
            p.est["source"] = "estimate (subgraph not in the profile)"
        if opts.policy == "none":
            return False, "policy none: everything runs in TVM"
        if opts.policy == "all":
            return True, "policy all (" + reason + ")"
        return ok, reason

    progress("partitioning for ACL")
    result = partition.partition(mod, name, keep)
    kept = [p for p in result.partitions if p.delegate]

    members: dict[str, bytes | Path] = {}
    parts_manifest = []
    orders: dict[str, tuple[dict, bytes]] = {}  # symbol -> (order, weights blob), delegated only
    for p in result.partitions:
        entry = {"symbol": p.symbol, "ops": [o.removeprefix("relax.") for o in p.ops], "composites": p.composites,
                 "delegate": p.delegate, "reason": p.reason, "est": p.est}
        if p.delegate and measured and p.est.get("executor"):
            entry["executor"] = p.est["executor"]     # hint for the runtime's auto mode
        if p.delegate:
            order, blob = orders[p.symbol] = codegen.region_to_order(p.func, p.symbol)
            members[f"orders/{p.symbol}.json"] = json.dumps(order, indent=1, sort_keys=True).encode()
            members[f"orders/{p.symbol}.bin"] = blob
            # the ONNX rendering refers to the weights blob (external data) instead of copying it
            members[f"orders/{p.symbol}.onnx"] = order_onnx.order_to_onnx(
                order, blob, external=f"{p.symbol}.bin").SerializeToString()
            entry.update(order=f"orders/{p.symbol}.json", weights=f"orders/{p.symbol}.bin", onnx=f"orders/{p.symbol}.onnx",
                         onnx_external={f"{p.symbol}.bin": f"orders/{p.symbol}.bin"})
        parts_manifest.append(entry)

    from . import report

    graph = report.graph_of(result.mod)
    lowered = codegen.lower_regions(result.mod)
    target_entries = {}
    # Each fallback is compiled without its weights: they are passed in at load time, read from
    # the order's blob where the bytes are the same (most are), else from a small params member.
    fallbacks = {}
    for p in kept:
        fb_mod, values = codegen.region_as_module(p.func, lift_weights=True)
        entry = next(e for e in parts_manifest if e["symbol"] == p.symbol)
        entry["fallback_params"] = _fallback_params(p.symbol, *orders[p.symbol], values, members)
        fallbacks[p.symbol] = fb_mod
    with tempfile.TemporaryDirectory(prefix="tandoor-") as tmp:
        tmpd = Path(tmp)
        for t in tgts:
            progress(f"compiling the TVM part for {t.name}")
            lib = tmpd / f"{t.name}.so"
            codegen.build(lowered, t.llvm, lib, t.cross_cc)
            members[f"lib/{t.name}.so"] = lib.read_bytes()
            entry = {"arch": t.arch, "lib": f"lib/{t.name}.so", "llvm": t.llvm, "fallback": {}}
            for p in kept:
                progress(f"compiling the TVM fallback of {p.symbol} for {t.name}")
                fb = tmpd / f"{t.name}.{p.symbol}.so"
                codegen.build(fallbacks[p.symbol], t.llvm, fb, t.cross_cc)
                member = f"fallback/{t.name}/{p.symbol}.so"
                members[member] = fb.read_bytes()
                entry["fallback"][p.symbol] = member
            target_entries[t.name] = entry

        progress("recording golden input/output pairs with onnxruntime")
        golden = []
        for k, (ins, outs) in enumerate(_golden(model, GOLDEN_PAIRS)):
            g = {"inputs": [], "outputs": []}
            for i, a in enumerate(ins):
                members[f"golden/input_{k}_{i}.npy"] = _npy(a)
                g["inputs"].append(f"golden/input_{k}_{i}.npy")
            for j, a in enumerate(outs):
                members[f"golden/output_{k}_{j}.npy"] = _npy(a)
                g["outputs"].append(f"golden/output_{k}_{j}.npy")
            golden.append(g)
        if opts.labels:
            members["labels.txt"] = Path(opts.labels).read_bytes()

        ops_delegated = result.ops_delegated
        manifest = {
            "model": {"name": name, "version": opts.version, "source_sha256": model.sha256, "source": Path(model_path).name},
            "tvm_version": tvm.__version__,
            "tandoor_version": _tandoor_version(),
            "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "targets": target_entries,
            "inputs": [{**i.as_dict(), "layout": opts.layout if len(i.shape) == 4 else None} for i in model.inputs],
            "outputs": [o.as_dict() for o in model.outputs],
            "preprocess": preprocess,
            "postprocess": postprocess,
            "labels": "labels.txt" if opts.labels else None,
            "partitions": parts_manifest,
            "tvm_ops": [{"op": o.removeprefix("relax."), "reason": r} for o, r in result.tvm_ops],
            "ops_total": result.ops_total,
            "ops_delegated": ops_delegated,
            "flops_total": round(total_flops),
            "flops_delegated": round(sum(p.est.get("flops", 0) for p in kept)),
            "delegation_ratio": round(ops_delegated / result.ops_total, 4) if result.ops_total else 0.0,
            "predicted_speedup": round(cost.predicted_speedup(model_us, [p.est for p in kept]), 3),
            "model_tvm_us": round(model_us, 1),
            "profile": measured.manifest_entry() if measured else None,
            "policy": opts.policy,
            "layout_transposes": facts["layout_transposes"],
            "golden": golden,
            "graph": graph,
            "tolerance": TOLERANCE,
            "notes": model.notes,
        }
        progress(f"writing {out_path.name}")
        return hmod.write_bundle(out_path, manifest, members, private_key=key)


def _fallback_params(symbol: str, order: dict, blob: bytes, values: list[np.ndarray], members: dict) -> list[dict]:
    """Where the TVM fallback's weight parameters live: byte ranges of the order's blob when the
    bytes are identical (or, for a 2-D kernel, its transpose: ``perm``), else of
    ``fallback/<symbol>.params.bin`` (made here when needed)."""
    import hashlib

    known = {}
    for w in order["weights"].values():
        off, n = int(w["offset"]), int(w["nbytes"])
        known.setdefault(hashlib.sha256(blob[off:off + n]).digest(), off)
    extra = bytearray()
    out = []
    def le_bytes(x: np.ndarray) -> bytes:
        return np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False).tobytes()

    for a in values:
        data = le_bytes(a)
        spec = {"member": f"orders/{symbol}.bin", "offset": known.get(hashlib.sha256(data).digest()),
                "nbytes": len(data), "shape": list(a.shape), "dtype": str(a.dtype)}
        if spec["offset"] is None and a.ndim == 2:  # a dense kernel is the order's, transposed
            off = known.get(hashlib.sha256(le_bytes(a.T)).digest())
            if off is not None:
                spec.update(offset=off, shape=list(a.T.shape), perm=[1, 0])
        if spec["offset"] is None:
            extra.extend(b"\0" * (-len(extra) % 64))
            spec.update(member=f"fallback/{symbol}.params.bin", offset=len(extra))
            extra.extend(data)
        out.append(spec)
    if extra:
        members[f"fallback/{symbol}.params.bin"] = bytes(extra)
    return out


def _flops(func) -> float:
    from tvm import relax
    import tvm as _tvm

    total = 0.0

    def visit(e):
        nonlocal total
        if isinstance(e, relax.Call) and isinstance(e.op, _tvm.ir.Op):
            total += cost.op_flops(e)

    relax.analysis.post_order_visit(func.body, visit)
    return total
