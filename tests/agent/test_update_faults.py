"""The device fails closed and recovers out loud (issue 30): real `tandoor-agent` processes, a real
mosquitto, real files, the agent's failpoints (TANDOOR_FAILPOINT) where a native library would
misbehave, a real tmpfs for a full disk.

- a damaged keyring never re-trusts a retired key; trust is decided at install, so a committed
  model keeps serving after its key is retired, and retiring the key of the only good model is
  refused unless forced
- every state.json recovery (truncated, zero bytes, garbage, an edited field, a directory in its
  place, it and its previous copy damaged) keeps the committed model and is published on status
  and telemetry; `tandoor fleet status` shows it
- the disk fills during the health gate: rolled back, kind no_space, no traceback, the next
  deploy commits at once
- a model that passes its gate and then crashes the agent: rolled_back [crash_loop] with the count
- a model that passes its gate and then hangs the agent's hot swap: rolled_back [swap_timeout]
  within the configured deadline, the old model serving throughout, the next deploy taken at once;
  a model that hangs inside the gate: rolled back at the configured gate timeout
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from support.agents import (START_TIMEOUT, AgentProcess, B, acks, agent_config, assert_committed_state,  # noqa: F401
                            broker, deploy, running_sha, seed_slots, serving_frames, start_agent, status_of, wd)
from support.bundle_edit import sha
from support.cli import BIN
from support.mosquitto import Recorder, available
from support.tmpfs import small_tmpfs
from tandoor_agent.update import slots
from tandoor_contract import hmod

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")


def tracebacks(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith("Traceback")]


def ask(rec: Recorder, dev: str, cmd: str, timeout: float = 30, **args) -> dict:
    """An MQTT 5 command and its response."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    corr = uuid.uuid4().bytes
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = f"tandoor/{dev}/response"
    props.CorrelationData = corr
    rec.publish(f"tandoor/{dev}/cmd", json.dumps({"cmd": cmd, "args": args}), properties=props)
    return rec.wait_for(lambda m: m.topic == f"tandoor/{dev}/response" and getattr(m.properties, "CorrelationData",
                                                                                    None) == corr,
                        timeout, f"the answer to {cmd}").json()


def key_op(port: int, dev: str, op: str, signer: Path, **kw) -> dict:
    from tandoor_fleet.rollout import Fleet

    with Fleet(f"mqtt://127.0.0.1:{port}") as f:
        return f.key_command([dev], op, signer, **kw)[dev]


# --- 1 and 2: keys ---------------------------------------------------------------------------------

def test_trust_is_decided_at_install_and_a_damaged_keyring_trusts_no_retired_key(wd, broker, B):
    """A device trusting k1 (its config) serves v1 (signed k1). Retiring k1 once k2 is added is
    refused while v1 is its only good model (the answer names the model), and accepted with
    force; after a restart v1 still serves (verified at install, by k1). A k2 bundle commits. Then
    keyring.json and its previous copy are garbage: after a restart the k2 bundle still serves,
    the status says the keyring was rebuilt and trusts the config's keys minus the retired k1
    (none), and a k1-signed bundle is refused as signed by a retired key."""
    dev = "keys30"
    d = B["pub"].parent
    fp1, fp2 = (hmod.key_fingerprint(hmod.load_public_key(d / f"{k}.pub.pem")) for k in ("k1", "k2"))
    sd = seed_slots(wd / f"{dev}-slots", B["v1"], B["pub"])
    cfg = agent_config(wd, dev, broker.port, sd, B["pub"])
    with Recorder(broker.port, f"tandoor/{dev}/#") as rec:
        a = start_agent(wd, dev, cfg, rec)
        try:
            r = key_op(broker.port, dev, "add-key", d / "k1.pem", public_key=d / "k2.pub.pem")
            assert r["ok"], r
            r = key_op(broker.port, dev, "retire-key", d / "k2.pem", fingerprint=fp1)
            assert r["ok"] is False and r["kind"] == "only_good_model", r
            assert [x["slot"] for x in r["affects"]] == ["a"] and r["affects"][0]["model"]["version"] == "1", r
            r = key_op(broker.port, dev, "retire-key", d / "k2.pem", fingerprint=fp1, force=True)
            assert r["ok"] and r["trusted"] == [fp2] and [x["slot"] for x in r["affects"]] == ["a"], r
        finally:
            a.stop()
        a = start_agent(wd, dev, cfg, rec, tag="-2")  # today: exit 14, its own bundle refused
        try:
            running_sha(rec, dev, sha(B["v1"]))
            out = deploy(broker.port, B["k2"], [dev], job_id="job-k2")["devices"][dev]
            assert out["state"] == "committed", out
        finally:
            a.stop()
        for name in ("keyring.json", "keyring.json.prev"):
            (sd / "keys" / name).write_bytes(b'{"added": ["' + fp2.encode() + b'"], "retir')
        a = start_agent(wd, dev, cfg, rec, tag="-3")
        try:
            st = running_sha(rec, dev, sha(B["k2"]))
            assert st["keyring"]["trusted"] == [] and st["keyring"]["retired"] == [fp1], st["keyring"]
            assert "rebuilt" in st["keyring"]["state"], st["keyring"]
            rec_keys = [x for x in st["recovered"] if x["damaged"] == "keys/keyring.json"]
            assert rec_keys and "not JSON" in rec_keys[0]["reason"], st["recovered"]
            out = deploy(broker.port, B["v4"], [dev], job_id="job-k1-after-damage",
                         allow_downgrade=True)["devices"][dev]
            assert out["state"] == "failed" and out["kind"] == "retired_key" and fp1 in out["reason"], out
            running_sha(rec, dev, sha(B["k2"]))
            assert not tracebacks(a.output())
        finally:
            a.stop()


# --- 3, 4, 5: a damaged state.json ---------------------------------------------------------------

@pytest.fixture(scope="module")
def deployed(wd, broker, B):
    """A slot directory where a real deploy committed v2 over v1 (so the acks journal knows it)."""
    dev = "st30"
    sd = seed_slots(wd / f"{dev}-slots", B["v1"], B["pub"])
    cfg = agent_config(wd, dev, broker.port, sd, B["pub"])
    with Recorder(broker.port, f"tandoor/{dev}/#") as rec:
        a = start_agent(wd, dev, cfg, rec)
        try:
            assert deploy(broker.port, B["v2"], [dev], job_id="job-st-v2")["devices"][dev]["state"] == "committed"
            serving_frames(rec, dev)  # served: its starts no longer count (the boot record is cleared)
        finally:
            a.stop()
    return sd


def _damage(sd: Path, how: str) -> None:
    state = sd / "state.json"
    good = state.read_bytes()
    if how == "truncated":
        state.write_bytes(good[: len(good) // 2])
    elif how == "zero bytes":
        state.write_bytes(b"")
    elif how == "garbage":
        state.write_bytes(b"\x00\xffnot a state\n" * 40)
    elif how == "edited field":  # valid JSON, every invariant holds: only the checksum knows
        state.write_bytes(good.replace(b'"version": "2"', b'"version": "9"', 1))
        assert state.read_bytes() != good
    elif how == "a directory":
        state.unlink()
        state.mkdir()
        (state / "x").write_text("in the way")
    elif how == "it and its previous copy":
        state.write_bytes(good[:100])
        (sd / "state.json.prev").write_bytes(b"\x00" * 64)


DAMAGES = ["truncated", "zero bytes", "garbage", "edited field", "a directory", "it and its previous copy"]


def test_every_state_recovery_keeps_the_committed_model_and_is_published(wd, broker, B, deployed):
    """For each damage, a copy of the slot directory (v2 committed by job-st-v2, v1 the previous
    good slot) is served by an agent: each comes up on v2, the committed one, never the older
    v1; its status and its telemetry carry `recovered` naming the damage, what it chose and what
    it marked bad (nothing here); no traceback; and `tandoor fleet status` shows it. The device
    whose state and previous copy were both lost then takes the next deploy at once."""
    devs = {how: f"rec30-{i}" for i, how in enumerate(DAMAGES)}
    procs: dict[str, AgentProcess] = {}
    with Recorder(broker.port, [f"tandoor/{d}/#" for d in devs.values()]) as rec:
        try:
            for how, dev in devs.items():
                sd = wd / f"{dev}-slots"
                shutil.copytree(deployed, sd)
                _damage(sd, how)
                cfg = agent_config(wd, dev, broker.port, sd, B["pub"])
                procs[how] = AgentProcess(["--config", str(cfg)], wd / f"{dev}.log")
            for how, dev in devs.items():
                try:
                    st = status_of(rec, dev, START_TIMEOUT, lambda s: s.get("state") == "running", f"{dev} running")
                except AssertionError:
                    raise AssertionError(f"{how}: {procs[how].output()[-2000:]}") from None
                assert st["model"]["sha256"] == sha(B["v2"]) and st["slot"] == "b", (how, st)
                assert len(st.get("recovered") or []) == 1, (how, st.get("recovered"))
                r = st["recovered"][0]
                assert r["damaged"] == "state.json" and r["reason"], (how, r)
                assert r["chose"]["slot"] == "b" and r["chose"]["sha256"] == sha(B["v2"]), (how, r)
                assert r["marked_bad"] == [] and r["kept_as"].startswith("state.json.corrupt-"), (how, r)
                assert (wd / f"{dev}-slots" / r["kept_as"]).exists(), (how, r)
                if how == "it and its previous copy":
                    assert "job-st-v2" in r["chose"]["how"], r  # the acks journal said so
                tel = rec.wait_for(lambda m: m.topic == f"tandoor/{dev}/telemetry", 30, f"{dev} telemetry").json()
                assert tel["recovered"] == st["recovered"], (how, tel.get("recovered"))
                assert_committed_state(wd / f"{dev}-slots", sha(B["v2"]))
            assert "a directory" in devs and (wd / f"{devs['a directory']}-slots" / "state.json").is_file()
            res = subprocess.run([str(BIN / "tandoor"), "fleet", "status", "--broker",
                                  f"mqtt://127.0.0.1:{broker.port}"], capture_output=True, text=True, timeout=60)
            line = next(ln for ln in res.stdout.splitlines() if ln.startswith(devs["truncated"] + " "))
            assert "recovered: state.json" in line and "serving slot b" in line, res.stdout
            dev = devs["it and its previous copy"]
            out = deploy(broker.port, B["v3"], [dev], job_id="job-st-after")["devices"][dev]
            assert out["state"] == "committed", out
            for how, p in procs.items():
                assert not tracebacks(p.output()), (how, p.output()[-3000:])
        finally:
            for p in procs.values():
                p.stop()


# --- 6: the disk fills during the health gate --------------------------------------------------

def test_the_disk_filling_during_the_health_gate_rolls_back_and_the_next_deploy_commits(wd, broker, B, tmp_path):
    """slot_dir on a tmpfs with room for two bundles; once the trial starts, another writer fills
    the disk: the commit cannot be written, so the trial is rolled back (kind no_space, one line,
    no traceback), v1 keeps serving, and once the space is freed the next deploy commits at once
    (no restart, no `busy`)."""
    size = B["v1"].stat().st_size
    filler = tmp_path / "tmpfs" / "filler"

    def fill() -> None:
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC

    with small_tmpfs(tmp_path / "tmpfs", 2 * size + size // 2 + slots.DEFAULT_RESERVE + 256 * 1024) as mnt:
        sd = seed_slots(mnt / "slots", B["v1"], B["pub"])
        dev = "full30"
        cfg = agent_config(wd, dev, broker.port, sd, B["pub"])
        with Recorder(broker.port, f"tandoor/{dev}/#") as rec:
            a = start_agent(wd, dev, cfg, rec)
            try:
                box = {}
                th = threading.Thread(target=lambda: box.update(deploy(broker.port, B["v2"], [dev], job_id="job-fill",
                                                                       timeout=90, health_frames=2000)))
                th.start()
                rec.wait_for(lambda m: m.topic.endswith("/update/ack") and m.json().get("state") == "trial", 60, "trial")
                fill()
                th.join(120)
                out = box["devices"][dev]
                assert out["state"] == "rolled_back" and out["kind"] == "no_space", out
                assert "running model is untouched" in out["reason"], out
                running_sha(rec, dev, sha(B["v1"]))
                serving_frames(rec, dev)
                st = assert_committed_state(sd, sha(B["v1"]))
                assert st["slots"]["b"]["state"] == "bad", st["slots"]["b"]
                filler.unlink()
                out = deploy(broker.port, B["v3"], [dev], job_id="job-after-fill", timeout=60)["devices"][dev]
                assert out["state"] == "committed", out   # not refused "busy", within the deploy's 60 s
                running_sha(rec, dev, sha(B["v3"]))
                assert not tracebacks(a.output()), a.output()[-3000:]
            finally:
                a.stop()


# --- 7 and 8: models that misbehave only after their gate ----------------------------------------

def test_a_model_that_crashes_the_agent_after_its_gate_is_reported_rolled_back_crash_loop(wd, broker, B):
    """v2 passes its gate (in the gate's child) and then kills the agent natively (SIGSEGV at the
    failpoint where its library loads) at the hot swap and at every start. Restarted as systemd
    would, the agent rolls it back after the third death and serves v1; the deploy's final answer
    is rolled_back [crash_loop] with the count, never an internal error."""
    dev = "crash30"
    sd = seed_slots(wd / f"{dev}-slots", B["v1"], B["pub"])
    cfg = agent_config(wd, dev, broker.port, sd, B["pub"])
    env = {"TANDOOR_FAILPOINT": f"agent:build=crash@{sha(B['v2'])[:16]}"}
    deaths = []
    with Recorder(broker.port, f"tandoor/{dev}/#") as rec:
        a = start_agent(wd, dev, cfg, rec, env=env)
        box = {}
        th = threading.Thread(target=lambda: box.update(deploy(broker.port, B["v2"], [dev], job_id="job-crash",
                                                               timeout=120)))
        th.start()
        try:
            for start in range(1, 6):
                deadline = time.monotonic() + START_TIMEOUT
                while a.proc.poll() is None and th.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not th.is_alive():
                    break
                assert a.proc.poll() is not None, "the agent neither died nor answered"
                deaths.append(a.stop())
                a = AgentProcess(["--config", str(cfg)], wd / f"{dev}-{start}.log", env=env)  # systemd's restart
            th.join(60)
            out = box["devices"][dev]
            assert out["state"] == "rolled_back" and out["kind"] == "crash_loop", out
            assert out.get("attempts") == 3 and "3 starts in a row" in out["reason"], out
            assert deaths == [-11] * 3, deaths
            running_sha(rec, dev, sha(B["v1"]))
            assert_committed_state(sd, sha(B["v1"]))
            finals = [x for x in acks(rec, dev, "job-crash") if x["state"] in ("committed", "rolled_back", "failed")]
            assert [(x["state"], x.get("kind")) for x in finals] == [("rolled_back", "crash_loop")], finals
        finally:
            a.stop()


# Deadlines short enough to keep the test quick, long enough that a healthy bundle's gate (a fresh
# Python importing the runtime) and hot swap finish on a 2-core CI machine under full load: 4 s
# timed out a healthy gate at load average 12.
SWAP_S, GATE_S = 8.0, 20.0


def test_a_model_that_hangs_after_or_inside_its_gate_is_rolled_back_at_its_deadline(wd, broker, B):
    """v2 passes its gate and then its load never returns in the agent (the failpoint where its
    library loads, in the hot swap's build): at update.swap_timeout_s the swap is given up, the
    commit rolled back (kind swap_timeout), v1 serves on in the same process, state.json agrees,
    and the next deploy (v3) commits at once. v4 hangs inside the gate's child: rolled back at
    update.health_timeout_s, not 300 s."""
    dev = "hang30"
    sd = seed_slots(wd / f"{dev}-slots", B["v1"], B["pub"])
    cfg = agent_config(wd, dev, broker.port, sd, B["pub"], update={"swap_timeout_s": SWAP_S, "health_timeout_s": GATE_S})
    env = {"TANDOOR_FAILPOINT": f"agent:build=hang@{sha(B['v2'])[:16]},agent:health-load=hang@{sha(B['v4'])[:16]}"}
    with Recorder(broker.port, f"tandoor/{dev}/#") as rec:
        a = start_agent(wd, dev, cfg, rec, env=env)
        session = rec.wait_for(lambda m: m.topic.endswith("/status"), 10).json()["session"]
        try:
            out = deploy(broker.port, B["v2"], [dev], job_id="job-hang", timeout=90)["devices"][dev]
            assert out["state"] == "rolled_back" and out["kind"] == "swap_timeout", out
            assert f"{SWAP_S:g} s" in out["reason"], out
            st = running_sha(rec, dev, sha(B["v1"]))
            assert st["session"] == session  # no restart
            serving_frames(rec, dev)
            s = assert_committed_state(sd, sha(B["v1"]))
            assert s["slots"]["b"]["state"] == "bad" and s.get("boot") is None, s
            t0 = time.monotonic()
            out = deploy(broker.port, B["v3"], [dev], job_id="job-after-hang", timeout=90)["devices"][dev]
            assert out["state"] == "committed", out
            running_sha(rec, dev, sha(B["v3"]))
            out = deploy(broker.port, B["v4"], [dev], job_id="job-gate-hang", timeout=90)["devices"][dev]
            assert out["state"] == "rolled_back" and out["kind"] == "unhealthy", out
            assert f"timed out after {GATE_S:g} s" in out["reason"], out
            assert time.monotonic() - t0 < 120  # the configured deadline, not the 300 s ceiling
            running_sha(rec, dev, sha(B["v3"]))
            up = ask(rec, dev, "update-status")["result"]
            assert up["busy"] is None and up["deadlines"]["swap_timeout_s"] == SWAP_S, up
            assert not tracebacks(a.output()), a.output()[-3000:]
        finally:
            a.stop()
