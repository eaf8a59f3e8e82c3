"""`tandoor cache`: what the compile cache holds, or empty it."""

from __future__ import annotations

import json
import os

import click





@click.command("cache")
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
