"""Deploy, cancel and rollback with their record in the console's database: the one code path of
`tandoor fleet deploy/cancel/rollback --db URL` and of the console's action buttons.

A deploy's job is written (state ``running``, its waves) before any offer is sent: a database that
refuses the write stops the deploy with the database's reason, so no job runs unrecorded. Its
progress lines and its result follow; a write that fails after the start is logged and the deploy
goes on (the devices' acks, which the console also keeps, still say how it ends).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..client import Fleet
from ..rollout import Rollout
from .store import Store, StoreError

log = logging.getLogger("tandoor.console")
DB_ENV = "TANDOOR_CONSOLE_DB"


def store_from(db: str | None) -> Store | None:
    """``--db`` or $TANDOOR_CONSOLE_DB, opened and migrated; None when neither is given."""
    url = db or os.environ.get(DB_ENV)
    return Store.open(url) if url else None


def deploy(fleet: Fleet, bundle: Path, devices: list[str] | None, store: Store | None, source: str,
           progress: Callable[[str], None] | None = None, **options: Any) -> dict[str, Any]:
    """A Rollout (the options of Fleet.deploy), recorded in ``store`` when one is given."""
    return run(prepare(fleet, bundle, devices, store, source, progress, **options), store)


def prepare(fleet: Fleet, bundle: Path, devices: list[str] | None, store: Store | None, source: str,
            progress: Callable[[str], None] | None = None, **options: Any) -> Rollout:
    """The planned Rollout, its job recorded (StoreError: not recorded, so not to be run)."""
    shown = progress or (lambda s: None)
    r = Rollout(fleet, bundle, devices=devices, progress=shown, **options)
    plan = r.plan()
    if store is None:
        return r
    store.record_job(plan.job_id, source=source, bundle=str(bundle), model=plan.model, sha256=plan.sha256,
                     options={k: v for k, v in options.items() if not callable(v)},
                     waves=[{"name": w.name, "devices": w.devices, "canary": w.canary} for w in plan.waves])

    def recorded(line: str) -> None:
        shown(line)
        try:
            store.job_progress(plan.job_id, line)
        except StoreError as e:
            log.warning("job %s: progress not recorded: %s", plan.job_id, e)

    r.progress = recorded
    return r


def run(r: Rollout, store: Store | None) -> dict[str, Any]:
    """Run a prepared Rollout and record its result."""
    res = r.run()
    if store is not None:
        try:
            store.finish_job(res["job_id"], res)
        except StoreError as e:
            log.warning("job %s: its result was not recorded: %s", res["job_id"], e)
            res["db_error"] = str(e)
    return res


def cancel(fleet: Fleet, job_id: str, devices: list[str] | None, store: Store | None, source: str,
           **kw: Any) -> dict[str, dict]:
    out = fleet.cancel(job_id, devices, **kw)
    if store is not None:
        _record(store, "cancel", job_id, source, out)
    return out


def rollback(fleet: Fleet, devices: list[str], store: Store | None, source: str, **kw: Any) -> dict[str, dict]:
    out = fleet.command(devices, "rollback", **kw)
    if store is not None:
        _record(store, "rollback", None, source, out)
    return out


def _record(store: Store, kind: str, job_id: str | None, source: str, out: dict[str, dict]) -> None:
    try:
        store.record_operation(kind, job_id, source, list(out), out)
    except StoreError as e:
        log.warning("%s: not recorded: %s", kind, e)
