"""A staged rollout of one bundle to many devices: what `tandoor fleet deploy` runs.

    Rollout(fleet, bundle, devices=..., canary_pct=10, ...).run()
      plan()            one job (offer, chunks) and its waves: the canaries, then waves of wave_size
      run_wave(wave)    offer the job to every device of the wave, send the bundle, wait for
                        every final ack (or the timeout)
      judge(wave)       after each wave: stop the rollout (every remaining device ``skipped``)
                        when more than ``max_failures`` devices failed or rolled back;
      judge_canaries()  after the canaries also when a canary's p95 after the commit (its
                        telemetry with the new model after ``canary_soak_s`` s of serving; else
                        the p95 its health gate measured) is over ``latency_budget_ms``, or its
                        p99 (from the same source) over ``p99_budget_ms`` (none by default)

Transports (the offer's ``transport``): ``mqtt``, the default: the bundle's chunks go once per
wave on the fleet-wide topic ``<prefix>/~fleet/update/chunk/<job>/<i>`` (every device of the
wave subscribed when it accepted the offer; the host waits for the wave's answers, at most
``offer_retry_s``, before sending), and a device that misses some asks for them on its
``update/need`` and gets exactly those on its own topic. ``url``: the offer names an artifact URL
(``artifact_url``, or the host's own ArtifactServer on ``serve``) that devices download with
Range requests. A device that has not answered the offer in ``offer_retry_s`` gets it again (it
resumes); one with no final ack by ``timeout`` is ``failed`` ("timeout").

The device side is agent/update/jobs.py; the states are tandoor_contract.protocol.JOB_STATES.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandoor_contract import protocol

from .artifacts import ArtifactServer
from .client import DEFAULT_CHUNK, BrokerURL, Fleet, FleetError, bundle_manifest, chunk_bundle  # noqa: F401 (API)

FAILED_STATES = ("failed", "rolled_back")
PROGRESS_EVERY_S = 2.0
RESEND_GRACE_S = 30.0        # a fleet-wide chunk asked for sooner than this may still be on its way (QoS 1)
QUIET_ABOVE = 20             # waves larger than this print only failures per device, and the counts
GROUP = protocol.FLEET_LEVEL  # the ``dev`` hooks and counters see for a fleet-wide chunk


@dataclass
class Wave:
    name: str                 # "canary", "wave 1", ...
    devices: list[str]
    canary: bool = False


@dataclass
class Plan:
    job_id: str
    sha256: str
    size: int
    model: dict
    chunks: list[bytes]
    offer: dict
    waves: list[Wave]


@dataclass
class _Live:
    """A device of the wave in progress, as the host sees it."""
    last_offer: float
    answered: bool = False
    answered_at: float | None = None                  # when it first answered (had subscribed)
    pending: set[int] = field(default_factory=set)   # chunks queued for this device alone


class Rollout:
    """One staged rollout. ``chunk_hook(dev, index, attempt, data)`` may change or drop (None)
    a chunk and ``order_hook(dev, indices)`` reorder the chunks (tests; ``dev`` is ``~fleet`` for
    a fleet-wide send); ``progress(line)`` gets the progress lines."""

    def __init__(self, fleet: Fleet, bundle: str | Path, *, devices: list[str] | None = None,
                 canary_pct: float = 0.0, max_failures: int = 0, latency_budget_ms: float | None = None,
                 p99_budget_ms: float | None = None,
                 timeout: float = 600.0, job_id: str | None = None, chunk_size: int = DEFAULT_CHUNK,
                 health_frames: int = 20, wave_size: int = 0, offer_retry_s: float = 5.0,
                 canary_soak_s: float = 0.0, transport: str = "mqtt", artifact_url: str | None = None,
                 serve: str | None = None, stall_timeout_s: float | None = 120.0, allow_downgrade: bool = False,
                 chunk_hook: Callable[[str, int, int, bytes], bytes | None] | None = None,
                 order_hook: Callable[[str, list[int]], list[int]] | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        if transport not in ("mqtt", "url"):
            raise FleetError(f"--transport must be mqtt or url, got {transport!r}")
        if transport == "url" and not (artifact_url or serve):
            raise FleetError("--transport url needs --artifact-url URL (an object store) or --serve HOST:PORT "
                             "(this host serves the bundle; HOST is the address the devices reach)")
        self.fleet = fleet
        self.bundle = Path(bundle)
        self.devices = devices
        if p99_budget_ms is not None and latency_budget_ms is not None and p99_budget_ms < latency_budget_ms:
            raise FleetError(f"--p99-budget-ms {p99_budget_ms:g} is below --latency-budget-ms {latency_budget_ms:g} "
                             "(the p95 budget): a p99 is never under its p95")
        self.canary_pct, self.max_failures, self.latency_budget_ms = canary_pct, max_failures, latency_budget_ms
        self.p99_budget_ms = p99_budget_ms
        self.timeout, self.job_id, self.chunk_size = timeout, job_id, chunk_size
        self.health_frames, self.wave_size, self.offer_retry_s = health_frames, wave_size, offer_retry_s
        self.canary_soak_s, self.transport, self.artifact_url, self.serve = canary_soak_s, transport, artifact_url, serve
        self.stall_timeout_s, self.allow_downgrade = stall_timeout_s, allow_downgrade
        self.chunk_hook, self.order_hook = chunk_hook, order_hook
        self.progress = progress or (lambda s: None)
        self.res: dict[str, dict] = {}
        self._live: dict[str, _Live] = {}
        self._open: set[str] = set()
        self._final_at: dict[str, float] = {}
        self._attempts: dict[tuple[str, int], int] = {}
        self._sent_at: dict[int, float] = {}  # fleet-wide chunks of this wave: when each was sent
        self._sent_pos: dict[int, int] = {}   # ... and in which order
        self._host_back: float | None = None  # when our own connection last came back (what was sent before is lost)
        self._offer_bytes = b""
        self._lock = threading.Lock()
        self._quiet = False
        self.t0 = time.monotonic()
        self._t_start_wall = time.time()
        self.planned: Plan | None = None
        self.server: ArtifactServer | None = None

    # ---------------------------------------------------------------------------------- plan
    def plan(self) -> Plan:
        """The job and its waves (no message sent yet)."""
        data = self.bundle.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        man = bundle_manifest(self.bundle)
        model = {"name": man["model"]["name"], "version": man["model"].get("version")}
        chunks = chunk_bundle(data, self.chunk_size)
        job_id = self.job_id or f"{model['name']}-v{model['version']}-{sha[:8]}-{int(time.time())}"
        job_id = "".join(c if c.isalnum() or c in "._-" else "_" for c in job_id)[:100]
        devices = self.devices
        if devices is None:
            devices = [d for d, s in self.fleet.devices().items() if s.get("online")]
        devices = list(dict.fromkeys(devices))
        if not devices:
            raise FleetError("no devices to deploy to (none online; name them with --devices)")
        offer = {"job_id": job_id, "sha256": sha, "size": len(data), "chunk_size": self.chunk_size,
                 "n_chunks": len(chunks), "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
                 "deadline": round(time.time() + self.timeout, 3), "issued": round(time.time(), 6),
                 "latency_budget_ms": self.latency_budget_ms, "health_frames": self.health_frames,
                 "model": model, "transport": self.transport}
        if self.p99_budget_ms is not None:
            offer["p99_budget_ms"] = self.p99_budget_ms
        if self.stall_timeout_s:
            offer["stall_timeout_s"] = self.stall_timeout_s
        if self.allow_downgrade:
            offer["allow_downgrade"] = True
        n_canary = (min(len(devices), max(1, math.ceil(len(devices) * self.canary_pct / 100.0)))
                    if self.canary_pct > 0 else 0)
        waves = [Wave("canary", devices[:n_canary], canary=True)] if n_canary else []
        rest = devices[n_canary:]
        step = self.wave_size if self.wave_size > 0 else max(1, len(rest))
        waves += [Wave(f"wave {k + 1}", rest[i:i + step]) for k, i in enumerate(range(0, len(rest), step))]
        self.planned = Plan(job_id, sha, len(data), model, chunks, offer, waves)
        self.res = {d: {"state": "pending", "reason": None} for d in devices}
        return self.planned

    # ----------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Plan, then each wave in turn with the checks between; returns {"job_id", "sha256",
        "devices": {id: {state, reason, ...}}, "aborted", "counts", "waves", "seconds", ...}."""
        plan = self.planned or self.plan()
        self.t0 = time.monotonic()
        self._t_start_wall = time.time()
        if self.transport == "url":
            self._start_artifacts(plan)
        self.fleet.listen(self._on_message)
        self.fleet.on_reconnect(self._host_reconnected)
        aborted: str | None = None
        failures = 0
        try:
            for wave in plan.waves:
                if aborted:
                    for d in wave.devices:
                        self.res[d].update(state="skipped", reason=f"rollout aborted: {aborted}")
                    continue
                self.run_wave(wave)
                failures += sum(self.res[d]["state"] in FAILED_STATES for d in wave.devices)
                aborted = self.judge(failures) or (self.judge_canaries(wave) if wave.canary else None)
                if aborted:
                    self.progress(f"aborting the rollout: {aborted}")
        finally:
            self.fleet.unlisten(self._on_message)
            self.fleet.on_reconnect(self._host_reconnected, remove=True)
            if self.server is not None:
                self.server.stop()
        counts: dict[str, int] = {}
        for r in self.res.values():
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        out = {"job_id": plan.job_id, "bundle": str(self.bundle), "sha256": plan.sha256, "model": plan.model,
               "size": plan.size, "n_chunks": len(plan.chunks), "transport": self.transport,
               "url": plan.offer.get("url"), "devices": self.res, "aborted": aborted, "counts": counts,
               "waves": [len(w.devices) for w in plan.waves], "seconds": round(time.monotonic() - self.t0, 3)}
        if self.server is not None:
            out["artifact_server"] = dict(self.server.stats)
        return out

    def _start_artifacts(self, plan: Plan) -> None:
        if self.artifact_url:
            plan.offer["url"] = self.artifact_url
            return
        host, _, port = (self.serve or "").rpartition(":")
        if not host or not port.isdigit():
            raise FleetError(f"--serve {self.serve!r}: expected HOST:PORT (port 0: any free one)")
        if host in ("0.0.0.0", "::", "[::]"):
            raise FleetError(f"--serve {self.serve}: give the address the devices reach, not {host}")
        try:
            self.server = ArtifactServer(self.bundle, host.strip("[]"), int(port), name=f"{plan.sha256}.hmod").start()
        except OSError as e:
            raise FleetError(f"--serve {self.serve}: cannot listen there ({e.strerror or e})") from None
        plan.offer["url"] = self.server.url
        self.progress(f"serving the bundle at {self.server.url} (HTTP, Range requests)")

    # ----------------------------------------------------------------------------- one wave
    def run_wave(self, wave: Wave) -> None:
        plan = self.planned
        devs = wave.devices
        self._quiet = len(devs) > QUIET_ABOVE
        self.progress(f"{wave.name}: {len(devs)} device(s): {', '.join(devs[:8])}{' ...' if len(devs) > 8 else ''}")
        offer_bytes = self._offer_bytes = json.dumps(plan.offer, separators=(",", ":")).encode()
        now = time.monotonic()
        with self._lock:
            self._sent_at, self._sent_pos = {}, {}
            for d in devs:
                self.res[d]["wave"] = wave.name
                self._live[d] = _Live(last_offer=now)
                self._open.add(d)
        for d in devs:
            self.fleet.enqueue((self._send_offer, d, offer_bytes))
        if self.transport == "mqtt":
            self._broadcast_when_answered(wave)
        self._wait_for_finals(wave, offer_bytes)
        with self._lock:
            for d in devs:
                self._live.pop(d, None)
                self._open.discard(d)

    def _broadcast_when_answered(self, wave: Wave) -> None:
        """The wave's chunks once on the fleet-wide topic, after every device answered the offer
        (subscribed to the job's chunks), or after ``offer_retry_s`` for the ones that did not."""
        plan = self.planned
        deadline = time.monotonic() + self.offer_retry_s
        while time.monotonic() < deadline and not all(
                self._live[d].answered for d in wave.devices if d in self._live):
            self.fleet.wait_for_change(0.05)
        order = list(range(len(plan.chunks)))
        if self.order_hook is not None:
            order = self.order_hook(GROUP, order)
        for i in order:
            self.fleet.enqueue((self._send_group_chunk, i))

    def _wait_for_finals(self, wave: Wave, offer_bytes: bytes) -> None:
        deadline = self.t0 + self.timeout
        last_report, last_final = time.monotonic(), self._finals_in(wave)
        while True:
            with self._lock:
                open_ = [d for d in wave.devices if d in self._open]
            if not open_:
                break
            now = time.monotonic()
            if now > deadline:
                for d in open_:
                    self.res[d].update(state="failed", reason=f"timeout after {self.timeout:g} s "
                                       f"(last state: {self.res[d]['state']})", kind="timeout")
                break
            for d in open_:
                st = self._live.get(d)
                if st is not None and not st.answered and now - st.last_offer > self.offer_retry_s:
                    st.last_offer = now
                    self.fleet.enqueue((self._send_offer, d, offer_bytes))
            if now - last_report >= PROGRESS_EVERY_S:
                done = self._finals_in(wave)
                rate = (done - last_final) / (now - last_report)
                last_report, last_final = now, done
                self.progress(self._state_line(wave, rate))
            self.fleet.wait_for_change(0.2)
        self.progress(self._state_line(wave, None))

    def _finals_in(self, wave: Wave) -> int:
        return sum(protocol.is_final(self.res[d]["state"]) for d in wave.devices)

    def _state_line(self, wave: Wave, rate: float | None) -> str:
        states: dict[str, int] = {}
        for d in wave.devices:
            states[self.res[d]["state"]] = states.get(self.res[d]["state"], 0) + 1
        order = {s: i for i, s in enumerate(["pending", *protocol.JOB_STATES])}
        line = ", ".join(f"{states[s]} {s}" for s in sorted(states, key=lambda s: order.get(s, 99)))
        sent = self.fleet.sent["bytes"] / 1e6
        tail = f" | {rate:.1f} devices/s done" if rate is not None else " | wave done"
        return f"{wave.name}: {line}{tail}, {sent:.1f} MB sent, {time.monotonic() - self.t0:.1f} s"

    # --------------------------------------------------------------------------- sending
    def _send_offer(self, dev: str, offer_bytes: bytes) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = max(1, int(self.planned.offer["deadline"] - time.time()))
        self.fleet.publish(dev, protocol.topic(self.fleet.prefix, dev, protocol.UPDATE_JOB), offer_bytes,
                           properties=props)

    def _hooked(self, dev: str, i: int, attempt: int) -> bytes | None:
        data = self.planned.chunks[i]
        return data if self.chunk_hook is None else self.chunk_hook(dev, i, attempt, data)

    def _send_group_chunk(self, i: int) -> None:
        k = self._attempts[(GROUP, i)] = self._attempts.get((GROUP, i), 0) + 1
        data = self._hooked(GROUP, i, k)
        if data is not None:
            self.fleet.publish(GROUP, protocol.group_chunk_topic(self.fleet.prefix, self.planned.job_id, i), data)
        with self._lock:
            self._sent_at.setdefault(i, time.monotonic())
            self._sent_pos.setdefault(i, len(self._sent_pos))

    def _send_chunk(self, dev: str, i: int) -> None:
        """A re-send to one device (it said it misses chunk ``i``)."""
        with self._lock:
            st = self._live.get(dev)
            if st is None:
                return
            st.pending.discard(i)
            k = self._attempts[(dev, i)] = self._attempts.get((dev, i), 0) + 1
        data = self._hooked(dev, i, k + self._attempts.get((GROUP, i), 0))
        if data is not None:
            self.fleet.publish(dev, protocol.chunk_topic(self.fleet.prefix, dev, self.planned.job_id, i), data)

    def _queue_resends(self, dev: str, need: dict) -> None:
        """Chunks a device misses, re-sent on its own topic: those it reported bad or lost in a
        reconnect, those sent fleet-wide before it subscribed, those sent fleet-wide before a
        chunk it already has (one session delivers in order, so an earlier one was lost), and
        those sent fleet-wide more than RESEND_GRACE_S ago, and those sent before the device's session
        began (its ``session_s``) or before our own connection came back. Any other chunk is on its
        way to the device (QoS 1 on a live session): sending it again would double the bytes."""
        n, now = len(self.planned.chunks), time.monotonic()
        idx = [i for i in need.get("missing") or [] if isinstance(i, int) and 0 <= i < n]
        now_due = bool(need.get("bad") or need.get("reconnected"))
        # chunks sent before the device's session began, or before ours came back, are lost
        session_s = need.get("session_s")
        lost_before = max(now - session_s if isinstance(session_s, (int, float)) and session_s >= 0 else 0.0,
                          self._host_back or 0.0)
        with self._lock:
            st = self._live.get(dev)
            if st is None:
                return
            latest = -1  # the position in the fleet-wide order of the newest chunk the device has
            if need.get("n_missing") == len(idx):
                have = set(range(n)).difference(idx)
                latest = max((self._sent_pos[j] for j in have if j in self._sent_pos), default=-1)

            def due(i: int) -> bool:
                sent = self._sent_at.get(i)
                if sent is None:
                    return False
                return (now_due or sent < lost_before or (st.answered_at is not None and st.answered_at > sent)
                        or latest > self._sent_pos[i] or now - sent >= RESEND_GRACE_S)

            todo = [i for i in idx if i not in st.pending and due(i)]
            st.pending.update(todo)
        for i in todo:
            self.fleet.enqueue((self._send_chunk, dev, i))

    def _host_reconnected(self) -> None:
        """Our connection to the broker came back (a broker restart, a network cut): whatever we
        sent before may be lost, and so may a device's need sent while we were away. Every chunk
        sent so far counts as lost, and the job is offered again to the devices still on it, which
        answer at once with what they miss (instead of at their next need, seconds to a minute away)."""
        with self._lock:
            self._host_back = time.monotonic()
            devs = sorted(self._open)
        if devs:
            self.progress(f"the broker connection came back: asking {len(devs)} device(s) what they miss")
        for d in devs:
            self.fleet.enqueue((self._send_offer, d, self._offer_bytes))

    # --------------------------------------------------------------------------- receiving
    def _on_message(self, dev: str, kind: str, body: dict, retained: bool) -> None:
        """From the fleet's MQTT thread: the job's needs and acks."""
        st = self._live.get(dev)
        if st is None or body.get("job_id") != self.planned.job_id:
            return
        if retained and float(body.get("ts") or 0) < self._t_start_wall:
            return
        if kind == protocol.UPDATE_NEED:
            self._answered(st)
            self._queue_resends(dev, body)
        elif kind == protocol.UPDATE_ACK:
            self._on_ack(dev, st, body)

    def _on_ack(self, dev: str, st: _Live, body: dict) -> None:
        state = body.get("state")
        self._answered(st)
        r = self.res[dev]
        if protocol.is_final(r["state"]) or state not in protocol.JOB_STATES:
            return
        r.update(state=state, reason=body.get("reason"), kind=body.get("kind"))
        for k in ("p95_ms", "health", "count", "n_chunks", "model", "repeated", "slot", "running",
                  "running_expires", "superseded_by", "downgrade", "attempts"):
            if k in body:
                r[k] = body[k]
        if protocol.is_final(state):
            r["t_final"] = round(time.monotonic() - self.t0, 3)
            self._final_at[dev] = time.time()
            with self._lock:
                st.pending.clear()
                self._open.discard(dev)
            if not self._quiet or not protocol.JOB_STATES[state].ok:
                self.progress(f"{dev}: {state}" + (f" ({body.get('reason')})" if body.get("reason") else ""))
        elif not self._quiet and (state != "received" or body.get("missing") == 0):
            self.progress(f"{dev}: {state}")

    @staticmethod
    def _answered(st: _Live) -> None:
        if not st.answered:
            st.answered, st.answered_at = True, time.monotonic()

    # ---------------------------------------------------------------------------- judging
    def judge(self, failures: int) -> str | None:
        """Why the rollout stops after a wave (too many failures), or None."""
        if failures > self.max_failures:
            return f"{failures} device(s) failed or rolled back (max {self.max_failures})"
        return None

    def judge_canaries(self, wave: Wave) -> str | None:
        """Why the rollout stops after the canaries (a p95 or a p99 over its budget), or None."""
        budgets = {q: b for q, b in (("p95", self.latency_budget_ms), ("p99", self.p99_budget_ms)) if b is not None}
        if not budgets:
            return None
        if self.canary_soak_s > 0:
            self.progress(f"canary soak: {self.canary_soak_s:g} s of telemetry with the new model")
        worst = self._canary_p95(wave.devices)
        for q, budget in budgets.items():          # p95 first: the reason names the budget that failed
            if worst.get(q) is None or worst[q][1] <= budget:
                continue
            d, ms = worst[q]
            r = self.res[d]
            how = (f"its telemetry over {r['telemetry_frames']} frame(s) since the swap"
                   if r["p95_source"] == "telemetry" else "its health gate")
            return f"canary {d} {q} latency {ms:.3g} ms ({how}) over the budget {budget:g} ms"
        return None

    def _canary_p95(self, wave: list[str]) -> dict[str, tuple[str, float]]:
        """The worst canary p95 and p99 (ms) after the commit, and where each number came from:
        ``{"p95": (device, ms), "p99": (device, ms)}``, a key absent when no canary has the number.

        For each committed canary: the inference p95 of its latest telemetry about the new model
        (``model.sha256`` = the bundle's; from agents that do not send the sha, the version in a
        message received after the commit). The agent starts its latency window over at the hot
        swap, so that p95 is the new model's alone, under the real camera load. With a soak the
        canaries serve that long after the last commit before the numbers are read. A canary
        without such telemetry is judged by the p95 its health gate measured (the committed ack),
        if any; the p99 comes from the same source (telemetry's inference p99, the gate's
        ``health.p99_ms``). Per canary ``res`` gets ``p95_ms_seen``, ``p99_ms_seen`` (None when its
        source has none), ``p95_source`` ("telemetry" | "health gate") and, from telemetry,
        ``telemetry_frames``."""
        res, final_at, plan = self.res, self._final_at, self.planned
        committed = [d for d in wave if res[d]["state"] == "committed"]
        if not committed:
            return {}
        end = max(final_at.get(d, 0.0) for d in committed) + self.canary_soak_s
        while time.time() < end:
            time.sleep(min(0.2, max(0.0, end - time.time())))

        def fresh(d: str) -> dict | None:
            tel = self.fleet.telemetry.get(d)
            m = (tel or {}).get("model") or {}
            if m.get("sha256"):
                ok = m["sha256"] == plan.sha256
            else:  # an agent that does not say its sha: the version, and only after the commit
                ok = m.get("version") == plan.model.get("version") and tel.get("_rx", 0) > final_at.get(d, 0.0)
            inf = ((tel or {}).get("latency_ms") or {}).get("inference") or {}
            return inf if ok and inf.get("p95") is not None and inf.get("count") else None

        worst: dict[str, tuple[str, float]] = {}
        for d in committed:
            inf = fresh(d)
            if inf is not None:
                p, p99, src = float(inf["p95"]), inf.get("p99"), "telemetry"
                res[d]["telemetry_frames"] = inf["count"]
            elif res[d].get("p95_ms") is not None:
                p, p99, src = float(res[d]["p95_ms"]), (res[d].get("health") or {}).get("p99_ms"), "health gate"
            else:
                res[d]["p95_source"] = None
                continue
            p99 = float(p99) if isinstance(p99, (int, float)) and not isinstance(p99, bool) else None
            res[d].update(p95_ms_seen=p, p99_ms_seen=p99, p95_source=src)
            for q, ms in (("p95", p), ("p99", p99)):
                if ms is not None and (q not in worst or ms > worst[q][1]):
                    worst[q] = (d, ms)
        return worst


def deploy(fleet: Fleet, bundle: Path, devices: list[str] | None = None, **options: Any) -> dict[str, Any]:
    """A staged rollout of ``bundle`` to ``devices`` (all known when None) over a connected
    ``fleet`` (see :class:`Rollout` for the options); its summary."""
    return Rollout(fleet, bundle, devices=devices, **options).run()
