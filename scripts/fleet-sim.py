#!/usr/bin/env python
"""Simulate a fleet taking a canary rollout through one mosquitto.

    .venv/bin/python scripts/fleet-sim.py --agents 100 --processes 4 --canary 10 --docs

Each simulated agent is a real paho MQTT client running the real device side of the update
protocol (agent/update/jobs.py: job offer, chunk checks, need, acks) with its own SlotStore in a temp
directory (install verifies the signature, hashes, format and arch, moves the bundle into the
inactive slot, commit/rollback for real). What is simulated is only the model: the health gate
does no inference (it sleeps ``--gate-s`` and reports a fixed p95 and p99), and the "hot swap" republishes
the retained status with the new model. The agents run in ``--processes`` worker processes.

The host side is the real fleet/rollout.py (what `tandoor fleet deploy` runs): canaries, then
the rest in waves, over ``--transport mqtt`` (chunks once per wave on the fleet-wide topic) or
``url`` (the host serves the bundle over HTTP on 127.0.0.1, the agents fetch it with Range
requests). Recorded: time to full rollout, what each agent was delivered (bytes, over the
bundle's size), messages and bytes the host sent per device, the host's CPU, the broker's $SYS
counters over the rollout, and the mosquitto process' CPU (psutil). ``--pad-kb`` makes the
bundle bigger (a listed member of random bytes). ``--docs`` appends the numbers to
docs/benchmarks.md ("Fleet rollout").
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
P99_OVER_P95 = 1.25   # the simulated gate's p99 when none is given: a steady model's tail
sys.path.insert(0, str(ROOT / "tests"))


# ------------------------------------------------------------------------------ device side
class SimDevice:
    """One simulated agent: paho client + Updater + SlotStore, no inference."""

    def __init__(self, dev: str, host: str, port: int, slot_dir: Path, pub: Path, seed: Path | None,
                 prefix: str = "tandoor", gate_s: float = 0.2, p95_ms: float = 5.0, fail_gate: bool = False,
                 p99_ms: float | None = None, gate_judges_p99: bool = True, username: str | None = None, password: str | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from tandoor_agent.update.slots import SlotStore
        from tandoor_agent.update.jobs import Updater

        self.dev, self.host, self.port = dev, host, port
        self.base = f"{prefix}/{dev}"
        self.gate_s, self.p95_ms, self.fail_gate = gate_s, p95_ms, fail_gate
        self.p99_ms = p99_ms if p99_ms is not None else p95_ms * P99_OVER_P95
        self.gate_judges_p99 = gate_judges_p99   # False: an agent from before the p99 budget (reports, never judges it)
        self.store = SlotStore(slot_dir, [pub])
        if seed is not None and self.store.primary_bundle() is None:
            self.store.install(seed, "seed", [pub])
            self.store.commit("seeded")
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sim-{dev}", protocol=mqtt.MQTTv5)
        if username:
            self.c.username_pw_set(username, password)
        self.c.reconnect_delay_set(0.5, 4)
        self.connected = threading.Event()
        self.c.on_connect = self._on_connect
        self.c.on_message = self._on_message
        self.received = {"messages": 0, "bytes": 0}  # update messages and their payload bytes, as delivered
        self.updater = Updater(self.store, self.base, self._publish, trusted_keys=[pub], gate=self._gate,
                               swap=self._swap, device_id=dev, need_interval_s=2.0,
                               subscribe=lambda t: self.c.subscribe(t, qos=1), unsubscribe=self.c.unsubscribe)
        self.updater.recover()
        self.c.will_set(f"{self.base}/status", json.dumps({"online": False, "device_id": dev}), qos=1, retain=True)

    def _on_message(self, client, userdata, m) -> None:
        if self.updater.wants(m.topic):
            self.received["messages"] += 1
            self.received["bytes"] += len(m.payload)
            self.updater.on_message(m.topic, m.payload, getattr(m, "properties", None))

    def _publish(self, topic, payload, qos, retain):
        self.c.publish(topic, payload, qos=qos, retain=retain)

    def status(self) -> dict:
        st = self.store.load()
        p = st["primary"]
        m = dict(st["slots"][p]["model"] or {}) if p else {}
        if p:
            m["sha256"] = st["slots"][p]["sha256"]
        return {"online": True, "device_id": self.dev, "state": "running", "model": m, "slot": p,
                "agent_version": "sim", "ts": round(time.time(), 3)}

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        if reason.is_failure:
            return
        for t in self.updater.subscriptions:
            client.subscribe(t, qos=1)
        client.publish(f"{self.base}/status", json.dumps(self.status()), qos=1, retain=True)
        self.connected.set()
        self.updater.on_connected()

    def _gate(self, store, keys, latency_budget_ms=None, frames=20, delegate=None, p99_budget_ms=None, **kw):
        """The verdict, as health.gate returns it (the job settles the trial on it)."""
        from tandoor_agent.update.health import HealthReport

        time.sleep(self.gate_s)
        if self.fail_gate:
            return HealthReport(ok=False, reason="golden self-test failed: simulated failure", frames=frames)
        rep = HealthReport(ok=True, golden_ok=True, golden_max_abs_err=0.0, p95_ms=self.p95_ms,
                           p99_ms=self.p99_ms, median_ms=self.p95_ms * 0.8, frames=frames,
                           latency_budget_ms=latency_budget_ms, p99_budget_ms=p99_budget_ms)
        if latency_budget_ms is not None and self.p95_ms > latency_budget_ms:
            rep.ok, rep.reason = False, f"p95 latency {self.p95_ms:g} ms over budget {latency_budget_ms:g} ms"
        elif self.gate_judges_p99 and p99_budget_ms is not None and self.p99_ms > p99_budget_ms:
            rep.ok, rep.reason = False, f"p99 latency {self.p99_ms:g} ms over budget {p99_budget_ms:g} ms"
        return rep

    def _swap(self, timeout_s: float = 0.0) -> None:
        self.c.publish(f"{self.base}/status", json.dumps(self.status()), qos=1, retain=True)

    def start(self) -> SimDevice:
        """Connect (the worker's NetLoop then drives the client)."""
        self.updater.start()
        self.c.connect(self.host, self.port, 30, clean_start=True)
        return self

    def stop(self) -> None:
        self.updater.stop()
        self.c.publish(f"{self.base}/status", json.dumps({"online": False, "device_id": self.dev}), qos=1,
                       retain=True)
        self.c.disconnect()


class NetLoop:
    """One thread drives every paho client of a worker process (select over their sockets),
    instead of a network thread per client: hundreds of threads on two cores spend their time
    handing the GIL around, which a real fleet (one agent per board) never does."""

    def __init__(self, devs: list[SimDevice]) -> None:
        self.devs = devs
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="sim-netloop", daemon=True)

    def start(self) -> NetLoop:
        self._t.start()
        return self

    def _run(self) -> None:
        import select

        last_misc = 0.0
        while not self._stop.is_set():
            socks = {}
            for d in self.devs:
                s = d.c.socket()
                if s is not None:
                    socks[s] = d
            want_w = [s for s, d in socks.items() if d.c.want_write()]
            try:
                r, w, _ = select.select(list(socks), want_w, [], 0.05)
            except (OSError, ValueError):
                continue
            for s in r:
                socks[s].c.loop_read(10)
            for s in w:
                socks[s].c.loop_write()
            now = time.monotonic()
            if now - last_misc > 1.0:
                last_misc = now
                for d in self.devs:
                    if d.c.socket() is None:
                        try:
                            d.c.reconnect()
                        except OSError:
                            pass
                    else:
                        d.c.loop_misc()

    def stop(self, drain_s: float = 2.0) -> None:
        time.sleep(drain_s)  # let the last publishes out
        self._stop.set()
        self._t.join(5)


def worker(args) -> int:
    ids = args.ids.split(",")
    fail = set(filter(None, (args.fail or "").split(",")))
    devs = [SimDevice(d, args.host, args.port, Path(args.slot_root) / d, Path(args.pub), Path(args.seed),
                      gate_s=args.gate_s, p95_ms=args.p95_ms, p99_ms=args.p99_ms, fail_gate=d in fail,
                      gate_judges_p99=not args.gate_ignores_p99) for d in ids]
    for d in devs:
        d.start()
    net = NetLoop(devs).start()
    for d in devs:
        d.connected.wait(30)
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    for d in devs:
        d.stop()
    net.stop()
    print(json.dumps({d.dev: {**d.received, "downloaded": d.updater.counters["chunks"] if d.updater.counters["downloads"]
                              else 0} for d in devs}), flush=True)
    return 0


class SimFleet:
    """``n`` simulated agents in ``processes`` worker processes (context manager)."""

    def __init__(self, n: int, port: int, workdir: Path, pub: Path, seed: Path, processes: int = 4,
                 gate_s: float = 0.2, p95_ms: float = 5.0, fail: set[str] = frozenset(), prefix: str = "sim",
                 p99_ms: float | None = None, gate_judges_p99: bool = True) -> None:
        self.ids = [f"{prefix}{i:03d}" for i in range(n)]
        self.port, self.dir, self.pub, self.seed = port, Path(workdir), pub, seed
        self.processes = max(1, min(processes, n))
        self.gate_s, self.p95_ms, self.fail = gate_s, p95_ms, fail
        self.p99_ms = p99_ms if p99_ms is not None else p95_ms * P99_OVER_P95
        self.gate_judges_p99 = gate_judges_p99
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> SimFleet:
        groups = [self.ids[i::self.processes] for i in range(self.processes)]
        for k, g in enumerate(groups):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--port", str(self.port),
                   "--ids", ",".join(g), "--slot-root", str(self.dir / "slots"), "--pub", str(self.pub),
                   "--seed", str(self.seed), "--gate-s", str(self.gate_s), "--p95-ms", str(self.p95_ms),
                   "--p99-ms", str(self.p99_ms), *([] if self.gate_judges_p99 else ["--gate-ignores-p99"]),
                   "--fail", ",".join(sorted(self.fail))]
            log = open(self.dir / f"worker{k}.log", "wb")
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        for p in self.procs:
            line = p.stdout.readline()
            if b"ready" not in line:
                raise RuntimeError(f"a simulator worker did not start: {line!r}; see {self.dir}/worker*.log")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
            except Exception:
                pass
        self.received: dict[str, dict] = {}  # per device: update messages and bytes it was delivered
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
            for line in p.stdout.read().decode(errors="replace").splitlines():
                if line.startswith("{"):
                    self.received.update(json.loads(line))


# -------------------------------------------------------------------------------- host side
def make_bundles(d: Path, pad_bytes: int = 0) -> dict[str, Path]:
    """A small real bundle (zoo dynamic_batch, 1x3x32x32, host + aarch64) as v1 and v2, signed;
    ``pad_bytes`` of random bytes in a listed member (``padding.bin``) make it that much bigger
    (a larger bundle with the same model: the transfer is what scales)."""
    from tandoor_contract import hmod
    from tandoor_zoo import models as zoo

    d.mkdir(parents=True, exist_ok=True)
    hmod.generate_keypair(d / "k.pem", d / "k.pub.pem")
    base = d / "base.hmod"
    subprocess.run([str(Path(sys.executable).parent / "tandoor"), "compile", str(zoo.dynamic_batch()), "-o", str(base),
                    "--target", "aarch64", "-q", "--input", "input=1x3x32x32"], check=True)
    out = {"pub": d / "k.pub.pem"}
    for v in ("1", "2"):
        with zipfile.ZipFile(base) as z:
            man = json.loads(z.read(hmod.MANIFEST))
            members = {n: z.read(n) for n in man["files"]}
        man.pop("files")
        man["model"]["version"] = v
        if pad_bytes:
            import os

            members["padding.bin"] = os.urandom(pad_bytes)
        hmod.write_bundle(d / f"v{v}.hmod", man, members, private_key=d / "k.pem")
        out[f"v{v}"] = d / f"v{v}.hmod"
    return out


class SysWatch:
    """$SYS counters of mosquitto (sys_interval 1) and its process CPU via psutil."""

    KEYS = ("messages/received", "messages/sent", "bytes/received", "bytes/sent", "clients/connected",
            "publish/messages/received", "publish/messages/sent")

    def __init__(self, port: int, pid: int) -> None:
        import paho.mqtt.client as mqtt
        import psutil
        from paho.mqtt.enums import CallbackAPIVersion

        self.vals: dict[str, float] = {}
        self.cycles: list[float] = []  # when bytes/sent arrived: once per $SYS cycle (the $SYS
                                       # messages to us change it, so it is always republished)
        self._cv = threading.Condition()
        self.proc = psutil.Process(pid)
        self.cpu_samples: list[float] = []
        self._stop = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sim-syswatch")
        self.c.on_connect = lambda c, *a: c.subscribe("$SYS/broker/#")
        self.c.on_message = self._msg
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.proc.cpu_percent(None)
        threading.Thread(target=self._sample, daemon=True).start()

    def _msg(self, c, u, m) -> None:
        k = m.topic[len("$SYS/broker/"):]
        try:
            v = float(m.payload.decode().split()[0])
        except (ValueError, IndexError):
            return
        with self._cv:
            self.vals[k] = v
            if k == "bytes/sent":
                self.cycles.append(time.monotonic())
            self._cv.notify_all()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.cpu_samples.append(self.proc.cpu_percent(None))
            except Exception:
                return

    def snapshot(self, timeout: float = 10.0) -> dict:
        """The counters as the broker computes them after now: waits until two $SYS cycles have
        arrived after this call (mosquitto republishes only changed values, and on a busy machine a
        cycle can arrive late; a stale value would leave the rollout's traffic out of the delta;
        the second cycle is complete by the time it starts)."""
        t0 = time.monotonic()
        with self._cv:
            self._cv.wait_for(lambda: sum(t > t0 for t in self.cycles) >= 2, timeout)
            vals = {k: self.vals.get(k) for k in self.KEYS}
        t = self.proc.cpu_times()
        return {"t": time.monotonic(), "cpu_s": t.user + t.system, **vals}

    def close(self) -> None:
        self._stop.set()
        self.c.disconnect()
        self.c.loop_stop()


def run_sim(args) -> dict:
    from support.mosquitto import Broker

    from tandoor_fleet import rollout
    from tandoor_fleet.rollout import Fleet

    work = Path(tempfile.mkdtemp(prefix="tnd-fleetsim-"))
    try:
        if args.bundle:
            B = {"v1": Path(args.seed_bundle or args.bundle), "v2": Path(args.bundle), "pub": Path(args.pub)}
        else:
            B = make_bundles(work / "bundles", pad_bytes=int(args.pad_kb * 1024))
        extra = ("sys_interval 1\nmax_queued_messages 100000\nmax_inflight_messages 100\n"
                 "max_packet_size 1048576\n")
        broker = Broker(work / "broker", extra_config=extra).start()
        try:
            t_boot = time.monotonic()
            with SimFleet(args.agents, broker.port, work, B["pub"], B["v1"], processes=args.processes,
                          gate_s=args.gate_s, p95_ms=args.p95_ms, p99_ms=args.p99_ms,
                          fail=set(args.fail.split(",")) if args.fail else set()) as sim:
                boot_s = time.monotonic() - t_boot
                watch = SysWatch(broker.port, broker.proc.pid)
                f = Fleet(f"mqtt://127.0.0.1:{broker.port}", window=args.window).connect()
                try:
                    online = {d for d, s in f.devices(wait=1.5).items() if s.get("online")}
                    if len(online) < args.agents:
                        raise RuntimeError(f"only {len(online)} of {args.agents} simulated agents are online")
                    before = watch.snapshot()
                    cpu0 = time.process_time()
                    lines = []
                    t0 = time.monotonic()

                    def progress(m):
                        line = f"[{time.monotonic() - t0:6.1f}s] {m}"
                        lines.append(line)
                        if args.verbose or "wave" in m or "canary" in m or "abort" in m:
                            print(line, file=sys.stderr, flush=True)

                    res = rollout.deploy(f, B["v2"], sim.ids, canary_pct=args.canary, max_failures=args.max_failures,
                                         latency_budget_ms=args.latency_budget_ms, p99_budget_ms=args.p99_budget_ms,
                                         timeout=args.timeout,
                                         chunk_size=args.chunk_size, wave_size=args.wave_size, progress=progress,
                                         transport=args.transport,
                                         serve="127.0.0.1:0" if args.transport == "url" else None)
                    host_cpu = time.process_time() - cpu0
                    after = watch.snapshot()
                    per = {d: f.per_device.get(d, {}) for d in sim.ids}
                finally:
                    f.close()
                    watch.close()
        finally:
            broker.stop()
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    n = len(sim.ids)
    wall = after["t"] - before["t"]

    def delta(k):
        a, b = after.get(k), before.get(k)
        return None if a is None or b is None else a - b

    def mean(k):
        vals = [p.get(k, 0) for p in per.values()]
        return sum(vals) / max(1, len(vals))

    got = [sim.received.get(d, {}) for d in sim.ids]
    if args.transport == "url":  # over HTTP: what the host's artifact server sent, per device
        dev_bytes = [res["artifact_server"]["bytes"] / n] * n
    else:
        dev_bytes = [g.get("bytes", 0) for g in got]
    finals = [r.get("t_final") for r in res["devices"].values() if r.get("t_final") is not None]
    canary = [r.get("t_final") for r in res["devices"].values() if r.get("wave") == "canary" and r.get("t_final")]
    cpu = watch.cpu_samples
    return {
        "agents": n, "processes": args.processes, "bundle_bytes": res["size"], "chunk_size": args.chunk_size,
        "n_chunks": res["n_chunks"], "canary_pct": args.canary, "waves": res["waves"], "counts": res["counts"],
        "aborted": res["aborted"], "boot_s": round(boot_s, 1),
        "rollout_s": res["seconds"], "canary_done_s": max(canary) if canary else None,
        "first_commit_s": min(finals) if finals else None, "last_commit_s": max(finals) if finals else None,
        "transport": args.transport,
        "device_received": {"bytes_mean": round(sum(dev_bytes) / max(1, n)), "bytes_max": round(max(dev_bytes or [0])),
                            "x_bundle_mean": round(sum(dev_bytes) / max(1, n) / res["size"], 3),
                            "x_bundle_max": round(max(dev_bytes or [0]) / res["size"], 3),
                            "messages_mean": round(sum(g.get("messages", 0) for g in got) / max(1, n), 1)},
        "host_cpu_s": round(host_cpu, 2),
        "per_device": {"messages_to": round(mean("messages_out"), 1), "bytes_to": round(mean("bytes_out")),
                       "messages_from": round(mean("messages_in"), 1), "bytes_from": round(mean("bytes_in"))},
        "broker": {"messages_received": delta("messages/received"), "messages_sent": delta("messages/sent"),
                   "bytes_received": delta("bytes/received"), "bytes_sent": delta("bytes/sent"),
                   "seconds": round(wall, 2), "cpu_s": round(after["cpu_s"] - before["cpu_s"], 2),
                   "cpu_pct_mean": round(100 * (after["cpu_s"] - before["cpu_s"]) / wall, 1) if wall else None,
                   "cpu_pct_peak": round(max(cpu), 1) if cpu else None},
        "gate_s": args.gate_s,
    }


HEADER = """
## Fleet rollout

`scripts/fleet-sim.py` starts a local mosquitto 2.0 ($SYS every 1 s) and N simulated agents in a few
processes, each a real paho MQTT 5 client running the real device side of the update protocol
(`agent/update/jobs.py`: offer, per-chunk sha256, need, acks) with its own `SlotStore` in a temp dir
(install verifies signature, hashes, format and arch, moves the bundle into the inactive slot, commits
for real). Only the model is simulated: the health gate sleeps `--gate-s` instead of running inference
(the real gate takes ~7-10 s for this model in its child process on this box). The host is the real
`fleet/rollout.py` (what `tandoor fleet deploy` runs): canaries, their final acks, then the rest.
Bundle: the zoo's dynamic_batch (1x3x32x32, host + aarch64 libs), compiled and signed by the script.
Everything (agents, host, broker, other jobs) shares 2 vCPUs. Per-device numbers are what the host
counted on that device's topics; broker numbers are $SYS deltas over the rollout (so they include the
host's monitoring subscription: every ack/need is delivered once more to it), CPU is the mosquitto
process via psutil (0.5 s samples).

The host sends each chunk once per wave on the fleet-wide topic and the broker fans it out, so the
broker's egress is ~ devices x bundle size and its ingress ~ waves x bundle size (`--transport url`:
the bytes go over HTTP from the host's artifact server instead); time to full rollout is the canary
wave (transfer + install + gate) plus the remaining waves; the gate runs in parallel on every device.
Each worker process drives its agents' MQTT clients from one network thread. See docs/fleet.md
("Scale") for 1000 devices.
"""


def to_markdown(r: dict, cmd: str, with_header: bool) -> str:
    b, p = r["broker"], r["per_device"]
    mb = lambda x: f"{x / 1e6:.1f} MB" if x is not None else "n/a"  # noqa: E731
    return (HEADER if with_header else "") + f"""
### {r['agents']} agents, {r['canary_pct']:g} % canary, waves {' + '.join(str(w) for w in r['waves'])}, gate {r['gate_s']:g} s

```
{cmd}
```

| | |
|---|---|
| outcome | {', '.join(f"{v} {k}" for k, v in sorted(r['counts'].items()))}{' (aborted: ' + r['aborted'] + ')' if r['aborted'] else ''} |
| bundle | {r['bundle_bytes']} bytes, {r['n_chunks']} chunks of {r['chunk_size']} bytes |
| time to full rollout | {r['rollout_s']:.1f} s (canaries done at {r['canary_done_s']} s; first commit {r['first_commit_s']} s, last {r['last_commit_s']} s); agents started in {r['boot_s']} s |
| transport | {r['transport']} |
| each device received | {r['device_received']['x_bundle_mean']}x the bundle on average, {r['device_received']['x_bundle_max']}x at most |
| per device, host -> device | {p['messages_to']} messages, {p['bytes_to'] / 1e3:.1f} kB on its own topics (offer + re-sends) |
| host CPU | {r['host_cpu_s']} s |
| per device, device -> host | {p['messages_from']} messages, {p['bytes_from'] / 1e3:.2f} kB (acks, needs) |
| broker messages received / sent | {b['messages_received']:.0f} / {b['messages_sent']:.0f} over {b['seconds']} s |
| broker bytes received / sent | {mb(b['bytes_received'])} / {mb(b['bytes_sent'])} |
| mosquitto CPU | {b['cpu_s']} s, mean {b['cpu_pct_mean']} % of one core, peak {b['cpu_pct_peak']} % |
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--canary", type=float, default=10.0, help="canary percentage")
    ap.add_argument("--wave-size", type=int, default=0)
    ap.add_argument("--max-failures", type=int, default=0)
    ap.add_argument("--latency-budget-ms", type=float, default=None, help="the p95 budget")
    ap.add_argument("--p99-budget-ms", type=float, default=None, help="the p99 budget (none by default)")
    ap.add_argument("--chunk-size", type=int, default=64 * 1024)
    ap.add_argument("--window", type=int, default=64, help="host: QoS 1 messages in flight")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--transport", choices=("mqtt", "url"), default="mqtt",
                    help="mqtt: chunks on the fleet-wide topic; url: the host serves the bundle over HTTP on "
                         "127.0.0.1 and the agents download it with Range requests")
    ap.add_argument("--gate-s", type=float, default=0.2, help="simulated health gate time")
    ap.add_argument("--p95-ms", type=float, default=5.0, help="p95 the simulated gate reports")
    ap.add_argument("--p99-ms", type=float, default=None,
                    help=f"p99 the simulated gate reports (default: {P99_OVER_P95:g}x --p95-ms)")
    ap.add_argument("--gate-ignores-p99", action="store_true",
                    help="the simulated gate reports its p99 but does not judge it (an agent from before the p99 "
                         "budget): only the host's canary check can stop the rollout on it")
    ap.add_argument("--fail", default="", help="device ids whose gate fails")
    ap.add_argument("--pad-kb", type=float, default=0, help="make the compiled bundle this much bigger "
                    "(random bytes in a listed member), e.g. 1850 for a 2 MB bundle")
    ap.add_argument("--bundle", help="deploy this bundle (default: compile the zoo's dynamic_batch)")
    ap.add_argument("--seed-bundle", help="what the agents start with (with --bundle)")
    ap.add_argument("--pub", help="trusted public key (with --bundle)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--docs", action="store_true", help="append the result to docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--slot-root", help=argparse.SUPPRESS)
    ap.add_argument("--seed", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    r = run_sim(args)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(json.dumps(r, indent=2))
    if args.docs:
        cmd = ".venv/bin/python scripts/fleet-sim.py " + " ".join(a for a in (argv or sys.argv[1:]) if a != "--docs")
        p = ROOT / "docs" / "benchmarks.md"
        text = p.read_text()
        p.write_text(text.rstrip("\n") + "\n" + to_markdown(r, cmd.strip(), "\n## Fleet rollout\n" not in text))
    return 0 if r["counts"].get("committed") == r["agents"] or args.fail else 1


if __name__ == "__main__":
    sys.exit(main())
