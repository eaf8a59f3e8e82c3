"""Real agents for service and update tests: processes, their config files, what they publish.

    AGENT, START_TIMEOUT          how an agent is started, and how long its start may take
    write_config(path, ...)       an agent.toml from keyword sections
    AgentProcess                  a real `tandoor-agent` process with its log; stop/kill with signals
    NotifySocket                  a unix datagram socket as systemd's NOTIFY_SOCKET
    status_of(rec, dev, ...)      wait for a (retained) status message that satisfies a predicate
    make_bundles, seed_slots, agent_config, running_sha   update-test bundles and devices
    start_agent, deploy, acks, serving_frames, assert_committed_state   an update test's steps and checks
    fixtures wd, broker, B         a module's work dir, mosquitto and make_bundles' bundles
                                   (``from support.agents import B, broker, wd``)
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tandoor_agent.update import slots
from tandoor_agent.update.slots import SlotStore
from tandoor_contract import hmod

from .bundle_edit import npy, rewrite, sha, version
from .cli import BIN, compiled
from .mosquitto import Broker, Recorder

AGENT = os.environ.get("TANDOOR_AGENT", "").split() or [str(BIN / "tandoor-agent")]
START_TIMEOUT = 180  # importing TVM on a busy 2-core CI machine
CHUNK = 16 * 1024    # update tests send bundles in chunks this size: several chunks even for a small bundle


def write_config(path: Path, **sections) -> Path:
    """sections: top-level keys, plus broker={...}, camera={...} tables."""
    lines, tables = [], []
    for k, v in sections.items():
        (tables if isinstance(v, dict) else lines).append((k, v))
    out = [f"{k} = {json.dumps(v)}" for k, v in lines]
    for name, table in tables:
        out.append(f"[{name}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    path.write_text("\n".join(out) + "\n")
    return path


class NotifySocket:
    """What systemd listens on for sd_notify: a unix datagram socket; records every message
    (monotonic time, text) and lets a test wait for one."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            with self._cond:
                self.messages.append((time.monotonic(), data.decode()))
                self._cond.notify_all()

    def states(self, key: str) -> list[float]:
        """When each message carrying ``key`` (e.g. "READY=1") came."""
        with self._cond:
            return [t for t, m in self.messages if f"{key}\n" in m + "\n"]

    def wait_for(self, key: str, after: float = 0.0, timeout: float = 30.0, count: int = 1) -> list[float]:
        """Wait until ``count`` messages carrying ``key`` came after ``after`` (monotonic); their times."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = [t for t, m in self.messages if t > after and f"{key}\n" in m + "\n"]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {count} x {key} within {timeout:g} s; got {self.messages[-5:]}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop = True
        self._t.join(2)
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)  # so the next agent of a test can bind it again


class AgentProcess:
    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        self._f = open(log, "wb")
        self.proc = subprocess.Popen([*AGENT, *args], stdout=self._f, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._f.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._f.close()


def status_of(rec: Recorder, device: str, timeout: float, pred=lambda s: True, what="status"):
    return rec.wait_for(lambda m: m.topic == f"tandoor/{device}/status" and pred(m.json()), timeout, what).json()


def make_bundles(bundles_dir: Path, d: Path) -> dict[str, Path]:
    """dynamic_batch (1x3x32x32, host + aarch64) by the real CLI; versions signed with k1; a bundle
    signed with k2; an aarch64-only one; one whose golden output is off (re-signed)."""
    from tandoor_zoo import models as zoo

    d.mkdir(parents=True, exist_ok=True)
    for k in ("k1", "k2"):
        if not (d / f"{k}.pem").exists():
            hmod.generate_keypair(d / f"{k}.pem", d / f"{k}.pub.pem")
    base = compiled("dynamic_batch", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32")
    k1 = d / "k1.pem"
    out = {f"v{i}": rewrite(base, d / f"v{i}.hmod", version(str(i)), k1) for i in range(1, 6)}
    out["k2"] = rewrite(base, d / "k2.hmod", version("99"), d / "k2.pem")
    here = hmod.machine_arch()

    def other_arch_only(man, members):
        for t in [t for t, v in man["targets"].items() if hmod.normalize_arch(v["arch"]) == here]:
            v = man["targets"].pop(t)
            members.pop(v["lib"], None)
            fb = v.get("fallback")
            for m in (fb.values() if isinstance(fb, dict) else [fb] if fb else []):
                members.pop(m, None)
        man["model"]["version"] = "arm-only"

    out["arm"] = rewrite(base, d / "arm.hmod", other_arch_only, k1)

    def tamper_golden(man, members):
        name = man["golden"][0]["outputs"][0]
        a = np.load(io.BytesIO(members[name]), allow_pickle=False).copy()
        a.flat[3] += 0.31
        members[name] = npy(a)
        man["model"]["version"] = "bad-golden"

    out["bad_golden"] = rewrite(base, d / "bad_golden.hmod", tamper_golden, k1)
    out["pub"] = d / "k1.pub.pem"
    return out


def int8_bundle(bundles_dir: Path, d: Path, version_: str, key: Path) -> Path:
    """A QDQ INT8 bundle (tests/support/qdq.py's small CNN, per-channel, int8 orders; host +
    aarch64) of the same 1x3x32x32 input as make_bundles' ones, signed with ``key``."""
    from .qdq import quantized_small_cnn

    d.mkdir(parents=True, exist_ok=True)
    _, q = quantized_small_cnn(d)
    base = compiled("small_int8_update", q, bundles_dir, "--policy", "all")
    return rewrite(base, d / f"int8-v{version_}.hmod", version(version_), key)


def seed_slots(slot_dir: Path, bundle: Path, pub: Path) -> Path:
    store = SlotStore(slot_dir)
    store.install(bundle, "seed", [pub])
    store.commit("seeded by the test")
    return slot_dir


def agent_config(wd: Path, dev: str, port: int, slot_dir: Path, pub: Path, broker: dict | None = None,
                 **tables) -> Path:
    """An update test's device: its slot dir, the test key, a synthetic camera; ``broker``
    entries and other tables (``update={...}``) on top."""
    return write_config(wd / f"{dev}.toml", device_id=dev, slot_dir=str(slot_dir), trusted_keys=[str(pub)],
                        delegate="onnxruntime", telemetry_period_s=1.0, results_max_rate_hz=5.0,
                        broker={"port": port, "reconnect_min_s": 0.5, "reconnect_max_s": 2.0, "keepalive_s": 10,
                                **(broker or {})},
                        camera={"source": "synthetic:64x48@20"}, **tables)


def running_sha(rec: Recorder, dev: str, want: str, timeout: float = 60) -> dict:
    """The device's (retained) status says it serves ``want``: a fresh subscriber each time."""
    with Recorder(rec.port, f"tandoor/{dev}/status") as fresh:
        return status_of(fresh, dev, timeout, lambda s: s.get("online") and s.get("state") == "running"
                         and (s.get("model") or {}).get("sha256") == want, f"{dev} serving {want[:12]}")


def start_agent(wd: Path, dev: str, cfg: Path, rec: Recorder, env: dict | None = None, tag: str = "") -> AgentProcess:
    """An agent started with ``cfg``, once its retained status says it runs (``rec`` is cleared first)."""
    rec.clear()
    a = AgentProcess(["--config", str(cfg)], wd / f"{dev}{tag}.log", env=env)
    status_of(rec, dev, START_TIMEOUT, lambda s: s.get("state") == "running" and s.get("online"), f"{dev} running")
    return a


def deploy(port: int, bundle: Path, devices: list[str], timeout: float = 240, **kw) -> dict:
    """A rollout from the host side (tandoor_fleet), as `tandoor fleet deploy` runs it."""
    from tandoor_fleet import rollout

    f = rollout.Fleet(f"mqtt://127.0.0.1:{port}").connect()
    try:
        return rollout.deploy(f, bundle, devices, timeout=timeout, chunk_size=kw.pop("chunk_size", CHUNK), **kw)
    finally:
        f.close()


def serving_frames(rec: Recorder, dev: str, timeout: float = 30) -> None:
    """Frames keep flowing: results published after this point."""
    t = time.time()
    rec.wait_for(lambda m: m.topic == f"tandoor/{dev}/results" and m.t > t, timeout, f"{dev} results")


def acks(rec: Recorder, dev: str, job: str) -> list[dict]:
    return [m.json() for m in rec.on(f"tandoor/{dev}/update/ack") if m.json().get("job_id") == job]


def assert_committed_state(slot_dir: Path, want_sha: str) -> dict:
    """state.json is sound, no trial, and its primary is the bundle ``want_sha``, on disk."""
    st = json.loads((slot_dir / "state.json").read_text())
    slots.check_state(st)
    assert st["trial"] is None and st["primary"] in ("a", "b"), st
    assert all(s["state"] in ("good", "bad", "empty") for s in st["slots"].values()), st
    assert st["slots"][st["primary"]]["sha256"] == want_sha
    assert sha(slot_dir / st["primary"] / "model.hmod") == want_sha
    return st


# --- module fixtures of the update tests ------------------------------------------------------------

@pytest.fixture(scope="module")
def wd(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def broker(wd):
    b = Broker(wd / "broker").start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def B(bundles_dir, tmp_path_factory):  # noqa: N802 (the bundles, by the name the tests index)
    return make_bundles(bundles_dir, tmp_path_factory.mktemp("bundles"))
