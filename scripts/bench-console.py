#!/usr/bin/env python
"""The fleet console at scale: N simulated devices publishing telemetry at the agent's default
period through one mosquitto, into `tandoor fleet console` on SQLite and on PostgreSQL.

    .venv/bin/python scripts/bench-console.py --devices 1000 --seconds 120 --json

Each simulated device has its retained status and publishes, every ``--period`` s (the agent's
``telemetry_period_s`` default, 5 s), a telemetry message of the real agent's shape (docs/protocol.md:
per-stage latency, FPS, CPU, RSS, temperatures, power, per-class counts), stamped with the
publisher's clock; the devices are spread evenly over the period and published by ``--publishers``
paho clients (the console's load is the messages, not the number of TCP connections). Measured:

- ingest lag: from the message's ``ts`` to its row being written (``telemetry_raw.received``),
  p50/p99 over the messages after the first period;
- the console process' CPU (% of one core, mean and peak of 1 s samples) and peak RSS (psutil);
- the fleet page with every device on one page (``/?n=1000``) and the default first page of 50,
  the median of 10 loads each, sorted by inference p95;
- the database's size per row of raw telemetry and of the 1-minute rollups (SQLite's dbstat,
  PostgreSQL's pg_total_relation_size, indexes included), hence its growth per device-day.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.console import ConsoleProcess  # noqa: E402
from support.mosquitto import Broker  # noqa: E402
from support import postgres  # noqa: E402


def telemetry(dev: str, seq: int, rnd: random.Random) -> dict:
    p50 = rnd.uniform(18, 24)
    return {"seq": seq, "device_id": dev, "session": "bench", "ts": round(time.time(), 3), "sent_ts": round(time.time(), 3),
            "fps": round(rnd.uniform(24, 30), 2), "frames": seq * 150, "dropped": 0, "errors": 0,
            "latency_ms": {s: {"p50": round(p50 * k, 2), "p95": round(p50 * k * 1.2, 2), "p99": round(p50 * k * 1.4, 2),
                               "mean": round(p50 * k, 2), "count": 150}
                           for s, k in (("capture", 0.05), ("preprocess", 0.02), ("inference", 1.0), ("postprocess", 0.01))},
            "cpu_percent": round(rnd.uniform(150, 190), 1), "rss_mb": round(rnd.uniform(200, 220), 1),
            "temperatures_c": {"soc-thermal": round(rnd.uniform(45, 60), 1), "gpu-thermal": round(rnd.uniform(40, 55), 1)},
            "power": {"source": "estimated", "estimated": True, "total_w": round(rnd.uniform(6, 9), 2),
                      "rails": {"board": 7.9}, "basis": "bench"},
            "energy_j": 1234.5, "energy_per_inference_mj": 172.2,
            "objects": {"frames": 150, "counts": {"person": rnd.randint(0, 300), "car": rnd.randint(0, 100)},
                        "max": {"person": 3, "car": 2}, "mean": {"person": 1.2, "car": 0.4}},
            "uptime_s": 1000.0, "state": "running", "model": {"name": "efficientnet_lite0", "version": "1", "sha256": "a" * 64},
            "mqtt": {"connected": True, "protocol": "5", "connects": 1}}


class Publishers:
    def __init__(self, port: int, devices: list[str], period: float, n_clients: int) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.devices, self.period = devices, period
        self.clients = []
        for i in range(n_clients):
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-pub-{i}", protocol=mqtt.MQTTv5)
            c.max_inflight_messages_set(1000)
            c.connect("127.0.0.1", port)
            c.loop_start()
            self.clients.append(c)
        self.stop = threading.Event()
        self.sent = self.results = 0

    def statuses(self) -> None:
        for i, d in enumerate(self.devices):
            self.clients[i % len(self.clients)].publish(f"tandoor/{d}/status", json.dumps({
                "online": True, "device_id": d, "state": "running", "agent_version": "0.1.0", "slot": "a",
                "model": {"name": "efficientnet_lite0", "version": "1", "sha256": "a" * 64}, "ts": time.time()}),
                qos=1, retain=True).wait_for_publish(10)

    def run(self) -> None:
        rnd = random.Random(1)
        gap = self.period / len(self.devices)
        t = time.monotonic()
        seq = 0
        while not self.stop.is_set():
            seq += 1
            for i, d in enumerate(self.devices):
                t += gap
                delay = t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.clients[i % len(self.clients)].publish(f"tandoor/{d}/telemetry",
                                                            json.dumps(telemetry(d, seq, rnd)), qos=1)
                self.sent += 1
                if self.stop.is_set():
                    break

    def run_results(self, hz: float) -> None:
        """Every device's results at ``hz`` (the agent's results_max_rate_hz default is 2), a detector's shape."""
        body = json.dumps({"kind": "detector", "detections": [
            {"box": [417.3, 15.4, 440.2, 44.2], "score": 0.78, "class_id": 0, "label": "person"}] * 3,
            "seq": 130, "source": "v4l2:/dev/video0", "frame": [640, 480], "t_capture": 5231.1,
            "timings_ms": {"capture": 2.0, "preprocess": 0.6, "inference": 21.1, "postprocess": 0.3}, "ts": 0})
        gap = 1.0 / (hz * len(self.devices))
        t = time.monotonic()
        while not self.stop.is_set():
            for i, d in enumerate(self.devices):
                t += gap
                delay = t - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.clients[i % len(self.clients)].publish(f"tandoor/{d}/results", body, qos=0)
                self.results += 1
                if self.stop.is_set():
                    break

    def close(self) -> None:
        for c in self.clients:
            c.disconnect()
            c.loop_stop()


def page_ms(url: str, n: int = 10) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        urllib.request.urlopen(url, timeout=60).read()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 1)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(store: str, args, work: Path) -> dict:
    import psutil

    from tandoor_fleet.console.store import Store

    pg = None
    if store == "postgres":
        pg = postgres.Postgres().start()
        db = pg.url
    else:
        db = f"sqlite:///{work / 'console.db'}"
    devices = [f"bench{i:05d}" for i in range(args.devices)]
    try:
        with Broker(work / f"broker-{store}", extra_config="max_queued_messages 100000\n") as b:
            console = ConsoleProcess(work / f"console-{store}", b.port, db=db).start()
            proc = psutil.Process(console.proc.pid)
            pubs = Publishers(b.port, devices, args.period, args.publishers)
            pubs.statuses()
            t0 = time.time()
            th = threading.Thread(target=pubs.run, daemon=True)
            th.start()
            if args.results_hz > 0:
                threading.Thread(target=pubs.run_results, args=(args.results_hz,), daemon=True).start()
            cpu, rss = [], []
            proc.cpu_percent(None)
            while time.time() - t0 < args.seconds:
                time.sleep(1.0)
                cpu.append(proc.cpu_percent(None))
                rss.append(proc.memory_info().rss / 2**20)
            full = page_ms(f"{console.url}/?n={args.devices}&sort=inf_p95&desc=1")
            first = page_ms(f"{console.url}/?sort=inf_p95&desc=1")
            pubs.stop.set()
            th.join(10)
            time.sleep(2)   # the last messages written
            pubs.close()
            console.stop()
        s = Store(db)
        lag = [float(r["lag"]) for r in s.query("SELECT received - ts AS lag FROM telemetry_raw WHERE ts > ?",
                                                (t0 + args.period,))]
        n_raw = int(s.query("SELECT COUNT(*) AS n FROM telemetry_raw")[0]["n"])
        n_1m = int(s.query("SELECT COUNT(*) AS n FROM telemetry_1m")[0]["n"])
        if store == "postgres":
            size = {t: int(s.query(f"SELECT pg_total_relation_size('{t}') AS b")[0]["b"]) for t in ("telemetry_raw", "telemetry_1m")}
        else:
            # the table and its indexes (SQLite's dbstat virtual table, in Python's sqlite3 on Debian)
            size = {t: int(s.query("SELECT SUM(pgsize) AS b FROM dbstat WHERE name IN "
                                   "(SELECT name FROM sqlite_master WHERE tbl_name = ?)", (t,))[0]["b"] or 0)
                    for t in ("telemetry_raw", "telemetry_1m")}
        s.close()
        per_raw = size["telemetry_raw"] / max(1, n_raw)
        per_1m = size["telemetry_1m"] / max(1, n_1m)
        raw_day = 86400 / args.period
        return {"store": store, "devices": args.devices, "period_s": args.period, "seconds": args.seconds,
                "sent": pubs.sent, "results_sent": pubs.results, "results_hz": args.results_hz, "rows": n_raw, "rate_msg_s": round(n_raw / args.seconds, 1),
                "lag_ms": {"p50": round(pct(lag, 0.5) * 1000, 1), "p99": round(pct(lag, 0.99) * 1000, 1),
                           "max": round(max(lag) * 1000, 1)} if lag else None,
                "console_cpu_pct": {"mean": round(statistics.mean(cpu[2:] or cpu), 1), "max": round(max(cpu), 1)},
                "console_rss_mb_max": round(max(rss), 1),
                "fleet_page_ms": {f"{args.devices} rows": full, "50 rows": first},
                "bytes_per_row": {"telemetry_raw": round(per_raw), "telemetry_1m": round(per_1m)},
                "per_device_day_mb": {"raw": round(per_raw * raw_day / 1e6, 2), "rollups": round(per_1m * 1440 / 1e6, 3)}}
    finally:
        if pg is not None:
            pg.stop()


def to_markdown(results: list[dict], cmd: str) -> str:
    lines = [f"`{cmd}`", "",
             "| store | devices, period, results | msgs/s | ingest lag p50 / p99 | console CPU mean / peak | console RSS | "
             "fleet page, all rows / first 50 | bytes per raw row / rollup row |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['store']} | {r['devices']}, {r['period_s']:g} s, {r['results_hz']:g} Hz | "
                     f"{round((r['sent'] + r['results_sent']) / r['seconds'])} | "
                     f"{r['lag_ms']['p50']} / {r['lag_ms']['p99']} ms | {r['console_cpu_pct']['mean']} / "
                     f"{r['console_cpu_pct']['max']} % | {r['console_rss_mb_max']} MiB | "
                     f"{r['fleet_page_ms'][str(r['devices']) + ' rows']} / {r['fleet_page_ms']['50 rows']} ms | "
                     f"{r['bytes_per_row']['telemetry_raw']} / {r['bytes_per_row']['telemetry_1m']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--period", type=float, default=5.0, help="telemetry period per device (the agent's default)")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--results-hz", type=float, default=0.0,
                    help="each device's results per second too (the agent's default results_max_rate_hz is 2; "
                         "the console keeps one per 5 s)")
    ap.add_argument("--stores", default="sqlite,postgres")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="tandoor-bench-console-") as d:
        for store in args.stores.split(","):
            r = run_one(store, args, Path(d))
            print(json.dumps(r), file=sys.stderr, flush=True)
            out.append(r)
    cmd = "scripts/bench-console.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(json.dumps(out, indent=2) if args.json else to_markdown(out, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
