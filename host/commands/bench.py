"""`tandoor bench`: onnxruntime, TVM only and the hybrid timed side by side on this host."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract import hmod, orders

from ..inputs import InputFile

from ..cli_base import progress as cli_progress
from ..cli_base import debug_option, fail


@click.command()
@click.argument("model", type=InputFile("model"))
@click.option("--input", "inputs", multiple=True, metavar="NAME=1x3x224x224", help="Pin an input's shape (repeatable).")
@click.option("--runs", default=20, show_default=True, help="Timed runs per path and block (medians, p95 and p99 are reported).")
@click.option("--blocks", type=click.IntRange(1), default=1, show_default=True,
              help="Repeat the timing N times (--runs runs per path each): p50/p95/p99 over all runs and the "
                   "run-to-run spread, the worst block's median over the best block's.")
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
def bench(model, inputs, runs, blocks, warmup, policy, executors, include_armnn, as_json, plot, kernels, int8_model, images,
          count):
    """onnxruntime vs TVM only vs the hybrid module per executor, in one process.
    With --int8: what INT8 buys, route by route."""
    from .. import bench as bench_mod

    if int8_model is None and (images is not None or count is not None):
        raise CompileError("--images and --count go with --int8: they measure the INT8 model's agreement with MODEL")
    if int8_model is not None and (kernels or plot or executors or include_armnn or policy != "cost"):
        raise CompileError("--int8 times fixed fp32 and INT8 routes; --kernels, --plot, --executor, --armnn and "
                           "--policy belong to the plain tandoor bench MODEL")
    try:
        with cli_progress("benchmarking", quiet=as_json) as progress:
            if int8_model is not None:
                from ..bench_int8 import run_int8

                res = run_int8(model, int8_model, inputs, runs=runs, blocks=blocks, warmup=warmup, images=images, count=count,
                               progress=progress)
            else:
                res = bench_mod.run(model, inputs, runs=runs, blocks=blocks, warmup=warmup, policy=policy, include_armnn=include_armnn,
                                    executors=tuple(executors) or None, kernels=kernels, progress=progress)
        if plot:
            bench_mod.plot(res, plot)
    except (CompileError, hmod.BundleError) as err:
        fail(err)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    elif int8_model is not None:
        from ..bench_int8 import print_int8

        print_int8(res)
    else:
        bench_mod.print_table(res)
        if plot:
            click.echo(f"plot written to {plot}")
