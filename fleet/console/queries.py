"""What the pages and /metrics read from the store: the fleet's counts, the device table (sorted,
filtered, paginated in SQL), one device's series, snapshot, classes and events, the jobs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tandoor_contract import protocol

from .store import Store

# the device table's columns: (key, heading, SQL expression it sorts by)
COLUMNS: list[tuple[str, str, str]] = [
    ("device_id", "device", "device_id"),
    ("online", "online", "online"),
    ("last_seen", "last seen", "last_seen"),
    ("state", "state", "state"),
    ("model_name", "model", "model_name"),
    ("model_version", "version", "model_version"),
    ("sha256", "sha", "sha256"),
    ("slot", "slot", "slot"),
    ("agent_version", "agent", "agent_version"),
    ("fps", "FPS", "fps"),
    ("inf_p95", "inference p95 ms", "inf_p95"),
    ("power_w", "power W", "power_w"),
    ("temp_c", "hottest °C", "temp_c"),
    ("recoveries", "recoveries", "recoveries"),
    ("job_state", "last job", "job_state"),
]
SORTABLE = {k: expr for k, _, expr in COLUMNS}
PAGE_SIZE = 50
PAGE_MAX = 1000       # ?n= rows a page, at most
FAILED_DEVICE_STATES = ("error", "camera-lost")
FAILED_JOB_STATES = ("failed", "rolled_back")

# chart series: (key, label, raw column, rollup expression)
SERIES: list[tuple[str, str, str, str]] = [
    ("inf_p50", "inference p50 ms", "inf_p50", "inf_p50_sum / n"),
    ("inf_p95", "inference p95 ms", "inf_p95", "inf_p95_max"),
    ("inf_p99", "inference p99 ms", "inf_p99", "inf_p99_max"),
    ("cap_p95", "capture p95 ms", "cap_p95", "cap_p95_max"),
    ("pre_p95", "preprocess p95 ms", "pre_p95", "pre_p95_max"),
    ("post_p95", "postprocess p95 ms", "post_p95", "post_p95_max"),
    ("fps", "FPS", "fps", "fps_sum / n"),
    ("cpu", "CPU %", "cpu", "cpu_sum / n"),
    ("rss_mb", "RSS MiB", "rss_mb", "rss_max"),
    ("temp_c", "hottest °C", "temp_c", "temp_max"),
    ("power_w", "power W", "power_w", "power_sum / n"),
]
CHARTS: list[tuple[str, list[str]]] = [
    ("latency (ms)", ["inf_p50", "inf_p95", "inf_p99", "cap_p95", "pre_p95", "post_p95"]),
    ("FPS", ["fps"]), ("CPU %", ["cpu"]), ("RSS MiB", ["rss_mb"]), ("temperature °C", ["temp_c"]),
    ("power W", ["power_w"]),
]
RANGES = {"hour": 3600, "day": 86400}


def category(d: dict) -> str:
    """offline / updating / failed / online: how the fleet page counts a device."""
    if not d.get("online"):
        return "offline"
    js = d.get("job_state")
    if js and not protocol.is_final(js):
        return "updating"
    if d.get("state") in FAILED_DEVICE_STATES or js in FAILED_JOB_STATES:
        return "failed"
    return "online"


@dataclass
class Table:
    rows: list[dict]
    total: int
    page: int
    pages: int
    sort: str
    desc: bool
    q: str
    size: int = PAGE_SIZE


def devices_table(store: Store, q: str = "", sort: str = "device_id", desc: bool = False, page: int = 1,
                  page_size: int = PAGE_SIZE) -> Table:
    sort = sort if sort in SORTABLE else "device_id"
    where, args = "", ()
    if q:
        where = ("WHERE device_id LIKE ? OR model_name LIKE ? OR state LIKE ? OR model_version LIKE ? "
                 "OR job_state LIKE ?")
        args = (f"%{q}%",) * 5
    total = int(store.query(f"SELECT COUNT(*) AS n FROM devices {where}", args)[0]["n"])
    pages = max(1, -(-total // page_size))
    page = min(max(1, page), pages)
    nulls = "" if store.dialect == "sqlite" else (" NULLS LAST" if not desc else " NULLS FIRST")
    rows = store.query(f"SELECT * FROM devices {where} ORDER BY {SORTABLE[sort]} {'DESC' if desc else 'ASC'}{nulls}, "
                       f"device_id LIMIT {int(page_size)} OFFSET {int((page - 1) * page_size)}", args)
    for r in rows:
        r["category"] = category(r)
    return Table(rows, total, page, pages, sort, desc, q, page_size)


def fleet_counts(store: Store) -> dict[str, Any]:
    rows = store.query("SELECT online, state, job_state, model_name, model_version FROM devices")
    counts = {"online": 0, "offline": 0, "updating": 0, "failed": 0}
    by_model: dict[tuple, dict[str, int]] = {}
    for r in rows:
        c = category(r)
        counts[c] += 1
        m = by_model.setdefault((r["model_name"] or "?", r["model_version"] or "?"),
                                {"online": 0, "offline": 0, "updating": 0, "failed": 0})
        m[c] += 1
    return {"total": len(rows), "counts": counts,
            "by_model": [{"model": k[0], "version": k[1], **v, "total": sum(v.values())}
                         for k, v in sorted(by_model.items())]}


def device(store: Store, dev: str) -> dict | None:
    rows = store.query("SELECT * FROM devices WHERE device_id = ?", (dev,))
    if not rows:
        return None
    d = rows[0]
    d["category"] = category(d)
    try:
        d["status"] = json.loads(d.get("status_json") or "{}")
    except ValueError:
        d["status"] = {}
    return d


def series(store: Store, dev: str, rng: str = "hour", now: float | None = None) -> dict[str, Any]:
    """Chart data: the last hour from raw telemetry, the last day from the 1-minute rollups."""
    now = time.time() if now is None else now
    span = RANGES.get(rng, 3600)
    if rng == "day":
        cols = ", ".join(f"{expr} AS {k}" for k, _, _, expr in SERIES)
        rows = store.query(f"SELECT minute * 60 AS t, {cols} FROM telemetry_1m WHERE device_id = ? AND minute >= ? "
                           "ORDER BY minute", (dev, int((now - span) // 60)))
    else:
        cols = ", ".join(f"{raw} AS {k}" for k, _, raw, _ in SERIES)
        rows = store.query(f"SELECT ts AS t, {cols} FROM telemetry_raw WHERE device_id = ? AND ts >= ? ORDER BY ts",
                           (dev, now - span))
    out = {"t": [float(r["t"]) for r in rows]}
    for k, _, _, _ in SERIES:
        out[k] = [None if r[k] is None else round(float(r[k]), 3) for r in rows]
    return {"range": rng, "series": out, "labels": {k: label for k, label, _, _ in SERIES},
            "charts": [{"title": t, "keys": ks} for t, ks in CHARTS]}


def snapshot(store: Store, dev: str) -> tuple[bytes, float, int | None] | None:
    rows = store.query("SELECT jpeg, ts, detections FROM snapshots WHERE device_id = ?", (dev,))
    return (bytes(rows[0]["jpeg"]), rows[0]["ts"], rows[0]["detections"]) if rows else None


def classes(store: Store, dev: str) -> list[dict]:
    return store.query("SELECT label, total, frames_max FROM class_counts WHERE device_id = ? ORDER BY total DESC, label "
                       "LIMIT 100", (dev,))


def latest_result(store: Store, dev: str) -> dict | None:
    rows = store.query("SELECT ts, json FROM results WHERE device_id = ?", (dev,))
    if not rows:
        return None
    try:
        return {"ts": rows[0]["ts"], **json.loads(rows[0]["json"])}
    except ValueError:
        return None


def events(store: Store, dev: str | None = None, job: str | None = None, limit: int = 100) -> list[dict]:
    if job is not None:
        return store.query("SELECT * FROM events WHERE job_id = ? ORDER BY ts, id LIMIT ?", (job, limit))
    return store.query("SELECT * FROM events WHERE device_id = ? ORDER BY ts DESC, id DESC LIMIT ?", (dev, limit))


def jobs(store: Store, limit: int = 100) -> list[dict]:
    out = store.query("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,))
    seen = {j["job_id"] for j in out}
    # jobs the console saw only in acks (started by a console-less deploy): listed too
    for r in store.query("SELECT job_id, MIN(ts) AS created FROM job_devices GROUP BY job_id ORDER BY 2 DESC LIMIT ?",
                         (limit,)):
        if r["job_id"] not in seen:
            out.append({"job_id": r["job_id"], "created": r["created"], "state": "seen in acks", "source": "unknown"})
    for j in out:
        j["counts"] = {r["state"]: int(r["n"]) for r in store.query(
            "SELECT state, COUNT(*) AS n FROM job_devices WHERE job_id = ? GROUP BY state", (j["job_id"],))}
    return sorted(out, key=lambda j: -(j["created"] or 0))


def job(store: Store, job_id: str) -> dict | None:
    rows = store.query("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
    devs = {r["device_id"]: r for r in store.query("SELECT * FROM job_devices WHERE job_id = ? ORDER BY device_id",
                                                     (job_id,))}
    if not rows and not devs:
        return None
    j = rows[0] if rows else {"job_id": job_id, "state": "seen in acks", "source": "unknown"}
    opts = json.loads(j.get("options_json") or "{}")
    result = json.loads(j.get("result_json") or "{}")
    waves = json.loads(j.get("waves_json") or "[]") or [{"name": "devices", "devices": sorted(devs)}]
    budget = opts.get("latency_budget_ms")
    for w in waves:
        counts: dict[str, int] = {}
        for d in w["devices"]:
            st = (devs.get(d) or {}).get("state") or ((result.get("devices") or {}).get(d) or {}).get("state") or "pending"
            counts[st] = counts.get(st, 0) + 1
        w["counts"] = counts
        if w.get("canary"):
            w["p95"] = [{"device": d, "p95_ms": ((result.get("devices") or {}).get(d) or {}).get("p95_ms_seen")
                         or (devs.get(d) or {}).get("p95_ms"),
                         "source": ((result.get("devices") or {}).get(d) or {}).get("p95_source") or "health gate",
                         "budget_ms": budget} for d in w["devices"]]
    per_device = []
    for w in waves:
        for d in w["devices"]:
            r = devs.get(d) or {}
            res = (result.get("devices") or {}).get(d) or {}
            per_device.append({"device": d, "wave": w["name"], "state": r.get("state") or res.get("state") or "pending",
                               "kind": r.get("kind") or res.get("kind"), "reason": r.get("reason") or res.get("reason"),
                               "ts": r.get("ts")})
    return {**j, "options": opts, "result": result, "waves": waves, "devices": per_device,
            "timeline": events(store, job=job_id, limit=500)}


def metrics(store: Store) -> dict[str, Any]:
    fc = fleet_counts(store)
    devs = store.query("SELECT device_id, online, fps, inf_p95, power_w, temp_c, last_seen FROM devices")
    return {"counts": fc, "devices": devs}
