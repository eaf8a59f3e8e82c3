"""The fleet's connection to the broker and its one-shot operations: devices, job status,
commands (rollback), cancel, key rotation. ``Rollout`` (rollout.py) drives deploys through it.

Plain MQTT (paho, MQTT 5), so any broker works: one mosquitto, or a cluster (EMQX, HiveMQ,
VerneMQ; docs/fleet.md). The topics are tandoor_contract.protocol's (docs/protocol.md).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tandoor_contract import hmod, protocol
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


def bundle_manifest(path: Path) -> dict:
    """The bundle's manifest (read, not verified: the devices verify)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            m = json.loads(z.read(hmod.MANIFEST))
        m["model"]["name"]
        return m
    except Exception as e:
        raise FleetError(f"{path}: not a bundle ({e})") from None


def bundle_model(path: Path) -> dict:
    m = bundle_manifest(path)["model"]
    return {"name": m["name"], "version": m.get("version")}


def _wait_published(info, timeout: float) -> None:
    """Until the broker has the message (PUBACK), or paho says it is no longer ours to track."""
    try:
        info.wait_for_publish(timeout)
    except (RuntimeError, ValueError):
        pass


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
        self.key_acks: dict[tuple[str, str], dict] = {}  # (device, key op id) -> its answer
        self.telemetry: dict[str, dict] = {}
        self._cond = threading.Condition()
        self._listeners: list[Callable[[str, str, dict, bool], None]] = []
        self._reconnect_listeners: list[Callable[[], None]] = []
        self.connects = 0   # 2+: the connection to the broker came back (what was in flight is lost)
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
            _wait_published(self._outstanding.popleft(), max(0.01, deadline - time.monotonic()))
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
        self.connects += 1
        self.connected.set()
        if self.connects > 1:
            for fn in list(self._reconnect_listeners):
                try:
                    fn()
                except Exception as e:
                    self.log(f"after the reconnect: {e}")

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
            elif kind == "update/ack" and "key_op" in body:
                self.key_acks[(dev, str(body["key_op"]))] = body
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
        """Paced: at most ``window`` QoS 1 messages unacknowledged (waits for the oldest PUBACK)."""
        with self._pub_lock:
            while len(self._outstanding) >= self.window and not self._closing:
                _wait_published(self._outstanding.popleft(), 5.0)
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

    # ---------------------------------------------------------------------------- listening
    def listen(self, fn: Callable[[str, str, dict, bool], None]) -> None:
        """``fn(device, kind, body, retained)`` for every JSON message (from the MQTT thread)."""
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[str, str, dict, bool], None]) -> None:
        self._listeners.remove(fn)

    def on_reconnect(self, fn: Callable[[], None] | None, remove: bool = False) -> None:
        """``fn()`` after every reconnect to the broker (from the MQTT thread, subscriptions sent);
        ``remove=True`` to stop."""
        (self._reconnect_listeners.remove if remove else self._reconnect_listeners.append)(fn)

    def wait_for_change(self, timeout: float) -> None:
        """Until a message arrives, at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait(timeout)

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
                          "recovered": s.get("recovered"), "keyring": s.get("keyring"), "ts": s.get("ts")}
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

    # ------------------------------------------------------------------------------ cancel
    def cancel(self, job_id: str, devices: Iterable[str] | None = None, reason: str = "cancelled by the operator",
               timeout: float = 30.0) -> dict[str, dict]:
        """Drop ``job_id`` on the devices (default: every device whose last ack names it and is
        not final). A device downloading it answers ``cancelled``; one that has not seen it
        records it as cancelled (a late offer is refused); one past its download says so and the
        job ends by itself. Returns {device: its answer}."""
        if devices is None:
            self.wait_settled(1.0)
            with self._cond:
                devices = [d for d, a in sorted(self.acks.items())
                           if a.get("job_id") == job_id and not protocol.is_final(a.get("state") or "")]
        devices = list(dict.fromkeys(devices))
        t0 = time.time()
        body = json.dumps({"job_id": job_id, "reason": reason, "ts": round(t0, 3)}).encode()
        for d in devices:
            self.publish(d, protocol.topic(self.prefix, d, protocol.UPDATE_CANCEL), body)

        def answer(d: str) -> dict | None:
            a = self.acks.get(d)
            if a and a.get("job_id") == job_id and float(a.get("ts") or 0) >= t0 - 1 and (
                    protocol.is_final(a.get("state") or "") or a.get("note")):
                return {k: v for k, v in a.items() if not k.startswith("_")}
            return None

        return self._collect(devices, answer, timeout)

    def _collect(self, devices: list[str], answer: Callable[[str], dict | None], timeout: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        out: dict[str, dict] = {}
        with self._cond:
            while len(out) < len(devices) and time.monotonic() < deadline:
                for d in devices:
                    if d not in out and (a := answer(d)) is not None:
                        out[d] = a
                self._cond.wait(0.2)
        for d in devices:
            out.setdefault(d, {"ok": False, "state": None, "reason": f"no answer within {timeout:g} s"})
        return out

    # -------------------------------------------------------------------------- key rotation
    def key_command(self, devices: Iterable[str], op: str, signing_key: Path, *, public_key: Path | None = None,
                    fingerprint: str | None = None, force: bool = False, timeout: float = 30.0) -> dict[str, dict]:
        """Send a signed add-key (``public_key``) or retire-key (``fingerprint``; ``force``: even
        when it signed every good model of a device) command (agent/update/keys.py) and collect
        each device's answer (a retire-key's names the installed models it ``affects``)."""
        body: dict[str, Any] = {"op": op, "id": f"keyop-{uuid.uuid4().hex[:12]}", "issued": round(time.time(), 6)}
        try:
            if op == "add-key":
                body["key"] = hmod.public_key_pem(hmod.load_public_key(public_key))
            else:
                body["fingerprint"] = fingerprint
                if force:
                    body["force"] = True
            msg = hmod.sign_command(body, signing_key)
        except hmod.BundleError as e:
            raise FleetError(str(e)) from None
        data = json.dumps(msg).encode()
        devices = list(dict.fromkeys(devices))
        for d in devices:
            self.publish(d, protocol.topic(self.prefix, d, protocol.UPDATE_KEYS), data)
        return self._collect(devices, lambda d: self.key_acks.get((d, body["id"])), timeout)
