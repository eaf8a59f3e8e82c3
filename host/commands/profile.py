"""`tandoor profile`: measure each region on each executor here, for `compile --profile`."""

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

    try:
        with cli_progress("profiling", quiet=as_json) as progress:
            res = prof.measure(bundle, runs=runs, warmup=warmup, executors=tuple(executors) or prof.EXECUTORS,
                               progress=progress)
        if out:
            prof.write(res, out)
    except (CompileError, hmod.BundleError) as err:
        fail(err)
    except OSError as err:
        fail(CompileError(f"cannot write {out}: {err.strerror}"))
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
        elif isinstance(v, dict) and "error" in v:
            c.print(f"whole model with {e}: not measured: {v['error']}", markup=False, soft_wrap=True)
    if out:
        c.print(f"profile written to {out}")
