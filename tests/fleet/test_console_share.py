"""Two consoles in one shared-subscription group on one real PostgreSQL, over two mosquitto brokers
each holding a share of the devices: every telemetry message is written exactly once, both
consoles take a share of the broker they have in common, and one console shows the devices of
both brokers."""

from __future__ import annotations

import json
import re
import time

import pytest

from support import postgres
from support.console import ConsoleProcess, WebClient
from support.mosquitto import Broker, Recorder, available
from tandoor_fleet.console.store import Store

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")


def _written(c: ConsoleProcess) -> int:
    m = re.search(r'^tandoor_console_messages_total\{result="written"\} (\d+)', WebClient(c.url).get("/metrics")[1], re.M)
    return int(m.group(1)) if m else 0


def test_two_consoles_share_the_messages_and_one_reads_two_brokers(tmp_path):
    with postgres.Postgres() as pg, Broker(tmp_path / "x") as bx, Broker(tmp_path / "y") as by:
        px, py = Recorder(bx.port, "nothing/x").start(), Recorder(by.port, "nothing/y").start()
        xs, ys = [f"x{i}" for i in range(10)], [f"y{i}" for i in range(5)]
        for p, devs in ((px, xs), (py, ys)):      # retained before the consoles start: each reads them all
            for d in devs:
                p.publish(f"tandoor/{d}/status", json.dumps({"online": True, "state": "running"}), retain=True)
        both = ConsoleProcess(tmp_path / "c1", bx.port, db=pg.url,
                              extra=["--broker", f"mqtt://127.0.0.1:{by.port}"]).start()
        one = ConsoleProcess(tmp_path / "c2", bx.port, db=pg.url).start()
        try:
            for c, n in ((both, 2), (one, 1)):
                deadline = time.monotonic() + 20
                while c.output().count("connected to the broker") < n and time.monotonic() < deadline:
                    time.sleep(0.1)
            time.sleep(3.5)   # past the retained window: from now on only the shared subscriptions deliver
            sent = 0
            for k in range(10):
                for d in xs:
                    px.publish(f"tandoor/{d}/telemetry", json.dumps({"ts": time.time(), "seq": k, "fps": 10.0 + k}))
                    sent += 1
            for k in range(4):
                for d in ys:
                    py.publish(f"tandoor/{d}/telemetry", json.dumps({"ts": time.time(), "seq": k, "fps": 5.0}))
                    sent += 1
            s = Store(pg.url)
            deadline = time.monotonic() + 20
            while s.query("SELECT COUNT(*) AS n FROM telemetry_raw")[0]["n"] < sent and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1)
            assert s.query("SELECT COUNT(*) AS n FROM telemetry_raw")[0]["n"] == sent == 120
            assert s.query("SELECT COUNT(DISTINCT device_id || '/' || seq) AS n FROM telemetry_raw")[0]["n"] == 120
            t_both, t_one = _written(both) - len(xs + ys), _written(one) - len(xs)   # less the retained statuses
            assert t_both + t_one == 120 and t_one > 0 and t_both > len(ys) * 4, (t_both, t_one)
            body = WebClient(both.url).get("/?n=100")[1]
            assert all(f'data-device="{d}"' in body for d in xs + ys)
        finally:
            px.stop()
            py.stop()
            assert both.stop() == 0 and one.stop() == 0
