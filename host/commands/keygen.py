"""`tandoor keygen`: an Ed25519 key pair to sign bundles and key commands with."""

from __future__ import annotations

from pathlib import Path

import click

from tandoor_contract import hmod


from ..cli_base import fail


@click.command()
@click.option("-o", "--output", "out", default="tandoor-key", show_default=True,
              help="Writes OUT.pem (private, keep it secret) and OUT.pub.pem (give to devices).")
def keygen(out):
    """Make an Ed25519 key pair for signing bundles."""
    priv, pub = Path(f"{out}.pem"), Path(f"{out}.pub.pem")
    try:
        fp = hmod.generate_keypair(priv, pub)
    except hmod.BundleError as err:
        fail(err)
    click.echo(f"wrote {priv} (private) and {pub} (public), fingerprint {fp}")
