"""The console's database, on SQLite and on a real PostgreSQL (Debian's initdb/pg_ctl in a temp data
dir): an old database upgraded in place with its rows kept, a newer one refused untouched; the
1-minute rollups against the same numbers summed here; retention; device events; jobs."""

from __future__ import annotations

import random
import time

import pytest

from support import postgres
from tandoor_fleet.console import queries as Q
from tandoor_fleet.console import schema
from tandoor_fleet.console.store import Msg, Store, StoreError


@pytest.fixture(scope="module")
def pg():
    with postgres.Postgres() as p:
        yield p


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'console.db'}"
    p = request.getfixturevalue("pg")
    name = f"t{time.monotonic_ns()}"
    s = Store(p.url)
    c = s.conn()
    c.autocommit = True
    c.execute(f"CREATE DATABASE {name}")
    s.close()
    return p.url.rsplit("/", 1)[0] + "/" + name


def test_an_old_database_is_upgraded_in_place_and_a_newer_one_is_refused(url):
    old = Store(url)
    assert old.migrate(upto=1) == [1]
    old.write(lambda cur: (cur.execute(old.sql("INSERT INTO devices (device_id, online, state, model_name) "
                                               "VALUES (?, 1, 'running', 'm')"), ("dev-old",)),
                           cur.execute(old.sql("INSERT INTO jobs (job_id, created, state) VALUES (?, ?, 'done')"),
                                       ("job-old", 1.0))))
    old.close()
    s = Store(url)
    assert s.version() == 1
    assert s.migrate() == list(range(2, schema.LATEST + 1))
    assert s.version() == schema.LATEST
    d = Q.device(s, "dev-old")
    assert d["state"] == "running" and d["model_name"] == "m" and d["recoveries"] == 0, d
    assert [j["job_id"] for j in Q.jobs(s)] == ["job-old"]
    assert s.migrate() == []      # a second start changes nothing
    s.write(lambda cur: cur.execute(s.sql("INSERT INTO schema_version (version, applied) VALUES (?, ?)"),
                                    (schema.LATEST + 1, time.time())))
    s.close()
    with pytest.raises(StoreError, match=f"schema version {schema.LATEST + 1}, newer than this console's"):
        Store.open(url)
    assert Q.device(Store(url), "dev-old")["state"] == "running"


def _tel(ts: float, rnd: random.Random, objects: dict | None = None) -> dict:
    return {"ts": ts, "seq": 1, "fps": rnd.uniform(5, 30), "cpu_percent": rnd.uniform(10, 190),
            "rss_mb": rnd.uniform(100, 300),
            "latency_ms": {"inference": {"p50": rnd.uniform(5, 10), "p95": rnd.uniform(10, 20), "p99": rnd.uniform(20, 30)},
                           "capture": {"p95": rnd.uniform(0, 5)}},
            "temperatures_c": {"soc": rnd.uniform(40, 60), "gpu": rnd.uniform(40, 60)},
            "power": {"total_w": rnd.uniform(3, 9)}, "objects": objects}


def test_rollups_retention_events_and_counts(url):
    s = Store.open(url, raw_hours=1.0, rollup_days=1.0)
    rnd = random.Random(42)
    now = time.time()
    t0 = (now // 60 - 3 * 60) * 60          # three hours ago, on a minute
    msgs = [Msg("status", "d1", {"online": True, "state": "running", "model": {"name": "m", "version": "1",
                                                                             "sha256": "a" * 64}})]
    sent = []
    for i in range(3 * 60 * 12):             # three hours at the default 5 s period
        body = _tel(t0 + i * 5, rnd, {"counts": {"face": 2, "car": i % 3}, "max": {"face": 1, "car": 2}})
        sent.append(body)
        msgs.append(Msg("telemetry", "d1", body))
    msgs.append(Msg("status", "d1", {"online": False, "reason": "connection lost"}))
    for k in range(0, len(msgs), 500):
        s.apply(msgs[k:k + 500])
    # the rollup of one minute, against the same numbers summed here
    minute = int(sent[100]["ts"] // 60)
    mine = [b for b in sent if int(b["ts"] // 60) == minute]
    row = s.query("SELECT * FROM telemetry_1m WHERE device_id = 'd1' AND minute = ?", (minute,))[0]
    assert row["n"] == len(mine) == 12
    assert row["fps_sum"] / row["n"] == pytest.approx(sum(b["fps"] for b in mine) / 12)
    assert row["inf_p95_max"] == pytest.approx(max(b["latency_ms"]["inference"]["p95"] for b in mine))
    assert row["temp_max"] == pytest.approx(max(max(b["temperatures_c"].values()) for b in mine))
    assert row["rss_max"] == pytest.approx(max(b["rss_mb"] for b in mine))
    day = Q.series(s, "d1", "day", now=now)["series"]
    assert len(day["t"]) == 180 and day["t"][0] == t0
    hour = Q.series(s, "d1", "hour", now=now)["series"]
    assert len(hour["t"]) == len([b for b in sent if b["ts"] >= now - 3600])
    assert hour["inf_p95"][-1] == pytest.approx(sent[-1]["latency_ms"]["inference"]["p95"], abs=1e-3)
    assert {c["label"]: c["total"] for c in Q.classes(s, "d1")} == {
        "face": 2 * len(sent), "car": sum(i % 3 for i in range(len(sent)))}
    kinds = [e["kind"] for e in reversed(Q.events(s, "d1"))]
    assert kinds == ["online", "state", "offline"], kinds
    d = Q.device(s, "d1")
    assert d["category"] == "offline" and d["fps"] == pytest.approx(sent[-1]["fps"])
    assert d["temp_sensor"] in ("soc", "gpu")
    # retention: raw older than 1 h goes, rollups stay for the day; a day later the rollups go too
    gone = s.prune(now)
    assert gone["telemetry_raw"] == len([b for b in sent if b["ts"] < now - 3600])
    assert gone["telemetry_1m"] == 0
    assert s.query("SELECT MIN(ts) AS t FROM telemetry_raw")[0]["t"] >= now - 3600
    gone = s.prune(now + 86400 + 4 * 3600)
    assert gone["telemetry_1m"] == 180 and gone["events"] == 3
    assert s.query("SELECT COUNT(*) AS n FROM telemetry_1m")[0]["n"] == 0


def test_acks_and_jobs_fill_the_deployments_page(url):
    s = Store.open(url)
    s.record_job("job-1", source="the CLI", bundle="m.hmod", model={"name": "m", "version": "2"}, sha256="b" * 64,
                 options={"latency_budget_ms": 40.0},
                 waves=[{"name": "canary", "devices": ["a"], "canary": True}, {"name": "wave 1", "devices": ["b", "c"]}])
    s.apply([Msg("status", "b", {"online": True, "state": "running"}),
             Msg("update/ack", "a", {"job_id": "job-1", "state": "received", "ts": 1.0}),
             Msg("update/ack", "a", {"job_id": "job-1", "state": "committed", "ts": 2.0,
                                     "health": {"p95_ms": 12.5}}),
             Msg("update/ack", "b", {"job_id": "job-1", "state": "rolled_back", "kind": "unhealthy",
                                     "reason": "<b>p95</b> over budget", "ts": 3.0}),
             Msg("update/ack", "c", {"key_op": "k1", "ok": True, "op": "add-key", "fingerprint": "ff00"})])
    s.finish_job("job-1", {"devices": {"a": {"state": "committed", "p95_ms_seen": 13.0, "p95_source": "telemetry"},
                                       "b": {"state": "rolled_back"}, "c": {"state": "skipped"}},
                           "aborted": None, "counts": {"committed": 1, "rolled_back": 1, "skipped": 1}})
    j = Q.job(s, "job-1")
    assert j["state"] == "finished with failures" and j["source"] == "the CLI"
    assert [w["counts"] for w in j["waves"]] == [{"committed": 1}, {"rolled_back": 1, "skipped": 1}]
    assert j["waves"][0]["p95"] == [{"device": "a", "p95_ms": 13.0, "source": "telemetry", "budget_ms": 40.0}]
    assert {d["device"]: d["state"] for d in j["devices"]} == {"a": "committed", "b": "rolled_back", "c": "skipped"}
    assert [e["kind"] for e in j["timeline"]] == ["deploy", "job", "job", "job", "deploy"]
    assert Q.jobs(s)[0]["counts"] == {"committed": 1, "rolled_back": 1}
    assert [e["text"] for e in Q.events(s, "c")] == ["key add-key ff00: ok"]
    assert Q.device(s, "b")["category"] == "failed"
