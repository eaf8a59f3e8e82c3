"""The agent's MQTT link (paho-mqtt 2.x): status with birth/death (the will), telemetry with an
offline buffer, rate-limited results, and commands with request/response.

Topics, under ``<topic_prefix>/<device_id>/`` (docs/protocol.md has the payloads):

    status     retained, QoS 1: {"online": true, ...} on every connect (the "birth"); the same
               topic with {"online": false, "reason": "connection lost"} is registered as the MQTT
               will (the "death", Sparkplug-style), and {"online": false, "reason": "stopped"} is
               published before a clean disconnect.
    telemetry  QoS 1, every telemetry_period_s, each with a sequence number ``seq``. Kept in a
               bounded queue (offline_buffer, oldest dropped first) and sent one at a time, the next
               only after the broker acknowledged the previous: after an outage they arrive in
               order, nothing duplicated by the agent (a QoS 1 resend may duplicate one).
    results    QoS 0, the latest result, at most results_max_rate_hz; not buffered.
    snapshot   retained, QoS 0: a JPEG of the latest frame with its boxes, every snapshot.period_s
               and on the "snapshot" command.
    cmd        requests (the agent subscribes, QoS 1).
    response   default response topic, when a request names none.

MQTT 5 is used when the broker speaks it (``broker.protocol = "auto"`` tries 5, and after a
CONNACK refusing the protocol version reconnects with 3.1.1 for the life of the process). With
MQTT 5, a request's Response Topic and Correlation Data properties are honoured (the correlation
data is echoed as a property of the response); with 3.1.1, or when a v5 request carries no
Response Topic, ``response_topic`` and ``correlation_id`` fields of the JSON request are used.
Responses carry a Message Expiry Interval (60 s); results 10 s.

Hostile requests never take the agent down: a response topic that cannot carry a response (not
UTF-8, over 65535 bytes, a wildcard, NUL, ``$``-reserved, or under the topic prefix but not this
device's ``response``: a device's inbound topics would read the answer back as a request) is
refused as a malformed request, answered on ``<base>/response``; ``respond()`` never raises; paho's
callbacks run with ``suppress_exceptions``. A request whose correlation (MQTT 5 Correlation Data,
else the JSON ``correlation_id``), response topic and payload were seen in the last
``REPLAY_WINDOW_S`` is not run again: it gets the recorded response with ``"repeated": true`` (a
QoS 1 redelivery or a replay runs a command once).

Liveness: the sender thread watches paho's network thread; when it has died (a bug, a callback
that raised through paho) the client is replaced: the old socket is closed (the broker publishes
the will), a new client connects and publishes the birth message again (``loop_restarts``
counts it). ``alive`` is False once the sender thread itself died; the service then exits so the
service manager restarts the agent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tandoor_contract import protocol

from .config import Config

log = logging.getLogger("tandoor.mqtt")

RESPONSE_EXPIRY_S = 60
RESULT_EXPIRY_S = 10
_UNSUPPORTED_PROTOCOL = 132  # CONNACK reason "Unsupported protocol version" (and 3.1.1's rc 1)
MAX_TOPIC_BYTES = 65535      # an MQTT topic name's length field is 16 bits
MAX_REQUEST_BYTES = 64 * 1024  # a command request; every real one is a few hundred bytes
MAX_CORRELATION_ID_BYTES = 1024
CMD_RE = re.compile(r"^[a-z][a-z0-9-]{0,63}$")
REPLAY_WINDOW_S = RESPONSE_EXPIRY_S  # a repeated request within the life of its answer gets that answer
UNREACHABLE_SAY_S = 60.0     # a broker that stays out of reach is said again this often


def _unreachable(host: str, port: int) -> str:
    """Why a connect failed, as far as the agent can tell: the name, or nobody answering."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        return f"{host} does not resolve: {err.strerror or err}; check broker.host and the board's /etc/hosts"
    return "no answer on that address; check that the broker runs and broker.port"
REPLAY_MEMORY = 256                  # ... of the last this many requests
#: test failpoint: "kill-loop:N" ends paho's network thread, "kill-sender:N" the sender thread,
#: when telemetry message N is acknowledged / about to be sent (as a bug in either would)
FAILPOINT_ENV = "TANDOOR_MQTT_FAILPOINT"


class _Failpoint(BaseException):
    """Raised by the test failpoint: a BaseException, so no ``except Exception`` (ours, or paho's
    suppress_exceptions) keeps it from ending the thread it is raised in."""


def _failpoint() -> tuple[str, int] | None:
    v = os.environ.get(FAILPOINT_ENV, "")
    m = re.fullmatch(r"(kill-loop|kill-sender):(\d+)", v)
    return (m.group(1), int(m.group(2))) if m else None


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str).encode("utf-8")


def topic_problem(topic: Any, *, prefix: str, base: str) -> str | None:
    """Why ``topic`` cannot carry a response from the device at ``base`` (under ``prefix``), or
    None when it can. Checked before anything is published, so paho never raises on it."""
    if not isinstance(topic, str) or not topic:
        return "must be a non-empty string"
    try:
        n = len(topic.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8 (it has a lone surrogate)"
    if n > MAX_TOPIC_BYTES:
        return f"is {n} bytes long, over MQTT's {MAX_TOPIC_BYTES}"
    if "+" in topic or "#" in topic:
        return "must be a topic name without wildcards (+ or #)"
    if "\0" in topic:
        return "must not contain NUL"
    if topic.startswith("$"):
        return "must not start with $ (reserved for the broker)"
    if (topic == prefix or topic.startswith(prefix + "/")) and topic != f"{base}/{protocol.RESPONSE}":
        return (f"must not be under {prefix}/ other than {base}/{protocol.RESPONSE} (a device's inbound topics "
                "would read the answer as a request)")
    return None


@dataclass
class Request:
    """One command request, as received on <base>/cmd."""

    cmd: str | None
    args: dict
    response_topic: str
    correlation_data: bytes | None = None   # MQTT 5 property, echoed as a property
    correlation_id: Any = None              # JSON field, echoed as a field
    error: str | None = None                # set when the request itself is malformed
    received: float = field(default_factory=time.time)
    digest: bytes = b""                     # sha256 of the payload (the replay memory's key)


class Link:
    """Owns the paho client; thread-safe for the service loop to call into.

    ``on_command(request)`` is called from paho's network thread for every well-formed request;
    malformed ones are answered here with an error response. ``status()`` is called to build the
    birth message on each connect.
    """

    def __init__(self, cfg: Config, on_command: Callable[[Request], None] | None = None,
                 status: Callable[[], dict] | None = None, session: str | None = None) -> None:
        self.cfg = cfg
        self.base = cfg.topic_base
        self.prefix = cfg["broker.topic_prefix"]
        self.topic = {name: f"{self.base}/{name}" for name in (protocol.STATUS, protocol.TELEMETRY, protocol.RESULTS,
                                                               protocol.SNAPSHOT, protocol.CMD, protocol.RESPONSE)}
        self.on_command = on_command
        self._status_fn = status or (lambda: {})
        self.session = session or uuid.uuid4().hex[:12]
        self.protocol = "3.1.1" if cfg["broker.protocol"] == "3.1.1" else "5"
        self._buffer_size = cfg["offline_buffer"]
        self._queue: deque[dict] = deque()
        self._cond = threading.Condition()
        self._acked: set[int] = set()
        self._connected = False
        self._stopping = False
        self._downgrade = False
        self._unreachable_said = -float("inf")     # monotonic time the last "cannot reach" warning went out
        self._seq = 0
        self.connects = 0
        self.offline_dropped = 0
        self.results_sent = 0
        self.snapshots_sent = 0
        self.loop_restarts = 0
        self._will: dict = {}
        self._client: mqtt.Client | None = None
        self._thread: threading.Thread | None = None
        self._replies: OrderedDict[bytes, tuple[float, dict | None]] = OrderedDict()  # replay memory
        self._inflight_msg: dict | None = None  # the telemetry message waiting for its PUBACK
        self._failpoint = _failpoint()
        self.updater = None  # agent.updater.Updater: update topics are subscribed and routed to it

    # ------------------------------------------------------------------------------- client
    def _make_client(self) -> mqtt.Client:
        cfg = self.cfg
        v5 = self.protocol == "5"
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cfg.client_id,
                        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                        **({} if v5 else {"clean_session": True}))
        c.enable_logger(logging.getLogger("tandoor.mqtt.paho"))
        c.suppress_exceptions = True  # a callback's bug is logged, it does not end the network thread
        if cfg["broker.username"]:
            c.username_pw_set(cfg["broker.username"], cfg.password())
        if cfg.tls:
            c.tls_set(ca_certs=cfg["broker.tls.ca"] or None, certfile=cfg["broker.tls.cert"] or None,
                      keyfile=cfg["broker.tls.key"] or None)
            if cfg["broker.tls.insecure"]:
                c.tls_insecure_set(True)
        c.reconnect_delay_set(cfg["broker.reconnect_min_s"], cfg["broker.reconnect_max_s"])
        self._set_will(c)
        c.on_connect = self._on_connect
        c.on_connect_fail = self._on_connect_fail
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        return c

    def _set_will(self, c: mqtt.Client) -> None:
        payload = {"online": False, "reason": "connection lost", "device_id": self.cfg["device_id"],
                   "session": self.session, "ts": round(time.time(), 3), **self._will}
        c.will_set(self.topic["status"], _json(payload), qos=1, retain=True)

    def set_identity(self, **fields: Any) -> None:
        """Fields (model, slot, agent_version...) carried by the will from the next connect on."""
        self._will.update(fields)
        if self._client is not None:
            self._set_will(self._client)

    def start(self) -> None:
        self._client = self._make_client()
        self._connect(self._client)
        self._thread = threading.Thread(target=self._run, name="tandoor-mqtt-out", daemon=True)
        self._thread.start()

    def _connect(self, c: mqtt.Client) -> None:
        kw = {}
        if self.protocol == "5":
            kw["clean_start"] = True
        c.connect_async(self.cfg["broker.host"], self.cfg["broker.port"], self.cfg["broker.keepalive_s"], **kw)
        c.loop_start()

    @staticmethod
    def _network_alive(c: mqtt.Client) -> bool:
        # paho 2.x keeps its loop_start() thread in _thread and clears it when that thread ends,
        # however it ends (also by an exception that escaped its loop)
        t = getattr(c, "_thread", None)
        return t is not None and t.is_alive()

    def _replace_client(self, why: str) -> None:
        """A fresh paho client in place of the old one (sender thread only): the old socket is
        closed without a DISCONNECT, so the broker publishes the will; the new client's connect
        publishes the birth message. Telemetry in flight on the old client is sent again."""
        old = self._client
        log.warning("%s; starting a new MQTT client", why)
        try:
            old.loop_stop()
        except Exception:
            pass
        try:
            sock = old.socket()
            if sock is not None:
                sock.close()
        except Exception:
            pass
        with self._cond:
            was = self._connected
            self._connected = False
            self._acked.clear()
            self._cond.notify_all()
        if was:
            log.info("link down until the new client connects")
        self._client = self._make_client()
        self._connect(self._client)

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def alive(self) -> bool:
        """The link works or is trying to: its sender thread (which also restarts a dead network
        loop) runs. False before start() and after stop()."""
        t = self._thread
        return t is not None and t.is_alive()

    # ---------------------------------------------------------------------------- callbacks
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            if reason_code.value == _UNSUPPORTED_PROTOCOL and self.protocol == "5" \
                    and self.cfg["broker.protocol"] == "auto":
                log.warning("broker refuses MQTT 5; falling back to 3.1.1")
                with self._cond:
                    self._downgrade = True
                    self._cond.notify_all()
            else:
                log.error("broker refused the connection: %s", reason_code)
            return
        client.subscribe(self.topic["cmd"], qos=1)
        if self.updater is not None:
            for t in self.updater.subscriptions:
                client.subscribe(t, qos=1)
        with self._cond:
            self._connected = True
            self.connects += 1
            self._cond.notify_all()
        self._unreachable_said = -float("inf")      # the next outage is said at once
        log.info("connected to %s:%s (MQTT %s)", self.cfg["broker.host"], self.cfg["broker.port"], self.protocol)
        self._publish_status_now(self._status_fn())
        if self.updater is not None:
            self.updater.on_connected()

    def _on_connect_fail(self, client, userdata) -> None:
        # said at once and then every UNREACHABLE_SAY_S, not per retry: a broker that cannot be
        # reached (a host name the board cannot resolve, a port nobody listens on) must not be silent
        now = time.monotonic()
        if now - self._unreachable_said < UNREACHABLE_SAY_S:
            return
        self._unreachable_said = now
        host, port = self.cfg["broker.host"], self.cfg["broker.port"]
        log.warning("cannot reach the broker at %s:%s (%s); retrying with backoff", host, port, _unreachable(host, port))

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if client is not self._client:
            return  # a replaced client saying goodbye
        with self._cond:
            was = self._connected
            self._connected = False
            self._cond.notify_all()
        if was and not self._stopping:
            log.warning("lost the broker (%s); reconnecting with backoff", reason_code)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if client is not self._client:
            return
        with self._cond:
            self._acked.add(mid)
            self._cond.notify_all()
        fp = self._failpoint
        if fp is not None and fp[0] == "kill-loop" and self._seq >= fp[1]:
            self._failpoint = None
            log.error("%s=kill-loop: ending the MQTT network thread (test failpoint)", FAILPOINT_ENV)
            raise _Failpoint("kill-loop")

    def _on_message(self, client, userdata, msg) -> None:
        try:
            self._dispatch(msg)
        except Exception:  # never let a message take the network thread down
            log.exception("message on %r", str(msg.topic)[:200])

    def _dispatch(self, msg) -> None:
        if self.updater is not None and self.updater.wants(msg.topic):
            try:
                self.updater.on_message(msg.topic, msg.payload, getattr(msg, "properties", None))
            except Exception:
                log.exception("update message on %s", msg.topic)
            return
        if msg.topic != self.topic["cmd"]:
            return
        try:
            req = self._parse_request(msg)
        except Exception as err:  # a bug in the parser: still an answer, on the default topic
            log.exception("cannot parse a request")
            req = Request(None, {}, self.topic["response"], error=f"bad request: {err}")
        if self._replayed(req):
            return
        if req.error is not None:
            self.respond(req, ok=False, error=req.error)
            return
        if self.on_command is None:
            self.respond(req, ok=False, error="commands are not accepted yet")
            return
        try:
            self.on_command(req)
        except Exception as err:
            log.exception("command handler failed")
            self.respond(req, ok=False, error=f"internal error: {err}")

    def _parse_request(self, msg) -> Request:
        """The request in ``msg``; ``error`` says what is malformed (the rest is then unused
        except where the answer goes and the correlation to echo, both checked first)."""
        props = getattr(msg, "properties", None)
        rt = getattr(props, "ResponseTopic", None) if props is not None else None
        cd = getattr(props, "CorrelationData", None) if props is not None else None
        req = Request(None, {}, self.topic["response"], correlation_data=cd)

        def bad(why: str) -> Request:
            req.error = f"malformed request: {why}"
            return req

        if rt is not None:
            why = topic_problem(rt, prefix=self.prefix, base=self.base)
            if why is not None:
                return bad(f"the Response Topic {why}")
            req.response_topic = rt
        payload = bytes(msg.payload)
        req.digest = hashlib.sha256(payload).digest()
        if len(payload) > MAX_REQUEST_BYTES:
            return bad(f"{len(payload)} bytes, over the {MAX_REQUEST_BYTES} byte limit")
        try:
            body = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            return bad(f"not JSON ({' '.join(str(e).split())[:200]})")
        if not isinstance(body, dict):
            return bad("the payload must be a JSON object")
        cid = body.get("correlation_id")
        if cid is not None:
            try:
                n = len(_json(cid))
            except (ValueError, TypeError, RecursionError):
                return bad("correlation_id must be plain JSON (no NaN or Infinity)")
            if n > MAX_CORRELATION_ID_BYTES:
                return bad(f"correlation_id is {n} bytes as JSON, over {MAX_CORRELATION_ID_BYTES}")
            req.correlation_id = cid
        if rt is None:
            frt = body.get("response_topic")
            if frt is not None:
                why = topic_problem(frt, prefix=self.prefix, base=self.base)
                if why is not None:
                    return bad(f"response_topic {why}")
                req.response_topic = frt
        cmd = body.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            return bad("missing \"cmd\" (a string)")
        if not CMD_RE.match(cmd):
            return bad("\"cmd\" must be a command name (a-z, 0-9 and -, starting with a letter, at most 64)")
        args = body.get("args", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return bad("\"args\" must be an object")
        req.cmd, req.args = cmd, args
        return req

    # ---------------------------------------------------------------------- replay memory
    @staticmethod
    def _replay_key(req: Request) -> bytes | None:
        if req.correlation_data is not None:
            corr = b"cd:" + bytes(req.correlation_data)
        elif req.correlation_id is not None:
            corr = b"id:" + _json(req.correlation_id)
        else:
            return None
        # the payload too: a client that reuses a correlation for a new request gets it run
        return hashlib.sha256(corr + b"\0" + req.response_topic.encode("utf-8") + b"\0" + req.digest).digest()

    def _replayed(self, req: Request) -> bool:
        """True when ``req`` repeats a recent one (same correlation, response topic and payload): it
        gets the recorded response (or none while the first still runs), never a second run."""
        key = self._replay_key(req)
        if key is None:
            return False
        now = time.monotonic()
        with self._cond:
            while self._replies:
                k, (t, _) = next(iter(self._replies.items()))
                if now - t <= REPLAY_WINDOW_S and len(self._replies) <= REPLAY_MEMORY:
                    break
                self._replies.popitem(last=False)
            seen = self._replies.get(key)
            if seen is None:
                self._replies[key] = (now, None)
                return False
        body = seen[1]
        if body is None:
            log.info("a repeated request (%s) while the first still runs: ignored", req.cmd or "malformed")
        else:
            log.info("a repeated request (%s): answered from the record, not run again", body.get("cmd"))
            self._send_response(req, _json({**body, "repeated": True}))
        return True

    # ------------------------------------------------------------------------------ publish
    def _props(self, packet: int = PacketTypes.PUBLISH, **values: Any) -> Properties | None:
        if self.protocol != "5" or not values:
            return None
        p = Properties(packet)
        for k, v in values.items():
            setattr(p, k, v)
        return p

    def respond(self, req: Request, ok: bool, result: Any = None, error: str | None = None) -> bool:
        """Answer ``req`` (never raises: the service calls this with whatever came in). False when
        the answer could not be handed to paho."""
        body: dict[str, Any] = {"ok": ok, "cmd": req.cmd, "device_id": self.cfg["device_id"], "ts": round(time.time(), 3)}
        if req.correlation_id is not None:
            body["correlation_id"] = req.correlation_id
        if ok:
            body["result"] = result
        else:
            body["error"] = error
        try:
            payload = _json(body)
        except (ValueError, TypeError, RecursionError) as e:  # a result that is not plain JSON: a bug
            log.error("the response to %s is not JSON: %s", req.cmd, e)
            body = {k: v for k, v in body.items() if k != "result"}
            body.update(ok=False, error=f"internal error: the result is not JSON ({e})")
            payload = _json(body)
        key = self._replay_key(req)
        if key is not None:
            with self._cond:
                self._replies[key] = (time.monotonic(), body)
        return self._send_response(req, payload)

    def _send_response(self, req: Request, payload: bytes) -> bool:
        props = {"MessageExpiryInterval": RESPONSE_EXPIRY_S}
        if req.correlation_data is not None:
            props["CorrelationData"] = req.correlation_data
        c = self._client
        if c is None:
            return False
        try:
            info = c.publish(req.response_topic, payload, qos=1, properties=self._props(**props))
        except Exception as e:  # the topic was checked; anything else paho refuses is only logged
            log.warning("cannot send the response to %s on %r: %s", req.cmd, req.response_topic[:200], e)
            return False
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    def _publish_status_now(self, status: dict) -> None:
        c = self._client
        if c is None:
            return
        payload = {"online": True, "device_id": self.cfg["device_id"], "session": self.session,
                   "protocol": self.protocol, **status, "ts": round(time.time(), 3)}
        c.publish(self.topic["status"], _json(payload), qos=1, retain=True)

    def publish_raw(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        """For the updater (acks, need): QoS 1 is queued by paho while offline."""
        c = self._client
        if c is not None:
            c.publish(topic, payload, qos=qos, retain=retain)

    def subscribe_raw(self, topic: str) -> None:
        """For the updater: follow a job's fleet-wide chunk topic (re-subscribed at every connect
        from ``updater.subscriptions``)."""
        c = self._client
        if c is not None:
            c.subscribe(topic, qos=1)

    def unsubscribe_raw(self, topic: str) -> None:
        c = self._client
        if c is not None:
            c.unsubscribe(topic)

    def publish_status(self, status: dict) -> None:
        """A fresh birth message (state changed: running, model reloaded...). Only while connected;
        every (re)connect publishes one anyway."""
        if self._connected:
            self._publish_status_now(status)

    def publish_result(self, result: dict) -> bool:
        """QoS 0, not buffered: a result is only worth something now."""
        c = self._client
        if c is None or not self._connected:
            return False
        info = c.publish(self.topic["results"], _json(result), qos=0,
                         properties=self._props(MessageExpiryInterval=RESULT_EXPIRY_S))
        ok = info.rc == mqtt.MQTT_ERR_SUCCESS
        self.results_sent += ok
        return ok

    # --- snapshots: a JPEG of the latest frame with its boxes (retained, like Frigate's) -----------
    def publish_snapshot(self, jpeg: bytes, seq: int, detections: int) -> bool:
        """The raw JPEG on ``<base>/snapshot``, retained, QoS 0 (only while connected: an old
        picture is not worth queueing). MQTT 5: Content Type image/jpeg, the frame's seq and
        detection count as user properties."""
        c = self._client
        if c is None or not self._connected:
            return False
        props = None
        if self.protocol == "5":
            props = Properties(PacketTypes.PUBLISH)
            props.ContentType = "image/jpeg"
            props.UserProperty = [("seq", str(seq)), ("detections", str(detections)), ("ts", f"{time.time():.3f}")]
        info = c.publish(self.topic["snapshot"], jpeg, qos=0, retain=True, properties=props)
        ok = info.rc == mqtt.MQTT_ERR_SUCCESS
        self.snapshots_sent += ok
        return ok

    def publish_telemetry(self, snapshot: dict) -> int:
        """Queue one telemetry message; returns its sequence number. At most ``offline_buffer``
        wait besides the one in flight, the oldest dropped first and counted in
        ``offline_dropped`` (each dropped one is a gap in ``seq``, and every gap is counted): while
        offline, and also while a stalled connection is not yet known to be dead (acks stop
        coming, the queue grows)."""
        with self._cond:
            self._seq += 1
            msg = {"seq": self._seq, "device_id": self.cfg["device_id"], "session": self.session, **snapshot}
            if not self._connected:
                msg["queued_offline"] = True
                if self._buffer_size == 0:
                    self.offline_dropped += 1
                    return self._seq
            sent = 1 if self._queue and self._queue[0] is self._inflight_msg else 0  # goes out anyway
            while len(self._queue) - sent >= max(self._buffer_size, 1):
                del self._queue[sent]
                self.offline_dropped += 1
            self._queue.append(msg)
            self._cond.notify_all()
            return self._seq

    @property
    def buffered(self) -> int:
        return len(self._queue)

    def stats(self) -> dict:
        return {"connected": self._connected, "protocol": self.protocol, "connects": self.connects,
                "telemetry_buffered": len(self._queue), "telemetry_dropped_offline": self.offline_dropped,
                "results_sent": self.results_sent, "snapshots_sent": self.snapshots_sent,
                "loop_restarts": self.loop_restarts}

    # ------------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        try:
            self._send_loop()
        except _Failpoint:
            log.error("%s=kill-sender: the sender thread ends (test failpoint)", FAILPOINT_ENV)
        except Exception:
            log.exception("the MQTT sender thread died")

    def _send_loop(self) -> None:
        """Sends queued telemetry one message at a time, each after the previous one's PUBACK;
        replaces the client when paho's network thread died, and with a 3.1.1 client when the
        broker refuses MQTT 5."""
        inflight: int | None = None  # mid of the message waiting for its PUBACK
        inflight_msg: dict | None = None  # and the queue entry it was made from
        while True:
            with self._cond:
                while True:
                    if self._downgrade:
                        break
                    if not self._stopping and not self._network_alive(self._client):
                        break
                    if inflight is not None and inflight in self._acked:
                        break
                    if inflight is None and self._connected and self._queue:
                        break
                    if self._stopping and (inflight is None and (not self._queue or not self._connected)):
                        return
                    self._cond.wait(0.5)
                    if self._stopping and self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                        return
                downgrade, self._downgrade = self._downgrade, False
                dead = not downgrade and not self._stopping and not self._network_alive(self._client)
                if not (downgrade or dead) and inflight is not None and inflight in self._acked:
                    self._acked.discard(inflight)
                    if self._queue and self._queue[0] is inflight_msg:  # never dropped while in flight
                        self._queue.popleft()
                    inflight = inflight_msg = self._inflight_msg = None
                    continue
                if not (downgrade or dead):
                    inflight_msg = self._inflight_msg = self._queue[0]
                    msg = dict(inflight_msg)
            if downgrade or dead:
                if downgrade:
                    self.protocol = "3.1.1"
                else:
                    self.loop_restarts += 1
                self._replace_client("the broker refuses MQTT 5" if downgrade else
                                     "the MQTT network thread died (its connection is gone)")
                inflight = inflight_msg = self._inflight_msg = None  # goes again on the new client
                continue
            fp = self._failpoint
            if fp is not None and fp[0] == "kill-sender" and msg["seq"] >= fp[1]:
                raise _Failpoint("kill-sender")
            msg["sent_ts"] = round(time.time(), 3)
            info = self._client.publish(self.topic["telemetry"], _json(msg), qos=1)
            # Even when this fails with "not connected", paho keeps the QoS 1 message and sends it
            # after reconnecting: wait for its PUBACK in every case, never publish it twice.
            inflight = info.mid

    _drain_deadline: float | None = None

    def stop(self, reason: str = "stopped", status: dict | None = None, timeout: float = 5.0) -> None:
        """Drain queued telemetry (bounded by ``timeout``), publish the retained offline status,
        disconnect cleanly (no will), stop the network thread."""
        c = self._client
        if c is None:
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            self._drain_deadline = deadline
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        c = self._client  # the sender may have replaced it
        if self._connected:
            payload = {"online": False, "reason": reason, "device_id": self.cfg["device_id"],
                       "session": self.session, "protocol": self.protocol, **(status or {}),
                       "ts": round(time.time(), 3)}
            payload["online"] = False
            info = c.publish(self.topic["status"], _json(payload), qos=1, retain=True)
            try:
                info.wait_for_publish(max(0.5, deadline - time.monotonic()))
            except (RuntimeError, ValueError):
                pass
        try:
            c.disconnect()
        except Exception:
            pass
        c.loop_stop()
        self._connected = False
