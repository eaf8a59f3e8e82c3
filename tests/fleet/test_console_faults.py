"""The console process under bad input and failures, against a real mosquitto and its real
SQLite file: markup in a device's id, model name and error is escaped in every page; malformed
and oversized payloads are a log line each and the console serves on; logins, roles and CSRF
guard the actions; a broker that goes away leaves the pages up saying since when they are stale;
a full disk is said on the page and in the log, and a deploy recorded there refuses to start
(nothing offered) instead of running unrecorded; writes resume when space returns."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import BIN
from support.console import ConsoleProcess, WebClient, csrf_of
from support.mosquitto import Broker, Recorder, available
from support.tmpfs import small_tmpfs

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")

HOSTILE = '<img src=x onerror="alert(1)">'
OP_TOKEN, VIEW_TOKEN = "token:operator-secret-0123456789", "token:viewer-secret-0123456789"


def _until(fn, timeout: float = 10, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


def test_hostile_input_logins_broker_loss_and_a_full_disk(tmp_path, bundles_dir):
    with small_tmpfs(tmp_path / "db", 2 * 1024 * 1024) as dbdir, Broker(tmp_path / "broker") as b:
        c = ConsoleProcess(tmp_path / "console", b.port, db=f"sqlite:///{dbdir / 'console.db'}",
                           users={"op": ("operator", OP_TOKEN), "view": ("viewer", VIEW_TOKEN)}).start()
        pub = Recorder(b.port, "nothing/here").start()
        try:
            # --- markup from a device, and payloads the console must drop
            pub.publish(f"tandoor/{HOSTILE}/status", json.dumps({
                "online": True, "state": "error", "error": "<script>alert(2)</script>",
                "model": {"name": "<b>bold</b>", "version": "1", "sha256": "c" * 64}}), retain=True)
            pub.publish("tandoor/ok-dev/status", json.dumps({"online": True, "state": "running"}), retain=True)
            pub.publish("tandoor/ok-dev/telemetry", b"{not json")
            pub.publish("tandoor/ok-dev/telemetry", b"[1, 2]")
            pub.publish("tandoor/ok-dev/status", json.dumps({"online": True, "pad": "x" * 70000}))
            pub.publish("tandoor/ok-dev/snapshot", b"<html>not a jpeg</html>")
            for why in ("telemetry is not JSON", "telemetry must be a JSON object", "status of 700",
                        "snapshot is not a JPEG"):
                _until(lambda: why in c.output(), what=f"a log line '{why}'")
            assert c.alive() and "Traceback" not in c.output()

            web = WebClient(c.url)
            st, body = web.get("/")
            assert st == 200 and 'action="/login"' in body, "not logged in: the login page"
            assert web.get("/fragment/")[0] == 401 and web.get("/metrics")[0] == 401
            st, body = web.post("/login", {"name": "op", "secret": "wrong"})
            assert st == 401 and "wrong name or password" in body
            web.login("view", VIEW_TOKEN[6:])
            _until(lambda: "ok-dev" in web.get("/")[1] and "&lt;b&gt;bold" in web.get("/")[1], what="both devices listed")
            for path in ("/", f"/device/{HOSTILE}", "/fragment/"):
                st, body = web.get(path.replace(HOSTILE, re.sub(r"[^A-Za-z0-9]", lambda m: f"%{ord(m.group()):02X}",
                                                                 HOSTILE)))
                assert st == 200, (path, body[:300])
                assert "<img src=x" not in body and "<script>alert" not in body and "<b>bold" not in body, path
                assert "&lt;img src=x onerror=" in body, path
            assert "&lt;script&gt;alert(2)&lt;/script&gt;" in web.get("/device/%3Cimg%20src%3Dx%20onerror%3D%22"
                                                                       "alert(1)%22%3E")[1]
            st, metrics = web.get("/metrics", headers={"Authorization": f"Bearer {VIEW_TOKEN[6:]}"})
            assert st == 200 and 'tandoor_console_messages_total{result="rejected"} 4' in metrics, \
                [x for x in metrics.splitlines() if "messages_total" in x]
            assert 'tandoor_devices{state="failed"} 1' in metrics and 'tandoor_devices{state="online"} 1' in metrics
            # a viewer cannot act; an operator's form without its CSRF token is refused
            assert web.post("/actions/rollback", {"devices": "ok-dev", "csrf": "x"})[0] == 403
            op = WebClient(c.url)
            csrf = op.login("op", OP_TOKEN[6:])
            assert op.post("/actions/rollback", {"devices": "ok-dev"})[0] == 403
            assert op.post("/actions/rollback", {"devices": "ok-dev", "csrf": csrf + "x"})[0] == 403
            assert csrf == csrf_of(op.get("/deployments")[1])

            # --- the broker goes away: pages keep serving and say since when they are stale
            b.kill()
            body = _until(lambda: (lambda r: r[1] if "stale since" in r[1] else None)(web.get("/")),
                          what="'stale since' on the fleet page")
            assert "ok-dev" in body and "Broker connection lost" in body
            b.start()
            _until(lambda: "stale since" not in web.get("/")[1], 30, "the stale note gone after the broker is back")
            pub.stop()
            pub = Recorder(b.port, "nothing/here").start()

            # --- a full disk: said on the page and in the log; a recorded deploy refuses to start
            subprocess.run(["dd", "if=/dev/zero", f"of={dbdir / 'fill'}", "bs=64k"], capture_output=True)
            pub.publish("tandoor/ok-dev/telemetry", json.dumps({"ts": time.time(), "fps": 5.0}))
            _until(lambda: "refuses writes: database or disk is full" in web.get("/")[1], what="the full disk on the page")
            assert "database or disk is full" in c.output() and c.alive()
            with Recorder(b.port, "tandoor/+/update/job") as offers:
                r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(_bundle(bundles_dir)), "--devices", "ok-dev",
                                    "--broker", f"mqtt://127.0.0.1:{b.port}", "--db", c.db, "--timeout", "30"],
                                   capture_output=True, text=True, timeout=120)
                assert r.returncode == 2, r.stderr
                assert r.stderr.count("\n") == 1 and "database or disk is full" in r.stderr, r.stderr
                assert "nothing was sent: the job could not be recorded" in r.stderr
                time.sleep(0.5)
                assert offers.on("/update/job") == [], "an offer went out for an unrecorded job"
            (dbdir / "fill").unlink()
            pub.publish("tandoor/ok-dev/telemetry", json.dumps({"ts": time.time(), "fps": 7.0}))
            _until(lambda: "7.0 FPS" in web.get("/device/ok-dev")[1], what="the telemetry after the disk freed")
            assert "refuses writes" not in web.get("/")[1]
        finally:
            pub.stop()
            rc = c.stop()
        assert rc == 0 and "Traceback" not in c.output(), c.output()[-3000:]


def _bundle(d: Path) -> Path:
    """A real bundle for the refused deploy (never sent): the zoo's dynamic_batch by the real CLI."""
    from support.cli import compiled
    from tandoor_zoo import models as zoo

    return compiled("dynamic_batch", zoo.dynamic_batch(), d, "--input", "input=1x3x32x32")
