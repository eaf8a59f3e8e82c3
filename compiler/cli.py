"""`tandoor`: the host-side tools (compile, inspect, verify, keygen)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from tandoor_agent import hmod

from .errors import CompileError


def _fail(err: Exception) -> None:
    click.echo(f"tandoor: error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 2))


def _floats(text: str | None, opt: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise CompileError(f"{opt} '{text}': expected comma-separated numbers such as 0.485,0.456,0.406") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tandoor")
def main() -> None:
    """Tandoor: compile ONNX vision models into ACL-partitioned hybrid modules for ARM boards."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Bundle to write (.hmod). Written atomically: a failed compile leaves nothing there.")
@click.option("--input", "inputs", multiple=True, metavar="NAME=1x3x224x224",
              help="Pin an input's shape (repeatable). Default: the model's static shape.")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="host, aarch64, rk3588, jetson-orin, rpi5 (repeatable). host is always included.")
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), help="Ed25519 private key (tandoor keygen) to sign with.")
@click.option("--labels", type=click.Path(dir_okay=False, path_type=Path), help="Class labels, one per line.")
@click.option("--mean", help="Per-channel mean, e.g. 0.485,0.456,0.406 (0..1 units) or 127,127,127 (pixel units).")
@click.option("--std", help="Per-channel std, same units as --mean.")
@click.option("--layout", type=click.Choice(["NCHW", "NHWC"]), default="NCHW", show_default=True, help="Input image layout.")
@click.option("--bgr", is_flag=True, help="The model expects BGR channel order.")
@click.option("--policy", type=click.Choice(["cost", "all"]), default="cost", show_default=True,
              help="cost: delegate a subgraph only when it pays for its boundary; all: every supported op.")
@click.option("--name", help="Model name in the manifest (default: from the ONNX graph or file name).")
@click.option("--model-version", "version", default="1", show_default=True, help="Model version in the manifest.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def compile(model, out, inputs, targets, key, labels, mean, std, layout, bgr, policy, name, version, quiet):
    """Compile MODEL.onnx into a hybrid module bundle."""
    from rich.console import Console

    from .pipeline import Options, compile_model

    console = Console(stderr=True, quiet=quiet)
    try:
        opts = Options(list(inputs), list(targets), key, labels, _floats(mean, "--mean"), _floats(std, "--std"),
                       layout, bgr, policy, name, version)
        with console.status("compiling") as status:
            def progress(msg: str) -> None:
                status.update(msg)
                console.log(msg)
            manifest = compile_model(model, out, opts, progress)
    except (CompileError, hmod.BundleError) as err:
        _fail(err)
    console.print(
        f"[green]wrote[/] {out}: {manifest['ops_delegated']}/{manifest['ops_total']} ops to ACL "
        f"(ratio {manifest['delegation_ratio']:.2f}) in {sum(p['delegate'] for p in manifest['partitions'])} subgraph(s), "
        f"targets {', '.join(manifest['targets'])}, predicted speedup {manifest['predicted_speedup']:.2f}x"
        + (", signed" if key else "")
    )


@main.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--graph", type=click.Path(dir_okay=False, path_type=Path), help="Draw the partitioned graph (SVG).")
def inspect(bundle, as_json, graph):
    """Show what runs where: ACL subgraphs, ops left to TVM and why, ratio, predicted speedup."""
    from . import report

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
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--reference", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The source ONNX model.")
@click.option("--delegate", type=click.Choice(["auto", "armnn", "onnxruntime", "tvm"]), default="onnxruntime",
              show_default=True, help="Executor for the delegated subgraphs.")
@click.option("--random", "n_random", default=3, show_default=True, help="Random inputs besides the golden ones.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify(bundle, reference, delegate, n_random, as_json):
    """Run the bundle's host lib against MODEL.onnx in onnxruntime; exit 1 past tolerance."""
    from .verify import verify as run_verify

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
            click.echo(f"  {c['kind']:7s} max abs {c['max_abs_err']:.3g}  max rel {c['max_rel_err']:.3g}  {'ok' if c['ok'] else 'FAIL'}")
        for s in res["subgraphs"]:
            click.echo(f"  {s['symbol']}: {s['executor']} ({s['backend']})")
        verdict = "PASS" if res["ok"] else "FAIL"
        click.echo(f"{verdict}: max abs err {res['max_abs_err']:.3g}, max rel err {res['max_rel_err']:.3g} "
                   f"(atol {res['atol']}, rtol {res['rtol']})")
    sys.exit(0 if res["ok"] else 1)


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


if __name__ == "__main__":
    main()
