"""The console's database schema as numbered migrations, one SQL text for SQLite and PostgreSQL.

A database records the versions applied (``schema_version``); at start every later migration runs,
each in its own transaction, so a database from an older console is upgraded in place and never
dropped. A migration once released is never edited: a change is a new entry at the end.

Dialect tokens, replaced per store: ``{real}`` (REAL / DOUBLE PRECISION), ``{blob}`` (BLOB /
BYTEA), ``{serial}`` (an auto-numbered integer primary key), ``{bigint}``.
"""

from __future__ import annotations

DIALECT = {
    "sqlite": {"real": "REAL", "blob": "BLOB", "serial": "INTEGER PRIMARY KEY AUTOINCREMENT", "bigint": "INTEGER"},
    "postgres": {"real": "DOUBLE PRECISION", "blob": "BYTEA", "serial": "BIGSERIAL PRIMARY KEY", "bigint": "BIGINT"},
}

# (version, what it adds, statements)
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "devices, their events, deploy jobs and per-device job states", [
        """CREATE TABLE devices (
            device_id TEXT PRIMARY KEY, online INTEGER NOT NULL DEFAULT 0, state TEXT,
            model_name TEXT, model_version TEXT, sha256 TEXT, slot TEXT, agent_version TEXT, session TEXT,
            last_seen {real}, status_json TEXT, job_id TEXT, job_state TEXT)""",
        """CREATE TABLE events (
            id {serial}, ts {real} NOT NULL, device_id TEXT, job_id TEXT, kind TEXT NOT NULL,
            state TEXT, text TEXT)""",
        "CREATE INDEX events_device ON events (device_id, ts)",
        "CREATE INDEX events_job ON events (job_id, ts)",
        """CREATE TABLE jobs (
            job_id TEXT PRIMARY KEY, created {real} NOT NULL, finished {real}, source TEXT, bundle TEXT,
            model_name TEXT, model_version TEXT, sha256 TEXT, state TEXT NOT NULL, options_json TEXT,
            waves_json TEXT, result_json TEXT, aborted TEXT)""",
        """CREATE TABLE job_devices (
            job_id TEXT NOT NULL, device_id TEXT NOT NULL, state TEXT, kind TEXT, reason TEXT, ts {real},
            p95_ms {real}, PRIMARY KEY (job_id, device_id))""",
    ]),
    (2, "telemetry: raw messages for a window, 1-minute rollups for longer; the device's latest numbers", [
        """CREATE TABLE telemetry_raw (
            device_id TEXT NOT NULL, ts {real} NOT NULL, received {real} NOT NULL, seq {bigint},
            fps {real}, cpu {real}, rss_mb {real}, power_w {real}, temp_c {real},
            cap_p95 {real}, pre_p95 {real}, inf_p50 {real}, inf_p95 {real}, inf_p99 {real}, post_p95 {real})""",
        "CREATE INDEX telemetry_raw_device ON telemetry_raw (device_id, ts)",
        "CREATE INDEX telemetry_raw_ts ON telemetry_raw (ts)",
        # sums and counts so that a minute is updated by each message (mean = sum / n); the
        # percentiles kept are the minute's worst (the max of the messages' p95 / p99)
        """CREATE TABLE telemetry_1m (
            device_id TEXT NOT NULL, minute {bigint} NOT NULL, n INTEGER NOT NULL,
            fps_sum {real}, cpu_sum {real}, rss_max {real}, power_sum {real}, temp_max {real},
            inf_p50_sum {real}, inf_p95_max {real}, inf_p99_max {real}, cap_p95_max {real}, pre_p95_max {real},
            post_p95_max {real}, PRIMARY KEY (device_id, minute))""",
        "CREATE INDEX telemetry_1m_minute ON telemetry_1m (minute)",
        "ALTER TABLE devices ADD COLUMN fps {real}",
        "ALTER TABLE devices ADD COLUMN inf_p95 {real}",
        "ALTER TABLE devices ADD COLUMN power_w {real}",
        "ALTER TABLE devices ADD COLUMN temp_c {real}",
        "ALTER TABLE devices ADD COLUMN temp_sensor TEXT",
        "ALTER TABLE devices ADD COLUMN telemetry_ts {real}",
    ]),
    (3, "snapshots, the latest result, per-class counts, recoveries", [
        """CREATE TABLE snapshots (
            device_id TEXT PRIMARY KEY, ts {real} NOT NULL, jpeg {blob} NOT NULL, detections INTEGER)""",
        "CREATE TABLE results (device_id TEXT PRIMARY KEY, ts {real} NOT NULL, json TEXT NOT NULL)",
        """CREATE TABLE class_counts (
            device_id TEXT NOT NULL, label TEXT NOT NULL, total {bigint} NOT NULL, frames_max INTEGER,
            PRIMARY KEY (device_id, label))""",
        "ALTER TABLE devices ADD COLUMN recoveries INTEGER NOT NULL DEFAULT 0",
    ]),
]

LATEST = MIGRATIONS[-1][0]


def statements(dialect: str, upto: int | None = None, after: int = 0) -> list[tuple[int, str, list[str]]]:
    """The migrations after version ``after`` (up to ``upto``) with the dialect's tokens filled in."""
    tok = DIALECT[dialect]
    return [(v, doc, [s.format(**tok) for s in stmts]) for v, doc, stmts in MIGRATIONS
            if after < v <= (upto if upto is not None else LATEST)]
