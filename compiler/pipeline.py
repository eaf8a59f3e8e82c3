"""The compiler, start to finish: ONNX model -> signed hybrid module bundle (.hmod).

``compile_model`` runs these stages, each a function below, in this order; an unexpected failure
in one is an InternalError (exit 3) naming the stage, a bad input a CompileError (exit 2):

    load       frontend.load: read, check, normalise (compiler/stages/normalise.py), pin shapes, fold;
               hatch.cut: nodes neither ACL nor the device's TVM runtime runs -> onnxruntime orders;
               with npu, what the NPU's table takes (compiler/backends/rknn/npu.py) -> rknn orders
    npu        (npu only) each rknn order converted by the RKNN toolkit (compiler/backends/rknn/, its own
               venv) and checked in its simulator against onnxruntime; past its tolerance: refused
    import     importer.to_relax: ONNX -> Relax with weights as constants
    optimise   passes.optimise: fold, NHWC, layout transposes cancelled
    partition  the ACL table -> merged regions -> the cost policy keeps what pays -> symbols
    codegen    each kept region -> an order (+ ONNX rendering, + TVM fallback module); each
               onnxruntime order -> its order + the original nodes as ONNX
    build      the TVM side and every fallback, per target (aarch64 cross-compiled); a call to a
               packed function the device's runtime lacks refuses the compile (hatch.check_runtime)
    golden     onnxruntime on the source model: pairs the device (and the check) replays
    write      hmod.write_bundle to a temporary name beside the output
    check      the written bundle's own golden self-test in a separate process (the agent's
               health check: the host lib with its auto executors and with the TVM fallbacks);
               a mismatch refuses the bundle, so a wrong one is never written (unless check=False)

Before all of them the compile cache (compiler/cache.py) is asked: the same model bytes, options and
compiler source compiled before on this machine give that bundle back, re-signed and re-dated, in
well under a second (``cache=False``, ``tandoor compile --no-cache``, skips it). ``timings``, a dict
the caller passes, receives the seconds each stage took (``tandoor compile --timings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandoor_contract import agreement, backends, durable, hmod, media, orders, probe

from . import cache as cache_mod
from .stages import check_facts, frontend
from .backends.acl import order_onnx
from .int8 import quantize
from .backends.rknn import stages as npu_stages
from .stages import profile as profile_mod
from . import targets as targets_mod
from .errors import CompileError, InternalError

GOLDEN_PAIRS = 2


@dataclass
class Options:
    inputs: list[str] = field(default_factory=list)   # "NAME=1x3x224x224" pins
    targets: list[str] = field(default_factory=list)
    key: Path | None = None
    labels: Path | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    layout: str | None = None     # None: media.guess_layout of the input shape
    bgr: bool = False
    policy: str = "cost"          # cost | all | none (none: everything in TVM, for benchmarks)
    name: str | None = None
    version: str = "1"
    profile: Path | None = None   # tandoor profile output: measured numbers over estimates
    check: bool = True            # run the written bundle's golden self-test before it replaces anything
    measure: str = "auto"         # auto | on | off: decide from times measured here (host targets only)
    build: int | None = None      # a build number the build system counts up: devices refuse older ones
    # how frames become the input and what decodes the outputs (tandoor_contract.media)
    resize: str = "stretch"       # stretch | letterbox
    letterbox_align: str = "center"
    pad_value: int = 114
    pixel_range: str | None = None  # "0-1" | "0-255"; None: from the mean/std units
    decoder: str | None = None
    decoder_options: dict = field(default_factory=dict)  # conf, iou, max_det and the decoder's own
    cache: bool = True            # take the bundle from the compile cache when it holds it (compiler/cache.py)
    # the RK3588's NPU (compiler/backends/rknn/): what its table takes becomes rknn orders, converted by the
    # RKNN toolkit (compiler/backends/rknn/toolkit.py) in int8 (calibrated on npu_samples: model inputs made from the
    # calibration frames by the bundle's preprocessing) or fp16
    npu: bool = False
    npu_dtype: str = "int8"
    npu_samples: list | None = None
    npu_judged: bool = False      # a --max-drop judges the NPU on real frames after: the orders' bound only warns
    gpu_tuning: Path | None = None  # a MetaSchedule database for the GPU part (compiler/backends/cuda)


def _tandoor_version() -> str:
    try:
        from importlib.metadata import version

        return version("tandoor")
    except Exception:
        return "0"


def preprocess_entry(opts: Options, shape: list[int], dtype: str = "float32") -> dict | None:
    """The manifest's preprocess entry for the first input (of ``shape`` and ``dtype``)."""
    if opts.mean is None and opts.std is None and not opts.bgr and opts.resize == "stretch" \
            and opts.pixel_range is None:
        return None
    layout = opts.layout or media.guess_layout(shape)
    if media.raw_pixels(dtype):   # the graph normalises: only the geometry and colour order are ours
        given = [f for f, v in (("--mean", opts.mean), ("--std", opts.std), ("--pixel-range", opts.pixel_range))
                 if v is not None]
        if given:
            raise CompileError(f"{' and '.join(given)} cannot apply: the model's input is {dtype}, raw pixels 0..255 that "
                               "the model normalises inside its graph (Cast, then Sub/Mul/Div); drop them")
        return media.preprocess_entry(resize=opts.resize, align=opts.letterbox_align, pad_value=opts.pad_value,
                                      scale=1.0, bgr=opts.bgr, layout=layout)
    chans = shape[1 if layout == "NCHW" else -1]
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
                                      mean=mean, std=std, scale=scale, bgr=opts.bgr, layout=layout)
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


def _media(opts: Options, inputs: list[dict], members: dict) -> dict:
    """What the manifest says about frames and results (how a frame becomes each input, what decodes
    the outputs, the labels) from ``inputs`` (the manifest's input specs); ``labels.txt`` goes into
    ``members`` or out of it. None of it changes what is compiled: the compile cache rewrites it on a
    hit, so one model compiled with other --mean/--decoder/--conf flags is not compiled again."""
    if opts.labels:
        members["labels.txt"] = Path(opts.labels).read_bytes()
    else:
        members.pop("labels.txt", None)
    return {
        "inputs": [{**i, "layout": (opts.layout or media.guess_layout(i["shape"])) if len(i["shape"]) == 4 else None}
                   for i in inputs],
        "preprocess": preprocess_entry(opts, inputs[0]["shape"], inputs[0]["dtype"]) if inputs else None,
        "postprocess": _postprocess(opts),
        "labels": "labels.txt" if opts.labels else None,
    }


def _npy(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


STAGES = ("cache", "startup", "load", "npu", "import", "optimise", "partition", "measure", "codegen", "build", "golden", "write", "check")
MEASURES = ("auto", "on", "off")
POLICIES = ("cost", "all", "none")


@contextlib.contextmanager
def stage(name: str, timings: dict | None = None):
    """Run one stage: the user's errors pass through; anything else becomes one line naming it.
    TANDOOR_FAILPOINT=compile:<stage> makes the stage fail (tests of that path). ``timings``
    accumulates the stage's seconds under its name."""
    t0 = time.perf_counter()
    try:
        if os.environ.get("TANDOOR_FAILPOINT") == f"compile:{name}":
            raise RuntimeError(f"failpoint compile:{name}")
        yield
    except (CompileError, hmod.BundleError, KeyboardInterrupt):
        raise
    except Exception as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise InternalError(f"internal error in stage {name}: {type(err).__name__}: {text[:400]}") from err
    finally:
        if timings is not None:
            timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - t0, 3)


def compile_model(model: str | Path, out: str | Path, opts: Options | None = None, *,
                  progress: Callable[[str], None] | None = None, timings: dict | None = None,
                  **options) -> dict:
    """Compile ``model`` (an .onnx path) into the bundle ``out`` (.hmod); returns the manifest as
    written.

    Keyword arguments are the fields of :class:`Options` (``inputs=["x=1x3x224x224"]``,
    ``targets=["aarch64"]``, ``key=``, ``labels=``, ``mean=``, ``std=``, ``layout=``, ``bgr=``,
    ``policy="cost"|"all"|"none"``, ``profile=``, ``name=``, ``version=``, ``check=True``,
    ``cache=True``, ``npu=True`` with ``npu_dtype="int8"|"fp16"`` and ``npu_samples=`` (lists of
    model inputs to calibrate and check on; rk3588 targets)), or pass an ``Options``. ``progress(message)`` is called as each stage starts;
    ``timings`` (a dict) receives each stage's seconds.

    Raises CompileError (bad input, exit 2) or InternalError (a stage failed, exit 3). Nothing is
    written at ``out`` unless every stage, the self-check included, succeeded.
    """
    opts = dataclasses.replace(opts, **options) if opts is not None else Options(**options)
    say = progress or (lambda s: None)
    out_path = Path(out)
    if out_path.suffix != hmod.SUFFIX:
        raise CompileError(f"output {out_path} should end in {hmod.SUFFIX}")
    if not out_path.parent.is_dir():
        raise CompileError(f"output directory {out_path.parent} does not exist")
    if opts.policy not in POLICIES:
        raise CompileError(f"unknown --policy {opts.policy}; choose {', '.join(POLICIES)}")
    if opts.measure not in MEASURES:
        raise CompileError(f"unknown --measure {opts.measure}; choose {', '.join(MEASURES)}")
    tgts = targets_mod.resolve(opts.targets)
    key = hmod.load_private_key(opts.key) if opts.key else None
    for label, path in (("--labels", opts.labels), ("--profile", opts.profile)):
        if path is not None and not Path(path).is_file():
            raise CompileError(f"{label} {path}: no such file")

    if opts.gpu_tuning is not None and not any(t.gpu for t in tgts):
        raise CompileError("--gpu-tuning is for a GPU part: give --target jetson-orin or cuda-sm90")
    if opts.npu:
        npu_stages.check_options(opts, tgts, calibrated=bool(opts.npu_samples))

    ckey = None
    # a failpoint tests a stage: it must run, not come from the cache
    if opts.cache and Path(model).is_file() and not os.environ.get("TANDOOR_FAILPOINT", "").startswith("compile:"):
        with stage("cache", timings):
            ckey = cache_mod.key(model, opts, [t.name for t in tgts])
    if ckey is None:
        return _compile(model, out_path, opts, tgts, key, say, timings, None)
    with cache_mod.locked(ckey):    # a second compile of the same thing waits for this one, then hits
        with stage("cache", timings):
            entry = cache_mod.get(ckey)
        if entry is not None:
            written = _from_cache(entry, out_path, opts, key, say, timings)
            if written is not None:
                return written
        return _compile(model, out_path, opts, tgts, key, say, timings, ckey)


def _compile(model, out_path: Path, opts: Options, tgts, key, say, timings: dict | None,
             ckey: str | None) -> dict:
    """The stages, start to finish; with ``ckey``, the checked bundle also goes into the cache."""
    # these import TVM (2-3 s of a compile's start): here, so that a compile the cache serves never does
    global codegen, cost, hatch, importer, partition, passes, report
    with stage("startup", timings):
        from .stages import codegen, cost, importer, partition, passes
        from .backends.onnx import hatch
        from . import report

    say("loading and normalising the ONNX model")
    npu_summary = None
    with stage("load", timings):
        loaded = frontend.load(model, opts.inputs)
        picked, npu_source, board_profile = npu_stages.pick(loaded, opts, say) if opts.npu else \
            (None, None, None)
        loaded.tvm_proto, loaded.hatch = npu_stages.cut(loaded, opts.name or loaded.name, picked)
    for g in loaded.hatch:
        say(f"{g.symbol}: {len(g.nodes)} node(s) to {'the NPU' if g.kind == backends.RKNN else 'onnxruntime'}"
            + (f" ({', '.join(g.op_types)})" if g.kind == backends.ONNX else "") + (" after the TVM part" if g.tail else ""))
    converted = None
    if picked is not None:
        with stage("npu", timings):
            converted = npu_stages.convert(loaded, opts, picked, say, GOLDEN_PAIRS)
            npu_summary = npu_stages.manifest(loaded, picked, converted.orders, npu_source)
    _media(opts, [i.as_dict() for i in loaded.inputs], {})     # a bad --mean or --decoder fails here, before the work
    say("importing into TVM Relax")
    with stage("import", timings):
        mod = importer.to_relax(loaded)
    say("optimising the graph (constants, BatchNorm, NHWC, transposes)")
    with stage("optimise", timings):
        mod, facts = passes.optimise(mod)
    with stage("partition", timings):
        plan = _partition(mod, loaded, opts, tgts, say, measured=board_profile)
    if _measures(opts, tgts, plan):
        with stage("measure", timings):
            measured = _measure_here(mod, loaded, opts, tgts, say)
        if measured is not None:
            with stage("partition", timings):
                plan = _partition(mod, loaded, opts, tgts, say, measured=measured, source="measured here")
    say(f"writing orders for {len(plan.kept)} delegated subgraph(s)")
    with stage("codegen", timings):
        members, parts_manifest, fallbacks = _codegen(plan)
    with stage("build", timings):
        # a GPU target's library takes the whole TVM side, ACL's regions too (policy none): a Jetson's
        # GPU outruns ACL on its CPU cores; only the onnxruntime orders stay (compiler/backends/cuda)
        gpu_mod = _partition(mod, loaded, opts, tgts, lambda s: None, policy="none").result.mod \
            if any(t.gpu for t in tgts) and opts.policy != "none" else None
        target_entries = _build(plan, fallbacks, tgts, members, say, gpu_mod, opts.gpu_tuning)
    say("recording golden input/output pairs with onnxruntime")
    with stage("golden", timings):
        # an NPU bundle's pairs are held-out frames: INT8 is calibrated for frames, not noise
        golden, tolerance = _golden_members(loaded, members, converted.check[:GOLDEN_PAIRS]
                                            if converted is not None and converted.held_out else None)
        if converted is not None and converted.orders:
            npu_stages.promise(tolerance, loaded, converted, opts.npu_dtype)
    manifest = _manifest(loaded, opts, plan, facts, parts_manifest, target_entries, golden, model, members,
                         tolerance)
    if npu_summary is not None:
        manifest["npu"] = npu_summary
    if ckey is not None:
        manifest["cache"] = {"key": ckey, "hit": False}
    with stage("golden", timings):   # a QDQ model: golden within quantization steps, not fp32's tolerance
        manifest.update(quantize.manifest_entries(loaded, int8_share=(
            manifest["flops_delegated_int8"] / manifest["flops_total"] if manifest["flops_total"] else 0.0)) or {})

    def keep(staged: Path, written: dict) -> None:     # the checked bundle, before it is the user's
        if ckey is not None:
            with stage("cache", timings):
                cache_mod.put(ckey, staged, {"checked": opts.check, "compiled": written["created"],
                                             "model": written["model"]["name"], "source": Path(model).name,
                                             "targets": list(written["targets"])})

    return _write(out_path, manifest, members, key, opts.check, say, timings, then=keep)


def _write(out_path: Path, manifest: dict, members: dict, key, check: bool, say, timings: dict | None,
           then: Callable[[Path, dict], None] = lambda staged, written: None) -> dict:
    """Write the bundle beside ``out_path``, self-check it (``check``), call ``then`` on it, and only
    then move it to ``out_path``: a failure anywhere leaves whatever was there."""
    staged = out_path.with_name(f".{out_path.name}.unchecked")
    try:
        say(f"writing {out_path.name}")
        with stage("write", timings):
            written = hmod.write_bundle(staged, manifest, members, private_key=key)
        if check:
            say("checking the bundle: its golden self-test with the host lib")
            with stage("check", timings):
                _self_check(staged)
        then(staged, written)
        os.replace(staged, out_path)
        durable.fsync_dir(out_path.parent)
    finally:
        staged.unlink(missing_ok=True)
    return written


def _from_cache(entry: cache_mod.Entry, out_path: Path, opts: Options, key, say, timings: dict | None) -> dict | None:
    """The cached bundle written at ``out_path`` with this compile's manifest-only fields (version,
    build), a new ``created`` and this key's signature; checked first when it was cached unchecked
    and this compile wants the check. None when the entry turns out damaged (it is dropped)."""
    say(f"taking the bundle from the compile cache (entry {entry.key[:12]}, compiled {entry.meta.get('compiled')})")
    with stage("cache", timings):
        try:
            with hmod.open_bundle(entry.bundle) as b:
                manifest = dict(b.manifest)
                members = {n: b.read(n) for n in manifest.get("files") or {}}
        except hmod.BundleError:
            cache_mod.drop(entry.key)
            return None
    manifest.pop("files", None)
    manifest.pop("format_version", None)
    manifest.update(_media(opts, manifest["inputs"], members))
    manifest["model"] = {**manifest["model"], "version": opts.version}
    manifest.pop("build", None)
    if opts.build is not None:
        manifest["build"] = int(opts.build)
    manifest["cache"] = {"key": entry.key, "hit": True, "compiled": manifest.get("created")}
    manifest["created"] = _now()
    check = opts.check and not entry.meta.get("checked")
    return _write(out_path, manifest, members, key, check, say, timings,
                  then=lambda staged, written: cache_mod.mark_checked(entry) if check else None)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class Plan:
    """What the partition stage decided: the module with its regions, and the numbers behind it."""
    name: str
    result: partition.PartitionResult
    kept: list[partition.Partition]     # the delegated partitions
    total_flops: float
    model_us: float
    measured: profile_mod.Measured | None   # with compile --profile
    arch: str
    hatch: list = field(default_factory=list)   # onnxruntime orders (compiler/backends/onnx/hatch.py Group)


def _partition(mod, loaded: frontend.LoadedModel, opts: Options, tgts, say,
               measured: profile_mod.Measured | None = None, policy: str | None = None,
               source: str = "profile") -> Plan:
    """The ACL table's regions, each kept only if the cost policy (compiler/stages/cost.py) says it pays:
    from estimates, from a profile given with --profile, or from ``measured`` here."""
    total_flops = cost.module_flops(mod["main"])
    arch = cost.arch_of(tgts)
    policy = policy or opts.policy
    if measured is not None:
        arch = measured.arch
    elif opts.profile is not None:
        say(f"checking the profile {Path(opts.profile).name}")
        measured = profile_mod.load_for_compile(opts.profile, loaded, arch)
        arch = measured.arch
    model_us = measured.model_tvm_us if measured and measured.model_tvm_us else cost.model_tvm_us(mod["main"], arch)

    def keep(p: partition.Partition) -> tuple[bool, str]:
        est = cost.estimate(p.func, arch)
        f = est["flops"]      # per call site: a region calls a shared composite function once per use
        m = measured.subgraph(p) if measured else None
        ok, reason, nums = cost.decide(est, model_us, m, source=source)
        p.est = {"flops": f, "share": round(f / total_flops, 6) if total_flops else 0.0, "bytes": est["bytes"],
                 "boundary_bytes": est["boundary_bytes"], "arch": arch, **nums}
        if m is not None:   # what the estimate said, beside what was measured: how far off it was
            p.est["estimated"] = cost.estimate_error(est, m)
        if measured and m is None:
            p.est["source"] = "estimate (subgraph not in the profile)"
        if policy == "none":
            return False, "policy none: everything runs in TVM"
        if policy == "all":
            return True, "policy all (" + reason + ")"
        return ok, reason

    say("partitioning for ACL")
    name = opts.name or loaded.name
    result = partition.partition(mod, name, keep)
    return Plan(name, result, [p for p in result.partitions if p.delegate], total_flops, model_us, measured, arch,
                loaded.hatch)




def _measures(opts: Options, tgts, plan: Plan) -> bool:
    """Measure when the decisions are for this machine (no board target), the cost policy decides,
    no profile was given, and there is something to decide."""
    if opts.measure == "off" or opts.profile is not None or opts.policy != "cost" or not plan.result.partitions:
        return False
    here = all(getattr(t, "name", "host") == "host" for t in tgts)
    if opts.measure == "on" and not here:
        raise CompileError("--measure on needs host-only targets: a board's times come from the board "
                           "(tandoor-agent profile there, then compile --profile)")
    return here


def _measure_here(mod, loaded: frontend.LoadedModel, opts: Options, tgts, say) -> profile_mod.Measured | None:
    """Every candidate region delegated (policy all), built for this machine, then timed here by
    the agent's own profiler in a fresh process (`tandoor-agent profile`, a few runs each): the
    times the cost policy then decides from. Without the agent installed, the estimates decide."""
    agent = Path(sys.executable).parent / "tandoor-agent"
    if not agent.exists():
        return None
    host = [t for t in tgts if t.name == "host"]
    candidates = _partition(mod, loaded, opts, host, say, policy="all")
    members, parts_manifest, fallbacks = _codegen(candidates)
    target_entries = _build(candidates, fallbacks, host, members, say)
    golden, tolerance = _golden_members(loaded, members)
    manifest = _manifest(loaded, opts, candidates, {"layout_transposes": 0}, parts_manifest, target_entries,
                         golden, loaded.path, members, tolerance)
    with tempfile.TemporaryDirectory(prefix="tandoor-measure-") as tmp:
        bundle, prof = Path(tmp) / "candidates.hmod", Path(tmp) / "profile.json"
        hmod.write_bundle(bundle, manifest, members)
        # Arm NN here is CpuRef unless this is an Arm machine: a reference backend, seconds per call
        execs = ["onnxruntime", "tvm"] + (["armnn"] if hmod.machine_arch() == "aarch64" else [])
        say(f"measuring {len(candidates.kept)} candidate subgraph(s) here on {', '.join(execs)}")
        cmd = [str(agent), "profile", str(bundle), "-o", str(prof), "--runs", str(MEASURE_RUNS),
               "--warmup", str(MEASURE_WARMUP)] + [a for e in execs for a in ("--executor", e)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            tail = " ".join((res.stderr or res.stdout).strip().splitlines()[-1:])[:300]
            raise InternalError(f"internal error in stage measure: tandoor-agent profile failed ({tail})")
        return profile_mod.load_for_compile(prof, loaded, hmod.machine_arch())


MEASURE_RUNS, MEASURE_WARMUP = 7, 2


def _codegen(plan: Plan) -> tuple[dict, list[dict], dict]:
    """Orders (JSON + weights + ONNX rendering) per kept region, the manifest's partition entries,
    and each kept region as a TVM module (its fallback) with its weights lifted out."""
    members: dict[str, bytes | Path] = {}
    parts_manifest = []
    fallbacks = {}
    for p in plan.result.partitions:
        entry = {"symbol": p.symbol, "ops": [o.removeprefix("relax.") for o in p.ops], "composites": p.composites,
                 "delegate": p.delegate, "reason": p.reason, "est": p.est}
        if p.delegate and plan.measured and p.est.get("executor"):
            entry["executor"] = p.est["executor"]     # hint for the runtime's auto mode
        if p.delegate:
            order, blob = codegen.region_to_order(p.func, p.symbol)
            # a quantized order's per-channel scales go to the blob once, as float32, for all of its
            # readers (orders.scale_refs_out); compact JSON (indented, they were 1.6 MB of 12)
            stored, blob = orders.scale_refs_out(order, blob)
            blob = order_onnx.with_zero_run(order, blob)
            members[f"orders/{p.symbol}.json"] = json.dumps(stored, sort_keys=True, separators=(",", ":")).encode()
            members[f"orders/{p.symbol}.bin"] = blob
            # the ONNX rendering refers to the weights blob (external data) instead of copying it
            members[f"orders/{p.symbol}.onnx"] = order_onnx.order_to_onnx(
                stored, blob, external=f"{p.symbol}.bin").SerializeToString()
            # what the order gives on the probe inputs, for the device to check its Arm NN against
            members[f"orders/{p.symbol}.probe.npz"] = _probe(order, members[f"orders/{p.symbol}.onnx"], p.symbol, blob)
            entry.update(order=f"orders/{p.symbol}.json", weights=f"orders/{p.symbol}.bin", onnx=f"orders/{p.symbol}.onnx",
                         onnx_external={f"{p.symbol}.bin": f"orders/{p.symbol}.bin"},
                         probe=f"orders/{p.symbol}.probe.npz")
            # per-channel weights: no member for Arm NN's TfLite parser, the agent makes it from the
            # order (agent/run/executors/armnn_tflite.py)
            # The fallback is compiled without its weights: they are passed in at load time, read from
            # the order's blob where the bytes are the same (most are), else from a small params member.
            fb_mod, values = codegen.region_as_module(p.func, lift_weights=True)
            entry["fallback_params"] = _fallback_params(p.symbol, stored, blob, values, members)
            fallbacks[p.symbol] = fb_mod
        parts_manifest.append(entry)
    for g in plan.hatch:
        member = f"orders/{g.symbol}"
        members[f"{member}.onnx"] = g.onnx_bytes
        if g.tail:      # not a VM call: the manifest's ``tail`` (_manifest) says how it runs
            continue
        members[f"{member}.json"] = json.dumps(g.order(), sort_keys=True, separators=(",", ":")).encode()
        if g.kind == backends.RKNN:
            members[f"{member}.rknn"] = g.rknn_blob
        parts_manifest.append(g.manifest_entry(member))
    return members, parts_manifest, fallbacks


PROBE_DRIFT_SEEDS = (1, 2)


def _probe(order: dict, onnx_bytes: bytes, symbol: str, blob: bytes) -> bytes:
    """onnxruntime's outputs of the order's ONNX rendering on the probe inputs, sampled
    (tandoor_contract.probe); for an INT8 order, with each quantized output's drift under
    check_facts.requant_flips (the most over PROBE_DRIFT_SEEDS)."""
    import onnx
    import onnxruntime as ort

    from .stages.check_facts import requant_flips

    def session(model: bytes):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        ext = np.frombuffer(blob, np.uint8)
        so.add_external_initializers_from_files_in_memory([f"{symbol}.bin"], [ext], [len(blob)])
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])

    names = [o["name"] for o in order["outputs"]]
    feeds = dict(zip([i["name"] for i in order["inputs"]], probe.inputs(order)))
    outs = session(onnx_bytes).run(names, feeds)
    if not orders.is_quantized(order) or not any(np.asarray(o).dtype.kind in "iu" for o in outs):
        return probe.pack(outs)
    try:
        rendering = onnx.load_from_string(onnx_bytes)
        runs = [session(requant_flips(rendering, seed=seed).SerializeToString()).run(names, feeds)
                for seed in PROBE_DRIFT_SEEDS]
    except Exception:   # no drift recorded: the agent keeps the strict rule for this order
        return probe.pack(outs)
    drift = []
    for j, a in enumerate(outs):
        if np.asarray(a).dtype.kind not in "iu":
            drift.append(None)
            continue
        steps = [np.abs(np.asarray(a, np.int64) - np.asarray(r[j], np.int64)) for r in runs]
        drift.append((max(float(np.mean(s > 1)) for s in steps), max(float(s.max()) for s in steps)))
    return probe.pack(outs, drift)


def _build(plan: Plan, fallbacks: dict, tgts, members: dict, say, gpu_mod=None, gpu_tuning=None) -> dict:
    """The TVM side and every fallback, per target; libs become members. ``gpu_mod``: the module a
    GPU target's libraries are built from (else the CPU libs' lowered module and lib_params)."""
    lowered, values = codegen.lift_main_weights(codegen.lower_regions(plan.result.mod))
    lib_params = _params_member(values, hmod.LIB_PARAMS, members)
    provided = frozenset([p.symbol for p in plan.kept] + [g.symbol for g in plan.hatch if not g.tail])
    merged = codegen.merge_fallbacks(fallbacks) if fallbacks else None
    target_entries, gpu_side = {}, None
    with tempfile.TemporaryDirectory(prefix="tandoor-") as tmp:
        tmpd = Path(tmp)
        for t in tgts:
            say(f"compiling the TVM part for {t.name}")
            lib = tmpd / f"{t.name}.so"
            codegen.build(lowered, t.llvm, lib, t.cross_cc, provided)
            # packed when the bundle is format 4 anyway (fallbacks or lib_params): older agents
            # still get every bundle they could run
            member = hmod.packed_lib(t.name) if fallbacks or lib_params else f"lib/{t.name}.so"
            members[member] = hmod.pack_lib(lib.read_bytes()) if member.endswith(hmod.PACKED) else lib.read_bytes()
            entry = {"arch": t.arch, "lib": member, "llvm": t.llvm, "fallback": {}}
            if lib_params:
                entry["lib_params"] = lib_params    # the same member for every target
            if t.gpu:   # the TVM side for the target's NVIDIA GPU, one library per SM, its own weights
                from tandoor_contract import gpu as gpu_contract

                from .backends import cuda

                gpu_side = gpu_side or ((lowered, None) if gpu_mod is None else
                                        codegen.lift_main_weights(codegen.lower_regions(gpu_mod)))
                on_gpu = frozenset(g.symbol for g in plan.hatch if not g.tail) if gpu_mod is not None else provided
                if part := cuda.bundle_part(gpu_side[0], t, on_gpu, tmpd, members, member.endswith(hmod.PACKED), say,
                                            gpu_tuning):
                    gpu_params = lib_params if gpu_side[1] is None else cuda.shared_params(
                        gpu_side[1], members, lib_params, lambda vs: _params_member(vs, gpu_contract.PARAMS, members))
                    if gpu_params:
                        part["lib_params"] = gpu_params
                    entry["gpu"] = {**part, "orders": sorted(on_gpu)}    # the orders its libraries call
            if merged is not None:
                # one library for every subgraph, a function each (hmod.fallback_function)
                say(f"compiling the TVM fallbacks of {len(fallbacks)} subgraph(s) for {t.name}")
                member = hmod.fallback_lib(t.name)
                fb = tmpd / f"{t.name}.fallback.so"
                codegen.build(merged, t.llvm, fb, t.cross_cc)
                members[member] = hmod.pack_lib(fb.read_bytes())
                entry["fallback"] = {symbol: member for symbol in fallbacks}
            target_entries[t.name] = entry
    return target_entries


def _golden(model: frontend.LoadedModel, n: int, inputs: list[list[np.ndarray]] | None = None) \
        -> tuple[list[tuple[list[np.ndarray], list[np.ndarray]]], list[dict[str, np.ndarray]], check_facts.Facts]:
    """``n`` golden pairs from onnxruntime (on ``inputs``, else probe inputs), each run's tensors
    the check needs to know about (compiler/stages/check_facts.py), and the model's facts."""
    import onnxruntime as ort

    try:
        facts = check_facts.analyse(model.proto)
        ref = check_facts.Reference(model.proto, facts, noisy=True)
    except Exception as err:
        text = " ".join(str(err).split())
        raise CompileError(f"{model.path.name}: onnxruntime {ort.__version__} cannot run this model ({text[:240]}); "
                           "the bundle's golden pairs need it as the reference: export the model with ops and "
                           "opsets onnxruntime runs") from None
    pairs, runs = [], []
    for k in range(n if inputs is None else len(inputs)):
        # probe inputs are not stored: the device makes the same bits (hmod GENERATED)
        ins = probe.inputs({"inputs": [i.as_dict() for i in model.inputs]}, seed=k + 1) if inputs is None else inputs[k]
        feeds = {i.name: a for i, a in zip(model.inputs, ins)}
        pairs.append(([feeds[i.name] for i in model.inputs], ref.run(feeds)))
        runs.append(ref.last)
    return pairs, runs, facts


def _golden_members(loaded: frontend.LoadedModel, members: dict,
                    inputs: list[list[np.ndarray]] | None = None) -> tuple[list[dict], dict]:
    """The manifest's golden entries (outputs, the elements ties make arbitrary, and ``inputs``
    when given, as members) and the tolerance the compiler promises (compiler/stages/check_facts.py)."""
    golden = []
    pairs, runs, facts = _golden(loaded, GOLDEN_PAIRS, inputs)
    tied = [check_facts.ties(facts, run) for run in runs]
    for k, ((ins, outs), free_of) in enumerate(zip(pairs, tied)):
        g = {"inputs": hmod.GENERATED, "seed": k + 1, "outputs": []}
        if inputs is not None:
            g = {"inputs": [], "outputs": []}
            for j, a in enumerate(ins):
                members[f"golden/input_{k}_{j}.npy"] = _npy(a)
                g["inputs"].append(f"golden/input_{k}_{j}.npy")
        for j, a in enumerate(outs):
            members[f"golden/output_{k}_{j}.npy"] = _npy(a)
            g["outputs"].append(f"golden/output_{k}_{j}.npy")
        for j, (name, free) in enumerate(free_of.items()):
            members[f"golden/ties_{k}_{j}.npy"] = _npy(free)
            g.setdefault("ties", {})[name] = f"golden/ties_{k}_{j}.npy"
        golden.append(g)
    return golden, check_facts.promise(facts, runs, tied)


def _manifest(loaded, opts: Options, plan: Plan, facts: dict, parts_manifest, target_entries, golden,
              model, members: dict, tolerance: dict) -> dict:
    import tvm

    result, kept = plan.result, plan.kept
    return {
        "model": {"name": plan.name, "version": opts.version, "source_sha256": loaded.sha256, "source": Path(model).name},
        **({"build": int(opts.build)} if opts.build is not None else {}),
        "tvm_version": tvm.__version__,
        "tandoor_version": _tandoor_version(),
        "created": _now(),
        "targets": target_entries,
        **_media(opts, [i.as_dict() for i in loaded.inputs], members),   # inputs, preprocess, postprocess, labels
        "outputs": [o.as_dict() for o in loaded.outputs],
        **({"tail": tail} if (tail := hatch.tail_entry(loaded.proto, loaded.hatch)) else {}),
        "partitions": parts_manifest,
        "tvm_ops": [{"op": o.removeprefix("relax."), "reason": r} for o, r in result.tvm_ops],
        "ops_total": result.ops_total,
        "ops_delegated": result.ops_delegated,
        "flops_total": round(plan.total_flops),
        "flops_delegated": round(sum(p.est.get("flops", 0) for p in kept)),
        "flops_delegated_int8": round(sum(cost.int8_flops(p.func) for p in kept)),
        "delegation_ratio": round(result.ops_delegated / result.ops_total, 4) if result.ops_total else 0.0,
        "predicted_speedup": round(cost.predicted_speedup(plan.model_us, [p.est for p in kept]), 3),
        "model_tvm_us": round(plan.model_us, 1),
        "profile": plan.measured.manifest_entry() if plan.measured else None,
        "policy": opts.policy,
        "layout_transposes": facts["layout_transposes"],
        "boundaries": report.boundaries(result.mod),
        "golden": golden,
        "graph": report.graph_of(result.mod),
        "tolerance": tolerance,     # per output and path (tandoor_contract.agreement)
        **({"fp16": loaded.fp16} if loaded.fp16 else {}),    # what was fp16, now fp32, and the drift
        "notes": loaded.notes,
    }


# The check runs where the bundle would: the agent's own health check in a fresh process that loads
# TVM's runtime only, as the device's agent does (a function only the compiler library registers
# fails here as it would there), golden pairs only, with auto's executors and with the TVM
# fallbacks. The compiler never imports the agent; a machine with the compiler but not the agent
# skips the check.
_CHECK = ("import json, sys\n"
          "from tandoor_agent.run import lean\n"
          "lean.runtime_only()\n"
          "from tandoor_agent.update.health import health_check\n"
          "print(json.dumps([health_check(sys.argv[1], delegate=d, frames=0).to_dict() for d in sys.argv[2:]], "
          "default=str))\n")
CHECK_DELEGATES = agreement.CHECK_DELEGATES


def _self_check(path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("tandoor_agent") is None:
        return
    res = subprocess.run([sys.executable, "-c", _CHECK, str(path), *CHECK_DELEGATES], capture_output=True,
                         text=True, timeout=1800)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    if res.returncode != 0 or not lines:
        tail = " ".join((res.stderr or res.stdout).strip().splitlines()[-1:])[:300]
        raise InternalError(f"internal error in stage check: the self-check process failed ({tail})")
    for delegate, rep in zip(CHECK_DELEGATES, json.loads(lines[-1])):
        if not rep.get("ok"):
            raise CompileError(
                f"the compiled bundle does not reproduce the model (self-check with {delegate} executors: "
                f"{rep.get('reason')}); nothing was written. Report the model's traits, or use --no-check "
                "to write it anyway")


def _fallback_params(symbol: str, order: dict, blob: bytes, values: list[np.ndarray], members: dict) -> list[dict]:
    """Where the TVM fallback's weight parameters live: byte ranges of the order's blob when the
    bytes are identical (or, for a 2-D kernel, its transpose: ``perm``), else of
    ``fallback/<symbol>.params.bin`` (made here when needed)."""
    import hashlib

    known = {}
    ranges = [(int(w["offset"]), int(w["nbytes"])) for w in order["weights"].values()]
    for off, n in ranges + orders.scale_refs(order):   # a quantized op's scales are parameters too
        known.setdefault(hashlib.sha256(blob[off:off + n]).digest(), off)
    out, misses = [], []   # misses: (index, array) of the values no order range holds
    for a in values:
        data = _le_bytes(a)
        spec = {"member": f"orders/{symbol}.bin", "offset": known.get(hashlib.sha256(data).digest()),
                "nbytes": len(data), "shape": list(a.shape), "dtype": str(a.dtype)}
        if spec["offset"] is None and not a.any():    # zero points: the zeros the blob ends with
            spec["offset"] = order_onnx.zero_run(blob, len(data))
        if spec["offset"] is None and a.ndim == 2:  # a dense kernel is the order's, transposed
            off = known.get(hashlib.sha256(_le_bytes(a.T)).digest())
            if off is not None:
                spec.update(offset=off, shape=list(a.T.shape), perm=[1, 0])
        if spec["offset"] is None:
            misses.append((len(out), a))
        out.append(spec)
    extra = _params_member([a for _, a in misses], f"fallback/{symbol}.params.bin", members)
    for (i, _), spec in zip(misses, extra):
        out[i] = spec
    return out


def _le_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False).tobytes()


def _params_member(values: list[np.ndarray], member: str, members: dict) -> list[dict]:
    """``values`` laid out 64-byte aligned in ``member``: their specs ({member, offset, nbytes,
    shape, dtype}, as hmod.blob_array reads them); none and no member when there are none."""
    data, out = bytearray(), []
    for a in values:
        data.extend(b"\0" * (-len(data) % 64))
        raw = _le_bytes(a)
        out.append({"member": member, "offset": len(data), "nbytes": len(raw), "shape": list(a.shape),
                    "dtype": str(a.dtype)})
        data.extend(raw)
    if out:
        members[member] = bytes(data)
    return out
