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
  process; a hung inference stops the watchdog pings (SIGABRT and a restart, as systemd does, recover)
- a seeded mutation fuzzer over every topic the agent reads: thousands of cases, the agent
  serving throughout, nothing installed
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
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


@pytest.mark.parametrize("host,why", [("no-such-host.invalid", "no-such-host.invalid does not resolve"),
                                      ("127.0.0.1", "no answer on that address")])
def test_a_broker_out_of_reach_is_said_once_in_the_log_and_the_agent_serves_on(wd, bundle, keys, host, why):
    """A broker name the board cannot resolve (the emulated bookworm image has no /etc/hosts, so
    "localhost" did not resolve there and its agent said nothing for 20 minutes) or a port nobody
    listens on: the agent says so at once, once (not once per retry), and serves its model on."""
    from support.mosquitto import free_port

    dev = f"far-{host.split('.')[0]}"
    cfg = write_config(wd / f"{dev}.toml", device_id=dev, bundle=str(bundle), trusted_keys=[str(keys["public"])],
                       delegate="onnxruntime", broker={"host": host, "port": free_port(), "reconnect_min_s": 0.2,
                                                       "reconnect_max_s": 0.5},
                       camera={"source": "synthetic:64x48@20"})
    proc = AgentProcess(["serve", "--config", str(cfg)], wd / f"{dev}.log")
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "cannot reach the broker" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3.0)       # several retries at 0.2-0.5 s
        said = [ln for ln in proc.output().splitlines() if "cannot reach the broker" in ln]
        assert len(said) == 1, proc.output()[-2000:]
        assert f"cannot reach the broker at {host}:" in said[0] and why in said[0] and "retrying" in said[0]
        assert "running" in proc.output() and proc.proc.poll() is None
    finally:
        assert proc.stop() == 0


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


def test_a_hung_inference_stops_the_watchdog_and_a_restart_recovers(wd, broker, bundle, keys):
    """The failpoint makes one inference never return (a wedged driver): the loop stops feeding
    the watchdog (it must, or systemd could not tell), so the test, as systemd does past
    WatchdogSec, sends SIGABRT and starts the agent again, which serves."""
    hang = wd / "hang-now"
    a = Agent(wd, "hang1", broker.port, bundle, keys["public"], notify=True, env={"TANDOOR_SERVE_HANG_FILE": str(hang)})
    b = None
    try:
        a.notify.wait_for("WATCHDOG=1", count=2, timeout=30)
        hang.touch()
        deadline = time.monotonic() + 30
        while "this inference hangs (test failpoint)" not in a.proc.output():
            assert time.monotonic() < deadline, a.proc.output()[-2000:]
            time.sleep(0.05)
        t_hung = time.monotonic()
        with pytest.raises(AssertionError, match="no 1 x WATCHDOG=1"):
            a.notify.wait_for("WATCHDOG=1", after=t_hung + 0.1, timeout=2.5)  # WATCHDOG_USEC is 1 s
        assert a.proc.stop(signal.SIGABRT, timeout=30) == -signal.SIGABRT
        st = status_of(a.rec, "hang1", 30, lambda s: not s["online"], "the will")
        assert st["reason"] == "connection lost"
        a.close()
        b = Agent(wd, "hang1", broker.port, bundle, keys["public"], notify=True,
                  env={"TANDOOR_SERVE_HANG_FILE": str(hang)})
        assert not hang.exists() and b.status["session"] != a.status["session"]
        b.notify.wait_for("READY=1", timeout=30)
        b.result_after(time.time())
    finally:
        a.close()
        if b is not None:
            b.close()


# --- 5. hostile input on every topic the agent reads -------------------------------------------------

FUZZ_CASES = 3000
FUZZ_BARRIER = 250  # a ping after this many: the agent must answer it before the next batch
FUZZ_SEED = 17
#: values a mutation puts in place of a field's (wrong types, extremes, lone surrogates, deep nests)
ODD_VALUES = [None, True, False, 0, -1, 2 ** 63, 1e308, -1e-308, "", "x" * 5000, "\ud800", "tandoor/#", [], {},
              [[[[[[]]]]]], {"a": {"b": {"c": None}}}, "../../etc/passwd", "\x00", "ping", 3.5]


def _seeds(dev: str) -> tuple[list[tuple[str, bytes]], dict]:
    """Valid messages for each topic the agent reads, and a job offer (its chunks real)."""
    rng = random.Random(FUZZ_SEED)
    data = rng.randbytes(4 * 1024)
    chunks = [data[i:i + 1024] for i in range(0, len(data), 1024)]
    offer = {"job_id": "fuzz-1", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "chunk_size": 1024,
             "n_chunks": 4, "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
             "deadline": time.time() + 3600, "issued": time.time(), "stall_timeout_s": 600, "transport": "mqtt",
             "health_frames": 5, "model": {"name": "fuzz", "version": "9"}}
    base = f"tandoor/{dev}"
    j = lambda o: json.dumps(o).encode()  # noqa: E731
    seeds = [(f"{base}/cmd", j({"cmd": c, **extra})) for c, extra in [
        ("ping", {}), ("get-config", {}), ("update-status", {}), ("snapshot", {}),
        ("set-config", {"args": {"top_k": 3}}), ("set-config", {"args": {"results_max_rate_hz": 5}}),
        ("ping", {"correlation_id": "c-1", "response_topic": "fuzz/answers"}), ("frobnicate", {"args": {}})]]
    seeds += [(f"{base}/update/job", j(offer)),
              (f"{base}/update/cancel", j({"job_id": "fuzz-0", "reason": "fuzz"})),
              (f"{base}/update/keys", j({"op": "add-key", "id": "k-fuzz", "issued": time.time(),
                                         "key": "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
                                         "signature": "00" * 64, "signer": "0" * 16}))]
    seeds += [(f"{base}/update/chunk/fuzz-1/{i}", c) for i, c in enumerate(chunks)]
    seeds += [(f"tandoor/~fleet/update/chunk/fuzz-1/{i}", c) for i, c in enumerate(chunks)]
    return seeds, offer


def _mutate(rng: random.Random, topic: str, payload: bytes) -> tuple[str, bytes]:
    how = rng.randrange(10)
    if how == 0:  # flipped bytes
        b = bytearray(payload)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return topic, bytes(b)
    if how == 1:  # truncated
        return topic, payload[:rng.randrange(len(payload) + 1)]
    if how == 2:  # junk inserted
        i = rng.randrange(len(payload) + 1)
        return topic, payload[:i] + rng.randbytes(rng.randint(1, 64)) + payload[i:]
    if how == 3:  # huge (rarely), or a deep nest
        if rng.random() < 0.1:
            return topic, b'{"cmd": "ping", "pad": "' + b"A" * rng.randint(70_000, 2_000_000) + b'"}'
        return topic, b"[" * rng.randint(1000, 200_000)
    if how == 4:  # a wrong index or job in a chunk topic, or a sub-topic nobody expects
        parts = topic.split("/")
        parts[-1] = rng.choice(["-1", "999999", "x", "", "1e3", str(2 ** 70)])
        if rng.random() < 0.3:
            parts[-2] = rng.choice(["fuzz-2", "..", "a" * 200])
        return "/".join(parts), payload
    try:
        body = json.loads(payload)
    except ValueError:
        return topic, rng.randbytes(rng.randint(0, 256))
    if not isinstance(body, dict):
        return topic, payload
    if how in (5, 6, 7) and body:  # a field of a wrong type or an extreme value
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(list(body))
            body[k] = rng.choice(ODD_VALUES)
    elif how == 8:  # unknown fields and commands
        body[rng.choice(["cmd", "args", "op", "job_id", "zzz"])] = "".join(
            rng.choice("abcdefghij-_/#+$\u00e9") for _ in range(rng.randint(0, 80)))
    else:  # NaN, or non-UTF-8 bytes in a string
        return topic, json.dumps(body).replace("}", ', "n": NaN}', 1).encode() if rng.random() < 0.5 \
            else json.dumps(body).encode().replace(b'"', b'"\xff', 1)
    return topic, json.dumps(body).encode()


def _tracebacks(log: str) -> list[str]:
    """Each traceback in an agent's log, up to and with its exception line."""
    out, cur = [], None
    for line in log.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            cur = [line]
        elif cur is not None:
            cur.append(line)
            if not line.startswith((" ", "\t")):
                out.append("\n".join(cur))
                cur = None
    return out


def test_hostile_input_on_every_topic_the_agent_reads(wd, broker, bundle, keys):
    """FUZZ_CASES seeded mutations (flipped, truncated, junk, huge, deep nests, wrong types,
    unknown commands and fields, NaN, bad UTF-8, bad chunk topics, odd MQTT 5 Response Topics and
    Correlation Data, replays of earlier messages) on cmd, update/job, update/chunk, the fleet
    chunk topic, update/cancel and update/keys. A ping after every FUZZ_BARRIER is answered, the
    network thread never restarts, no traceback is logged, every response is a well-formed
    answer, nothing is installed, and results and telemetry still flow at the end."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    dev = "fz1"
    slots = seed_slots(wd / "fz-slots", bundle, keys["public"])
    a = Agent(wd, dev, broker.port, bundle, keys["public"], slot_dir=slots, log_level="warning",
              extra_topics=("fuzz/#",))
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="fuzzer", protocol=mqtt.MQTTv5)
    pub.max_inflight_messages_set(200)
    pub.connect("127.0.0.1", broker.port)
    pub.loop_start()
    try:
        before = a.ask({"cmd": "update-status"})["result"]
        seeds, offer = _seeds(dev)
        a.rec.publish(f"tandoor/{dev}/update/job", json.dumps(offer))  # a job, so chunks have one to hit
        a.rec.wait_for(lambda m: m.topic.endswith("/update/ack") and m.json().get("job_id") == "fuzz-1", 30,
                       "the fuzz job accepted")
        rng = random.Random(FUZZ_SEED)
        sent: list[tuple[str, bytes, Properties | None]] = []
        kinds: dict[str, int] = {}
        for n in range(1, FUZZ_CASES + 1):
            if sent and rng.random() < 0.05:  # a replay of an earlier message, properties and all
                topic, payload, props = rng.choice(sent)
                kind = "replay"
            else:
                seed = rng.choice(seeds)
                kind = "~fleet/update/chunk" if "~fleet" in seed[0] else \
                    seed[0].split("/", 2)[2].replace("/fuzz-1", "").rstrip("/0123456789")
                topic, payload = _mutate(rng, *seed)
                props = None
                if topic.endswith("/cmd") and rng.random() < 0.4:
                    props = Properties(PacketTypes.PUBLISH)
                    props.ResponseTopic = rng.choice(["fuzz/answers", "fuzz/+/x", "fuzz/#", f"tandoor/{dev}/cmd",
                                                      f"tandoor/{dev}/update/job", "fuzz/" + "y" * 1000])
                    props.CorrelationData = rng.choice([b"", b"c", rng.randbytes(16), rng.randbytes(2000)])
                sent.append((topic, payload, props))
            kinds[kind] = kinds.get(kind, 0) + 1
            pub.publish(topic, payload, qos=1, properties=props).wait_for_publish(30)
            if n % FUZZ_BARRIER == 0:
                r = a.ask({"cmd": "ping"}, timeout=60)
                assert r["ok"] and r["result"]["pong"], (n, r)
                assert a.proc.proc.poll() is None, a.proc.output()[-3000:]
        print(f"\nfuzzed {FUZZ_CASES} cases (seed {FUZZ_SEED}) on topics {sorted(kinds.items())}")
        # the fuzz may have (validly) changed the safe keys: put them back, then results must flow
        r = a.ask({"cmd": "set-config", "args": {"top_k": 5, "results_max_rate_hz": 5, "telemetry_period_s": 0.5}})
        assert r["ok"], r
        t0 = time.time()
        a.result_after(t0)
        tel = a.telemetry(after=t0 + 0.6)
        assert tel["mqtt"]["loop_restarts"] == 0 and tel["mqtt"]["connects"] == 1, tel["mqtt"]
        after = a.ask({"cmd": "update-status"})["result"]
        assert after["slots"] == before["slots"], (before, after)  # nothing installed
        states = {m.json().get("state") for m in a.rec.on(f"{dev}/update/ack")}
        assert not states & {"verified", "staged", "trial", "committed"}, states
        answers = [m for m in a.rec.messages if m.topic in (f"tandoor/{dev}/response", "fuzz/answers")]
        assert len(answers) > FUZZ_CASES // 4, len(answers)
        for m in answers:
            body = m.json()
            assert isinstance(body["ok"], bool) and (body["ok"] or (isinstance(body["error"], str) and body["error"]))
        assert any(m.json().get("repeated") for m in answers), "no replay answered from the record"
        assert not (tbs := _tracebacks(a.proc.output())), tbs[:3]
    finally:
        pub.loop_stop()
        pub.disconnect()
        a.close()


def test_deeply_nested_json_on_the_update_topics_is_refused_without_a_traceback(wd, broker, bundle, keys):
    dev = "fz2"
    slots = seed_slots(wd / "fz2-slots", bundle, keys["public"])
    a = Agent(wd, dev, broker.port, bundle, keys["public"], slot_dir=slots, log_level="warning")
    try:
        for leaf in ("update/job", "update/cancel", "update/keys"):
            a.rec.publish(f"tandoor/{dev}/{leaf}", b"[" * 100_000)
        a.rec.publish(f"tandoor/{dev}/update/job", b'{"job_id": "deep-1", "x": ' + b"[" * 100_000 + b"}")
        ack = a.rec.wait_for(lambda m: m.topic.endswith("/update/ack") and m.json().get("job_id") == "deep-1", 20,
                             "the deep offer refused").json()
        assert ack["state"] == "failed" and ack["kind"] == "malformed", ack
        assert a.ask({"cmd": "ping"})["ok"]
        assert _tracebacks(a.proc.output()) == []
    finally:
        a.close()
