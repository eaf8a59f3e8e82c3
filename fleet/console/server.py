"""`tandoor fleet console`: open the store, start the ingest, serve the pages until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil
import signal
from pathlib import Path

from aiohttp import web

from .auth import Auth, load_users
from .ingest import Ingest
from .store import Store
from .web import Console

log = logging.getLogger("tandoor.console")


def default_db() -> str:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "tandoor"
    base.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{base / 'console.db'}"


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(db: str, listen: str, brokers: list[str], cafile: str | None, prefix: str, group: str,
        users: Path | None, bundles: Path | None, raw_hours: float, rollup_days: float,
        results: bool = True, ready=None) -> None:
    """Blocks until a signal; raises ValueError / StoreError / AuthError / OSError for the CLI to say."""
    host, port = parse_listen(listen)
    auth = Auth(load_users(users) if users else None)
    if not is_loopback(host) and not auth.enabled:
        log.warning("listening on %s without --users: anyone who reaches it reads the fleet (actions stay off)", host)
    store = Store.open(db, raw_hours=raw_hours, rollup_days=rollup_days)
    log.info("database %s at schema version %d (raw telemetry %g h, rollups %g days)", store._where(),
             store.version(), raw_hours, rollup_days)
    ingest = Ingest(store, brokers, prefix=prefix, group=group, cafile=cafile, results=results).start()
    console = Console(store, ingest, auth, brokers[0], cafile=cafile, prefix=prefix, bundles_dir=bundles)
    try:
        asyncio.run(_serve(console, host, port, ready))
    finally:
        ingest.stop()
        shutil.rmtree(console.upload_dir, ignore_errors=True)


async def _serve(console: Console, host: str, port: int, ready) -> None:
    runner = web.AppRunner(console.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0] if runner.addresses else (host, port)
    log.info("serving on http://%s:%d/", bound[0] if ":" not in str(bound[0]) else f"[{bound[0]}]", bound[1])
    if ready is not None:
        ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()
