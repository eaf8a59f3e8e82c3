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
