"""The fleet side against a real mosquitto: the repo's secured config (mosquitto/tandoor.conf +
acl, generated passwords) refuses a device that publishes or subscribes on another device's
topics; the same config's TLS listener (certificates made here) carries a real agent and
`tandoor fleet devices --broker mqtts://... --cafile` while plain MQTT on that port gets nowhere;
a canary rollout to real agents aborts the rest when the canary's telemetry p95 is over
--latency-budget-ms; a canary rollout to simulated agents (scripts/fleet-sim.py: real MQTT
clients, the real updater and SlotStore, no inference) aborts the remaining devices when failures
exceed --max-failures; a 10-agent simulation smoke test."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time

import pytest

from support.cli import BIN, ROOT
from support.mosquitto import Broker, Client, Recorder, available, make_tls_files, secured_broker
from support.agents import START_TIMEOUT, AgentProcess, agent_config, make_bundles, running_sha, seed_slots
from support.bundle_edit import sha

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")



def _load_sim():
    spec = importlib.util.spec_from_file_location("fleet_sim", ROOT / "scripts" / "fleet-sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def B(bundles_dir, tmp_path_factory):
    return make_bundles(bundles_dir, tmp_path_factory.mktemp("fleetbundles"))


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
        # the fleet-wide chunk topic: every device reads it, only the operator writes it
        assert d1.sub("tandoor/~fleet/update/chunk/job-g/#") == 1 and d2.sub("tandoor/~fleet/update/chunk/job-g/#") == 1
        assert d1.sub("tandoor/dev1/update/cancel") == 1 and d1.sub("tandoor/dev1/update/keys") == 1
        assert d1.pub("tandoor/~fleet/update/chunk/job-g/0", b"forged fleet chunk") == NOT_AUTHORIZED
        assert op.pub("tandoor/~fleet/update/chunk/job-g/0", b"chunk for the wave") == 0
        assert op.pub("tandoor/dev1/update/cancel", b'{"job_id": "job-g"}') == 0
        # every delivery each client should get has arrived (then what it got besides is what the
        # broker let through, nothing still on its way)
        wave = ("tandoor/~fleet/update/chunk/job-g/0", b"chunk for the wave")
        d1.expect([wave, ("tandoor/dev1/update/cancel", b'{"job_id": "job-g"}'),
                   ("tandoor/dev1/update/job", b'{"for": "dev1"}')])
        d2.expect([wave, ("tandoor/dev2/cmd", b'{"cmd": "ping"}'), ("tandoor/dev2/update/chunk/j/0", b"chunk for dev2")])
        op.expect([("tandoor/dev1/status", b'{"online": true}'), wave])
        d1.msgs[:] = [m for m in d1.msgs if "~fleet" not in m[0] and not m[0].endswith("/cancel")]
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


def fleet_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tandoor"), "fleet", *args], capture_output=True, text=True, timeout=timeout)


def test_agent_and_fleet_over_the_shipped_tls_listener(tmp_path, B):
    """mosquitto/tandoor.conf's TLS listener with a CA and server certificate made here: a real
    agent (broker.tls.ca, user = device_id, password_file) shows up in `tandoor fleet devices
    --broker mqtts://... --cafile ca.pem`; the same port refuses plain MQTT, and TLS without
    the private CA (system CAs only) is refused, each with one line and exit code 2."""
    tls = make_tls_files(tmp_path / "tls")
    users = {"tls-dev": "dev pass", "fleet-operator": "op-secret"}
    b = secured_broker(tmp_path, users, tls=tls)
    (tmp_path / "dev.pass").write_text("dev pass\n")
    cfg = tmp_path / "tls-dev.toml"
    cfg.write_text(f"""device_id = "tls-dev"
bundle = "{B['v1']}"
trusted_keys = ["{B['pub']}"]
delegate = "onnxruntime"
telemetry_period_s = 1.0

[broker]
host = "localhost"
port = {b.port}
username = "tls-dev"
password_file = "{tmp_path / 'dev.pass'}"
reconnect_min_s = 0.5
reconnect_max_s = 2.0

[broker.tls]
ca = "{tls['ca']}"

[camera]
source = "synthetic:64x48@10"
""")
    url = f"mqtts://fleet-operator:op-secret@localhost:{b.port}"
    agent = AgentProcess(["--config", str(cfg)], tmp_path / "tls-dev.log")
    try:
        from tandoor_fleet.rollout import Fleet

        with Fleet(url, cafile=str(tls["ca"])) as f:  # over TLS: wait until the agent serves
            deadline = time.monotonic() + START_TIMEOUT
            while (f.status.get("tls-dev") or {}).get("state") != "running" and time.monotonic() < deadline:
                assert agent.proc.poll() is None, agent.output()[-2000:]
                time.sleep(0.5)
        r = fleet_cli("devices", "--broker", url, "--cafile", str(tls["ca"]), "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)["tls-dev"]
        assert d["online"] is True and d["state"] == "running", d
        assert d["model"]["sha256"] == sha(B["v1"]) and d["model"]["version"] == "1"
        r = fleet_cli("devices", "--broker", url, "--cafile", str(tls["ca"]))  # the table a person reads
        assert r.returncode == 0 and re.search(r"^tls-dev\s+online\s+running\s+dynamic_batch v1 ", r.stdout, re.M), r.stdout
        # plain MQTT to the TLS port: no MQTT answer, said in one line
        r = fleet_cli("devices", "--broker", f"mqtt://fleet-operator:op-secret@localhost:{b.port}")
        assert r.returncode == 2 and r.stdout == "", r.stdout
        assert r.stderr.count("\n") == 1 and "does not answer MQTT: a TLS listener?" in r.stderr, r.stderr
        # TLS without the private CA: the broker's certificate is not trusted
        r = fleet_cli("devices", "--broker", url)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "TLS certificate not trusted" in r.stderr and "--cafile" in r.stderr, r.stderr
    finally:
        agent.stop()
        b.stop()
    log = agent.output()
    assert "tandoor-agent: error" not in log, log[-2000:]


# --- canary abort on the canary's telemetry p95 (real agents) -----------------------------------------

def test_canary_aborts_when_its_telemetry_p95_is_over_the_budget(tmp_path, B):
    """Two real agents on v1. --health-frames 0: the device gate checks only the golden
    self-test, its committed ack carries no p95, so only the canary's telemetry after the swap can
    show the latency. A budget under that real p95 stops the rollout after the canary (the other
    device skipped, with the canary's measured number in the reason); a budget it fits lets the
    next job through to both."""
    devs = ("c1", "c2")
    with Broker(tmp_path / "broker") as b, Recorder(b.port, "tandoor/+/telemetry") as tel:
        procs = {}
        try:
            for dev in devs:
                sd = seed_slots(tmp_path / f"{dev}-slots", B["v1"], B["pub"])
                procs[dev] = AgentProcess(["--config", str(agent_config(tmp_path, dev, b.port, sd, B["pub"]))],
                                          tmp_path / f"{dev}.log")
            for dev in devs:
                running_sha(tel, dev, sha(B["v1"]), START_TIMEOUT)
            common = ["--devices", "c1,c2", "--canary", "50%", "--health-frames", "0", "--canary-soak", "2",
                      "--broker", f"mqtt://127.0.0.1:{b.port}", "--timeout", "180", "--json"]
            r = fleet_cli("deploy", str(B["v2"]), "--latency-budget-ms", "0.001", *common, timeout=300)
            assert r.returncode == 1, r.stderr
            out = json.loads(r.stdout)
            c1, c2 = out["devices"]["c1"], out["devices"]["c2"]
            assert c1["state"] == "committed" and c1["wave"] == "canary", c1
            assert "p95_ms" not in c1 and c1["health"]["p95_ms"] is None, c1  # the gate measured no latency
            assert c1["p95_source"] == "telemetry" and c1["p95_ms_seen"] > 0.001, c1
            # the number is the canary's own telemetry about v2, over the frames since the swap only
            mine = [m.json() for m in tel.on("tandoor/c1/telemetry") if m.json()["model"].get("sha256") == sha(B["v2"])]
            seen = [t for t in mine if t["latency_ms"]["inference"]["p95"] == c1["p95_ms_seen"]
                    and t["latency_ms"]["inference"]["count"] == c1["telemetry_frames"]]
            assert seen, (c1, [t["latency_ms"]["inference"] for t in mine])
            assert 0 < c1["telemetry_frames"] < seen[0]["frames"], "the latency window started over at the swap"
            want = (f"canary c1 p95 latency {c1['p95_ms_seen']:.3g} ms (its telemetry over {c1['telemetry_frames']} "
                    f"frame(s) since the swap) over the budget 0.001 ms")
            assert out["aborted"] == want
            assert c2 == {"state": "skipped", "reason": f"rollout aborted: {want}"}, c2
            assert out["counts"] == {"committed": 1, "skipped": 1}
            running_sha(tel, "c2", sha(B["v1"]))  # never offered the job
            # a budget the real p95 fits: the canary passes and the rest follow
            r = fleet_cli("deploy", str(B["v3"]), "--latency-budget-ms", "1000", *common, timeout=300)
            assert r.returncode == 0, r.stdout + r.stderr
            out = json.loads(r.stdout)
            assert out["aborted"] is None and out["counts"] == {"committed": 2}, out
            c1 = out["devices"]["c1"]
            assert c1["p95_source"] == "telemetry" and 0 < c1["p95_ms_seen"] <= 1000, c1
            for dev in devs:
                running_sha(tel, dev, sha(B["v3"]))
        finally:
            for p in procs.values():
                p.stop()


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


def test_canary_abort_names_the_p99_over_its_budget(tmp_path, B):
    """Agents whose gate reports a p99 of 30 ms but does not judge it (from before the p99 budget):
    the canary commits, and the host's canary check, reading the p99 from its health report,
    stops the rollout naming the p99 and its budget while the p95 is within its own; a p99 budget
    the canary fits lets the next job through."""
    sim = _load_sim()
    with Broker(tmp_path / "broker") as b:
        with sim.SimFleet(4, b.port, tmp_path, B["pub"], B["v1"], processes=1, gate_s=0.1, p95_ms=5.0, p99_ms=30.0,
                          gate_judges_p99=False):
            common = ["--all", "--canary", "25%", "--latency-budget-ms", "10", "--broker",
                      f"mqtt://127.0.0.1:{b.port}", "--timeout", "120", "--json"]
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v2"]), *common, "--p99-budget-ms", "20"],
                               capture_output=True, text=True, timeout=200)
            assert r.returncode == 1, r.stderr
            out = json.loads(r.stdout)
            c = out["devices"]["sim000"]
            assert c["state"] == "committed" and c["p95_ms_seen"] == 5.0 and c["p99_ms_seen"] == 30.0, c
            assert c["p95_source"] == "health gate", c
            assert out["aborted"] == "canary sim000 p99 latency 30 ms (its health gate) over the budget 20 ms", out
            assert all(out["devices"][f"sim{i:03d}"]["state"] == "skipped" for i in range(1, 4)), out["devices"]
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v3"]), *common, "--p99-budget-ms", "40"],
                               capture_output=True, text=True, timeout=200)
            out = json.loads(r.stdout)
            assert r.returncode == 0 and out["counts"] == {"committed": 4}, (r.stderr[-2000:], out.get("counts"))
            # a p99 budget under the p95 one is refused before anything is sent
            r = subprocess.run([str(BIN / "tandoor"), "fleet", "deploy", str(B["v3"]), *common, "--p99-budget-ms", "5"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and r.stderr.strip() == (
                "tandoor: error: --p99-budget-ms 5 is below --latency-budget-ms 10 (the p95 budget): a p99 is never "
                "under its p95"), r.stderr


def test_fleet_sim_smoke_10_agents(tmp_path, B):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fleet-sim.py"), "--agents", "10", "--processes", "2",
                        "--canary", "20", "--bundle", str(B["v2"]), "--seed-bundle", str(B["v1"]), "--pub",
                        str(B["pub"]), "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["counts"] == {"committed": 10} and res["waves"] == [2, 8]
    # each chunk went once per wave on the fleet-wide topic: every device got the bundle about once,
    # and the host sent about two bundles (one per wave) plus offers, not ten
    got = res["device_received"]
    assert 1.0 <= got["x_bundle_mean"] and got["x_bundle_max"] <= 1.1, got
    assert res["per_device"]["bytes_to"] < res["bundle_bytes"] / 2, res["per_device"]
    assert res["broker"]["bytes_sent"] and res["broker"]["bytes_sent"] > 10 * res["bundle_bytes"]


def test_fleet_sim_url_transport_10_agents(tmp_path, B):
    """The same with --transport url: the host's artifact server on 127.0.0.1, Range requests."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fleet-sim.py"), "--agents", "10", "--processes", "2",
                        "--canary", "20", "--transport", "url", "--bundle", str(B["v2"]), "--seed-bundle", str(B["v1"]),
                        "--pub", str(B["pub"]), "--json"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["counts"] == {"committed": 10} and res["transport"] == "url"
    assert 1.0 <= res["device_received"]["x_bundle_mean"] <= 1.1, res["device_received"]
    # the broker carried only the control plane: offers, acks
    assert res["broker"]["bytes_sent"] < 2 * res["bundle_bytes"], res["broker"]
