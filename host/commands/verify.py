"""`tandoor verify`: a bundle as the device runs it against onnxruntime on the source model."""

from __future__ import annotations

import json
import sys

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract import agreement, hmod, orders

from ..inputs import InputFile
from ..quantize import (
    accuracy_options,
    verify_on_images,
)

from ..cli_base import debug_option, fail


@click.command()
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
    from ..verify import verify as run_verify

    if images is not None:
        verify_on_images(bundle, reference, images, delegate=delegate or "onnxruntime", count=count, max_drop=max_drop,
                         min_sqnr=min_sqnr, as_json=as_json)

    try:
        res = run_verify(bundle, reference, delegate=delegate, random_inputs=n_random)
    except (CompileError, hmod.BundleError) as err:
        fail(err)
    except Exception as err:  # runtime errors from the agent side, with their own exit codes
        fail(err)
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
