"""`tandoor quantize`: an fp32 model + real images -> a QDQ INT8 model (compiler/int8/quantize.py), the
images preprocessed as the bundle will preprocess the camera's frames (compiler/int8/calibration.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tandoor_compiler.errors import CompileError
from tandoor_contract import durable, media

from .inputs import InputFile

# The options that say how a frame becomes the input: the same names, choices and meaning as
# `tandoor compile`'s, so that one set of flags describes the model to both commands.
PREPROCESS_OPTIONS = (
    click.option("--mean", help="Per-channel mean, as tandoor compile --mean (0..1 or pixel units)."),
    click.option("--std", help="Per-channel std, same units as --mean."),
    click.option("--layout", type=click.Choice(["NCHW", "NHWC"]), default=None,
                 help="Input image layout. Default: from the input's shape (a last axis of 1 or 3 channels is NHWC)."),
    click.option("--bgr", is_flag=True, help="The model expects BGR channel order."),
    click.option("--resize", type=click.Choice(media.RESIZE_MODES), default="stretch", show_default=True,
                 help="stretch to the input, or letterbox (keep the aspect ratio, pad)."),
    click.option("--letterbox-align", type=click.Choice(media.ALIGNS), default="center", show_default=True,
                 help="Where the letterboxed image sits."),
    click.option("--pad-value", type=click.IntRange(0, 255), default=114, show_default=True,
                 help="Letterbox padding grey level."),
    click.option("--pixel-range", type=click.Choice(["0-1", "0-255"]),
                 help="Pixels before --mean/--std: 0-1 or raw 0-255 (default: from the units of --mean/--std)."),
)


def preprocess_options(f):
    for opt in reversed(PREPROCESS_OPTIONS):
        f = opt(f)
    return f


def keep_fp32_option(f):
    return click.option("--keep-fp32", "keep_fp32", multiple=True, metavar="NODE",
                        help="Leave this node in fp32 (repeatable): the layer report names the nodes that lose most.")(f)


def lead_option(f):
    return click.option("--all-int8", "all_int8", is_flag=True,
                        help="Quantize the first layers too where this target's int8 kernels are slower than fp32 "
                             "for them (by default a small stem and the stride-1 depthwise conv right after it stay "
                             "fp32 on x86_64: docs/int8.md, 'The fp32 lead').")(f)


def budget_options(f):
    f = click.option("--max-drop", type=click.FloatRange(0, 1), default=None, metavar="FRACTION",
                     help="Refuse (exit 2, nothing written) when agreement with the fp32 model on --validation drops "
                          "by more (0.05 = 5%), as NNCF's accuracy control does: a classifier's top-1 on the "
                          "images where fp32's top-1 probability is >= 0.5 (at least 20 such images, else "
                          "refused as not judgeable), a detector's matched boxes.")(f)
    return click.option("--validation", type=click.Path(path_type=Path), default=None,
                        help="With --max-drop: a directory of images or a video calibration did not see.")(f)


def preprocess_kwargs(*, mean, std, layout, bgr, resize, letterbox_align, pad_value, pixel_range) -> dict:
    """The compiler's keywords (pipeline.Options fields) for the preprocessing flags, as tandoor
    compile and tandoor quantize take them (--mean/--std parsed to lists)."""
    from .cli_base import floats

    return dict(mean=floats(mean, "--mean"), std=floats(std, "--std"), layout=layout, bgr=bgr, resize=resize,
                letterbox_align=letterbox_align, pad_value=pad_value, pixel_range=pixel_range)


class Shown:
    """The compiler's events (compiler/api.py ``on_event``) on a rich console: a spinner naming the
    stage, a bar while calibrating, the layer report once quantized, what the judge said."""

    def __init__(self, console):
        self.console = console
        self.status = None
        self.bar = None
        self.task = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()

    def _stop(self):
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.status is not None:
            self.status.stop()
            self.status = None

    def __call__(self, name: str, data: dict) -> None:
        if name == "stage":
            if self.bar is not None:
                self._stop()
            if self.status is None:
                self.status = self.console.status(data["message"])
                self.status.start()
            else:
                self.status.update(data["message"])
            self.console.log(data["message"])
        elif name == "calibrating":
            if self.bar is None:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

                self._stop()
                self.bar = Progress(TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(),
                                    TimeRemainingColumn(), console=self.console, transient=True)
                self.bar.start()
                self.task = self.bar.add_task("calibrating", total=data["total"])
            self.bar.update(self.task, completed=data["done"])
        elif name == "say":
            self.console.log(data["message"])
        elif name == "quantized":
            self._stop()
            print_report(data["report"], self.console)


@click.command()
@click.argument("model", type=InputFile("model"))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="INT8 model to write (.onnx, QDQ format). Written atomically.")
@click.option("--calibration", required=True, type=click.Path(path_type=Path),
              help="A directory of images or a video file like the deployment's camera sees.")
@click.option("--images", "count", type=click.IntRange(1), default=None,
              help="Calibrate on N images (or frames, spread over the video). Default: all the directory's "
                   "images, 300 frames of a video.")
@click.option("--method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="How activation ranges come from the calibration data (onnxruntime's calibrators).")
@click.option("--per-channel/--per-tensor", default=True, show_default=True,
              help="One weight scale per output channel (accurate for depthwise convs) or per weight tensor.")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="The targets the bundle will be compiled for, as tandoor compile --target (repeatable; host is "
                   "always one): they choose the activation type. Default: host alone.")
@click.option("--activations", type=click.Choice(["int8", "uint8"]), default=None,
              help="Activation type: int8 (S8S8) or uint8 (U8S8). Default: what the targets' int8 kernels want: "
                   "int8 when a board (aarch64, ACL) is among them, else this host's (x86_64: uint8).")
@click.option("--input", "inputs", multiple=True, metavar="NAME=1x3x224x224",
              help="Pin an input's shape (repeatable), as tandoor compile --input.")
@keep_fp32_option
@lead_option
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the per-layer report (every layer's SQNR against fp32) to this JSON file.")
@click.option("--report-images", "report_samples", type=click.IntRange(1), default=4, show_default=True,
              help="Calibration images (spread over them) the layer report compares on; more is steadier.")
@budget_options
@preprocess_options
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@click.option("--debug", is_flag=True, hidden=True)
def quantize(model, out, calibration, count, method, per_channel, targets, activations, inputs, keep_fp32, all_int8,
             report_path, report_samples, validation, max_drop, mean, std, layout, bgr, resize, letterbox_align,
             pad_value, pixel_range, quiet, debug):
    """Quantize MODEL.onnx to INT8 (QDQ) with calibration on real images; compile the result
    with the same --mean/--std/--resize flags."""
    from rich.console import Console

    from tandoor_compiler import api

    console = Console(stderr=True, quiet=quiet, log_path=False)
    flags = dict(mean=mean, std=std, layout=layout, bgr=bgr, resize=resize, letterbox_align=letterbox_align,
                 pad_value=pad_value, pixel_range=pixel_range)
    if report_path is not None and not report_path.parent.is_dir():
        raise CompileError(f"--report {report_path}: directory {report_path.parent} does not exist")
    with Shown(console) as shown:
        res = api.quantize(model, out, calibration=calibration, images=count, method=method, per_channel=per_channel,
                           activations=activations, keep_fp32=keep_fp32, all_int8=all_int8,
                           report_samples=report_samples, validation=validation, max_drop=max_drop, on_event=shown,
                           inputs=list(inputs), targets=list(targets), **preprocess_kwargs(**flags))
    if report_path is not None:
        durable.atomic_write(report_path, (json.dumps(res["report"], indent=2) + "\n").encode())
    q = res["quantized"]
    console.print(f"[green]wrote[/] {out}: {q.get('QuantizeLinear', 0)} QuantizeLinear / "
                  f"{q.get('DequantizeLinear', 0)} DequantizeLinear, calibrated on {res['samples']} image(s) from "
                  f"{res['source']} ({method}, {'per-channel' if per_channel else 'per-tensor'} weights, "
                  f"{res['activations']} activations), {res['bytes'] / 1e6:.1f} MB (fp32 {res['source_bytes'] / 1e6:.1f} MB)")
    console.print(f"activations {res['activations']}: {res['activations_why']}")
    print_lead(res, console)
    # `is`, not `in`: --pad-value 0 equals False and would be dropped
    given = {k: v for k, v in flags.items() if v is not None and v is not False and v != DEFAULTS.get(k)}
    if report_path is not None:
        console.print(f"wrote the per-layer report to {report_path}")
    console.print(f"next: tandoor compile {out} -o {Path(out).with_suffix('.hmod')}"
                  + "".join(f" --target {t}" for t in targets if t != "host")
                  + "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in given.items()))
    sys.stdout.flush()


def print_lead(res: dict, console) -> None:
    if res.get("fp32_lead"):
        convs = ", ".join(f"{n} ({r})" for n, r in res["fp32_lead"].items() if r != "on the way")
        console.print(f"kept in fp32, the fp32 lead: {convs}, as int8 is slower for them on {res['fp32_lead_why']} "
                      "(--all-int8 quantizes them too)")


def print_report(report: dict, console, *, worst: int = 5) -> None:
    """The layers that lost most against fp32 and each weak output, a line each (the warnings
    even with --quiet: a silently wrong output is what they are for)."""
    from rich.console import Console

    warn = console if not console.quiet else Console(stderr=True, log_path=False)
    layers = [r for r in report["layers"] if r["lost_db"] > 0][:worst]
    outs = ", ".join(f"{k} {v:.1f} dB" for k, v in report["outputs"].items())
    if layers:
        console.print(f"SQNR against fp32 on {report['samples']} calibration image(s): {outs}; the layers that lose "
                      "most, and what keeping each in fp32 (--keep-fp32 NODE) measured at the worst output:")
        for r in layers:
            keep = ("" if "keep_fp32_gain_db" not in r else ", in fp32 exact" if r["keep_fp32_output_db"] >= EXACT_DB
                    else f", in fp32 {r['keep_fp32_gain_db']:+.1f} dB")
            console.print(f"  {r['node']} ({r['op']}): {r['sqnr_db']:.1f} dB, {r['lost_db']:.1f} dB lost here{keep}")
        gains = [r["keep_fp32_gain_db"] for r in report["layers"] if "keep_fp32_gain_db" in r]
        if gains and max(gains) < 1.0:
            console.print("  no one layer in fp32 gains 1 dB: the error is spread over the network (more calibration "
                          "images, or --method percentile/entropy, may help more)")
    tried = [r for r in report["layers"] if r.get("keep_fp32_gain_db", 0) >= 1.0]
    best = max(tried, key=lambda r: r["keep_fp32_gain_db"], default=None)
    fix = (f"--keep-fp32 {best['node']} measured {best['keep_fp32_output_db']:.1f} dB" if best else
           "no one layer in fp32 fixes it: try --method entropy or percentile, or calibrate on images more like "
           "the deployment's")
    for name in report["weak"]:
        warn.print(f"[yellow]warning[/] output {name} is far from fp32 on {report['samples']} calibration image(s): "
                   f"SQNR {report['outputs'][name]:.1f} dB (< {report['weak_below_db']:g}); {fix}; check the accuracy "
                   "on other images with tandoor verify BUNDLE --reference FP32.onnx --images DIR")


EXACT_DB = 120.0    # float32 itself resolves ~140 dB: above this the output is fp32's
DEFAULTS = {o.name: o.default for o in (opt(lambda: None).__click_params__[0] for opt in PREPROCESS_OPTIONS)}


# --- `tandoor verify --images`: the INT8 bundle against the fp32 model on real images -------------

def accuracy_options(f):
    from tandoor_compiler.int8.accuracy import DEFAULT_MAX_DROP

    f = click.option("--min-sqnr", type=float, default=None, metavar="DB",
                     help="With --images: fail when an output's SQNR against the fp32 model is below DB.")(f)
    f = click.option("--max-drop", type=click.FloatRange(0, 1), default=DEFAULT_MAX_DROP, show_default=True,
                     help="With --images: fail when top-1 agreement with the fp32 model, on the images where fp32's "
                          "top-1 probability is >= 0.5, drops by more (0.05 = 5%); not judged with fewer than 20 "
                          "such images. Detectors: matched boxes.")(f)
    f = click.option("--count", type=click.IntRange(1), default=None,
                     help="With --images: use N images (or video frames, spread), default all.")(f)
    return click.option("--images", type=click.Path(path_type=Path), default=None,
                        help="A directory of images or a video: compare with --reference, the fp32 model, on them "
                             "(use images calibration did not see).")(f)


def verify_on_images(bundle, reference, images, *, delegate, count, max_drop, min_sqnr, as_json) -> None:
    """Print the report of compiler/int8/accuracy.py and exit 0 when ok, 1 when not."""
    import json

    from rich.console import Console

    from tandoor_compiler.int8.accuracy import compare_on_images

    console = Console(stderr=True, log_path=False)
    with console.status(f"running {Path(bundle).name} and {Path(reference).name} on the images"):
        res = compare_on_images(bundle, reference, images, count=count, delegate=delegate, max_drop=max_drop,
                                min_sqnr_db=min_sqnr)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        from tandoor_compiler.int8.agreement import describe

        for o in res["outputs"]:
            agree = f", {describe(o)}" if "confident_images" in o else ""
            click.echo(f"  {o['name']}: SQNR {o['sqnr_db']:.1f} dB, cosine mean {o['cosine_mean']:.4f} "
                       f"(worst {o['cosine_min']:.4f}){agree}")
        if res.get("box_agreement") is not None:
            click.echo(f"  boxes: {res['boxes_matched']} of fp32's {res['boxes_fp32']} matched at IoU 0.5 "
                       f"(box agreement {res['box_agreement']:.1%}), {res['boxes_extra']} the fp32 model did not find")
        elif "boxes_fp32" in res:
            click.echo("  boxes: the fp32 model found none on these images: box agreement is not measured")
        if res["confident_images"] is None and res["box_agreement"] is None and res["min_sqnr_db"] is None:
            click.echo("  nothing to judge these outputs by (no class scores, no boxes): give --min-sqnr DB, or "
                       "compile with --decoder")
        for note in res["notes"]:
            click.echo(f"  note: {note}")
        for f in res["failures"]:
            click.echo(f"  FAIL {f}")
        click.echo(f"{'PASS' if res['ok'] else 'FAIL'}: {res['images']} image(s) from {res['source']}, "
                   f"{res['delegate']} executors")
    sys.exit(0 if res["ok"] else 1)
