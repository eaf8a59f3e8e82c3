"""The serving agent's faults (issue 17, the serve side), each on real processes: a real
mosquitto, real `tandoor-agent serve` processes, real signals, real files.

- invalid response topics (a lone surrogate, > 65535 bytes, a wildcard, a device's own inbound
  topic) sent as the issue's repro did, with mosquitto_pub / mosquitto_rr: refused with a reason,
  the agent keeps serving and its MQTT network thread never dies
- liveness: paho's network thread killed (the failpoint raises out of a callback, as the bug did):
  the will, then a new client, birth, telemetry and commands again; the sender thread killed: the
  agent exits non-zero in one line (the service manager restarts it)
- telemetry while the broker is down: bounded, oldest dropped, the dropped count published and
  equal to the gaps, the rest delivered in order
- the camera's source removed mid-stream (an image folder, a video file) and put back:
  camera-lost with the reason, backoff, watchdog fed, commands answered, back to running, same
  process
- a seeded mutation fuzzer over every topic the agent reads: thousands of cases, the agent
  serving throughout, nothing installed
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from support.agents import START_TIMEOUT, AgentProcess, NotifySocket, seed_slots, status_of, write_config
from support.cli import compiled
from support.mosquitto import Broker, Recorder, available
from tandoor_contract import hmod

pytestmark = pytest.mark.skipif(not available() or not shutil.which("mosquitto_rr"),
                                reason="mosquitto and its clients are not installed (apt install mosquitto "
                                       "mosquitto-clients)")


# --- fixtures and helpers --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wd():
    d = Path(tempfile.mkdtemp(prefix="tsf-", dir="/tmp"))  # short: unix socket paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def keys(wd):
    hmod.generate_keypair(wd / "dev.pem", wd / "dev.pub.pem")
    return {"private": wd / "dev.pem", "public": wd / "dev.pub.pem"}


@pytest.fixture(scope="module")
def bundle(bundles_dir, keys, wd):
    from tandoor_zoo import models as zoo

    return compiled("serve_faults", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32",
                    "--key", str(keys["private"]))


@pytest.fixture(scope="module")
def broker(wd):
    b = Broker(wd / "broker").start()
    yield b
    b.stop()


class Agent:
    """A running `tandoor-agent serve` with a recorder on its topics (and on any extra ones)."""

    def __init__(self, wd: Path, dev: str, port: int, bundle: Path, pub: Path, *, env: dict | None = None,
                 notify: bool = False, extra_topics: tuple[str, ...] = (), slot_dir: Path | None = None,
                 **cfg) -> None:
        self.dev, self.port = dev, port
        self.notify = NotifySocket(wd / f"{dev}.sock") if notify else None
        source = {"bundle": str(bundle)} if slot_dir is None else {"slot_dir": str(slot_dir)}
        camera = cfg.pop("camera", {"source": "synthetic:64x48@20"})
        broker = {"port": port, "reconnect_min_s": 0.5, "reconnect_max_s": 1.0, "keepalive_s": 10,
                  **cfg.pop("broker", {})}
        top = {"delegate": "onnxruntime", "telemetry_period_s": 0.5, "results_max_rate_hz": 5.0, **cfg}
        self.cfg = write_config(wd / f"{dev}.toml", device_id=dev, trusted_keys=[str(pub)], **source, **top,
                                broker=broker, camera=camera)
        self.rec = Recorder(port, [f"tandoor/{dev}/#", *extra_topics])
        self.rec.client.reconnect_delay_set(0.1, 0.2)
        self.rec.start()
        env = {**(env or {}), **({"NOTIFY_SOCKET": self.notify.path, "WATCHDOG_USEC": "1000000"} if notify else {})}
        self.proc = AgentProcess(["serve", "--config", str(self.cfg)], wd / f"{dev}.log", env=env)
        try:
            self.status = status_of(self.rec, dev, START_TIMEOUT, lambda s: s.get("state") == "running",
                                    f"{dev} running")
        except AssertionError:
            self.close()
            raise AssertionError(f"{dev} did not start:\n{self.proc.output()[-3000:]}") from None

    def ask(self, body, *, timeout: float = 30, answers: str | None = None) -> dict:
        """An MQTT 5 request with a fresh Correlation Data; its response."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        topic = answers or f"tandoor/{self.dev}/response"
        corr = uuid.uuid4().bytes
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = topic
        props.CorrelationData = corr
        self.rec.publish(f"tandoor/{self.dev}/cmd", json.dumps(body), properties=props)
        return self.rec.wait_for(lambda m: m.topic == topic and getattr(m.properties, "CorrelationData", None) == corr,
                                 timeout, f"the answer to {body}").json()

    def telemetry(self, pred=lambda t: True, timeout: float = 30, after: float = 0.0) -> dict:
        return self.rec.wait_for(lambda m: m.topic == f"tandoor/{self.dev}/telemetry" and m.t > after
                                 and pred(m.json()), timeout, f"{self.dev} telemetry").json()

    def result_after(self, t: float, timeout: float = 30) -> dict:
        return self.rec.wait_for(lambda m: m.topic == f"tandoor/{self.dev}/results" and m.t > t, timeout,
                                 f"{self.dev} results after {t:.1f}").json()

    def statuses(self) -> list[dict]:
        return [m.json() for m in self.rec.on(f"{self.dev}/status")]

    def close(self) -> None:
        self.proc.kill()
        self.rec.stop()
        if self.notify is not None:
            self.notify.close()


def mosquitto(tool: str, port: int, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([tool, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout)


# --- 1. response topics that cannot carry a response -----------------------------------------------

def test_invalid_response_topics_are_refused_and_the_agent_keeps_serving(wd, broker, bundle, keys):
    """The issue's repro (mosquitto_pub with a lone surrogate, then mosquitto_rr ping) and the
    other topics no response can go to: each answered on <base>/response with the reason, the
    agent keeps serving and its network thread never died (no link restart)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    a = Agent(wd, "rt1", broker.port, bundle, keys["public"], log_level="warning")
    try:
        resp = "tandoor/rt1/response"
        long_topic = json.dumps({"cmd": "ping", "response_topic": "x" * 70000, "correlation_id": 3})
        cases = [  # (the request as mosquitto_pub sends it, what the refusal says)
            ('{"cmd":"ping","response_topic":"\\ud800","correlation_id":1}',
             "response_topic is not valid UTF-8 (it has a lone surrogate)"),
            ('{"response_topic":"\\ud800","correlation_id":2}',  # malformed too: used to kill paho's thread
             "response_topic is not valid UTF-8 (it has a lone surrogate)"),
            # no request that long is read at all (a topic over 65535 bytes needs one over 64 KiB)
            (long_topic, f"{len(long_topic)} bytes, over the 65536 byte limit"),
            (json.dumps({"cmd": "ping", "response_topic": "ops/+/answers", "correlation_id": 4}),
             "response_topic must be a topic name without wildcards"),
            (json.dumps({"cmd": "ping", "response_topic": "tandoor/rt1/cmd", "correlation_id": 5}),
             "response_topic must not be under tandoor/ other than tandoor/rt1/response"),
            (json.dumps({"cmd": "ping", "response_topic": "$SYS/x", "correlation_id": 6}),
             "response_topic must not start with $"),
        ]
        for i, (payload, why) in enumerate(cases, 1):
            r = mosquitto("mosquitto_pub", broker.port, "-t", "tandoor/rt1/cmd", "-m", payload, "-q", "1")
            assert r.returncode == 0, r.stderr
            # (an over-long request is refused unread: no correlation_id to echo)
            got = a.rec.wait_for(lambda m: m.topic == resp and (m.json().get("correlation_id") == i or
                                                                why in m.json().get("error", "")), 20,
                                 f"the refusal of case {i}").json()
            assert got["ok"] is False and got["error"].startswith(f"malformed request: {why}"), (i, got)
            # the repro's second half: the agent still answers a request/response client
            rr = mosquitto("mosquitto_rr", broker.port, "-t", "tandoor/rt1/cmd", "-e", "ops/rt1/rr",
                           "-m", '{"cmd":"ping"}', "-W", "20")
            assert rr.returncode == 0 and json.loads(rr.stdout)["result"]["pong"] is True, (i, rr.stdout, rr.stderr)
        # MQTT 5 Response Topic property with a wildcard (the broker passes it on as it is)
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = "ops/#"
        props.CorrelationData = b"wild"
        a.rec.publish("tandoor/rt1/cmd", '{"cmd":"ping"}', properties=props)
        got = a.rec.wait_for(lambda m: m.topic == resp and getattr(m.properties, "CorrelationData", None) == b"wild",
                             20, "the refusal of a wildcard Response Topic").json()
        assert got["error"] == "malformed request: the Response Topic must be a topic name without wildcards (+ or #)"
        t0 = time.time()
        assert a.ask({"cmd": "ping"})["result"]["pong"] is True
        a.result_after(t0)
        tel = a.telemetry(after=t0)
        assert tel["mqtt"]["loop_restarts"] == 0 and tel["mqtt"]["connects"] == 1, tel["mqtt"]
        assert a.proc.proc.poll() is None
        assert "Traceback" not in a.proc.output(), a.proc.output()[-3000:]
    finally:
        a.close()


# --- 2. liveness: the MQTT loop dies ---------------------------------------------------------------

def test_a_dead_mqtt_network_thread_is_replaced_and_everything_comes_back(wd, broker, bundle, keys):
    """The failpoint raises out of paho's on_publish (a BaseException, past suppress_exceptions),
    which ends paho's network thread the way the issue's bug did. The link sees it, closes the old
    socket (the broker publishes the will), connects a new client: birth again (same session),
    telemetry goes on without a gap, commands are answered, results flow."""
    a = Agent(wd, "lv1", broker.port, bundle, keys["public"], env={"TANDOOR_MQTT_FAILPOINT": "kill-loop:4"})
    try:
        session = a.status["session"]
        back = a.telemetry(lambda t: t["mqtt"]["loop_restarts"] == 1, 60)
        assert back["mqtt"]["connects"] == 2 and back["session"] == session, back["mqtt"]
        sts = a.statuses()
        death = next(i for i, s in enumerate(sts) if not s["online"])
        assert sts[death]["reason"] == "connection lost" and sts[death]["session"] == session, sts
        assert any(s["online"] and s["session"] == session for s in sts[death + 1:]), sts
        t0 = time.time()
        r = a.ask({"cmd": "ping"})
        assert r["ok"] and r["result"]["pong"] is True
        a.result_after(t0)
        later = a.telemetry(lambda t: t["seq"] > back["seq"] + 2, 30)
        seqs = [m.json()["seq"] for m in a.rec.on("lv1/telemetry")]
        firsts = [s for i, s in enumerate(seqs) if s not in seqs[:i]]  # a QoS 1 resend may repeat one
        assert firsts == list(range(1, later["seq"] + 1)), seqs
        assert later["mqtt"]["telemetry_dropped_offline"] == 0
        log = a.proc.output()
        assert "ending the MQTT network thread (test failpoint)" in log
        assert "the MQTT network thread died (its connection is gone); starting a new MQTT client" in log
        assert a.proc.proc.poll() is None
    finally:
        a.close()


def test_a_dead_sender_thread_ends_the_agent_so_the_service_manager_restarts_it(wd, broker, bundle, keys):
    """The link cannot mend its own sender: the agent exits 1 with one line (systemd's
    Restart=on-failure starts it again) and the retained status says error, not online."""
    a = Agent(wd, "lv2", broker.port, bundle, keys["public"], env={"TANDOOR_MQTT_FAILPOINT": "kill-sender:3"})
    try:
        code = a.proc.proc.wait(60)
        lines = [x for x in a.proc.output().splitlines() if x.startswith("tandoor-agent: error:")]
        assert code == 1 and lines == ["tandoor-agent: error: the MQTT link stopped working (its sender thread "
                                       "died, see the log above); exiting so that the service manager restarts "
                                       "the agent"], (code, a.proc.output()[-2000:])
        st = status_of(a.rec, "lv2", 10, lambda s: not s["online"])
        assert st["reason"] == "error" and st["state"] == "error" and "MQTT link stopped" in st["error"]
    finally:
        a.close()


# --- 3. telemetry while the broker is down ----------------------------------------------------------

def test_telemetry_buffered_offline_is_bounded_counted_and_delivered_in_order(wd, bundle, keys):
    """offline_buffer = 3, telemetry every 0.2 s, the broker SIGKILLed for 2 s: ~10 messages
    taken offline, the 3 newest kept; after the restart they arrive first and in order, then live
    ones; the published drop count equals the gaps in seq."""
    b = Broker(wd / "b-buffer").start()
    a = None
    try:
        a = Agent(wd, "buf1", b.port, bundle, keys["public"], telemetry_period_s=0.2, offline_buffer=3)
        before = a.telemetry(lambda t: t["seq"] >= 3, 30)
        b.kill()
        time.sleep(2.0)  # the outage itself
        b.start()
        live = a.telemetry(lambda t: t["mqtt"]["connects"] == 2 and not t.get("queued_offline"), 60)
        got = [m.json() for m in a.rec.on("buf1/telemetry")]
        order = [g["seq"] for g in got]
        firsts = [s for i, s in enumerate(order) if s not in order[:i]]  # a QoS 1 resend may repeat one
        assert firsts == sorted(firsts), order  # delivered in order
        offline = sorted({g["seq"] for g in got if g.get("queued_offline")})
        assert offline == [live["seq"] - 3, live["seq"] - 2, live["seq"] - 1], (offline, live["seq"])  # the newest
        dropped = live["mqtt"]["telemetry_dropped_offline"]
        missing = set(range(1, live["seq"])) - set(firsts)
        assert dropped == len(missing) and dropped >= 4, (dropped, sorted(missing), order)
        assert min(missing) > before["seq"] and max(missing) < offline[0], (sorted(missing), offline)
        assert live["mqtt"]["loop_restarts"] == 0 and a.proc.proc.poll() is None
    finally:
        if a is not None:
            a.close()
        b.stop()


# --- 4. the camera's source vanishes mid-stream and comes back --------------------------------------

def _frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(4)
    return [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(n)]


def _image_folder(d: Path) -> Path:
    import cv2

    d.mkdir()
    for i, img in enumerate(_frames(4)):
        assert cv2.imwrite(str(d / f"{i:03d}.png"), img)
    return d


def _video(p: Path) -> Path:
    import cv2

    w = cv2.VideoWriter(str(p), cv2.VideoWriter_fourcc(*"MJPG"), 20.0, (64, 48))
    assert w.isOpened()
    for img in _frames(10):  # half a second: the file is reopened at every pass
        w.write(img)
    w.release()
    return p


@pytest.mark.parametrize("kind", ["images", "file"])
def test_a_camera_source_removed_mid_stream_is_reopened_with_backoff(wd, broker, bundle, keys, kind):
    """The source is renamed away while the agent serves it, then put back: status says
    camera-lost with the reason at every reopen attempt (delays doubling to the cap), the
    watchdog keeps being fed and commands answered meanwhile, then running again in the same
    process (one READY=1, one session) and results flow."""
    dev = f"cam-{kind}"
    path = _image_folder(wd / "frames") if kind == "images" else _video(wd / "clip.avi")
    camera = {"source": f"{kind}:{path}", "fps": 20.0, "reconnect_min_s": 0.2, "reconnect_max_s": 0.8}
    a = Agent(wd, dev, broker.port, bundle, keys["public"], notify=True, camera=camera)
    away = path.with_name(path.name + ".away")
    try:
        session = a.status["session"]
        a.notify.wait_for("READY=1", timeout=30)
        os.rename(path, away)
        t_lost = time.monotonic()
        why = "no such directory" if kind == "images" else "no such file"
        lost = status_of(a.rec, dev, 30, lambda s: s.get("state") == "camera-lost", "camera-lost")
        assert lost["online"] and why in lost["camera_lost"]["reason"] and lost["camera_lost"]["attempts"] == 0, lost
        third = status_of(a.rec, dev, 30, lambda s: (s.get("camera_lost") or {}).get("attempts", 0) >= 3,
                          "three reopen attempts")
        assert str(path) in third["camera_lost"]["last_error"], third
        r = a.ask({"cmd": "ping"})
        assert r["ok"] and r["result"]["state"] == "camera-lost"
        a.notify.wait_for("WATCHDOG=1", after=t_lost, count=4, timeout=30)  # fed while lost
        delays = [s["camera_lost"]["delay_s"] for s in a.statuses() if s.get("camera_lost")]
        assert delays[:4] == [0.2, 0.4, 0.8, 0.8], delays  # doubling from min, capped at max
        os.rename(away, path)
        t_back = time.time()
        back = status_of(a.rec, dev, 30, lambda s: s.get("state") == "running" and "camera_lost" not in s
                         and s["ts"] > t_back - 1, "running again")
        assert back["session"] == session
        a.result_after(t_back)
        tel = a.telemetry(lambda t: t["state"] == "running", after=t_back)
        assert tel["camera"]["losses"] == 1 and tel["camera"]["lost"] is None, tel["camera"]
        assert len(a.notify.states("READY=1")) == 1 and a.proc.proc.poll() is None
    finally:
        if away.exists():
            os.rename(away, path)
        a.close()
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
