"""`tandoor fleet`: the fleet's devices, deploys (canaries, waves), status, cancel, rollback, keys and the console."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import click



from .. import cli_base
from ..cli_base import debug_option


def _broker_options(f):
    f = click.option("--prefix", default="tandoor", show_default=True, help="Topic prefix (broker.topic_prefix).")(f)
    f = click.option("--cafile", type=click.Path(exists=True, dir_okay=False),
                     help="CA (PEM) that signed the broker's TLS certificate (a private CA); "
                          "default with mqtts://: the system CAs.")(f)
    f = click.option("--broker", envvar="TANDOOR_BROKER", default="mqtt://localhost:1883", show_default=True,
                     help="mqtt[s]://user:pass@host:port (or $TANDOOR_BROKER).")(f)
    return f


def _fleet(broker, cafile, prefix):
    from tandoor_fleet.rollout import Fleet, FleetError

    try:
        return Fleet(broker, cafile=cafile, prefix=prefix,
                     log=lambda m: click.echo(m, err=True)).connect()
    except (FleetError, OSError) as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)


def _per_device(out: dict, as_json: bool, line, ok) -> None:
    """Print {device: answer} (as JSON, or ``line(answer)`` per device) and exit 0 when every
    answer is ``ok(answer)``, else 1."""
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        for d, a in out.items():
            click.echo(f"{d:24s} {line(a)}")
    sys.exit(0 if all(ok(a) for a in out.values()) else 1)


def _db_option(f):
    return click.option("--db", envvar="TANDOOR_CONSOLE_DB",
                        help="Record this in the fleet console's database (sqlite:///PATH, a path, or "
                             "postgresql://...; or $TANDOOR_CONSOLE_DB): the console shows it.")(f)


def _console_store(db):
    """The console's store for --db (None without it); a database that cannot be opened is one line."""
    from tandoor_fleet.console.actions import store_from
    from tandoor_fleet.console.store import StoreError

    try:
        return store_from(db)
    except StoreError as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)


def _device_list(devices: str | None) -> list[str] | None:
    return [d.strip() for d in devices.split(",") if d.strip()] if devices else None


@click.group()
def fleet():
    """Fleet model updates over MQTT (docs/fleet.md): devices, deploy, status, cancel, rollback, keys."""


@fleet.command("devices")
@_broker_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--wait", default=1.0, show_default=True, help="Seconds to collect retained status messages.")
def fleet_devices(broker, cafile, prefix, as_json, wait):
    """Devices from their retained status: online, state, model, slot, last update job."""
    f = _fleet(broker, cafile, prefix)
    try:
        devs = f.devices(wait=wait)
    finally:
        f.close()
    if as_json:
        click.echo(json.dumps(devs, indent=2))
        return
    for d, s in devs.items():
        m = s.get("model") or {}
        job = s.get("last_job") or {}
        click.echo(f"{d:24s} {'online ' if s.get('online') else 'offline'} {str(s.get('state')):9s} "
                   f"{m.get('name')} v{m.get('version')} slot {s.get('slot')} "
                   f"sha {str(m.get('sha256'))[:12]}  last job: {job.get('job_id')} {job.get('state') or ''}"
                   + _recovery_note(s))
    if not devs:
        click.echo("no devices (no retained status under the prefix)", err=True)


def _recovery_note(status: dict) -> str:
    """What a device had to repair at its start (its status' `recovered`), and a keyring that
    fell back to the configured keys: said on the device's line, so an operator sees it."""
    out = ""
    for r in status.get("recovered") or ():
        chose = r.get("chose") or {}
        bad = ", ".join(f"slot {b.get('slot')}" for b in r.get("marked_bad") or ())
        out += (f"  recovered: {r.get('damaged')} ({r.get('reason')})"
                + (f", serving slot {chose['slot']} ({chose.get('how')})" if chose.get("slot") else
                   f", {chose.get('how')}" if chose.get("how") else "")
                + (f", marked bad: {bad}" if bad else ""))
    kr = status.get("keyring") or {}
    if kr.get("state") == "rebuilt":
        out += f"  keyring rebuilt: trusting {', '.join(kr.get('trusted') or []) or 'no key'}"
    return out


@fleet.command("deploy")
@click.argument("bundle", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_broker_options
@click.option("--devices", help="Comma-separated device ids.")
@click.option("--all", "all_", is_flag=True, help="Every device whose retained status is online.")
@click.option("--canary", default="0", show_default=True, help="Canary share first, e.g. 10% (at least one device).")
@click.option("--max-failures", default=0, show_default=True, help="Abort the remaining devices when more fail.")
@click.option("--latency-budget-ms", type=float, help="p95 budget: the device health gate and the canary check.")
@click.option("--p99-budget-ms", type=click.FloatRange(0, min_open=True),
              help="p99 budget, judged beside the p95 one by the health gate and the canary check (none by "
                   "default: over the gate's 20 frames the p99 is nearly the slowest frame).")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds for the whole rollout (the job deadline).")
@click.option("--wave-size", default=0, show_default=True, help="Devices per wave after the canaries (0: all).")
@click.option("--chunk-size", default=64 * 1024, show_default=True, help="Bytes per chunk message.")
@click.option("--health-frames", default=20, show_default=True, help="Frames the device health gate runs.")
@click.option("--job-id", help="Job id (default: <model>-v<version>-<sha8>-<time>); the same id again is a no-op.")
@click.option("--canary-soak", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds the canaries serve the new model before their telemetry p95 (inference, every "
                   "frame since the swap) is checked against --latency-budget-ms; give it a few telemetry "
                   "periods. Without telemetry: the p95 of the device health gate.")
@click.option("--transport", type=click.Choice(["mqtt", "url"]), default="mqtt", show_default=True,
              help="mqtt: chunks once per wave on the fleet-wide topic, re-sends on request; url: devices "
                   "download the bundle themselves with HTTP Range requests (--artifact-url or --serve).")
@click.option("--artifact-url", help="With --transport url: where the devices fetch the bundle (an object store URL).")
@click.option("--serve", "serve", metavar="HOST:PORT",
              help="With --transport url: serve the bundle from this host over HTTP while the deploy runs "
                   "(HOST: the address the devices reach; port 0: any free one).")
@click.option("--stall-timeout", default=120.0, show_default=True, type=click.FloatRange(1),
              help="Seconds without progress after which a device drops the job (so a dead deploy never wedges it).")
@click.option("--allow-downgrade", is_flag=True,
              help="Let devices install a bundle older than the one they run (refused by default).")
@click.option("--json", "as_json", is_flag=True, help="Per device: final state and reason, as JSON.")
@_db_option
def fleet_deploy(bundle, broker, cafile, prefix, devices, all_, canary, max_failures, latency_budget_ms, p99_budget_ms,
                 timeout,
                 wave_size, chunk_size, health_frames, job_id, canary_soak, transport, artifact_url, serve,
                 stall_timeout, allow_downgrade, as_json, db):
    """Staged rollout of BUNDLE: canaries, then waves; stops on failures or a p95/p99 regression.

    Exit code 0 when every device committed, 1 otherwise, 2 on usage/connection errors."""
    from tandoor_fleet.console import actions
    from tandoor_fleet.console.store import StoreError
    from tandoor_fleet.rollout import FleetError

    if bool(devices) == bool(all_):
        click.echo("tandoor: error: give exactly one of --devices a,b or --all", err=True)
        sys.exit(2)
    try:
        pct = float(str(canary).rstrip("%"))
    except ValueError:
        click.echo(f"tandoor: error: --canary {canary!r}: expected a percentage such as 10%", err=True)
        sys.exit(2)
    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    t0 = __import__("time").monotonic()

    def progress(msg):
        click.echo(f"[{__import__('time').monotonic() - t0:6.1f}s] {msg}", err=True)

    try:
        res = actions.deploy(f, bundle, _device_list(devices), store, "the CLI", canary_pct=pct, max_failures=max_failures,
                       latency_budget_ms=latency_budget_ms, p99_budget_ms=p99_budget_ms, timeout=timeout,
                       job_id=job_id, chunk_size=chunk_size,
                       health_frames=health_frames, wave_size=wave_size, canary_soak_s=canary_soak,
                       transport=transport, artifact_url=artifact_url, serve=serve, stall_timeout_s=stall_timeout,
                       allow_downgrade=allow_downgrade, progress=progress)
    except (FleetError, StoreError) as err:
        click.echo(f"tandoor: error: {err}" + (" (nothing was sent: the job could not be recorded)"
                                                if isinstance(err, StoreError) else ""), err=True)
        sys.exit(2)
    finally:
        f.close()
    if res.get("db_error"):
        click.echo(f"tandoor: warning: the job ran but its result is not in the database: {res['db_error']}", err=True)
    if as_json:
        click.echo(json.dumps(res, indent=2, default=str))
    else:
        for d, r in res["devices"].items():
            click.echo(f"{d:24s} {r['state']:12s} {r.get('reason') or ''}")
        click.echo(f"job {res['job_id']}: " + ", ".join(f"{v} {k}" for k, v in sorted(res["counts"].items()))
                   + f" in {res['seconds']:.1f} s" + (f"; aborted: {res['aborted']}" if res["aborted"] else ""))
    sys.exit(0 if all(r["state"] == "committed" for r in res["devices"].values()) else 1)


@fleet.command("status")
@click.argument("job", required=False)
@_broker_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--wait", default=1.0, show_default=True, help="Seconds to collect retained messages.")
def fleet_status(job, broker, cafile, prefix, as_json, wait):
    """The last ack of JOB per device (from the retained update/ack topics), with what a device
    had to recover at its start; without JOB, every device's state and recoveries."""
    f = _fleet(broker, cafile, prefix)
    try:
        st = f.job_status(job, wait=wait) if job else {}
        devs = f.devices(wait=0.0 if job else wait)
    finally:
        f.close()
    if not job:
        if as_json:
            click.echo(json.dumps({d: {k: s.get(k) for k in ("online", "state", "model", "slot", "recovered", "keyring")}
                                   for d, s in devs.items()}, indent=2))
            return
        for d, s in devs.items():
            m = s.get("model") or {}
            click.echo(f"{d:24s} {'online ' if s.get('online') else 'offline'} {str(s.get('state')):9s} "
                       f"{m.get('name')} v{m.get('version')} slot {s.get('slot')}" + _recovery_note(s))
        if not devs:
            click.echo("no devices (no retained status under the prefix)", err=True)
        return
    if as_json:
        click.echo(json.dumps({d: {**a, **({"recovered": devs[d]["recovered"]} if (devs.get(d) or {}).get("recovered")
                                           else {})} for d, a in st.items()}, indent=2))
        return
    for d, a in st.items():
        click.echo(f"{d:24s} {a.get('state'):12s} {a.get('reason') or ''}" + _recovery_note(devs.get(d) or {}))
    if not st:
        click.echo(f"no device reports job {job}", err=True)


@fleet.command("cancel")
@click.argument("job")
@_broker_options
@click.option("--devices", help="Comma-separated device ids (default: every device whose last ack names JOB, not final).")
@click.option("--reason", default="cancelled by the operator", show_default=True, help="Said in the cancelled ack.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the answers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_db_option
def fleet_cancel(job, broker, cafile, prefix, devices, reason, timeout, as_json, db):
    """Drop JOB on the devices now (e.g. after its deploy died): they answer `cancelled` and take
    the next job at once. A device past its download finishes the job by itself (said so)."""
    from tandoor_fleet.console import actions

    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    try:
        out = actions.cancel(f, job, _device_list(devices), store, "the CLI", reason=reason, timeout=timeout)
    finally:
        f.close()
    if not out:
        click.echo(f"no device runs job {job} (give --devices to record the cancel anyway)", err=True)
    _per_device(out, as_json, lambda a: f"{str(a.get('state')):12s} {a.get('note') or a.get('reason') or ''}",
                lambda a: a.get("state") == "cancelled")


@fleet.group("keys")
def fleet_keys():
    """Key rotation on the devices: signed add-key / retire-key commands (docs/updates.md)."""


def _key_op(op, devices, sign_with, broker, cafile, prefix, timeout, as_json, **kw):
    from tandoor_fleet.rollout import FleetError

    f = _fleet(broker, cafile, prefix)
    try:
        out = f.key_command(_device_list(devices), op, Path(sign_with), timeout=timeout, **kw)
    except FleetError as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)
    finally:
        f.close()
    _per_device(out, as_json, lambda a: (("ok trusted: " + ", ".join(a.get("trusted") or [])) if a.get("ok")
                                         else f"FAILED {a.get('reason')}") + _affects(a), lambda a: a.get("ok"))


def _affects(answer: dict) -> str:
    """A retire-key's answer: the installed models the key signed (they keep serving)."""
    if "affects" not in answer:
        return ""
    models = [f"slot {a.get('slot')} {(a.get('model') or {}).get('name')} v{(a.get('model') or {}).get('version')}"
              + (" (serving)" if a.get("primary") else "") for a in answer["affects"]]
    return "; signed " + (", ".join(models) if models else "no installed model")


def _key_options(f):
    f = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(f)
    f = click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for the answers.")(f)
    f = click.option("--sign-with", required=True, type=click.Path(exists=True, dir_okay=False),
                     help="Private key (PEM) the devices trust now.")(f)
    f = click.option("--devices", required=True, help="Comma-separated device ids.")(f)
    return _broker_options(f)


@fleet_keys.command("add")
@click.argument("public_key", type=click.Path(exists=True, dir_okay=False))
@_key_options
def fleet_keys_add(public_key, devices, sign_with, broker, cafile, prefix, timeout, as_json):
    """Trust PUBLIC_KEY too (signed with a key the devices trust now)."""
    _key_op("add-key", devices, sign_with, broker, cafile, prefix, timeout, as_json, public_key=Path(public_key))


@fleet_keys.command("retire")
@click.argument("fingerprint")
@click.option("--force", is_flag=True, help="Retire it even on a device where it signed every good model.")
@_key_options
def fleet_keys_retire(fingerprint, force, devices, sign_with, broker, cafile, prefix, timeout, as_json):
    """Stop trusting the key FINGERPRINT (from `tandoor keygen`); its bundles are refused from now on.
    Installed models it signed keep serving (trusted at install); each device names them, and one
    where it signed every good model refuses unless --force."""
    _key_op("retire-key", devices, sign_with, broker, cafile, prefix, timeout, as_json, fingerprint=fingerprint,
            force=force)


@fleet.command("rollback")
@_broker_options
@click.option("--devices", required=True, help="Comma-separated device ids.")
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for the answers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_db_option
def fleet_rollback(broker, cafile, prefix, devices, timeout, as_json, db):
    """Roll the devices back to their previous good slot (the `rollback` command)."""
    from tandoor_fleet.console import actions

    store = _console_store(db)
    f = _fleet(broker, cafile, prefix)
    try:
        out = actions.rollback(f, _device_list(devices), store, "the CLI", timeout=timeout)
    finally:
        f.close()
    _per_device(out, as_json, lambda r: f"{'ok' if r.get('ok') else 'FAILED'} {r.get('result') or r.get('error')}",
                lambda r: r.get("ok"))


@fleet.command("console")
@click.option("--db", envvar="TANDOOR_CONSOLE_DB",
              help="sqlite:///PATH (or a path) or postgresql://user:pass@host/db; default "
                   "~/.local/share/tandoor/console.db (or $TANDOOR_CONSOLE_DB). Migrated at start, never dropped.")
@click.option("--listen", default="127.0.0.1:8080", show_default=True,
              help="HOST:PORT of the web pages (localhost unless told otherwise; port 0: any free one).")
@click.option("--broker", "brokers", multiple=True, envvar="TANDOOR_BROKER",
              help="mqtt[s]://user:pass@host:port; repeat it to read several brokers (each holding a share of the "
                   "devices). Actions go through the first. Default mqtt://localhost:1883 (or $TANDOOR_BROKER).")
@click.option("--cafile", type=click.Path(exists=True, dir_okay=False), help="CA (PEM) of the brokers' TLS certificates.")
@click.option("--prefix", default="tandoor", show_default=True, help="Topic prefix (broker.topic_prefix).")
@click.option("--group", default="tandoor-console", show_default=True,
              help="MQTT 5 shared-subscription group: consoles of one group split the messages.")
@click.option("--users", type=click.Path(dir_okay=False, path_type=Path),
              help="Users file (lines 'operator|viewer NAME SECRET', chmod 600; docs/fleet.md): logins, and the "
                   "deploy/cancel/rollback actions for operators. Without it the pages are read-only, no login.")
@click.option("--bundles", type=click.Path(file_okay=False, path_type=Path),
              help="A folder of .hmod bundles the deploy form offers (besides an upload).")
@click.option("--raw-hours", default=6.0, show_default=True, type=click.FloatRange(0.1),
              help="Hours raw telemetry is kept.")
@click.option("--rollup-days", default=14.0, show_default=True, type=click.FloatRange(0.1),
              help="Days the 1-minute telemetry rollups and device events are kept.")
@click.option("--results/--no-results", default=True, show_default=True,
              help="Keep each device's latest result (at most one per 5 s); --no-results: not even subscribed "
                   "(agents send up to results_max_rate_hz each: the console's largest stream in a big fleet).")
@click.option("--hash-password", is_flag=True,
              help="Read a password from stdin, print its users-file hash, and exit.")
@debug_option
def fleet_console(db, listen, brokers, cafile, prefix, group, users, bundles, raw_hours, rollup_days, results,
                  hash_password):
    """The fleet console: every device's status, telemetry, snapshot, jobs and key operations kept in a
    database (SQLite or PostgreSQL), and web pages of the fleet, each device and the deployments,
    live, with /metrics for Prometheus (docs/fleet.md, "The console")."""
    import logging

    from tandoor_fleet.console import server
    from tandoor_fleet.console.auth import AuthError, hash_password as hash_pw
    from tandoor_fleet.console.store import StoreError
    from tandoor_fleet.rollout import FleetError

    if hash_password:
        pw = sys.stdin.readline().rstrip("\n")
        if len(pw) < 8:
            click.echo("tandoor: error: a password of at least 8 characters, on stdin", err=True)
            sys.exit(2)
        click.echo(hash_pw(pw))
        return
    logging.basicConfig(level=logging.INFO, format="[console] %(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        server.run(db or server.default_db(), listen, list(brokers) or ["mqtt://localhost:1883"], cafile, prefix,
                   group, users, bundles, raw_hours, rollup_days, results)
    except (ValueError, StoreError, AuthError, FleetError) as err:
        click.echo(f"tandoor: error: {err}", err=True)
        sys.exit(2)
    except OSError as err:
        click.echo(f"tandoor: error: cannot listen on {listen}: {err.strerror or err}", err=True)
        sys.exit(2)
    except Exception as err:  # noqa: BLE001 (one line naming the stage; --debug for the traceback)
        if cli_base.DEBUG:
            traceback.print_exc()
        click.echo(f"tandoor: error: the console failed: {type(err).__name__}: {err}", err=True)
        sys.exit(3)
