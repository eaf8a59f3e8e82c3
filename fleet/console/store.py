"""The console's database: SQLite (a file, the default) or PostgreSQL (psycopg), one schema
(schema.py), migrated at open.

    store = Store.open("sqlite:///var/lib/tandoor/console.db")     # or a plain path
    store = Store.open("postgresql://console@db/tandoor")
    store.apply([Msg(...), ...])        # one transaction per batch (the ingest's writer thread)
    store.prune()                       # retention: raw telemetry, rollups, events

Every thread gets its own connection (the web server reads while the writer writes); SQLite runs
in WAL mode so readers never wait for the writer. Reads are in queries.py.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from . import schema

log = logging.getLogger("tandoor.console")

RAW_HOURS = 6.0        # raw telemetry kept this long (--raw-hours)
ROLLUP_DAYS = 14.0     # 1-minute rollups and device events kept this long (--rollup-days)
BUSY_TIMEOUT_S = 10.0


class StoreError(Exception):
    """The database cannot be opened, migrated or written: the message says which and why."""


@dataclass
class Msg:
    """One MQTT message the ingest parsed: ``kind`` is the topic leaf (status, telemetry, results,
    snapshot, update/ack), ``body`` the JSON object (snapshots: ``jpeg`` instead)."""
    kind: str
    device: str
    body: dict = field(default_factory=dict)
    jpeg: bytes | None = None
    received: float = field(default_factory=time.time)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lat(body: dict, stage: str, q: str) -> float | None:
    s = (body.get("latency_ms") or {}).get(stage)
    return _num(s.get(q)) if isinstance(s, dict) else None


def _hottest(body: dict) -> tuple[str | None, float | None]:
    temps = {k: v for k, v in (body.get("temperatures_c") or {}).items() if _num(v) is not None}
    if not temps:
        return None, None
    k = max(temps, key=lambda x: temps[x])
    return str(k), float(temps[k])


class Store:
    def __init__(self, url: str, raw_hours: float = RAW_HOURS, rollup_days: float = ROLLUP_DAYS) -> None:
        self.url = url
        self.dialect = "postgres" if url.startswith(("postgresql://", "postgres://")) else "sqlite"
        # sqlite:///abs/path.db, sqlite://rel/path.db, or a plain path
        rest = url[len("sqlite://"):] if url.startswith("sqlite://") else url
        self.path = None if self.dialect == "postgres" else Path("/" + rest.lstrip("/") if rest.startswith("//") else rest)
        self.raw_hours, self.rollup_days = raw_hours, rollup_days
        self._local = threading.local()
        self.write_error: str | None = None     # the last failed write (shown on every page), None when writes work
        self.write_error_since: float | None = None

    # ------------------------------------------------------------------------------ open
    @classmethod
    def open(cls, url: str, **kw: Any) -> Store:
        s = cls(url, **kw)
        s.migrate()
        return s

    def _connect(self):
        if self.dialect == "postgres":
            try:
                import psycopg
            except ImportError as e:
                raise StoreError("PostgreSQL needs psycopg: pip install 'psycopg[binary]' "
                                 "(the host extra has it)") from e
            try:
                return psycopg.connect(self.url, connect_timeout=10)
            except psycopg.Error as e:
                raise StoreError(f"cannot connect to PostgreSQL at {_redact(self.url)}: {_one_line(e)}") from None
        try:
            if self.path.parent and not self.path.parent.exists():
                raise StoreError(f"cannot open the database {self.path}: its directory does not exist")
            c = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, check_same_thread=False)
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")
            return c
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the database {self.path}: {e}") from None

    def conn(self):
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._connect()
        return c

    def close(self) -> None:
        c = getattr(self._local, "c", None)
        if c is not None:
            c.close()
            self._local.c = None

    def sql(self, q: str) -> str:
        return q.replace("?", "%s") if self.dialect == "postgres" else q

    def query(self, q: str, args: tuple = ()) -> list[dict]:
        """Rows as dicts (a read; its own short transaction)."""
        c = self.conn()
        cur = c.cursor()
        try:
            cur.execute(self.sql(q), args)
            cols = [d[0] for d in cur.description or ()]
            rows = [dict(zip(cols, r)) for r in cur.fetchall()]
        finally:
            cur.close()
            c.rollback() if self.dialect == "postgres" else c.commit()
        return rows

    def version(self) -> int:
        try:
            rows = self.query("SELECT MAX(version) AS v FROM schema_version")
        except Exception:
            self.conn().rollback()
            return 0
        return int(rows[0]["v"] or 0)

    def migrate(self, upto: int | None = None) -> list[int]:
        """Apply every migration after the database's version (up to ``upto``); the versions applied."""
        c = self.conn()
        try:
            cur = c.cursor()
            cur.execute(f"CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, "
                        f"applied {schema.DIALECT[self.dialect]['real']} NOT NULL, what TEXT)")
            c.commit()
            have = self.version()
            if have > schema.LATEST:
                raise StoreError(f"the database is at schema version {have}, newer than this console's "
                                 f"{schema.LATEST}: upgrade tandoor (the database was left as it is)")
            done = []
            for v, doc, stmts in schema.statements(self.dialect, upto, after=have):
                cur = c.cursor()
                for s in stmts:
                    cur.execute(s)
                cur.execute(self.sql("INSERT INTO schema_version (version, applied, what) VALUES (?, ?, ?)"),
                            (v, time.time(), doc))
                c.commit()
                log.info("database schema: applied migration %d (%s)", v, doc)
                done.append(v)
            return done
        except StoreError:
            raise
        except Exception as e:
            c.rollback()
            raise StoreError(f"cannot migrate the database {self._where()}: {_one_line(e)}") from None

    def _where(self) -> str:
        return _redact(self.url) if self.dialect == "postgres" else str(self.path)

    # ----------------------------------------------------------------------------- writes
    def write(self, fn, *args) -> Any:
        """Run ``fn(cursor, *args)`` in one transaction; StoreError naming the database's refusal."""
        c = self.conn()
        try:
            cur = c.cursor()
            out = fn(cur, *args)
            c.commit()
        except Exception as e:
            try:
                c.rollback()
            except Exception:
                self.close()    # a dead connection: the next write opens a new one
            why = _one_line(e)
            if self.write_error is None:
                self.write_error_since = time.time()
            self.write_error = f"the database {self._where()} refuses writes: {why}"
            raise StoreError(self.write_error) from None
        if self.write_error is not None:
            log.info("the database takes writes again (it refused them since %s)",
                     time.strftime("%H:%M:%S", time.localtime(self.write_error_since)))
        self.write_error = self.write_error_since = None
        return out

    def apply(self, batch: list[Msg]) -> None:
        self.write(self._apply, batch)

    def _apply(self, cur, batch: list[Msg]) -> None:
        self._now = time.time()   # telemetry rows say when they were written (the ingest lag's end)
        for m in batch:
            getattr(self, "_on_" + m.kind.replace("/", "_"))(cur, m)

    def _x(self, cur, q: str, args: tuple = ()) -> None:
        cur.execute(self.sql(q), args)

    def _one(self, cur, q: str, args: tuple = ()) -> tuple | None:
        cur.execute(self.sql(q), args)
        return cur.fetchone()

    def _event(self, cur, ts: float, dev: str | None, kind: str, text: str, job: str | None = None,
               state: str | None = None) -> None:
        self._x(cur, "INSERT INTO events (ts, device_id, job_id, kind, state, text) VALUES (?, ?, ?, ?, ?, ?)",
                (ts, dev, job, kind, state, text))

    def _on_status(self, cur, m: Msg) -> None:
        b, dev = m.body, m.device
        model = b.get("model") if isinstance(b.get("model"), dict) else {}
        prev = self._one(cur, "SELECT online, state, sha256, recoveries FROM devices WHERE device_id = ?", (dev,))
        online = 1 if b.get("online") else 0
        recov = len(b.get("recovered") or []) if isinstance(b.get("recovered"), list) else 0
        row = (online, _s(b.get("state")), _s(model.get("name")), _s(model.get("version")), _s(model.get("sha256")),
               _s(b.get("slot")), _s(b.get("agent_version")), _s(b.get("session")), m.received,
               json.dumps(b)[:20000], recov)
        self._x(cur, """INSERT INTO devices (online, state, model_name, model_version, sha256, slot, agent_version,
                         session, last_seen, status_json, recoveries, device_id) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)
                        ON CONFLICT (device_id) DO UPDATE SET online=excluded.online, state=excluded.state,
                         model_name=COALESCE(excluded.model_name, devices.model_name),
                         model_version=COALESCE(excluded.model_version, devices.model_version),
                         sha256=COALESCE(excluded.sha256, devices.sha256), slot=COALESCE(excluded.slot, devices.slot),
                         agent_version=COALESCE(excluded.agent_version, devices.agent_version),
                         session=excluded.session, last_seen=excluded.last_seen, status_json=excluded.status_json,
                         recoveries=excluded.recoveries""", (*row, dev))
        was_online, was_state, was_sha, was_recov = prev if prev else (None, None, None, 0)
        if prev is None or bool(was_online) != bool(online):
            why = f" ({_s(b.get('reason'))})" if b.get("reason") else ""
            self._event(cur, m.received, dev, "online" if online else "offline",
                        ("online" if online else "offline") + why, state=_s(b.get("state")))
        if online and b.get("state") != was_state and b.get("state"):
            self._event(cur, m.received, dev, "state", f"state {b.get('state')}"
                        + (f": {_s(b.get('error'))}" if b.get("error") else ""), state=_s(b.get("state")))
        if model.get("sha256") and was_sha and model.get("sha256") != was_sha:
            self._event(cur, m.received, dev, "model", f"now serving {_s(model.get('name'))} v{_s(model.get('version'))} "
                        f"(sha256 {str(model.get('sha256'))[:12]}, slot {_s(b.get('slot'))})")
        if recov and recov != (was_recov or 0):
            for r in b.get("recovered") or []:
                if isinstance(r, dict):
                    self._event(cur, m.received, dev, "recovery",
                                f"recovered {_s(r.get('damaged'))}: {_s(r.get('reason'))}")

    def _on_telemetry(self, cur, m: Msg) -> None:
        b, dev = m.body, m.device
        ts = _num(b.get("ts")) or m.received
        sensor, temp = _hottest(b)
        power = _num((b.get("power") or {}).get("total_w")) if isinstance(b.get("power"), dict) else None
        vals = {"fps": _num(b.get("fps")), "cpu": _num(b.get("cpu_percent")), "rss_mb": _num(b.get("rss_mb")),
                "power_w": power, "temp_c": temp, "cap_p95": _lat(b, "capture", "p95"),
                "pre_p95": _lat(b, "preprocess", "p95"), "inf_p50": _lat(b, "inference", "p50"),
                "inf_p95": _lat(b, "inference", "p95"), "inf_p99": _lat(b, "inference", "p99"),
                "post_p95": _lat(b, "postprocess", "p95")}
        seq = b.get("seq") if isinstance(b.get("seq"), int) else None
        self._x(cur, f"INSERT INTO telemetry_raw (device_id, ts, received, seq, {', '.join(vals)}) "
                     f"VALUES (?, ?, ?, ?{', ?' * len(vals)})", (dev, ts, self._now, seq, *vals.values()))
        v = vals
        minute = int(ts // 60)
        g = self._greatest
        self._x(cur, f"""INSERT INTO telemetry_1m (device_id, minute, n, fps_sum, cpu_sum, rss_max, power_sum, temp_max,
                         inf_p50_sum, inf_p95_max, inf_p99_max, cap_p95_max, pre_p95_max, post_p95_max)
                        VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                        ON CONFLICT (device_id, minute) DO UPDATE SET n = telemetry_1m.n + 1,
                         fps_sum = telemetry_1m.fps_sum + excluded.fps_sum,
                         cpu_sum = telemetry_1m.cpu_sum + excluded.cpu_sum,
                         rss_max = {g("telemetry_1m.rss_max", "excluded.rss_max")},
                         power_sum = telemetry_1m.power_sum + excluded.power_sum,
                         temp_max = {g("telemetry_1m.temp_max", "excluded.temp_max")},
                         inf_p50_sum = telemetry_1m.inf_p50_sum + excluded.inf_p50_sum,
                         inf_p95_max = {g("telemetry_1m.inf_p95_max", "excluded.inf_p95_max")},
                         inf_p99_max = {g("telemetry_1m.inf_p99_max", "excluded.inf_p99_max")},
                         cap_p95_max = {g("telemetry_1m.cap_p95_max", "excluded.cap_p95_max")},
                         pre_p95_max = {g("telemetry_1m.pre_p95_max", "excluded.pre_p95_max")},
                         post_p95_max = {g("telemetry_1m.post_p95_max", "excluded.post_p95_max")}""",
                (dev, minute, v["fps"] or 0.0, v["cpu"] or 0.0, v["rss_mb"], v["power_w"] or 0.0, v["temp_c"],
                 v["inf_p50"] or 0.0, v["inf_p95"], v["inf_p99"], v["cap_p95"], v["pre_p95"], v["post_p95"]))
        self._x(cur, """UPDATE devices SET fps = ?, inf_p95 = ?, power_w = ?, temp_c = ?, temp_sensor = ?,
                         telemetry_ts = ?, last_seen = ? WHERE device_id = ?""",
                (v["fps"], v["inf_p95"], power, temp, sensor, ts, m.received, dev))
        if cur.rowcount == 0:   # telemetry before any status: a row to hang it on
            self._x(cur, """INSERT INTO devices (device_id, online, fps, inf_p95, power_w, temp_c, temp_sensor,
                             telemetry_ts, last_seen) VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?)""",
                    (dev, v["fps"], v["inf_p95"], power, temp, sensor, ts, m.received))
        objs = b.get("objects")
        if isinstance(objs, dict) and isinstance(objs.get("counts"), dict):
            for label, n in list(objs["counts"].items())[:200]:
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    continue
                mx = (objs.get("max") or {}).get(label) if isinstance(objs.get("max"), dict) else None
                mx = mx if isinstance(mx, int) and not isinstance(mx, bool) else 0
                self._x(cur, """INSERT INTO class_counts (device_id, label, total, frames_max) VALUES (?, ?, ?, ?)
                                ON CONFLICT (device_id, label) DO UPDATE SET total = class_counts.total + excluded.total,
                                 frames_max = """ + self._greatest("class_counts.frames_max", "excluded.frames_max"),
                        (dev, str(label)[:200], n, mx))

    def _greatest(self, a: str, b: str) -> str:
        """The larger of two columns, either of which may be NULL (SQLite's MAX(x, NULL) is NULL)."""
        if self.dialect == "postgres":
            return f"GREATEST({a}, {b})"
        return f"MAX(COALESCE({a}, {b}), COALESCE({b}, {a}))"

    def _on_results(self, cur, m: Msg) -> None:
        self._x(cur, """INSERT INTO results (device_id, ts, json) VALUES (?, ?, ?)
                        ON CONFLICT (device_id) DO UPDATE SET ts = excluded.ts, json = excluded.json""",
                (m.device, m.received, json.dumps(m.body)[:20000]))

    def _on_snapshot(self, cur, m: Msg) -> None:
        det = m.body.get("detections")
        self._x(cur, """INSERT INTO snapshots (device_id, ts, jpeg, detections) VALUES (?, ?, ?, ?)
                        ON CONFLICT (device_id) DO UPDATE SET ts = excluded.ts, jpeg = excluded.jpeg,
                         detections = excluded.detections""",
                (m.device, m.received, m.jpeg, int(det) if isinstance(det, int) else None))

    def _on_update_ack(self, cur, m: Msg) -> None:
        b, dev = m.body, m.device
        if "key_op" in b:
            what = (f"key {_s(b.get('op'))} {_s(b.get('fingerprint'))}: ok" if b.get("ok")
                    else f"key operation refused ({_s(b.get('kind'))}): {_s(b.get('reason'))}")
            self._event(cur, m.received, dev, "key", what, state="ok" if b.get("ok") else "refused")
            return
        job, state = _s(b.get("job_id")), _s(b.get("state"))
        if not job or not state:
            return
        prev = self._one(cur, "SELECT state FROM job_devices WHERE job_id = ? AND device_id = ?", (job, dev))
        health = b.get("health") if isinstance(b.get("health"), dict) else {}
        p95 = _num(health.get("p95_ms")) if health else None
        self._x(cur, """INSERT INTO job_devices (job_id, device_id, state, kind, reason, ts, p95_ms) VALUES (?,?,?,?,?,?,?)
                        ON CONFLICT (job_id, device_id) DO UPDATE SET state = excluded.state, kind = excluded.kind,
                         reason = excluded.reason, ts = excluded.ts,
                         p95_ms = COALESCE(excluded.p95_ms, job_devices.p95_ms)""",
                (job, dev, state, _s(b.get("kind")), _s(b.get("reason") or b.get("note")),
                 _num(b.get("ts")) or m.received, p95))
        self._x(cur, "UPDATE devices SET job_id = ?, job_state = ? WHERE device_id = ?", (job, state, dev))
        if prev is None or prev[0] != state:
            text = state + (f" ({_s(b.get('kind'))})" if b.get("kind") else "") + (
                f": {_s(b.get('reason'))}" if b.get("reason") else "")
            self._event(cur, m.received, dev, "job", text, job=job, state=state)

    # ------------------------------------------------------------------------------ jobs
    def record_job(self, job_id: str, *, source: str, bundle: str, model: dict, sha256: str, options: dict,
                   waves: list[dict]) -> None:
        """A deploy about to start (raises StoreError: then it must not start)."""
        def fn(cur):
            self._x(cur, """INSERT INTO jobs (job_id, created, source, bundle, model_name, model_version, sha256, state,
                             options_json, waves_json) VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?, ?)
                            ON CONFLICT (job_id) DO UPDATE SET state = 'running', finished = NULL, source = excluded.source,
                             options_json = excluded.options_json, waves_json = excluded.waves_json""",
                    (job_id, time.time(), source, bundle, _s(model.get("name")), _s(model.get("version")), sha256,
                     json.dumps(options, default=str), json.dumps(waves)))
            self._event(cur, time.time(), None, "deploy", f"deploy started from {source}: {bundle}", job=job_id,
                        state="running")
        self.write(fn)

    def finish_job(self, job_id: str, result: dict) -> None:
        def fn(cur):
            done = all(r.get("state") == "committed" for r in (result.get("devices") or {}).values())
            state = "aborted" if result.get("aborted") else "done" if done else "finished with failures"
            self._x(cur, "UPDATE jobs SET finished = ?, state = ?, result_json = ?, aborted = ? WHERE job_id = ?",
                    (time.time(), state, json.dumps(result, default=str), result.get("aborted"), job_id))
            counts = ", ".join(f"{v} {k}" for k, v in sorted((result.get("counts") or {}).items()))
            self._event(cur, time.time(), None, "deploy", f"deploy {state}: {counts}"
                        + (f"; aborted: {result['aborted']}" if result.get("aborted") else ""), job=job_id, state=state)
        self.write(fn)

    def job_progress(self, job_id: str, line: str) -> None:
        self.write(lambda cur: self._event(cur, time.time(), None, "progress", line[:2000], job=job_id))

    def record_operation(self, kind: str, job_id: str | None, source: str, devices: list[str], answers: dict) -> None:
        """A cancel or rollback and each device's answer, as events."""
        def fn(cur):
            for d in devices:
                a = answers.get(d) or {}
                ok = a.get("ok") if "ok" in a else a.get("state") == "cancelled"
                text = (f"{kind} from {source}: " + ("ok" if ok else "FAILED") + " "
                        + _s(a.get("reason") or a.get("note") or a.get("error") or a.get("result") or "no answer"))
                self._event(cur, time.time(), d, kind, text[:2000], job=job_id, state="ok" if ok else "failed")
        self.write(fn)

    # -------------------------------------------------------------------------- retention
    def prune(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        raw_cut, roll_cut = now - self.raw_hours * 3600, now - self.rollup_days * 86400

        def fn(cur):
            out = {}
            for name, q, arg in (("telemetry_raw", "DELETE FROM telemetry_raw WHERE ts < ?", raw_cut),
                                 ("telemetry_1m", "DELETE FROM telemetry_1m WHERE minute < ?", int(roll_cut // 60)),
                                 ("events", "DELETE FROM events WHERE ts < ? AND device_id IS NOT NULL", roll_cut)):
                self._x(cur, q, (arg,))
                out[name] = cur.rowcount
            return out
        return self.write(fn)


def _s(v: Any) -> str | None:
    """A device-sent value as text for a column (never markup: the pages escape it)."""
    return None if v is None else str(v)[:500]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _redact(url: str) -> str:
    import re
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
