"""The host side of fleet updates: `tandoor fleet devices | deploy | status | rollback`.

Plain MQTT (paho, MQTT 5), so any broker works: one mosquitto, or a cluster (EMQX, HiveMQ,
VerneMQ; docs/fleet.md). The device side is agent/update/jobs.py; the topics are in docs/protocol.md.

A deploy is a staged rollout: the canaries (``canary_pct`` of the devices, at least one) get the
job first; when their final acks are in, the rollout stops (every remaining device ``skipped``)
if more than ``max_failures`` devices failed or rolled back, or if a canary's p95 latency after
the commit (its telemetry with the new model, after ``canary_soak_s`` seconds of serving; else the
p95 its health gate measured) is over ``latency_budget_ms``.
Then the rest in waves of ``wave_size`` (0: all at once), with the same failure check after each.
Each device gets the job offer, then every chunk (QoS 1, paced); chunks a device asks for on
``update/need`` are sent again; a device that has not answered an offer in ``offer_retry_s`` gets
it again (it resumes). A device with no final ack by ``timeout`` is ``failed`` ("timeout").
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tandoor_contract import protocol
from tandoor_contract.errors import TandoorError


DEFAULT_CHUNK = 64 * 1024


class FleetError(TandoorError):
    """A fleet operation that cannot go on (broker unreachable, bad bundle, unknown job)."""

    exit_code = 2


@dataclass
class BrokerURL:
    host: str
    port: int
    tls: bool
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str) -> BrokerURL:
        if "://" not in url:
            url = "mqtt://" + url
        u = urlparse(url)
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise FleetError(f"--broker: scheme must be mqtt:// or mqtts://, got {u.scheme}://")
        tls = u.scheme in ("mqtts", "ssl")
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError as e:
            raise FleetError(f"--broker: {e}") from None
        return cls(u.hostname or "localhost", port, tls,
                   unquote(u.username) if u.username else None, unquote(u.password) if u.password else None)


def chunk_bundle(data: bytes, chunk_size: int) -> list[bytes]:
    return [data[i:i + chunk_size] for i in range(0, len(data), chunk_size)] or [b""]


def bundle_model(path: Path) -> dict:
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            m = json.loads(z.read("manifest.json"))
        return {"name": m["model"]["name"], "version": m["model"].get("version")}
    except Exception as e:
        raise FleetError(f"{path}: not a bundle ({e})") from None


def _published(info) -> bool:
    """PUBACK received (or the message is no longer ours to track: paho re-sends it itself)."""
    try:
        return info.is_published()
    except (RuntimeError, ValueError):
        return True


class Fleet:
    """One paho client watching ``<prefix>/+/{status,telemetry,update/ack,update/need,response}``."""

    def __init__(self, broker: str = "mqtt://localhost:1883", cafile: str | None = None,
                 prefix: str = "tandoor", client_id: str | None = None, window: int = 64,
                 log: Callable[[str], None] | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._mqtt = mqtt
        self.url = BrokerURL.parse(broker)
        self.cafile = cafile
        self.prefix = prefix
        self.window = window
        self.log = log or (lambda s: None)
        self.status: dict[str, dict] = {}
        self.acks: dict[str, dict] = {}            # device -> last ack (any job)
        self.telemetry: dict[str, dict] = {}
        self._cond = threading.Condition()
        self._listeners: list[Callable[[str, str, dict, bool], None]] = []
        self._responses: dict[bytes, dict] = {}
        self.sent = {"messages": 0, "bytes": 0}
        self.per_device: dict[str, dict[str, int]] = {}
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"tandoor-fleet-{uuid.uuid4().hex[:8]}",
                             protocol=mqtt.MQTTv5)
        if self.url.username:
            self.c.username_pw_set(self.url.username, self.url.password)
        if self.url.tls or cafile:
            self.c.tls_set(ca_certs=cafile)
        self.c.max_inflight_messages_set(max(20, window))
        self.c.max_queued_messages_set(0)
        self.c.reconnect_delay_set(0.2, 2)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = lambda *a: self.connected.clear()
        self.c.on_message = self._on_message
        self.c.on_subscribe = lambda *a: self.subscribed.set()
        self._outstanding: deque = deque()
        self._pub_lock = threading.Lock()
        self._sendq: deque = deque()
        self._send_cv = threading.Condition()
        self._sender: threading.Thread | None = None
        self._closing = False
        self.auth_error: str | None = None

    # -------------------------------------------------------------------------- connection
    def connect(self, timeout: float = 10.0) -> Fleet:
        self.c.connect_async(self.url.host, self.url.port, 30, clean_start=True)
        self.c.loop_start()
        if not self.subscribed.wait(timeout):
            self.c.loop_stop()
            raise FleetError(self.auth_error or f"cannot connect to {self.url.host}:{self.url.port} "
                             f"within {timeout:g} s{self._why_not()}")
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="fleet-sender")
        self._sender.start()
        return self

    def _why_not(self) -> str:
        """After a failed connect, a second look at the socket (paho does not say): ': <why>'."""
        import socket
        import ssl

        try:
            sock = socket.create_connection((self.url.host, self.url.port), timeout=5)
        except OSError as e:
            return f": {e.strerror or e}"
        with sock:
            if not self.url.tls and not self.cafile:
                return " (the port accepts connections but does not answer MQTT: a TLS listener? use mqtts:// " \
                       "and --cafile)"
            ctx = ssl.create_default_context(cafile=self.cafile)
            try:
                ctx.wrap_socket(sock, server_hostname=self.url.host).close()
            except ssl.SSLCertVerificationError as e:
                return (f": TLS certificate not trusted ({e.verify_message}); give the CA that signed the "
                        f"broker's certificate with --cafile" if e.verify_code != 62 else
                        f": TLS certificate does not name {self.url.host} ({e.verify_message})")
            except (ssl.SSLError, OSError) as e:
                return f": TLS handshake failed ({e}); is the port a TLS listener?"
        return ""

    def close(self) -> None:
        self._closing = True
        with self._send_cv:
            self._send_cv.notify_all()
        deadline = time.monotonic() + 5
        while self._outstanding and time.monotonic() < deadline:
            if _published(self._outstanding[0]):
                self._outstanding.popleft()
            else:
                time.sleep(0.01)
        try:
            self.c.disconnect()
        except Exception:
            pass
        self.c.loop_stop()

    def __enter__(self) -> Fleet:
        return self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        if reason.is_failure:
            self.auth_error = f"broker refused the connection: {reason}"
            return
        p = self.prefix
        client.subscribe([(protocol.fleet_filter(p, protocol.STATUS), 1), (protocol.fleet_filter(p, protocol.UPDATE_ACK), 1),
                          (protocol.fleet_filter(p, protocol.UPDATE_NEED), 1), (protocol.fleet_filter(p, protocol.RESPONSE), 1),
                          (protocol.fleet_filter(p, protocol.TELEMETRY), 0)])
        self.connected.set()

    def _on_message(self, client, userdata, msg) -> None:
        parts = msg.topic.split("/")
        np_ = len(self.prefix.split("/"))
        if len(parts) < np_ + 2:
            return
        dev, kind = parts[np_], "/".join(parts[np_ + 1:])
        try:
            body = json.loads(msg.payload.decode("utf-8"))
        except Exception:
            return
        if not isinstance(body, dict):
            return
        with self._cond:
            pd = self.per_device.setdefault(dev, {"messages_out": 0, "bytes_out": 0, "messages_in": 0, "bytes_in": 0})
            if kind in ("update/ack", "update/need"):
                pd["messages_in"] += 1
                pd["bytes_in"] += len(msg.payload)
            if kind == "status":
                self.status[dev] = body
            elif kind == "telemetry":
                body["_rx"] = time.time()
                self.telemetry[dev] = body
            elif kind == "update/ack":
                body["_retained"] = bool(msg.retain)
                self.acks[dev] = body
            elif kind == "response":
                cd = getattr(getattr(msg, "properties", None), "CorrelationData", None)
                if cd is not None:
                    self._responses[bytes(cd)] = body
            self._cond.notify_all()
        for fn in list(self._listeners):
            try:
                fn(dev, kind, body, bool(msg.retain))
            except Exception:
                pass

    # ------------------------------------------------------------------------------ sending
    def _count(self, dev: str, n: int) -> None:
        with self._cond:
            pd = self.per_device.setdefault(dev, {"messages_out": 0, "bytes_out": 0, "messages_in": 0, "bytes_in": 0})
            pd["messages_out"] += 1
            pd["bytes_out"] += n
            self.sent["messages"] += 1
            self.sent["bytes"] += n

    def publish(self, dev: str, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                properties=None) -> None:
        """Paced: at most ``window`` QoS 1 messages unacknowledged."""
        with self._pub_lock:
            while len(self._outstanding) >= self.window:
                info = self._outstanding[0]
                t0 = time.monotonic()
                while not _published(info) and time.monotonic() - t0 < 5 and not self._closing:
                    time.sleep(0.002)
                self._outstanding.popleft()
            info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
            self._count(dev, len(payload))
            if qos:
                self._outstanding.append(info)

    def enqueue(self, item: tuple) -> None:
        with self._send_cv:
            self._sendq.append(item)
            self._send_cv.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._send_cv:
                while not self._sendq and not self._closing:
                    self._send_cv.wait(0.5)
                if self._closing:
                    return
                item = self._sendq.popleft()
            try:
                item[0](*item[1:])
            except Exception as e:
                self.log(f"send failed: {e}")

    # ------------------------------------------------------------------------------ reading
    def wait_settled(self, seconds: float = 1.0) -> None:
        """Let retained messages arrive."""
        time.sleep(seconds)

    def devices(self, wait: float = 1.0) -> dict[str, dict]:
        self.wait_settled(wait)
        with self._cond:
            out = {}
            for d, s in sorted(self.status.items()):
                ack = self.acks.get(d)
                out[d] = {"online": s.get("online"), "state": s.get("state"), "model": s.get("model"),
                          "slot": s.get("slot"), "agent_version": s.get("agent_version"),
                          "last_job": ({k: ack.get(k) for k in ("job_id", "state", "reason")} if ack else None),
                          "ts": s.get("ts")}
            return out

    def job_status(self, job_id: str, wait: float = 1.0) -> dict[str, dict]:
        self.wait_settled(wait)
        with self._cond:
            return {d: {k: v for k, v in a.items() if not k.startswith("_")}
                    for d, a in sorted(self.acks.items()) if a.get("job_id") == job_id}

    # ----------------------------------------------------------------------------- commands
    def command(self, devices: Iterable[str], cmd: str, args: dict | None = None,
                timeout: float = 120.0) -> dict[str, dict]:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        corr = {}
        for d in devices:
            cd = uuid.uuid4().bytes
            corr[d] = cd
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = protocol.topic(self.prefix, d, protocol.RESPONSE)
            props.CorrelationData = cd
            props.MessageExpiryInterval = max(1, int(timeout))
            self.publish(d, protocol.topic(self.prefix, d, protocol.CMD), json.dumps({"cmd": cmd, "args": args or {}}).encode(),
                         properties=props)
        deadline = time.monotonic() + timeout
        out: dict[str, dict] = {}
        with self._cond:
            while True:
                for d, cd in corr.items():
                    if d not in out and cd in self._responses:
                        out[d] = self._responses.pop(cd)
                if len(out) == len(corr) or time.monotonic() > deadline:
                    break
                self._cond.wait(0.2)
        for d in corr:
            out.setdefault(d, {"ok": False, "error": f"no response within {timeout:g} s"})
        return out

    # ------------------------------------------------------------------------------- deploy
    def deploy(self, bundle: Path, devices: list[str] | None = None, canary_pct: float = 0.0,
               max_failures: int = 0, latency_budget_ms: float | None = None, timeout: float = 600.0,
               job_id: str | None = None, chunk_size: int = DEFAULT_CHUNK, health_frames: int = 20,
               wave_size: int = 0, offer_retry_s: float = 5.0, canary_soak_s: float = 0.0,
               chunk_hook: Callable[[str, int, int, bytes], bytes | None] | None = None,
               order_hook: Callable[[str, list[int]], list[int]] | None = None,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Run the staged rollout; returns {"job_id", "sha256", "devices": {id: {state, reason,
        ...}}, "aborted", "seconds", "waves"}. ``chunk_hook(dev, index, attempt, data)`` may
        change or drop (None) a chunk (tests); ``order_hook(dev, indices)`` the send order."""
        t0 = time.monotonic()
        progress = progress or (lambda s: None)
        bundle = Path(bundle)
        data = bundle.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        model = bundle_model(bundle)
        chunks = chunk_bundle(data, chunk_size)
        job_id = job_id or f"{model['name']}-v{model['version']}-{sha[:8]}-{int(time.time())}"
        job_id = "".join(c if c.isalnum() or c in "._-" else "_" for c in job_id)[:100]
        if devices is None:
            devices = [d for d, s in self.devices().items() if s.get("online")]
        devices = list(dict.fromkeys(devices))
        if not devices:
            raise FleetError("no devices to deploy to (none online; name them with --devices)")
        deadline_epoch = time.time() + timeout
        offer = {"job_id": job_id, "sha256": sha, "size": len(data), "chunk_size": chunk_size,
                 "n_chunks": len(chunks), "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
                 "deadline": round(deadline_epoch, 3), "latency_budget_ms": latency_budget_ms,
                 "health_frames": health_frames, "model": model}
        offer_bytes = json.dumps(offer, separators=(",", ":")).encode()
        n_canary = min(len(devices), max(1, math.ceil(len(devices) * canary_pct / 100.0))) if canary_pct > 0 else 0
        waves: list[list[str]] = []
        if n_canary:
            waves.append(devices[:n_canary])
        rest = devices[n_canary:]
        step = wave_size if wave_size > 0 else max(1, len(rest))
        waves += [rest[i:i + step] for i in range(0, len(rest), step)]
        res: dict[str, dict] = {d: {"state": "pending", "reason": None} for d in devices}
        attempts: dict[tuple[str, int], int] = {}
        t_start_wall = time.time()
        live: dict[str, dict] = {}   # dev -> {"last_offer": t, "answered": bool, "pending": set()}
        final_at: dict[str, float] = {}  # dev -> wall time its final ack arrived
        lock = threading.Lock()

        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        def send_chunk(dev: str, i: int) -> None:
            with lock:
                st = live.get(dev)
                if st is None:
                    return
                st["pending"].discard(i)
                k = attempts[(dev, i)] = attempts.get((dev, i), 0) + 1
            payload = chunks[i]
            if chunk_hook is not None:
                payload = chunk_hook(dev, i, k, payload)
                if payload is None:
                    return
            self.publish(dev, protocol.chunk_topic(self.prefix, dev, job_id, i), payload)

        def send_offer(dev: str) -> None:
            props = Properties(PacketTypes.PUBLISH)
            props.MessageExpiryInterval = max(1, int(deadline_epoch - time.time()))
            self.publish(dev, protocol.topic(self.prefix, dev, protocol.UPDATE_JOB), offer_bytes, properties=props)

        def queue_chunks(dev: str, idx: Iterable[int]) -> None:
            with lock:
                st = live.get(dev)
                if st is None:
                    return
                todo = [i for i in idx if 0 <= i < len(chunks) and i not in st["pending"]]
                st["pending"].update(todo)
            for i in todo:
                self.enqueue((send_chunk, dev, i))

        def listener(dev: str, kind: str, body: dict, retained: bool) -> None:
            if dev not in live or body.get("job_id") != job_id:
                return
            if retained and float(body.get("ts") or 0) < t_start_wall:
                return
            if kind == "update/need":
                live[dev]["answered"] = True
                miss = [i for i in body.get("missing") or [] if isinstance(i, int)]
                queue_chunks(dev, miss)
            elif kind == "update/ack":
                st = body.get("state")
                live[dev]["answered"] = True
                r = res[dev]
                if r["state"] in protocol.FINAL_STATES:
                    return
                r.update(state=st, reason=body.get("reason"), kind=body.get("kind"))
                for k in ("p95_ms", "health", "count", "n_chunks", "model", "repeated", "slot"):
                    if k in body:
                        r[k] = body[k]
                if st in protocol.FINAL_STATES:
                    r["t_final"] = round(time.monotonic() - t0, 3)
                    final_at[dev] = time.time()
                    with lock:
                        live[dev]["pending"].clear()
                    progress(f"{dev}: {st}" + (f" ({body.get('reason')})" if body.get("reason") else ""))
                elif st != "received" or body.get("missing") == 0:
                    progress(f"{dev}: {st}")

        self._listeners.append(listener)
        aborted: str | None = None
        failures = 0
        try:
            for wi, wave in enumerate(waves):
                kind = "canary" if (wi == 0 and n_canary) else f"wave {wi + (0 if n_canary else 1)}"
                if aborted:
                    for d in wave:
                        res[d].update(state="skipped", reason=f"rollout aborted: {aborted}")
                    continue
                progress(f"{kind}: {len(wave)} device(s): {', '.join(wave[:8])}{' ...' if len(wave) > 8 else ''}")
                now = time.monotonic()
                for d in wave:
                    res[d]["wave"] = kind
                    live[d] = {"last_offer": now, "answered": False, "pending": set()}
                    self.enqueue((send_offer, d))
                for d in wave:
                    order = list(range(len(chunks)))
                    if order_hook is not None:
                        order = order_hook(d, order)
                    with lock:
                        live[d]["pending"].update(order)
                    for i in order:
                        self.enqueue((send_chunk, d, i))
                wave_deadline = t0 + timeout
                last_report = 0.0
                while True:
                    open_ = [d for d in wave if res[d]["state"] not in protocol.FINAL_STATES]
                    if not open_:
                        break
                    now = time.monotonic()
                    if now > wave_deadline:
                        for d in open_:
                            res[d].update(state="failed", reason=f"timeout after {timeout:g} s "
                                          f"(last state: {res[d]['state']})", kind="timeout")
                        break
                    for d in open_:
                        st = live[d]
                        if not st["answered"] and now - st["last_offer"] > offer_retry_s:
                            st["last_offer"] = now
                            self.enqueue((send_offer, d))
                    if now - last_report > 5.0:
                        last_report = now
                        states: dict[str, int] = {}
                        for d in wave:
                            states[res[d]["state"]] = states.get(res[d]["state"], 0) + 1
                        progress(f"{kind}: " + ", ".join(f"{v} {k}" for k, v in sorted(states.items())))
                    with self._cond:
                        self._cond.wait(0.2)
                for d in wave:
                    live.pop(d, None)
                failures += sum(res[d]["state"] in ("failed", "rolled_back") for d in wave)
                if failures > max_failures:
                    aborted = f"{failures} device(s) failed or rolled back (max {max_failures})"
                elif wi == 0 and n_canary and latency_budget_ms is not None:
                    if canary_soak_s > 0:
                        progress(f"canary soak: {canary_soak_s:g} s of telemetry with the new model")
                    worst = self._canary_p95(wave, res, final_at, sha, model, canary_soak_s)
                    if worst is not None and worst[1] > latency_budget_ms:
                        r = res[worst[0]]
                        how = (f"its telemetry over {r['telemetry_frames']} frame(s) since the swap"
                               if r["p95_source"] == "telemetry" else "its health gate")
                        aborted = (f"canary {worst[0]} p95 latency {worst[1]:.3g} ms ({how}) over the budget "
                                   f"{latency_budget_ms:g} ms")
                if aborted:
                    progress(f"aborting the rollout: {aborted}")
        finally:
            self._listeners.remove(listener)
        counts: dict[str, int] = {}
        for r in res.values():
            counts[r["state"]] = counts.get(r["state"], 0) + 1
        return {"job_id": job_id, "bundle": str(bundle), "sha256": sha, "model": model, "size": len(data),
                "n_chunks": len(chunks), "devices": res, "aborted": aborted, "counts": counts,
                "waves": [len(w) for w in waves], "seconds": round(time.monotonic() - t0, 3)}

    def _canary_p95(self, wave: list[str], res: dict, final_at: dict[str, float], sha: str, model: dict,
                    soak_s: float) -> tuple[str, float] | None:
        """The worst canary p95 (ms) after the commit, and where each number came from.

        For each committed canary: the inference p95 of its latest telemetry about the new model
        (``model.sha256`` = the bundle's; from agents that do not send the sha, the version in a
        message received after the commit). The agent starts its latency window over at the hot
        swap, so that p95 is the new model's alone, under the real camera load. With ``soak_s`` >
        0 the canaries serve that long after the last commit before the numbers are read (the
        latest message covers every frame since the swap). A canary without such telemetry is
        judged by the p95 its health gate measured (the committed ack), if any. Per canary
        ``res`` gets ``p95_ms_seen``, ``p95_source`` ("telemetry" | "health gate") and, from
        telemetry, ``telemetry_frames``."""
        committed = [d for d in wave if res[d]["state"] == "committed"]
        if not committed:
            return None
        end = max(final_at.get(d, 0.0) for d in committed) + soak_s
        while time.time() < end:
            time.sleep(min(0.2, max(0.0, end - time.time())))

        def fresh(d: str) -> dict | None:
            with self._cond:
                tel = self.telemetry.get(d)
            m = (tel or {}).get("model") or {}
            if m.get("sha256"):
                ok = m["sha256"] == sha
            else:  # an agent that does not say its sha: the version, and only after the commit
                ok = m.get("version") == model.get("version") and tel.get("_rx", 0) > final_at.get(d, 0.0)
            inf = ((tel or {}).get("latency_ms") or {}).get("inference") or {}
            return inf if ok and inf.get("p95") is not None and inf.get("count") else None

        worst = None
        for d in committed:
            inf = fresh(d)
            if inf is not None:
                p, src = float(inf["p95"]), "telemetry"
                res[d]["telemetry_frames"] = inf["count"]
            elif res[d].get("p95_ms") is not None:
                p, src = float(res[d]["p95_ms"]), "health gate"
            else:
                res[d]["p95_source"] = None
                continue
            res[d].update(p95_ms_seen=p, p95_source=src)
            if worst is None or p > worst[1]:
                worst = (d, p)
        return worst
