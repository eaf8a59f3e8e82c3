"""`tandoor`: the host-side tools (compile, inspect, verify, bench, profile, keygen, fleet).

Every command answers a bad input with one line naming the problem and the fix (exit 2, or the
error family's own code) and an unexpected failure with one line naming where it happened (exit 3);
``--debug`` (or TANDOOR_DEBUG=1) adds the traceback and what TVM printed natively.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract import agreement, hmod, media, orders
from tandoor_contract.errors import TandoorError

from .inputs import InputFile
from .quantize import (
    accuracy_options,
    budget_options,
    check_budget,
    judge,
    keep_fp32_option,
    lead_option,
    print_lead,
    quantize,
    verify_on_images,
)

DEBUG = os.environ.get("TANDOOR_DEBUG", "") not in ("", "0")
_native_log: Path | None = None     # where fd 2 goes while a command runs (without --debug)


def _fail(err: BaseException) -> None:
    if DEBUG:
        traceback.print_exception(err.__cause__ or err, file=sys.stderr)
    click.echo(f"tandoor: error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 2))


def _set_debug(ctx, param, value) -> None:
    global DEBUG
    if value:
        DEBUG = True


def debug_option(f):
    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                        help="On failure, print the traceback and what TVM printed natively.")(f)


class _Tool(click.Group):
    """The tandoor group: turns any error that reaches it into the one-line answer, and keeps what
    native code prints on fd 2 (TVM's C++ warnings, a compiler's chatter) off the user's screen
    unless --debug: fd 2 goes to a log file, Python's stderr to the real terminal."""

    def invoke(self, ctx):
        global DEBUG
        from tandoor_agent.run.lean import tvm_without_torch

        tvm_without_torch()    # TVM would import torch (3.5 s) when it is installed; no command needs it
        DEBUG = DEBUG or "--debug" in sys.argv[1:]     # a subcommand's --debug is parsed later than this
        if not DEBUG:
            warnings.simplefilter("ignore")     # TVM's importer warns about renamed inputs and the like
        with contextlib.ExitStack() as stack:
            if not DEBUG:
                stack.enter_context(_native_stderr_to_log())
            try:
                return super().invoke(ctx)
            except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
                raise
            except KeyboardInterrupt:
                click.echo("tandoor: interrupted; nothing was written", err=True)
                sys.exit(130)
            except TandoorError as err:
                _fail(err)
            except Exception as err:
                cmd = ctx.invoked_subcommand or "tandoor"
                text = " ".join(str(err).split()) or type(err).__name__
                _fail(_Internal(f"internal error in {cmd}: {type(err).__name__}: {text[:300]}; rerun with "
                                "--debug for the traceback", err))


class _Internal(TandoorError):
    exit_code = 3

    def __init__(self, msg: str, cause: BaseException) -> None:
        super().__init__(msg)
        self.__cause__ = cause


@contextlib.contextmanager
def _native_stderr_to_log():
    global _native_log
    fd, path = tempfile.mkstemp(prefix="tandoor-native-", suffix=".log")
    _native_log = Path(path)
    sys.stderr.flush()
    real = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    old = sys.stderr
    sys.stderr = os.fdopen(real, "w", buffering=1, closefd=False)
    try:
        yield
    finally:
        import gc

        gc.collect()               # native objects freed now print their farewells into the log
        sys.stderr.flush()
        sys.stderr = old
        os.dup2(real, 2)
        os.close(real)
        _native_log.unlink(missing_ok=True)


def _floats(text: str | None, opt: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise CompileError(f"{opt} '{text}': expected comma-separated numbers such as 0.485,0.456,0.406") from None


def _decoder_options(pairs: tuple[str, ...]) -> dict:
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        try:
            if not sep or not k:
                raise ValueError
            out[k.strip()] = json.loads(v)
        except ValueError:
            raise CompileError(f"--decoder-option {pair!r}: expected KEY=JSON, e.g. strides=[8,16,32] or agnostic=true") from None
    return out


@click.group(cls=_Tool, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tandoor")
@debug_option
def main() -> None:
    """Tandoor: compile ONNX vision models into ACL-partitioned hybrid modules for ARM boards."""


@main.command()
@click.argument("model", type=InputFile("model"))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Bundle to write (.hmod). Written atomically: a failed compile leaves nothing there.")
@click.option("--input", "inputs", multiple=True, metavar="NAME=1x3x224x224",
              help="Pin an input's shape (repeatable). Default: the model's static shape.")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="host, aarch64, rk3588, jetson-orin, rpi5, cuda-sm90 (repeatable). host is always included. "
                   "jetson-orin and cuda-sm90 (an x86_64 machine with an H100, for GPU checks) also get a GPU part: "
                   "the model for CUDA, sm_87 / sm_90 cubins (docs/gpu.md).")
@click.option("--gpu-tuning", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="A MetaSchedule tuning database (work dir) for the target's GPU: its records schedule the GPU "
                   "part's functions they cover, dlight's default rules the rest (docs/gpu.md).")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), help="Ed25519 private key (tandoor keygen) to sign with.")
@click.option("--labels", type=click.Path(dir_okay=False, path_type=Path), help="Class labels, one per line.")
@click.option("--mean", help="Per-channel mean, e.g. 0.485,0.456,0.406 (0..1 units) or 127,127,127 (pixel units).")
@click.option("--std", help="Per-channel std, same units as --mean.")
@click.option("--layout", type=click.Choice(["NCHW", "NHWC"]), default=None,
              help="Input image layout. Default: from the input's shape (a last axis of 1 or 3 channels is NHWC).")
@click.option("--bgr", is_flag=True, help="The model expects BGR channel order.")
@click.option("--policy", type=click.Choice(["cost", "all", "none"]), default="cost", show_default=True,
              help="cost: delegate a subgraph only when its gain beats its boundary cost (compiler/cost.py); "
                   "all: every supported op; none: nothing (TVM only, for benchmarks).")
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path),
              help="A profile from 'tandoor profile': measured times over estimates, executor chosen per subgraph. "
                   "Refused when its key (model, shapes, library versions) does not match.")
@click.option("--name", help="Model name in the manifest (default: from the ONNX graph or file name).")
@click.option("--model-version", "version", default="1", show_default=True, help="Model version in the manifest.")
@click.option("--build", type=click.IntRange(0), default=None,
              help="Build number (your CI's counter) in the signed manifest: devices refuse a bundle whose build is "
                   "older than the committed one unless the job allows a downgrade (docs/updates.md).")
@click.option("--measure", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Decide what to delegate from times measured on this machine (tandoor-agent profile of every "
                   "candidate subgraph, a few runs each). auto: when every target is this host; a board target "
                   "decides from estimates or --profile.")
@click.option("--no-check", is_flag=True,
              help="Write the bundle without running its golden self-test first (the check refuses a bundle "
                   "whose outputs differ from onnxruntime's on the source model).")
@click.option("--resize", type=click.Choice(media.RESIZE_MODES), default="stretch", show_default=True,
              help="How a frame becomes the input: stretch to it, or letterbox (keep the aspect ratio, pad).")
@click.option("--letterbox-align", type=click.Choice(media.ALIGNS), default="center", show_default=True,
              help="Where the letterboxed image sits: center (YOLO) or topleft (padding bottom-right).")
@click.option("--pad-value", type=click.IntRange(0, 255), default=114, show_default=True,
              help="Letterbox padding grey level: 114 as YOLO trains, 0 for black.")
@click.option("--pixel-range", type=click.Choice(["0-1", "0-255"]),
              help="Pixels before --mean/--std: 0-1 (divided by 255) or raw 0-255. Default: from the units of --mean/--std.")
@click.option("--decoder", type=click.Choice(tuple(d for d in media.DECODERS)),
              help="What decodes the outputs on the device (agent/serve/postprocess.py); stored in the manifest.")
@click.option("--conf", type=click.FloatRange(0, 1), help="Decoder score threshold (default: the decoder's).")
@click.option("--iou", type=click.FloatRange(0, 1), help="Decoder NMS IoU threshold (default: the decoder's).")
@click.option("--max-det", type=click.IntRange(1), help="Detections per frame at most (default: the decoder's).")
@click.option("--decoder-option", "decoder_opts", multiple=True, metavar="KEY=JSON",
              help="Another decoder option (repeatable), e.g. strides=[8,16,32] or agnostic=true.")
@click.option("--int8", is_flag=True,
              help="Quantize to INT8 first (as tandoor quantize, minmax, per-channel, the activation type the "
                   "targets want) on --calibration's images, preprocessed by the flags above, and compile the QDQ "
                   "model.")
@click.option("--npu", is_flag=True,
              help="RK3588: what the NPU's op table takes (compiler/npu.py) becomes rknn orders, converted by the RKNN "
                   "toolkit (.venv-rknn) and checked in its simulator; needs --target rk3588 (docs/npu.md).")
@click.option("--npu-dtype", type=click.Choice(["int8", "fp16"]), default="int8", show_default=True,
              help="With --npu: INT8 calibrated on --calibration's frames (preprocessed by the flags above), or fp16.")
@click.option("--calibration", type=click.Path(path_type=Path),
              help="With --int8 or --npu: a directory of images or a video like the deployment's camera sees.")
@click.option("--images", "calib_count", type=click.IntRange(1), default=None,
              help="With --int8 or --npu: calibrate on N images (default: the directory's; 300 frames of a video, "
                   "50 with --npu).")
@keep_fp32_option
@lead_option
@budget_options
@click.option("--no-cache", is_flag=True,
              help="Compile even when the compile cache holds this model with these options (and do not store the "
                   "result). The cache: ~/.cache/tandoor/compile, 'tandoor cache' to see or clear it.")
@click.option("--timings", is_flag=True, help="Print the seconds each stage took.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@debug_option
def compile(model, out, inputs, targets, key, labels, mean, std, layout, bgr, policy, profile, name, version,
            build, measure, no_check, resize, letterbox_align, pad_value, pixel_range, decoder, conf, iou, max_det,
            decoder_opts, int8, npu, npu_dtype, calibration, calib_count, keep_fp32, all_int8, validation, max_drop,
            no_cache, timings, quiet, gpu_tuning=None):
    """Compile MODEL.onnx into a hybrid module bundle."""
    from rich.console import Console

    from tandoor_compiler.pipeline import Options, compile_model

    from .quantize import quantize_with_calibration

    npu_samples = None
    if npu:
        if int8:
            raise CompileError("--npu quantizes for the NPU itself: drop --int8 (--npu-dtype int8 is the default)")
        if calibration is not None:
            npu_samples = _npu_samples(model, inputs, calibration, calib_count, dict(
                mean=mean, std=std, layout=layout, bgr=bgr, resize=resize, letterbox_align=letterbox_align,
                pad_value=pad_value, pixel_range=pixel_range))
        calibration = calib_count = None
    if int8 != (calibration is not None) or ((calib_count is not None or keep_fp32 or all_int8) and not int8) \
            or (max_drop is not None and not (int8 or npu)):
        raise CompileError("--int8 and --calibration go together (--images, --keep-fp32, --all-int8 and --max-drop "
                           "with them, or --max-drop with --npu): give both to quantize on your images first, or "
                           "neither")
    check_budget(validation, max_drop, model=model, inputs=inputs, decoder=decoder)

    opts = Options(list(inputs), list(targets), key, labels, _floats(mean, "--mean"), _floats(std, "--std"),
                   layout, bgr, policy, name, version, profile, check=not no_check, measure=measure, build=build,
                   resize=resize, letterbox_align=letterbox_align, pad_value=pad_value, pixel_range=pixel_range,
                   decoder=decoder,
                   decoder_options={**_decoder_options(decoder_opts), "conf": conf, "iou": iou, "max_det": max_det},
                   cache=not no_cache, npu=npu, npu_dtype=npu_dtype, npu_samples=npu_samples,
                   npu_judged=npu and max_drop is not None, gpu_tuning=gpu_tuning)
    console = Console(stderr=True, quiet=quiet, log_path=False)
    times: dict[str, float] = {}
    source = model     # the fp32 model: what --max-drop judges the INT8 bundle against
    with tempfile.TemporaryDirectory(prefix="tandoor-int8-") as tmp:
        if int8:
            q = Path(tmp) / f"{Path(model).stem}.int8.onnx"
            flags = dict(mean=mean, std=std, layout=layout, bgr=bgr, resize=resize, letterbox_align=letterbox_align,
                         pad_value=pad_value, pixel_range=pixel_range)
            res, src = quantize_with_calibration(model, q, calibration, calib_count, inputs=inputs, flags=flags,
                                                 targets=targets, keep_fp32=keep_fp32, lead=not all_int8,
                                                 console=console)
            console.log(f"quantized on {res['samples']} image(s) from {src.describe()}, {res['activations']} "
                        f"activations {res['activations_why']}")
            print_lead(res, console)
            opts = dataclasses.replace(opts, name=opts.name or Path(model).stem)
            model = q
        with console.status("compiling") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)
            # judged before it replaces anything: past the budget, nothing is written
            staged = Path(out).with_name(f".{Path(out).stem}.unjudged{Path(out).suffix}") if max_drop is not None else Path(out)
            try:
                p = compile_model(model, staged, opts, progress=progress, timings=times)
                if max_drop is not None:
                    from .accuracy import compare_on_images, simulated_npu

                    if npu:     # the rknn orders as the NPU runs them: in the toolkit's simulator
                        status.update(f"judging the bundle on {validation} with its NPU part in the RKNN simulator")
                        with simulated_npu(source, inputs, npu_samples):
                            res = compare_on_images(staged, source, validation, max_drop=max_drop, delegate="auto")
                        judge(res, max_drop, console, what=f"the NPU's {npu_dtype}",
                              fix=_npu_fix(p["npu"]))
                    else:
                        status.update(f"judging the INT8 bundle on {validation}")
                        judge(compare_on_images(staged, source, validation, max_drop=max_drop), max_drop, console)
                    os.replace(staged, out)
            finally:
                if staged != Path(out):
                    staged.unlink(missing_ok=True)
    kept = [x for x in p["partitions"] if x["delegate"] and x.get("kind") not in ("onnx", "rknn")]
    ort_ops = Counter(o.removeprefix("onnx.") for x in p["partitions"] if x.get("kind") == "onnx" for o in x["ops"])
    share = p.get("flops_delegated", 0) / p["flops_total"] if p.get("flops_total") else 0.0
    for note in p.get("notes") or ():
        console.print(f"[yellow]note[/] {note}")
    if p.get("npu"):
        n = p["npu"]
        console.print(f"[green]npu[/] {n['share']:.1%} of the FLOPs in {len(n['orders'])} rknn order(s) "
                      + ", ".join(f"{o['symbol']} {o['dtype']} (simulator vs onnxruntime: cosine "
                                  f"{min(o['check']['cosine']):.4f}"
                                  + "".join(f", top-1 {t:.0%}" for t in o["check"].get("top1") or () if t is not None)
                                  + f" on {o['check']['source']})" for o in n["orders"]))
    console.print(
        f"[green]wrote[/] {out}: {share:.1%} of the FLOPs ({p['ops_delegated']}/{p['ops_total']} ops) to ACL"
        + (f" ({p['flops_delegated_int8'] / p['flops_total']:.1%} as INT8)" if p.get("flops_delegated_int8") else "")
        + " in "
        f"{len(kept)} subgraph(s)" + (f" ({p['boundaries']} ACL/TVM boundaries)" if p.get("boundaries") is not None else "")
        + ", " + (f"{sum(ort_ops.values())} ONNX node(s) to onnxruntime ({', '.join(f'{k} x{v}' for k, v in ort_ops.most_common())}), "
                  if ort_ops else "")
        + f"{p['layout_transposes']} layout transpose(s), targets "
        f"{', '.join(sorted(p['targets'], key=lambda t: t != 'host'))}, "
        f"predicted speedup {p['predicted_speedup']:.2f}x" + (", signed" if key else "")
        + f", decided from {_decided_from(p)}" + ("" if opts.check else ", NOT self-checked (--no-check)")
        + (f", from the compile cache (first compiled {p['cache']['compiled']})" if (p.get("cache") or {}).get("hit")
           else ""))
    if timings or DEBUG:
        _print_timings(times)


NPU_FRAMES = 50      # frames of a video for --npu, every fifth held out for the check (a directory: all its images)


def _npu_fix(npu: dict) -> str:
    """What to try when the NPU's answers are past --max-drop: the layers the simulator's per-layer
    report says hurt most (compiler/rknn_worker.py), then the usual ways out."""
    worst = sorted((r for o in npu.get("orders") or () for r in o.get("worst_layers") or ()),
                   key=lambda r: r["cosine"])[:5]
    hurt = ("Layers that hurt most: " + ", ".join(f"{r['layer']} ({r['op']}, cosine {r['cosine']:.3f})" for r in worst)
            + ". ") if worst else ""
    return hurt + "Try --npu-dtype fp16, more --calibration frames, or compile without --npu"


def _npu_samples(model, inputs, calibration, count, flags: dict) -> list[list]:
    """The model inputs --npu calibrates (and checks) on: --calibration's images or video frames,
    preprocessed as the device will (tandoor quantize's reader, host/calibration.py)."""
    from tandoor_compiler import frontend

    from . import calibration as calib
    from .quantize import preprocess_entry

    loaded = frontend.load(model, list(inputs))
    if len(loaded.inputs) != 1:
        raise CompileError(f"the model has {len(loaded.inputs)} inputs; calibration from images feeds one image input")
    src = calib.open_source(calibration)
    n = count if count is not None else (min(NPU_FRAMES, src.size) if src.is_video else src.size)
    pre = preprocess_entry(loaded.inputs, **flags)
    spec = {**loaded.inputs[0].as_dict(), "layout": flags.get("layout") or media.guess_layout(loaded.inputs[0].shape)}
    return [[x] for x in calib.tensors(src, calib.pick(src.size, n), spec, pre)]


def _print_timings(times: dict[str, float]) -> None:
    """Seconds per stage, in the order they ran, on stderr (stdout stays for results)."""
    total = sum(times.values())
    click.echo("stage      seconds", err=True)
    for stage_name, secs in times.items():
        click.echo(f"{stage_name:10s} {secs:7.2f}", err=True)
    click.echo(f"{'total':10s} {total:7.2f}", err=True)


def _decided_from(manifest: dict) -> str:
    sources = {(x.get("est") or {}).get("source", "estimate") for x in manifest["partitions"] if x.get("kind") != "onnx"}
    if not sources:
        return "nothing (no candidate subgraph)"
    return " and ".join(sorted("estimates" if s.startswith("estimate") else s for s in sources))


@main.command()
@click.argument("bundle", type=InputFile("bundle"))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--graph", type=click.Path(dir_okay=False, path_type=Path), help="Draw the partitioned graph (SVG).")
@click.option("--sizes", "show_sizes", is_flag=True,
              help="Show where the bundle's bytes go instead: its members grouped by kind (order weights, "
                   "TVM libraries, fallbacks, probes, golden outputs...), bytes and share of the file.")
@debug_option
def inspect(bundle, as_json, graph, show_sizes):
    """Show what runs where: ACL subgraphs, ops left to TVM and why, ratio, predicted speedup;
    with --sizes, where the bundle's bytes go."""
    from tandoor_compiler import report

    if show_sizes:
        from . import sizes

        try:
            info = sizes.sizes(bundle)
        except hmod.BundleError as err:
            _fail(err)
        click.echo(json.dumps(info, indent=2) if as_json else "\n".join(sizes.lines(info)))
        return
    try:
        with hmod.open_bundle(bundle) as b:
            info = report.summary(b)
            if graph:
                report.draw_svg(b, graph)
    except (CompileError, hmod.BundleError) as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        report.print_summary(info)
        if graph:
            click.echo(f"graph written to {graph}")


@main.command()
@click.argument("bundle", type=InputFile("bundle"))
@click.option("--reference", required=True, type=InputFile("model"), help="The source ONNX model.")
@click.option("--delegate", type=click.Choice(("auto", *orders.EXECUTORS)), default=None,
              help="Executor for the delegated subgraphs. Default: those of the compile's self-check "
                   "(auto, then the TVM fallback), each in a runtime-only process as on the device.")
@click.option("--random", "n_random", default=3, show_default=True, help="Random inputs besides the golden ones.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@accuracy_options
@debug_option
def verify(bundle, reference, delegate, n_random, as_json, images, count, max_drop, min_sqnr):
    """Run the bundle as the device does against MODEL.onnx in onnxruntime; exit 1 past the
    tolerance the manifest promises for an output on the path that ran.
    With --images: against the fp32 MODEL.onnx on real images (top-1/top-5 agreement, SQNR)."""
    from .verify import verify as run_verify

    if images is not None:
        verify_on_images(bundle, reference, images, delegate=delegate or "onnxruntime", count=count, max_drop=max_drop,
                         min_sqnr=min_sqnr, as_json=as_json)

    try:
        res = run_verify(bundle, reference, delegate=delegate, random_inputs=n_random)
    except (CompileError, hmod.BundleError) as err:
        _fail(err)
    except Exception as err:  # runtime errors from the agent side, with their own exit codes
        _fail(err)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        if not res["reference_matches_source"]:
            click.echo("warning: the reference is not the file this bundle was compiled from (sha256 differs)", err=True)
        for c in res["cases"]:
            tied = f"  ({c['tied']} tied, not compared)" if c.get("tied") else ""
            tied += f"  ({c['past']} past the promise, excused)" if c.get("past") else ""
            nums = "  ".join(f"max {w} {'-' if c[k] is None else format(c[k], '.3g')}"
                             for w, k in (("abs", "max_abs_err"), ("rel", "max_rel_err")))
            click.echo(f"  {c['kind']:7s} {c['delegate']:11s} {c['path'] or '-':11s} {nums}  "
                       f"{'ok' if c['ok'] else 'FAIL'}{tied}")
        for r in res["runs"]:
            for s in r["executors"]:
                click.echo(f"  {r['delegate']}: {s['symbol']}: {s['executor']} ({s['backend']})"
                           + (f" [npu: unavailable ({s['npu_unavailable']})]" if s.get("npu_unavailable") else ""))
        for gpu in sorted({r["gpu"] for r in res["runs"] if r.get("gpu")}):
            click.echo(f"  gpu: {gpu}")
        if res.get("npu"):
            n = res["npu"]
            click.echo(f"  npu: {n['share']:.1%} of the FLOPs in {len(n['orders'])} rknn order(s); at compile the "
                       "simulator gave " + ", ".join(f"{o['symbol']} {o['dtype']} cosine {min(o['check']['cosine']):.4f}"
                                                     f" on {o['check']['source']}" for o in n["orders"]))
        verdict = "PASS" if res["ok"] else "FAIL"
        if all(c["max_abs_err"] is None for c in res["cases"]):
            click.echo(f"{verdict}: the bundle did not run")
        else:
            click.echo(f"{verdict}: max abs err {res['max_abs_err']:.3g}, max rel err {res['max_rel_err']:.3g} "
                       f"(atol {res['atol']:.3g}, rtol {res['rtol']:.3g}; per output in the manifest's tolerance)")
            if res.get("past"):
                click.echo(f"  {res['past']} element(s) past the promise, excused: an INT8 output may have up to "
                           f"{agreement.MAX_OUTLIERS:.1%} of its elements moved further by a flip upstream")
        if res["reason"]:
            click.echo(f"first miss: {res['reason']}")
    sys.exit(0 if res["ok"] else 1)


@main.command()
@click.argument("model", type=InputFile("model"))
@click.option("--input", "inputs", multiple=True, metavar="NAME=1x3x224x224", help="Pin an input's shape (repeatable).")
@click.option("--runs", default=20, show_default=True, help="Timed runs per path (medians are reported).")
@click.option("--warmup", default=5, show_default=True, help="Warm-up runs per path, not timed.")
@click.option("--policy", type=click.Choice(["cost", "all"]), default="cost", show_default=True,
              help="Compile policy of the hybrid module.")
@click.option("--executor", "executors", multiple=True, type=click.Choice(orders.EXECUTORS),
              help="Hybrid executors to measure (repeatable). Default: every available one.")
@click.option("--armnn", "include_armnn", is_flag=True,
              help="Include Arm NN even when it has only CpuRef (a reference implementation, seconds per inference).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write the latency breakdown as a PNG.")
@click.option("--kernels", is_flag=True, help="Also time TVM's kernels and onnxruntime's nodes, by op pattern.")
@click.option("--int8", "int8_model", type=InputFile("model"), default=None,
              metavar="INT8.onnx", help="Instead: MODEL (fp32) against this QDQ model of it (tandoor quantize), "
                                        "through onnxruntime, TVM and the hybrid, with the bundle sizes.")
@click.option("--images", type=click.Path(path_type=Path), default=None,
              help="With --int8: also the INT8 bundle's agreement with MODEL on these images or this video "
                   "(preprocessed as tandoor quantize recorded).")
@click.option("--count", type=click.IntRange(1), default=None, help="With --images: use N of them, spread.")
@debug_option
def bench(model, inputs, runs, warmup, policy, executors, include_armnn, as_json, plot, kernels, int8_model, images,
          count):
    """onnxruntime vs TVM only vs the hybrid module per executor, in one process.
    With --int8: what INT8 buys, route by route."""
    from rich.console import Console

    from . import bench as bench_mod

    if int8_model is None and (images is not None or count is not None):
        raise CompileError("--images and --count go with --int8: they measure the INT8 model's agreement with MODEL")
    if int8_model is not None and (kernels or plot or executors or include_armnn or policy != "cost"):
        raise CompileError("--int8 times fixed fp32 and INT8 routes; --kernels, --plot, --executor, --armnn and "
                           "--policy belong to the plain tandoor bench MODEL")
    console = Console(stderr=True, quiet=as_json)
    try:
        with console.status("benchmarking") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)
            if int8_model is not None:
                from .bench_int8 import run_int8

                res = run_int8(model, int8_model, inputs, runs=runs, warmup=warmup, images=images, count=count,
                               progress=progress)
            else:
                res = bench_mod.run(model, inputs, runs=runs, warmup=warmup, policy=policy, include_armnn=include_armnn,
                                    executors=tuple(executors) or None, kernels=kernels, progress=progress)
        if plot:
            bench_mod.plot(res, plot)
    except (CompileError, hmod.BundleError) as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    elif int8_model is not None:
        from .bench_int8 import print_int8

        print_int8(res)
    else:
        bench_mod.print_table(res)
        if plot:
            click.echo(f"plot written to {plot}")


@main.command()
@click.argument("bundle", type=InputFile("bundle"))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the profile here (for 'tandoor compile --profile').")
@click.option("--runs", default=20, show_default=True, help="Timed runs per measurement (fewer for calls > 0.25 s).")
@click.option("--warmup", default=5, show_default=True, help="Warm-up runs, not timed.")
@click.option("--executor", "executors", multiple=True, type=click.Choice(orders.EXECUTORS),
              help="Executors to measure (repeatable). Default: all; the unavailable ones are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@debug_option
def profile(bundle, out, runs, warmup, executors, as_json):
    """Measure every subgraph of BUNDLE on every executor and the TVM side, on this machine."""
    from rich.console import Console

    from tandoor_agent.run import profile as prof

    console = Console(stderr=True, quiet=as_json)
    try:
        with console.status("profiling") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)
            res = prof.measure(bundle, runs=runs, warmup=warmup, executors=tuple(executors) or prof.EXECUTORS,
                               progress=progress)
        if out:
            prof.write(res, out)
    except (CompileError, hmod.BundleError) as err:
        _fail(err)
    except OSError as err:
        _fail(CompileError(f"cannot write {out}: {err.strerror}"))
    if as_json:
        click.echo(json.dumps(res, indent=2, sort_keys=True))
        return
    from rich.table import Table

    k = res["key"]
    c = Console()
    c.print(f"[bold]{k['model']}[/] on {k['board']} (bundle sha256 {k['bundle_sha256'][:12]}…, "
            + ", ".join(f"{n} {v}" for n, v in k["libraries"].items() if v and n != "armnn_backends") + ")")
    t = Table(title="per subgraph, median us")
    for col in ("subgraph", "ops", "TVM", "onnxruntime", "armnn", "bridge (ort / armnn)", "unavailable"):
        t.add_column(col)
    for sym, s in res["subgraphs"].items():
        ex, br = s["exec_us"], s["bridge_us"]
        t.add_row(sym, str(len(s["ops"])), f"{s.get('tvm_us', float('nan')):.1f}",
                  f"{ex['onnxruntime']:.1f}" if "onnxruntime" in ex else "-",
                  f"{ex['armnn']:.1f} ({s['backend']['armnn']})" if "armnn" in ex else "-",
                  f"{br.get('onnxruntime', float('nan')):.1f} / {br.get('armnn', float('nan')):.1f}",
                  "; ".join(f"{e}: {w}" for e, w in s["unavailable"].items()))
    c.print(t)
    for e, v in res["model"].items():
        if isinstance(v, dict) and "total_us" in v:
            c.print(f"whole model with {e}: {v['total_us'] / 1e3:.2f} ms (delegated {v['delegated_us'] / 1e3:.2f} ms, "
                    f"TVM side {v['tvm_side_us'] / 1e3:.2f} ms)")
    if out:
        c.print(f"profile written to {out}")


@main.command()
@click.option("-o", "--output", "out", default="tandoor-key", show_default=True,
              help="Writes OUT.pem (private, keep it secret) and OUT.pub.pem (give to devices).")
def keygen(out):
    """Make an Ed25519 key pair for signing bundles."""
    priv, pub = Path(f"{out}.pem"), Path(f"{out}.pub.pem")
    try:
        fp = hmod.generate_keypair(priv, pub)
    except hmod.BundleError as err:
        _fail(err)
    click.echo(f"wrote {priv} (private) and {pub} (public), fingerprint {fp}")


@main.command("cache")
@click.option("--clear", is_flag=True, help="Remove every entry.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def cache_cmd(clear, as_json):
    """Show (or --clear) the compile cache: bundles compiled before on this machine, reused when the
    same model is compiled again with the same options and compiler (compiler/cache.py)."""
    from tandoor_compiler import cache

    root = cache.directory()
    if root is None:
        click.echo("the compile cache is off (TANDOOR_COMPILE_CACHE=0)")
        return
    if clear:
        n = cache.clear()
        click.echo(f"removed {n} {'entry' if n == 1 else 'entries'} from {root}")
        return
    ents = cache.entries()
    if as_json:
        click.echo(json.dumps({"directory": str(root), "entries": ents}, indent=2))
        return
    total = sum(int(e.get("size", 0)) for e in ents)
    click.echo(f"{root}: {len(ents)} {'entry' if len(ents) == 1 else 'entries'}, {total / 2**20:.1f} MB "
               f"(at most {os.environ.get('TANDOOR_COMPILE_CACHE_MB', cache.DEFAULT_MB)} MB; oldest use goes first)")
    for e in ents:
        click.echo(f"  {e['key'][:12]}  {e.get('source', '?'):32s} {', '.join(e.get('targets', [])):20s} "
                   f"{int(e.get('size', 0)) / 2**20:7.1f} MB  compiled {e.get('compiled')}"
                   + ("" if e.get("checked") else "  (not self-checked)"))


main.add_command(quantize)   # the INT8 command lives beside: host/quantize.py



# ------------------------------------------------------------------------------------ fleet
def _broker_options(f):
    f = click.option("--prefix", default="tandoor", show_default=True, help="Topic prefix (broker.topic_prefix).")(f)
    f = click.option("--cafile", type=click.Path(exists=True, dir_okay=False),
                     help="CA (PEM) that signed the broker's TLS certificate (a private CA); "
                          "default with mqtts://: the system CAs.")(f)
    f = click.option("--broker", envvar="TANDOOR_BROKER", default="mqtt://localhost:1883", show_default=True,
                     help="mqtt[s]://user:pass@host:port (or $TANDOOR_BROKER).")(f)
    return f


def _fleet(broker, cafile, prefix):
    from tandoor_fleet.rollout import Fleet, FleetError

    try:
        return Fleet(broker, cafile=cafile, prefix=prefix,
                     log=lambda m: click.echo(m, err=True)).connect()
    except (FleetError, OSError) as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)


def _per_device(out: dict, as_json: bool, line, ok) -> None:
    """Print {device: answer} (as JSON, or ``line(answer)`` per device) and exit 0 when every
    answer is ``ok(answer)``, else 1."""
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        for d, a in out.items():
            click.echo(f"{d:24s} {line(a)}")
    sys.exit(0 if all(ok(a) for a in out.values()) else 1)


def _db_option(f):
    return click.option("--db", envvar="TANDOOR_CONSOLE_DB",
                        help="Record this in the fleet console's database (sqlite:///PATH, a path, or "
                             "postgresql://...; or $TANDOOR_CONSOLE_DB): the console shows it.")(f)


def _console_store(db):
    """The console's store for --db (None without it); a database that cannot be opened is one line."""
    from tandoor_fleet.console.actions import store_from
    from tandoor_fleet.console.store import StoreError

    try:
        return store_from(db)
    except StoreError as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)


def _device_list(devices: str | None) -> list[str] | None:
    return [d.strip() for d in devices.split(",") if d.strip()] if devices else None


@main.group()
def fleet():
    """Fleet model updates over MQTT (docs/fleet.md): devices, deploy, status, cancel, rollback, keys."""


@fleet.command("devices")
@_broker_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--wait", default=1.0, show_default=True, help="Seconds to collect retained status messages.")
def fleet_devices(broker, cafile, prefix, as_json, wait):
    """Devices from their retained status: online, state, model, slot, last update job."""
    f = _fleet(broker, cafile, prefix)
    try:
        devs = f.devices(wait=wait)
    finally:
        f.close()
    if as_json:
        click.echo(json.dumps(devs, indent=2))
        return
    for d, s in devs.items():
        m = s.get("model") or {}
        job = s.get("last_job") or {}
        click.echo(f"{d:24s} {'online ' if s.get('online') else 'offline'} {str(s.get('state')):9s} "
                   f"{m.get('name')} v{m.get('version')} slot {s.get('slot')} "
                   f"sha {str(m.get('sha256'))[:12]}  last job: {job.get('job_id')} {job.get('state') or ''}"
                   + _recovery_note(s))
    if not devs:
        click.echo("no devices (no retained status under the prefix)", err=True)


def _recovery_note(status: dict) -> str:
    """What a device had to repair at its start (its status' `recovered`), and a keyring that
    fell back to the configured keys: said on the device's line, so an operator sees it."""
    out = ""
    for r in status.get("recovered") or ():
        chose = r.get("chose") or {}
        bad = ", ".join(f"slot {b.get('slot')}" for b in r.get("marked_bad") or ())
        out += (f"  recovered: {r.get('damaged')} ({r.get('reason')})"
                + (f", serving slot {chose['slot']} ({chose.get('how')})" if chose.get("slot") else
                   f", {chose.get('how')}" if chose.get("how") else "")
                + (f", marked bad: {bad}" if bad else ""))
    kr = status.get("keyring") or {}
    if kr.get("state") == "rebuilt":
        out += f"  keyring rebuilt: trusting {', '.join(kr.get('trusted') or []) or 'no key'}"
    return out


@fleet.command("deploy")
@click.argument("bundle", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_broker_options
@click.option("--devices", help="Comma-separated device ids.")
@click.option("--all", "all_", is_flag=True, help="Every device whose retained status is online.")
@click.option("--canary", default="0", show_default=True, help="Canary share first, e.g. 10% (at least one device).")
@click.option("--max-failures", default=0, show_default=True, help="Abort the remaining devices when more fail.")
@click.option("--latency-budget-ms", type=float, help="p95 budget: the device health gate and the canary check.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds for the whole rollout (the job deadline).")
@click.option("--wave-size", default=0, show_default=True, help="Devices per wave after the canaries (0: all).")
@click.option("--chunk-size", default=64 * 1024, show_default=True, help="Bytes per chunk message.")
@click.option("--health-frames", default=20, show_default=True, help="Frames the device health gate runs.")
@click.option("--job-id", help="Job id (default: <model>-v<version>-<sha8>-<time>); the same id again is a no-op.")
@click.option("--canary-soak", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds the canaries serve the new model before their telemetry p95 (inference, every "
                   "frame since the swap) is checked against --latency-budget-ms; give it a few telemetry "
                   "periods. Without telemetry: the p95 of the device health gate.")
@click.option("--transport", type=click.Choice(["mqtt", "url"]), default="mqtt", show_default=True,
              help="mqtt: chunks once per wave on the fleet-wide topic, re-sends on request; url: devices "
                   "download the bundle themselves with HTTP Range requests (--artifact-url or --serve).")
@click.option("--artifact-url", help="With --transport url: where the devices fetch the bundle (an object store URL).")
@click.option("--serve", "serve", metavar="HOST:PORT",
              help="With --transport url: serve the bundle from this host over HTTP while the deploy runs "
                   "(HOST: the address the devices reach; port 0: any free one).")
@click.option("--stall-timeout", default=120.0, show_default=True, type=click.FloatRange(1),
              help="Seconds without progress after which a device drops the job (so a dead deploy never wedges it).")
@click.option("--allow-downgrade", is_flag=True,
              help="Let devices install a bundle older than the one they run (refused by default).")
@click.option("--json", "as_json", is_flag=True, help="Per device: final state and reason, as JSON.")
@_db_option
def fleet_deploy(bundle, broker, cafile, prefix, devices, all_, canary, max_failures, latency_budget_ms, timeout,
                 wave_size, chunk_size, health_frames, job_id, canary_soak, transport, artifact_url, serve,
                 stall_timeout, allow_downgrade, as_json, db):
    """Staged rollout of BUNDLE: canaries, then waves; stops on failures or a p95 regression.

    Exit code 0 when every device committed, 1 otherwise, 2 on usage/connection errors."""
    from tandoor_fleet.console import actions
    from tandoor_fleet.console.store import StoreError
    from tandoor_fleet.rollout import FleetError

    if bool(devices) == bool(all_):
        click.echo("tandoor: error: give exactly one of --devices a,b or --all", err=True)
        sys.exit(2)
    try:
        pct = float(str(canary).rstrip("%"))
    except ValueError:
        click.echo(f"tandoor: error: --canary {canary!r}: expected a percentage such as 10%", err=True)
        sys.exit(2)
    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    t0 = __import__("time").monotonic()

    def progress(msg):
        click.echo(f"[{__import__('time').monotonic() - t0:6.1f}s] {msg}", err=True)

    try:
        res = actions.deploy(f, bundle, _device_list(devices), store, "the CLI", canary_pct=pct, max_failures=max_failures,
                       latency_budget_ms=latency_budget_ms, timeout=timeout, job_id=job_id, chunk_size=chunk_size,
                       health_frames=health_frames, wave_size=wave_size, canary_soak_s=canary_soak,
                       transport=transport, artifact_url=artifact_url, serve=serve, stall_timeout_s=stall_timeout,
                       allow_downgrade=allow_downgrade, progress=progress)
    except (FleetError, StoreError) as err:
        click.echo(f"tandoor: error: {err}" + (" (nothing was sent: the job could not be recorded)"
                                                if isinstance(err, StoreError) else ""), err=True)
        sys.exit(2)
    finally:
        f.close()
    if res.get("db_error"):
        click.echo(f"tandoor: warning: the job ran but its result is not in the database: {res['db_error']}", err=True)
    if as_json:
        click.echo(json.dumps(res, indent=2, default=str))
    else:
        for d, r in res["devices"].items():
            click.echo(f"{d:24s} {r['state']:12s} {r.get('reason') or ''}")
        click.echo(f"job {res['job_id']}: " + ", ".join(f"{v} {k}" for k, v in sorted(res["counts"].items()))
                   + f" in {res['seconds']:.1f} s" + (f"; aborted: {res['aborted']}" if res["aborted"] else ""))
    sys.exit(0 if all(r["state"] == "committed" for r in res["devices"].values()) else 1)


@fleet.command("status")
@click.argument("job", required=False)
@_broker_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--wait", default=1.0, show_default=True, help="Seconds to collect retained messages.")
def fleet_status(job, broker, cafile, prefix, as_json, wait):
    """The last ack of JOB per device (from the retained update/ack topics), with what a device
    had to recover at its start; without JOB, every device's state and recoveries."""
    f = _fleet(broker, cafile, prefix)
    try:
        st = f.job_status(job, wait=wait) if job else {}
        devs = f.devices(wait=0.0 if job else wait)
    finally:
        f.close()
    if not job:
        if as_json:
            click.echo(json.dumps({d: {k: s.get(k) for k in ("online", "state", "model", "slot", "recovered", "keyring")}
                                   for d, s in devs.items()}, indent=2))
            return
        for d, s in devs.items():
            m = s.get("model") or {}
            click.echo(f"{d:24s} {'online ' if s.get('online') else 'offline'} {str(s.get('state')):9s} "
                       f"{m.get('name')} v{m.get('version')} slot {s.get('slot')}" + _recovery_note(s))
        if not devs:
            click.echo("no devices (no retained status under the prefix)", err=True)
        return
    if as_json:
        click.echo(json.dumps({d: {**a, **({"recovered": devs[d]["recovered"]} if (devs.get(d) or {}).get("recovered")
                                           else {})} for d, a in st.items()}, indent=2))
        return
    for d, a in st.items():
        click.echo(f"{d:24s} {a.get('state'):12s} {a.get('reason') or ''}" + _recovery_note(devs.get(d) or {}))
    if not st:
        click.echo(f"no device reports job {job}", err=True)


@fleet.command("cancel")
@click.argument("job")
@_broker_options
@click.option("--devices", help="Comma-separated device ids (default: every device whose last ack names JOB, not final).")
@click.option("--reason", default="cancelled by the operator", show_default=True, help="Said in the cancelled ack.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the answers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_db_option
def fleet_cancel(job, broker, cafile, prefix, devices, reason, timeout, as_json, db):
    """Drop JOB on the devices now (e.g. after its deploy died): they answer `cancelled` and take
    the next job at once. A device past its download finishes the job by itself (said so)."""
    from tandoor_fleet.console import actions

    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    try:
        out = actions.cancel(f, job, _device_list(devices), store, "the CLI", reason=reason, timeout=timeout)
    finally:
        f.close()
    if not out:
        click.echo(f"no device runs job {job} (give --devices to record the cancel anyway)", err=True)
    _per_device(out, as_json, lambda a: f"{str(a.get('state')):12s} {a.get('note') or a.get('reason') or ''}",
                lambda a: a.get("state") == "cancelled")


@fleet.group("keys")
def fleet_keys():
    """Key rotation on the devices: signed add-key / retire-key commands (docs/updates.md)."""


def _key_op(op, devices, sign_with, broker, cafile, prefix, timeout, as_json, **kw):
    from tandoor_fleet.rollout import FleetError

    f = _fleet(broker, cafile, prefix)
    try:
        out = f.key_command(_device_list(devices), op, Path(sign_with), timeout=timeout, **kw)
    except FleetError as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)
    finally:
        f.close()
    _per_device(out, as_json, lambda a: (("ok trusted: " + ", ".join(a.get("trusted") or [])) if a.get("ok")
                                         else f"FAILED {a.get('reason')}") + _affects(a), lambda a: a.get("ok"))


def _affects(answer: dict) -> str:
    """A retire-key's answer: the installed models the key signed (they keep serving)."""
    if "affects" not in answer:
        return ""
    models = [f"slot {a.get('slot')} {(a.get('model') or {}).get('name')} v{(a.get('model') or {}).get('version')}"
              + (" (serving)" if a.get("primary") else "") for a in answer["affects"]]
    return "; signed " + (", ".join(models) if models else "no installed model")


def _key_options(f):
    f = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)
    f = click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the answers.")(f)
    f = click.option("--sign-with", required=True, type=click.Path(exists=True, dir_okay=False),
                     help="Private key (PEM) the devices trust now.")(f)
    f = click.option("--devices", required=True, help="Comma-separated device ids.")(f)
    return _broker_options(f)


@fleet_keys.command("add")
@click.argument("public_key", type=click.Path(exists=True, dir_okay=False))
@_key_options
def fleet_keys_add(public_key, devices, sign_with, broker, cafile, prefix, timeout, as_json):
    """Trust PUBLIC_KEY too (signed with a key the devices trust now)."""
    _key_op("add-key", devices, sign_with, broker, cafile, prefix, timeout, as_json, public_key=Path(public_key))


@fleet_keys.command("retire")
@click.argument("fingerprint")
@click.option("--force", is_flag=True, help="Retire it even on a device where it signed every good model.")
@_key_options
def fleet_keys_retire(fingerprint, force, devices, sign_with, broker, cafile, prefix, timeout, as_json):
    """Stop trusting the key FINGERPRINT (from `tandoor keygen`); its bundles are refused from now on.
    Installed models it signed keep serving (trusted at install); each device names them, and one
    where it signed every good model refuses unless --force."""
    _key_op("retire-key", devices, sign_with, broker, cafile, prefix, timeout, as_json, fingerprint=fingerprint,
            force=force)


@fleet.command("rollback")
@_broker_options
@click.option("--devices", required=True, help="Comma-separated device ids.")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for the answers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_db_option
def fleet_rollback(broker, cafile, prefix, devices, timeout, as_json, db):
    """Roll the devices back to their previous good slot (the `rollback` command)."""
    from tandoor_fleet.console import actions

    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    try:
        out = actions.rollback(f, _device_list(devices), store, "the CLI", timeout=timeout)
    finally:
        f.close()
    _per_device(out, as_json, lambda r: f"{'ok' if r.get('ok') else 'FAILED'} {r.get('result') or r.get('error')}",
                lambda r: r.get("ok"))


@fleet.command("console")
@click.option("--db", envvar="TANDOOR_CONSOLE_DB",
              help="sqlite:///PATH (or a path) or postgresql://user:pass@host/db; default "
                   "~/.local/share/tandoor/console.db (or $TANDOOR_CONSOLE_DB). Migrated at start, never dropped.")
@click.option("--listen", default="127.0.0.1:8080", show_default=True,
              help="HOST:PORT of the web pages (localhost unless told otherwise; port 0: any free one).")
@click.option("--broker", "brokers", multiple=True, envvar="TANDOOR_BROKER",
              help="mqtt[s]://user:pass@host:port; repeat it to read several brokers (each holding a share of the "
                   "devices). Actions go through the first. Default mqtt://localhost:1883 (or $TANDOOR_BROKER).")
@click.option("--cafile", type=click.Path(exists=True, dir_okay=False), help="CA (PEM) of the brokers' TLS certificates.")
@click.option("--prefix", default="tandoor", show_default=True, help="Topic prefix (broker.topic_prefix).")
@click.option("--group", default="tandoor-console", show_default=True,
              help="MQTT 5 shared-subscription group: consoles of one group split the messages.")
@click.option("--users", type=click.Path(dir_okay=False, path_type=Path),
              help="Users file (lines 'operator|viewer NAME SECRET', chmod 600; docs/fleet.md): logins, and the "
                   "deploy/cancel/rollback actions for operators. Without it the pages are read-only, no login.")
@click.option("--bundles", type=click.Path(file_okay=False, path_type=Path),
              help="A folder of .hmod bundles the deploy form offers (besides an upload).")
@click.option("--raw-hours", default=6.0, show_default=True, type=click.FloatRange(0.1),
              help="Hours raw telemetry is kept.")
@click.option("--rollup-days", default=14.0, show_default=True, type=click.FloatRange(0.1),
              help="Days the 1-minute telemetry rollups and device events are kept.")
@click.option("--results/--no-results", default=True, show_default=True,
              help="Keep each device's latest result (at most one per 5 s); --no-results: not even subscribed "
                   "(agents send up to results_max_rate_hz each: the console's largest stream in a big fleet).")
@click.option("--hash-password", is_flag=True,
              help="Read a password from stdin, print its users-file hash, and exit.")
@debug_option
def fleet_console(db, listen, brokers, cafile, prefix, group, users, bundles, raw_hours, rollup_days, results,
                  hash_password):
    """The fleet console: every device's status, telemetry, snapshot, jobs and key operations kept in a
    database (SQLite or PostgreSQL), and web pages of the fleet, each device and the deployments,
    live, with /metrics for Prometheus (docs/fleet.md, "The console")."""
    import logging

    from tandoor_fleet.console import server
    from tandoor_fleet.console.auth import AuthError, hash_password as hash_pw
    from tandoor_fleet.console.store import StoreError
    from tandoor_fleet.rollout import FleetError

    if hash_password:
        pw = sys.stdin.readline().rstrip("\n")
        if len(pw) < 8:
            click.echo("tandoor: error: a password of at least 8 characters, on stdin", err=True)
            sys.exit(2)
        click.echo(hash_pw(pw))
        return
    logging.basicConfig(level=logging.INFO, format="[console] %(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        server.run(db or server.default_db(), listen, list(brokers) or ["mqtt://localhost:1883"], cafile, prefix,
                   group, users, bundles, raw_hours, rollup_days, results)
    except (ValueError, StoreError, AuthError, FleetError) as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)
    except OSError as err:
        click.echo(f"tandoor: error: cannot listen on {listen}: {err.strerror or err}", err=True)
        sys.exit(2)
    except Exception as err:  # noqa: BLE001 (one line naming the stage; --debug for the traceback)
        if DEBUG:
            traceback.print_exc()
        click.echo(f"tandoor: error: the console failed: {type(err).__name__}: {err}", err=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
