"""`tandoor inspect`: what runs where in a bundle, and why; where its bytes go."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract import hmod

from ..inputs import InputFile

from ..cli_base import debug_option, fail


@click.command()
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
        from .. import sizes

        try:
            info = sizes.sizes(bundle)
        except hmod.BundleError as err:
            fail(err)
        click.echo(json.dumps(info, indent=2) if as_json else "\n".join(sizes.lines(info)))
        return
    try:
        with hmod.open_bundle(bundle) as b:
            info = report.summary(b)
            if graph:
                report.draw_svg(b, graph)
    except (CompileError, hmod.BundleError) as err:
        fail(err)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        report.print_summary(info)
        if graph:
            click.echo(f"graph written to {graph}")
