"""`tandoor-agent`: the board side. `run` does one-shot inference on a bundle."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import click
import numpy as np

from . import hmod


def _fail(err: Exception) -> None:
    click.echo(f"tandoor-agent: error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 2))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tandoor")
@click.option("-v", "--verbose", is_flag=True, help="Log executor choices and fallbacks.")
def main(verbose: bool) -> None:
    """Tandoor's on-board agent."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--input", "input_path", type=click.Path(dir_okay=False, path_type=Path),
              help="An image (PNG/JPEG) or a .npy array. Default: the bundle's first golden input.")
@click.option("--delegate", type=click.Choice(["auto", "armnn", "onnxruntime", "tvm"]), default="auto", show_default=True,
              help="Executor for delegated subgraphs; auto picks the best that can build each one.")
@click.option("--backends", default="CpuAcc,GpuAcc,CpuRef", show_default=True, help="Arm NN backend preference.")
@click.option("--trusted-key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Public key(s); when given, unsigned or wrongly signed bundles are refused.")
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1), help="Runs to time.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(1), help="Top-k to print for classifiers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def run(bundle, input_path, delegate, backends, keys, repeat, top, as_json):
    """One-shot inference: top outputs, which executor ran each subgraph, latency."""
    from . import preprocess
    from .runtime import HybridModule

    try:
        with hmod.open_bundle(bundle, trusted_keys=keys) as b:
            m = b.manifest
            if input_path is None:
                inputs = b.golden()[0][0]
            elif input_path.suffix == ".npy":
                inputs = [np.load(input_path, allow_pickle=False)]
            else:
                if not input_path.is_file():
                    raise FileNotFoundError(f"{input_path}: no such file")
                inputs = [preprocess.to_input(preprocess.load_image(input_path), m["inputs"][0], m.get("preprocess"))]
            labels = b.read(m["labels"]).decode().splitlines() if m.get("labels") else None
            module = HybridModule(b, delegate=delegate, armnn_backends=tuple(x for x in backends.split(",") if x))
            try:
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    outs = module.run(inputs)
                    times.append((time.perf_counter() - t0) * 1e3)
                subgraphs = module.describe()
            finally:
                module.close()
    except (hmod.BundleError, OSError) as err:
        _fail(err)
    except Exception as err:
        _fail(err)
    result = {"model": m["model"], "outputs": [], "subgraphs": subgraphs,
              "latency_ms": {"median": float(np.median(times)), "p95": float(np.percentile(times, 95)), "runs": repeat}}
    for spec, o in zip(m["outputs"], outs):
        entry = {"name": spec["name"], "shape": list(o.shape)}
        flat = o.reshape(-1)
        if o.ndim == 2 and o.shape[0] == 1 and o.shape[1] > 1:
            scores = preprocess.softmax_if_logits(flat)
            idx = np.argsort(-scores)[:top]
            entry["top5" if top == 5 else f"top{top}"] = [[labels[i] if labels and i < len(labels) else str(int(i)), float(scores[i])] for i in idx]
        result["outputs"].append(entry)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{m['model']['name']} v{m['model']['version']}")
    for e in result["outputs"]:
        click.echo(f"output {e['name']} {e['shape']}")
        for label, score in next((v for k, v in e.items() if k.startswith("top")), []):
            click.echo(f"  {score:6.3f}  {label}")
    for s in subgraphs:
        click.echo(f"subgraph {s['symbol']}: {s['executor']} ({s['backend']})"
                   + (f" [fallback: {s['fallback_reason']}]" if s.get("fallback_reason") else ""))
    lat = result["latency_ms"]
    click.echo(f"latency: median {lat['median']:.2f} ms, p95 {lat['p95']:.2f} ms over {repeat} run(s)")


if __name__ == "__main__":
    main()
