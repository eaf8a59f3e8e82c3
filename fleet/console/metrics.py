"""The console's Prometheus text (/metrics): the fleet's gauges and the console's own counters."""

from __future__ import annotations

import time
from typing import Any

# per-device gauges: (metric, help, column)
DEVICE_GAUGES: list[tuple[str, str, str]] = [
    ("tandoor_device_online", "1 when the device's retained status says online", "online"),
    ("tandoor_device_fps", "frames per second in the device's latest telemetry", "fps"),
    ("tandoor_device_inference_p95_ms", "inference p95 (ms) in the device's latest telemetry", "inf_p95"),
    ("tandoor_device_power_watts", "board power (W) in the device's latest telemetry", "power_w"),
    ("tandoor_device_temperature_celsius", "the hottest sensor in the device's latest telemetry", "temp_c"),
]


def _label(v: Any) -> str:
    """A label value as the text format wants it (backslash, quote and newline escaped)."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus(m: dict, health: dict, ingest: Any = None) -> str:
    out: list[str] = []

    def gauge(name: str, help_: str, samples: list[tuple[dict, Any]], kind: str = "gauge") -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, v in samples:
            if v is None:
                continue
            lab = ",".join(f'{k}="{_label(x)}"' for k, x in labels.items())
            out.append(f"{name}{{{lab}}} {float(v):g}" if lab else f"{name} {float(v):g}")

    fc = m["counts"]
    gauge("tandoor_devices", "devices by state (online, offline, updating, failed)",
          [({"state": k}, v) for k, v in fc["counts"].items()])
    gauge("tandoor_devices_by_model", "devices by model, version and state",
          [({"model": r["model"], "version": r["version"], "state": s}, r[s])
           for r in fc["by_model"] for s in ("online", "offline", "updating", "failed")])
    for name, help_, col in DEVICE_GAUGES:
        gauge(name, help_, [({"device": d["device_id"]}, d[col]) for d in m["devices"]])
    now = time.time()
    gauge("tandoor_device_last_seen_age_seconds", "seconds since the console last heard from the device",
          [({"device": d["device_id"]}, now - d["last_seen"]) for d in m["devices"] if d["last_seen"]])
    gauge("tandoor_console_broker_connected", "1 while the console is connected to the broker",
          [({"broker": b["name"]}, 1 if b["connected"] else 0) for b in health.get("brokers", [])])
    gauge("tandoor_console_database_writable", "0 while the database refuses writes",
          [({}, 0 if health.get("db_error") else 1)])
    gauge("tandoor_console_messages_total", "MQTT messages: received, written, rejected (malformed or "
          "oversized), dropped (queue full or database error)",
          [({"result": k}, v) for k, v in sorted((health.get("counters") or {}).items())], kind="counter")
    lag = sorted(getattr(ingest, "ingest_lag", []) or [])
    if lag:
        gauge("tandoor_console_ingest_lag_seconds", "telemetry: device timestamp to database row, last 1000 messages",
              [({"quantile": q}, lag[min(len(lag) - 1, int(q * len(lag)))]) for q in (0.5, 0.99)])
    return "\n".join(out) + "\n"
