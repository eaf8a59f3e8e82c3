"""The shipped broker rules (mosquitto/tandoor.conf + mosquitto/acl, as secured_broker runs them)
carry everything a real agent publishes to the fleet operator: status, telemetry, results,
snapshot, response, update/ack (job and key acks) and update/need; another device's account may
publish none of them in the agent's name."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from support.agents import START_TIMEOUT, AgentProcess, agent_config, make_bundles, seed_slots
from support.mosquitto import Client, available, secured_broker

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")

NOT_AUTHORIZED = 135   # MQTT 5 PUBACK reason code
DEV, OTHER = "acl-dev", "acl-other"


@pytest.fixture(scope="module")
def B(bundles_dir, tmp_path_factory):  # noqa: N802 (make_bundles' bundles, by the name the tests index)
    return make_bundles(bundles_dir, tmp_path_factory.mktemp("aclbundles"))


def _wait(op: Client, topic: str, pred=lambda p: True, timeout: float = 30) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, p in list(op.msgs):
            if t == topic and pred(p):
                return p
        time.sleep(0.05)
    raise AssertionError(f"nothing on {topic} within {timeout} s; the operator got {sorted({t for t, _ in op.msgs})}")


def test_every_topic_a_real_agent_publishes_reaches_the_operator_through_the_shipped_acl(tmp_path, B):
    users = {DEV: "dev pass", OTHER: "other pass", "fleet-operator": "op-secret"}
    b = secured_broker(tmp_path, users)
    (tmp_path / "dev.pass").write_text("dev pass\n")
    sd = seed_slots(tmp_path / "slots", B["v1"], B["pub"])
    cfg = agent_config(tmp_path, DEV, b.port, sd, B["pub"],
                       broker={"username": DEV, "password_file": str(tmp_path / "dev.pass")},
                       snapshot={"period_s": 1.0})
    op = Client(b.port, "fleet-operator", "op-secret")
    agent = AgentProcess(["--config", str(cfg)], tmp_path / "agent.log")
    base = f"tandoor/{DEV}"
    try:
        assert op.sub("tandoor/#") == 1
        _wait(op, f"{base}/status", lambda p: json.loads(p).get("state") == "running", START_TIMEOUT)
        assert json.loads(_wait(op, f"{base}/telemetry"))["device_id"] == DEV
        assert "ts" in json.loads(_wait(op, f"{base}/results"))
        assert _wait(op, f"{base}/snapshot").startswith(b"\xff\xd8"), "a JPEG"  # refused before the fix
        # a command without a response topic is answered on <base>/response
        assert op.pub(f"{base}/cmd", b'{"cmd": "ping", "correlation_id": 7}') == 0
        assert json.loads(_wait(op, f"{base}/response"))["correlation_id"] == 7
        # a job offer whose chunks never come: accepted (update/ack), then asked for (update/need)
        chunks = [b"a" * 16, b"b" * 16]
        offer = {"job_id": "acl-job", "sha256": hashlib.sha256(b"".join(chunks)).hexdigest(), "size": 32,
                 "chunk_size": 16, "n_chunks": 2, "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
                 "deadline": time.time() + 120, "issued": time.time()}
        assert op.pub(f"{base}/update/job", json.dumps(offer).encode()) == 0
        _wait(op, f"{base}/update/ack", lambda p: json.loads(p).get("state") == "received")
        assert json.loads(_wait(op, f"{base}/update/need"))["missing"] == [0, 1]
        assert op.pub(f"{base}/update/cancel", b'{"job_id": "acl-job"}') == 0
        _wait(op, f"{base}/update/ack", lambda p: json.loads(p).get("state") == "cancelled")
        # a key command it cannot verify: refused, and the refusal is a key ack on update/ack
        assert op.pub(f"{base}/update/keys", b'{"op": "add-key"}') == 0
        ack = json.loads(_wait(op, f"{base}/update/ack", lambda p: "key_op" in json.loads(p)))
        assert ack["ok"] is False and ack["reason"], ack
        # another device's account: every one of those topics refused in this device's name
        other = Client(b.port, OTHER, "other pass")
        try:
            for leaf in ("status", "telemetry", "results", "snapshot", "response", "update/ack", "update/need"):
                assert other.pub(f"{base}/{leaf}", b'{"forged": true}') == NOT_AUTHORIZED, leaf
            assert other.pub(f"tandoor/{OTHER}/snapshot", b"\xff\xd8its own") == 0   # its own: allowed
            _wait(op, f"tandoor/{OTHER}/snapshot")
        finally:
            other.close()
        time.sleep(0.5)
        assert not [t for t, p in op.msgs if b"forged" in p], "a forged message reached the operator"
    finally:
        agent.stop()
        op.close()
        b.stop()
    assert "tandoor-agent: error" not in agent.output(), agent.output()[-2000:]
