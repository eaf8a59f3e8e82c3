"""`tandoor-agent`: the board side. `run` does one-shot inference on a bundle.

Exit codes (one line on stderr for every failure, "tandoor-agent: error: <reason>"):

====  =====================================================================================
0     ok
1     unexpected internal error
2     usage: bad option, unreadable --input, --save-outputs not a directory
3     runtime: no executor can run a subgraph, input of the wrong shape, inference failed
10-19 the bundle was refused before anything in it was used (contract/hmod.py's table:
      10 not a bundle/truncated, 11 unsafe member, 12 hash mismatch, 13 missing member,
      14 bad signature, 15 unsigned, 16 format version, 17 no lib for this arch,
      18 extra member, 19 key file)
====  =====================================================================================
"""

from __future__ import annotations

# `tandoor-agent` is an agent process: TVM's runtime library only, no torch (agent/run/lean.py),
# decided before anything below can import tvm.
from .run import lean

lean.runtime_only()

import json  # noqa: E402
import logging
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from tandoor_contract import hmod
from tandoor_contract.errors import TandoorError

from . import failpoints
from .run import executors
from .serve import service


class UsageError_(TandoorError):
    exit_code = 2


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


DEBUG = False   # tandoor-agent --debug: an internal error prints its traceback too


def _fail(err: BaseException) -> None:
    """Exit with the error's one line (and its exit code); an unexpected error is exit 1, named
    internal, with the traceback only under --debug. Called from an ``except`` block."""
    code = getattr(err, "exit_code", None)
    msg = _one_line(err)
    if not isinstance(code, int):
        code, msg = 1, f"internal error ({type(err).__name__}): {msg}"
        if DEBUG:
            import traceback

            traceback.print_exc()
        else:
            msg += " (tandoor-agent --debug ... prints the traceback)"
    click.echo(f"tandoor-agent: error: {msg}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="tandoor")
@click.option("-v", "--verbose", is_flag=True, help="Log executor choices and fallbacks.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Run the agent service with this TOML config (same as `serve --config FILE`).")
@click.option("--debug", is_flag=True, help="On an internal error, print its traceback too (or TANDOOR_DEBUG=1).")
@click.pass_context
def main(ctx: click.Context, verbose: bool, config_path: Path | None, debug: bool) -> None:
    """Tandoor's on-board agent."""
    global DEBUG
    DEBUG = debug or os.environ.get("TANDOOR_DEBUG", "") not in ("", "0")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")
    service.main_callback(ctx, config_path)


def _read_input(path: Path, spec: dict, preprocess_cfg: dict | None, what: str) -> np.ndarray:
    from .serve import preprocess

    if not path.is_file():
        raise UsageError_(f"{what} {path}: no such file")
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        return preprocess.to_input(preprocess.load_image(path), spec, preprocess_cfg)
    except Exception as err:
        raise UsageError_(f"{what} {path}: cannot read it ({_one_line(err)})") from None


def _load_inputs(b: hmod.Bundle, given: tuple[str, ...]) -> list[np.ndarray]:
    """The model's inputs, in the manifest's order, from the --input options: none (the bundle's
    first golden input), one FILE for a one-input model, or NAME=FILE for each input."""
    m = b.manifest
    specs = m["inputs"]
    names = [s["name"] for s in specs]
    if not given:
        golden = b.golden()
        if not golden:
            raise UsageError_("the bundle has no golden input; pass --input FILE.npy or an image"
                              + ("" if len(specs) == 1 else " for each input as --input NAME=FILE"))
        return golden[0][0]
    by_name: dict[str, Path] = {}
    for g in given:
        name, sep, file = g.partition("=")
        if not sep or (name not in names and Path(g).is_file()):  # a bare FILE (its name may hold a '=')
            if len(specs) != 1 or len(given) != 1:
                raise UsageError_(f"--input {g}: the model takes {len(specs)} input(s) ({', '.join(names)}); "
                                  "give each as --input NAME=FILE")
            name, file = names[0], g
        if name not in names:
            raise UsageError_(f"--input {g}: the model has no input {name!r} (its inputs: {', '.join(names)})")
        if name in by_name:
            raise UsageError_(f"--input {name}= given twice")
        by_name[name] = Path(file)
    if missing := [n for n in names if n not in by_name]:
        raise UsageError_(f"no --input for {', '.join(missing)}: the model takes {len(specs)} inputs "
                          f"({', '.join(names)}); give each as --input NAME=FILE")
    return [_read_input(by_name[s["name"]], s, m.get("preprocess"), f"--input {s['name']}=") for s in specs]


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input", "input_specs", multiple=True, metavar="[NAME=]FILE",
              help="An image (PNG/JPEG) or a .npy array; NAME=FILE for one input of a multi-input model "
                   "(repeat it for each). Default: the bundle's first golden input.")
@click.option("--delegate", type=click.Choice(executors.CHOICES), default="auto", show_default=True,
              help="Executor tried first for delegated subgraphs (auto: rknn for rknn orders, then armnn where Arm NN has ACL (CpuAcc/GpuAcc), else onnxruntime > armnn > tvm); "
                   "one that cannot build a subgraph falls back to the next, with the reason logged.")
@click.option("--backends", default="CpuAcc,GpuAcc,CpuRef", show_default=True, help="Arm NN backend preference.")
@click.option("--trusted-key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Public key(s); when given, unsigned or wrongly signed bundles are refused.")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1), help="Runs to time.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(1), help="Top-k to print for classifiers.")
@click.option("--save-outputs", "save_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write the last run's outputs as DIR/output_<j>.npy.")
@click.option("--draw", "draw_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the --input image with the result drawn on it (boxes, labels, scores) to this .jpg/.png.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def run(bundle, input_specs, delegate, backends, keys, repeat, top, save_dir, draw_path, as_json):
    """One-shot inference: the decoded result, which executor ran each subgraph, latency."""
    try:
        image_path = _image_path(input_specs)
        _check_draw(draw_path, image_path)
        result = _run(bundle, input_specs, delegate, backends, keys, repeat, top, save_dir, image_path)
        if draw_path is not None:
            _draw(result, image_path, draw_path)
    except Exception as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    model = result["model"]
    click.echo(f"{model['name']} v{model['version']}")
    for e in result["outputs"]:
        click.echo(f"output {e['name']} {e['shape']}")
        for label, score in next((v for k, v in e.items() if k.startswith("top")), []):
            click.echo(f"  {score:6.3f}  {label}")
    if result.get("npu"):
        click.echo(f"npu: {result['npu']}")
    if result.get("gpu"):
        click.echo(f"gpu: {result['gpu']}")
    for s in result["subgraphs"]:
        bridge = f", bridge {s['bridge_us']:.0f} us/call" if "bridge_us" in s else ""
        layers = s.get("layers") or {}
        spread = f", layers {' '.join(f'{b}:{n}' for b, n in layers.items())}" if len(layers) > 1 else ""
        click.echo(f"subgraph {s['symbol']}: {s['executor']} ({s['backend']}{spread}{bridge})"
                   + (f" [fallback: {s['fallback_reason']}]" if s.get("fallback_reason") else ""))
    lat = result["latency_ms"]
    click.echo(f"latency: median {lat['median']:.2f} ms, p95 {lat['p95']:.2f} ms over {lat['runs']} run(s)")
    _echo_result(result["result"])
    if draw_path is not None:
        click.echo(f"drawn: {draw_path}")


# --- the result side: what the service would publish for this input, and the drawing ----------------

def _source_image(input_path: Path | None) -> np.ndarray | None:
    """The RGB image the input tensor was made of (None for .npy and golden inputs)."""
    from .serve import preprocess

    if input_path is None or input_path.suffix == ".npy" or not input_path.is_file():
        return None
    return preprocess.load_image(input_path)


def _result_of(m: dict, outs: list[np.ndarray], labels, input_path: Path | None, top: int) -> dict:
    """The service's ``results`` summary for this frame (agent/serve/pipeline.decode): boxes in
    the input image's pixels; ``frame`` is its width and height."""
    from .serve import pipeline

    image = _source_image(input_path)
    frame_hw = image.shape[:2] if image is not None else None
    summary = pipeline.decode(m, outs, frame_hw=frame_hw, labels=labels, top_k=top)
    body = json.loads(json.dumps(summary))  # tuples as lists, as the service sends them
    if frame_hw is not None:
        body["frame"] = [int(frame_hw[1]), int(frame_hw[0])]
    return body


def _check_draw(draw_path: Path | None, input_path: Path | None) -> None:
    if draw_path is None:
        return
    if input_path is None or input_path.suffix == ".npy":
        raise UsageError_("--draw needs an image --input (PNG/JPEG) to draw on")
    if draw_path.suffix.lower() not in (".jpg", ".jpeg", ".png"):
        raise UsageError_(f"--draw {draw_path}: give a .jpg or .png file name")
    if not draw_path.parent.is_dir():
        raise UsageError_(f"--draw {draw_path}: directory {draw_path.parent} does not exist")


def _draw(result: dict, input_path: Path, draw_path: Path) -> None:
    from .serve import draw

    try:
        draw.write(draw_path, draw.draw(_source_image(input_path), result["result"]))
    except OSError as err:
        raise UsageError_(f"--draw {draw_path}: cannot write it ({err.strerror or err})") from None


def _echo_result(r: dict) -> None:
    if r.get("kind") != "detector":
        return
    dets = r["detections"]
    frame = f" in the {r['frame'][0]}x{r['frame'][1]} image" if r.get("frame") else " (input pixels)"
    click.echo(f"{len(dets)} detection(s){frame}:")
    for d in dets:
        click.echo(f"  {d['score']:6.3f}  {d['label']:<16} [{', '.join(f'{v:.1f}' for v in d['box'])}]")


def _image_path(input_specs: tuple[str, ...]) -> Path | None:
    """The one image the input was made of (what --draw draws on and boxes are measured in)."""
    if len(input_specs) != 1:
        return None
    spec = input_specs[0]
    name, sep, file = spec.partition("=")
    path = Path(file) if sep and not Path(spec).is_file() else Path(spec)
    return path


def _run(bundle, input_specs, delegate, backends, keys, repeat, top, save_dir, image_path=None) -> dict:
    from .serve import preprocess

    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        raise UsageError_(f"--save-outputs {save_dir} is not a directory")
    failpoints.hit("run")
    with hmod.open_bundle(bundle, trusted_keys=keys) as b:
        b.lib_for()  # refuse a bundle without a lib for this machine before anything else
        m = b.manifest
        inputs = _load_inputs(b, tuple(input_specs))
        labels = b.read(m["labels"]).decode("utf-8", "replace").splitlines() if m.get("labels") else None
        from .run.runtime import HybridModule, check_inputs

        check_inputs(m, inputs)  # before any executor is built

        module = HybridModule(b, delegate=delegate, armnn_backends=tuple(x for x in backends.split(",") if x))
        try:
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                outs = module.run(inputs)
                times.append((time.perf_counter() - t0) * 1e3)
            subgraphs = module.describe()
            npu = module.npu()
            gpu = module.gpu()
        finally:
            module.close()
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        for j, o in enumerate(outs):
            np.save(save_dir / f"output_{j}.npy", o, allow_pickle=False)
    result = {"model": m["model"], "outputs": [], "subgraphs": subgraphs, **({"npu": npu} if npu else {}),
              **({"gpu": gpu} if gpu else {}),
              "latency_ms": {"median": float(np.median(times)), "p95": float(np.percentile(times, 95)), "runs": repeat}}
    for spec, o in zip(m["outputs"], outs):
        entry = {"name": spec["name"], "shape": list(o.shape)}
        if o.ndim == 2 and o.shape[0] == 1 and o.shape[1] > 1:  # a classifier's scores
            scores = preprocess.softmax_if_logits(o.reshape(-1))
            idx = np.argsort(-scores, kind="stable")[:top]
            entry["top5" if top == 5 else f"top{top}"] = [
                [labels[i] if labels and i < len(labels) else str(int(i)), float(scores[i])] for i in idx]
        result["outputs"].append(entry)
    result["result"] = _result_of(m, outs, labels, image_path, top)
    return result


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the profile here; on the host, `tandoor compile --profile FILE` uses it.")
@click.option("--runs", default=20, show_default=True, type=click.IntRange(1),
              help="Timed runs per measurement (fewer for calls > 0.25 s).")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(0), help="Warm-up runs, not timed.")
@click.option("--executor", "executors", multiple=True, type=click.Choice(executors.NAMES),
              help="Executors to measure (repeatable). Default: all; the unavailable ones are reported.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def profile(bundle, out, runs, warmup, executors, as_json):
    """Measure every subgraph of BUNDLE on every executor here, on the board, for the compiler's
    cost model (the same measurement as the host's `tandoor profile`, without the compiler)."""
    from .run import profile as prof

    if out is not None and out.is_dir():
        _fail(UsageError_(f"-o {out} is a directory; give a file name"))

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(f"  {msg}", err=True)

    try:
        res = prof.measure(bundle, runs=runs, warmup=warmup, executors=tuple(executors) or prof.EXECUTORS,
                           progress=progress)
        if out is not None:
            prof.write(res, out)
    except OSError as err:
        _fail(UsageError_(f"cannot write {out}: {err.strerror}"))
    except Exception as err:
        _fail(err)
    if as_json:
        click.echo(json.dumps(res, indent=2, sort_keys=True))
        return
    k = res["key"]
    click.echo(f"{k['model']} on {k['board']} (bundle sha256 {k['bundle_sha256'][:12]})")
    click.echo(f"{'subgraph':<28} {'ops':>4} {'TVM us':>10} {'onnxruntime us':>15} {'armnn us':>10}  backend")
    for sym, s in res["subgraphs"].items():
        ex = s["exec_us"]
        cell = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        click.echo(f"{sym:<28} {len(s['ops']):>4} {cell(s.get('tvm_us')):>10} {cell(ex.get('onnxruntime')):>15} "
                   f"{cell(ex.get('armnn')):>10}  {s['backend'].get('armnn', '-')}")
        for e, why in s["unavailable"].items():
            click.echo(f"  {e} unavailable: {why}")
    for e, v in res["model"].items():
        if isinstance(v, dict) and "total_us" in v:
            click.echo(f"whole model with {e}: {v['total_us'] / 1e3:.2f} ms (delegated {v['delegated_us'] / 1e3:.2f} ms, "
                       f"TVM side {v['tvm_side_us'] / 1e3:.2f} ms)")
        elif isinstance(v, dict) and "error" in v:
            click.echo(f"whole model with {e}: not measured: {v['error']}")
    if out is not None:
        click.echo(f"profile written to {out}; on the host: tandoor compile MODEL.onnx --profile {out.name} ...")


main.add_command(service.serve)  # tandoor-agent serve --config FILE (the loop: agent/serve/service.py)

if __name__ == "__main__":
    main()
