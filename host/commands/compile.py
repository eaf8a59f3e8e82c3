"""`tandoor compile`: flags in, a bundle out (the compiler does the work; INT8 and the NPU included)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import click

from tandoor_contract import backends, media

from ..inputs import InputFile
from ..quantize import Shown, budget_options, keep_fp32_option, lead_option, preprocess_kwargs, print_lead

from .. import cli_base
from ..cli_base import debug_option, decoder_options


@click.command()
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
              help="cost: delegate a subgraph only when its gain beats its boundary cost (compiler/stages/cost.py); "
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
              help="RK3588: what the NPU's op table takes (compiler/backends/rknn/npu.py) becomes rknn orders, converted by the RKNN "
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

    from tandoor_compiler import compile_model

    console = Console(stderr=True, quiet=quiet, log_path=False)
    times: dict[str, float] = {}
    with Shown(console) as shown:
        def on_event(name: str, data: dict) -> None:
            shown(name, data)
            if name == "quantized":
                console.log(f"quantized on {data['samples']} image(s) from {data['source']}, {data['activations']} "
                            f"activations {data['activations_why']}")
                print_lead(data, console)

        done = compile_model(
            model, out, int8=int8, calibration=calibration, images=calib_count, keep_fp32=keep_fp32,
            all_int8=all_int8, validation=validation, max_drop=max_drop, npu=npu, npu_dtype=npu_dtype,
            on_event=on_event, timings=times,
            inputs=list(inputs), targets=list(targets), key=key, labels=labels, policy=policy, name=name,
            version=version, profile=profile, check=not no_check, measure=measure, build=build, decoder=decoder,
            decoder_options={**decoder_options(decoder_opts), "conf": conf, "iou": iou, "max_det": max_det},
            cache=not no_cache, gpu_tuning=gpu_tuning,
            **preprocess_kwargs(mean=mean, std=std, layout=layout, bgr=bgr, resize=resize,
                                letterbox_align=letterbox_align, pad_value=pad_value, pixel_range=pixel_range))
    p = done.manifest
    kept = [x for x in p["partitions"] if x["delegate"] and (x.get("kind") or backends.LAYERS) == backends.LAYERS]
    ort_ops = Counter(o.removeprefix("onnx.") for x in p["partitions"] if x.get("kind") == backends.ONNX for o in x["ops"])
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
        f"{len(kept)} subgraph(s)" + (f" ({p['boundaries']} TVM/order boundaries)" if p.get("boundaries") is not None else "")
        + ", " + (f"{sum(ort_ops.values())} ONNX node(s) to onnxruntime ({', '.join(f'{k} x{v}' for k, v in ort_ops.most_common())}), "
                  if ort_ops else "")
        + f"{p['layout_transposes']} layout transpose(s), targets "
        f"{', '.join(sorted(p['targets'], key=lambda t: t != 'host'))}, "
        f"predicted speedup {p['predicted_speedup']:.2f}x" + (", signed" if key else "")
        + f", decided from {_decided_from(p)}" + ("" if not no_check else ", NOT self-checked (--no-check)")
        + (f", from the compile cache (first compiled {p['cache']['compiled']})" if (p.get("cache") or {}).get("hit")
           else ""))
    if timings or cli_base.DEBUG:
        _print_timings(times)


def _print_timings(times: dict[str, float]) -> None:
    """Seconds per stage, in the order they ran, on stderr (stdout stays for results)."""
    total = sum(times.values())
    click.echo("stage      seconds", err=True)
    for stage_name, secs in times.items():
        click.echo(f"{stage_name:10s} {secs:7.2f}", err=True)
    click.echo(f"{'total':10s} {total:7.2f}", err=True)


def _decided_from(manifest: dict) -> str:
    sources = {(x.get("est") or {}).get("source", "estimate") for x in manifest["partitions"]
               if x.get("kind") != backends.ONNX}
    if not sources:
        return "nothing (no candidate subgraph)"
    return " and ".join(sorted("estimates" if s.startswith("estimate") else s for s in sources))
