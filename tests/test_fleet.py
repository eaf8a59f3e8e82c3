"""The fleet side against a real mosquitto: the repo's secured config (mosquitto/tandoor.conf +
acl, generated passwords) refuses a device that publishes or subscribes on another device's
topics; a canary rollout to simulated agents (scripts/fleet-sim.py: real MQTT clients, the real
updater and SlotStore, no inference) aborts the remaining devices when failures exceed
--max-failures; a 10-agent simulation smoke test."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import BIN, ROOT
from mosquitto import MOSQUITTO, Broker, available
from test_updates import make_bundles

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")



def _load_sim():
    spec = importlib.util.spec_from_file_location("fleet_sim", ROOT / "scripts" / "fleet-sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def B(bundles_dir, tmp_path_factory):
    return make_bundles(bundles_dir, tmp_path_factory.mktemp("fleetbundles"))


# --- the secured broker config --------------------------------------------------------------------

def secured_broker(d: Path, users: dict[str, str]) -> Broker:
    """mosquitto/tandoor.conf with its global part as shipped (auth, ACL file, limits), the file
    paths pointed at temp files, and a plain listener on a free port instead of the TLS one."""
    import shutil

    passwd = d / "tandoor.passwd"
    for i, (u, p) in enumerate(users.items()):
        tool = shutil.which("mosquitto_passwd") or str(Path(MOSQUITTO).with_name("mosquitto_passwd"))
        subprocess.run([tool, *(["-c"] if i == 0 else []), "-b", str(passwd), u, p], check=True)
    conf = (ROOT / "mosquitto" / "tandoor.conf").read_text()
    glob = conf.split("# ---- listeners")[0]
    assert re.search(r"^allow_anonymous false$", glob, re.M) and re.search(r"^acl_file ", glob, re.M)
    glob = re.sub(r"^password_file .*$", f"password_file {passwd}", glob, flags=re.M)
    glob = re.sub(r"^acl_file .*$", f"acl_file {ROOT / 'mosquitto' / 'acl'}", glob, flags=re.M)
    glob = re.sub(r"^persistence true$", "persistence false", glob, flags=re.M)
    glob = re.sub(r"^(persistence_location|autosave_interval|log_dest) .*$", "", glob, flags=re.M)
    b = Broker(d / "broker")
    # started as root, mosquitto would drop to user mosquitto, who cannot read pytest's temp dir
    b.conf.write_text(glob + f"\nuser root\nlog_dest stderr\nlistener {b.port} 127.0.0.1\n")
    return b.start()


class Client:
    def __init__(self, port: int, user: str | None, pw: str | None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.msgs: list = []
        self.sub_rc: list = []
        self.pub_rc: dict[int, int] = {}
        self.conn_rc = None
        self.ev = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"t-{user}-{time.monotonic_ns()}",
                             protocol=mqtt.MQTTv5)
        if user:
            self.c.username_pw_set(user, pw)
        self.c.on_connect = lambda c, u, f, rc, p: (setattr(self, "conn_rc", rc), self.ev.set())
        self.c.on_message = lambda c, u, m: self.msgs.append((m.topic, bytes(m.payload)))
        self.c.on_subscribe = lambda c, u, mid, rcs, p: self.sub_rc.append([r.value for r in rcs])
        self.c.on_publish = lambda c, u, mid, rc, p: self.pub_rc.__setitem__(mid, rc.value)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.ev.wait(10)

    def sub(self, topic: str) -> int:
        n = len(self.sub_rc)
        self.c.subscribe(topic, qos=1)
        deadline = time.monotonic() + 10
        while len(self.sub_rc) == n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.sub_rc[-1][0]

    def pub(self, topic: str, payload: bytes = b"{}", retain: bool = False) -> int:
        info = self.c.publish(topic, payload, qos=1, retain=retain)
        deadline = time.monotonic() + 10
        while info.mid not in self.pub_rc and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.pub_rc.get(info.mid)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_secured_broker_refuses_another_devices_topics(tmp_path):
    users = {"dev1": "pw-one", "dev2": "pw-two", "fleet-operator": "op-secret"}
    b = secured_broker(tmp_path, users)
    try:
        anon = Client(b.port, None, None)
        assert anon.conn_rc is not None and anon.conn_rc.is_failure  # allow_anonymous false
        anon.close()
        wrong = Client(b.port, "dev1", "nope")
        assert wrong.conn_rc.is_failure
        wrong.close()
        op = Client(b.port, "fleet-operator", "op-secret")
        d1 = Client(b.port, "dev1", "pw-one")
        d2 = Client(b.port, "dev2", "pw-two")
        assert not op.conn_rc.is_failure and not d1.conn_rc.is_failure
        assert op.sub("tandoor/#") == 1
        assert d2.sub("tandoor/dev2/cmd") == 1 and d2.sub("tandoor/dev2/update/chunk/#") == 1
        # dev1 on its own topics: allowed
        assert d1.sub("tandoor/dev1/cmd") == 1 and d1.sub("tandoor/dev1/update/job") == 1
        assert d1.sub("tandoor/dev1/update/chunk/#") == 1
        assert d1.pub("tandoor/dev1/status", b'{"online": true}', retain=True) == 0
        assert d1.pub("tandoor/dev1/update/ack", b'{"state": "received"}') == 0
        # dev1 on dev2's topics: refused by the broker (PUBACK/SUBACK 0x87 not authorized)
        NOT_AUTHORIZED = 135
        assert d1.pub("tandoor/dev2/status", b'{"online": false, "forged": true}', retain=True) == NOT_AUTHORIZED
        assert d1.pub("tandoor/dev2/update/ack", b'{"state": "committed", "forged": true}') == NOT_AUTHORIZED
        assert d1.pub("tandoor/dev2/cmd", b'{"cmd": "rollback", "forged": true}') == NOT_AUTHORIZED
        assert d1.pub("tandoor/dev1/update/chunk/j/0", b"forged chunk to itself") == NOT_AUTHORIZED
        assert d1.pub("tandoor/dev1/cmd", b'{"cmd": "ping"}') == NOT_AUTHORIZED  # cmd is read-only for it
        # reading: mosquitto 2.0 may grant the SUBACK but checks every delivery against the ACL
        for t in ("tandoor/dev2/cmd", "tandoor/dev2/update/chunk/#", "tandoor/+/status", "$SYS/#"):
            assert d1.sub(t) in (1, NOT_AUTHORIZED)
        # the operator drives dev2; dev1 sees none of it
        assert op.pub("tandoor/dev2/cmd", b'{"cmd": "ping"}') == 0
        assert op.pub("tandoor/dev2/update/chunk/j/0", b"chunk for dev2") == 0
        assert op.pub("tandoor/dev1/update/job", b'{"for": "dev1"}') == 0
        time.sleep(1.0)
        assert ("tandoor/dev2/cmd", b'{"cmd": "ping"}') in d2.msgs
        assert ("tandoor/dev2/update/chunk/j/0", b"chunk for dev2") in d2.msgs
        assert [t for t, _ in d1.msgs] == ["tandoor/dev1/update/job"], d1.msgs
        assert not any(b"forged" in p for _, p in op.msgs + d2.msgs)
        assert ("tandoor/dev1/status", b'{"online": true}') in op.msgs
        # the fleet CLI with credentials in the URL; without them it is refused
        url = f"mqtt://fleet-operator:op-secret@127.0.0.1:{b.port}"
        r = subprocess.run([str(BIN / "tandoor"), "fleet", "devices", "--broker", url, "--json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "dev1" in json.loads(r.stdout), r.stderr
        r = subprocess.run([str(BIN / "tandoor"), "fleet", "devices", "--broker", f"mqtt://127.0.0.1:{b.port}"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and ("refused" in r.stderr.lower() or "cannot connect" in r.stderr), r.stderr
        for c in (op, d1, d2):
            c.close()
    finally:
        b.stop()


# --- canary abort on simulated agents ---------------------------------------------------------------

def test_canary_abort_when_failures_exceed_max(tmp_path, B):
    sim = _load_sim()
    with Broker(tmp_path / "broker") as b:
        fail = {"sim000"}
        with sim.SimFleet(10, b.port, tmp_path, B["pub"], B["v1"], processes=2, gate_s=0.1, fail=fail):
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v2"]), "--all", "--canary", "20%",
                                "--max-failures", "0", "--broker", f"mqtt://127.0.0.1:{b.port}", "--timeout", "120",
                                "--json"], capture_output=True, text=True, timeout=200)
            assert r.returncode == 1, r.stderr
            out = json.loads(r.stdout)
            st = {d: v["state"] for d, v in out["devices"].items()}
            assert st["sim000"] == "rolled_back" and st["sim001"] == "committed", st
            assert all(st[f"sim{i:03d}"] == "skipped" for i in range(2, 10)), st
            assert "1 device(s) failed or rolled back (max 0)" in out["aborted"]
            assert out["devices"]["sim005"]["reason"].startswith("rollout aborted")
            assert "simulated failure" in out["devices"]["sim000"]["reason"]
            # max-failures 1 lets the same job through the canaries and on to everyone else
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v3"]), "--all", "--canary", "20%",
                                "--max-failures", "1", "--wave-size", "4", "--broker", f"mqtt://127.0.0.1:{b.port}",
                                "--timeout", "120", "--json"], capture_output=True, text=True, timeout=200)
            out = json.loads(r.stdout)
            assert out["counts"] == {"committed": 9, "rolled_back": 1}, out["counts"]
            assert out["waves"] == [2, 4, 4]


def test_fleet_sim_smoke_10_agents(tmp_path, B):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fleet-sim.py"), "--agents", "10", "--processes", "2",
                        "--canary", "20", "--bundle", str(B["v2"]), "--seed-bundle", str(B["v1"]), "--pub",
                        str(B["pub"]), "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["counts"] == {"committed": 10} and res["waves"] == [2, 8]
    assert res["per_device"]["bytes_to"] >= res["bundle_bytes"]
    assert res["broker"]["bytes_sent"] and res["broker"]["bytes_sent"] > 10 * res["bundle_bytes"]
