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
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
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


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str).encode("utf-8")


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
        self._seq = 0
        self.connects = 0
        self.offline_dropped = 0
        self.results_sent = 0
        self.snapshots_sent = 0
        self._will: dict = {}
        self._client: mqtt.Client | None = None
        self._thread: threading.Thread | None = None
        self.updater = None  # agent.updater.Updater: update topics are subscribed and routed to it

    # ------------------------------------------------------------------------------- client
    def _make_client(self) -> mqtt.Client:
        cfg = self.cfg
        v5 = self.protocol == "5"
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cfg.client_id,
                        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311,
                        **({} if v5 else {"clean_session": True}))
        c.enable_logger(logging.getLogger("tandoor.mqtt.paho"))
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

    @property
    def connected(self) -> bool:
        return self._connected

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
        log.info("connected to %s:%s (MQTT %s)", self.cfg["broker.host"], self.cfg["broker.port"], self.protocol)
        self._publish_status_now(self._status_fn())
        if self.updater is not None:
            self.updater.on_connected()

    def _on_connect_fail(self, client, userdata) -> None:
        log.debug("cannot reach %s:%s; retrying", self.cfg["broker.host"], self.cfg["broker.port"])

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        with self._cond:
            was = self._connected
            self._connected = False
            self._cond.notify_all()
        if was and not self._stopping:
            log.warning("lost the broker (%s); reconnecting with backoff", reason_code)

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._cond:
            self._acked.add(mid)
            self._cond.notify_all()

    def _on_message(self, client, userdata, msg) -> None:
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
        except Exception as err:  # never let a request take the network thread down
            log.exception("cannot parse a request")
            req = Request(None, {}, self.topic["response"], error=f"bad request: {err}")
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
        props = getattr(msg, "properties", None)
        rt = getattr(props, "ResponseTopic", None) if props is not None else None
        cd = getattr(props, "CorrelationData", None) if props is not None else None
        req = Request(None, {}, rt or self.topic["response"], correlation_data=cd)
        try:
            body = json.loads(msg.payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            req.error = f"malformed request: not JSON ({e})"
            return req
        if not isinstance(body, dict):
            req.error = "malformed request: the payload must be a JSON object"
            return req
        req.correlation_id = body.get("correlation_id")
        if not rt:
            frt = body.get("response_topic")
            if frt is not None:
                if not isinstance(frt, str) or not frt or any(ch in frt for ch in "+#\0"):
                    req.error = "malformed request: response_topic must be a topic name without wildcards"
                    return req
                req.response_topic = frt
        cmd = body.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            req.error = "malformed request: missing \"cmd\" (a string)"
            return req
        args = body.get("args", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            req.error = "malformed request: \"args\" must be an object"
            return req
        req.cmd, req.args = cmd, args
        return req

    # ------------------------------------------------------------------------------ publish
    def _props(self, packet: int = PacketTypes.PUBLISH, **values: Any) -> Properties | None:
        if self.protocol != "5" or not values:
            return None
        p = Properties(packet)
        for k, v in values.items():
            setattr(p, k, v)
        return p

    def respond(self, req: Request, ok: bool, result: Any = None, error: str | None = None) -> None:
        body: dict[str, Any] = {"ok": ok, "cmd": req.cmd, "device_id": self.cfg["device_id"], "ts": round(time.time(), 3)}
        if req.correlation_id is not None:
            body["correlation_id"] = req.correlation_id
        if ok:
            body["result"] = result
        else:
            body["error"] = error
        props = {"MessageExpiryInterval": RESPONSE_EXPIRY_S}
        if req.correlation_data is not None:
            props["CorrelationData"] = req.correlation_data
        c = self._client
        if c is not None:
            c.publish(req.response_topic, _json(body), qos=1, properties=self._props(**props))

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
        """Queue one telemetry message; returns its sequence number. While offline at most
        ``offline_buffer`` are kept (the oldest dropped, counted in ``offline_dropped``)."""
        with self._cond:
            self._seq += 1
            msg = {"seq": self._seq, "device_id": self.cfg["device_id"], "session": self.session, **snapshot}
            if not self._connected:
                msg["queued_offline"] = True
                limit = self._buffer_size
                # the queue may still hold messages from before the outage, keep at most `limit`
                while self._queue and len(self._queue) >= max(limit, 1):
                    self._queue.popleft()
                    self.offline_dropped += 1
                if limit == 0:
                    self.offline_dropped += 1
                    return self._seq
            self._queue.append(msg)
            self._cond.notify_all()
            return self._seq

    @property
    def buffered(self) -> int:
        return len(self._queue)

    def stats(self) -> dict:
        return {"connected": self._connected, "protocol": self.protocol, "connects": self.connects,
                "telemetry_buffered": len(self._queue), "telemetry_dropped_offline": self.offline_dropped,
                "results_sent": self.results_sent, "snapshots_sent": self.snapshots_sent}

    # ------------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        """Sends queued telemetry one message at a time, each after the previous one's PUBACK;
        swaps in a 3.1.1 client when the broker refuses MQTT 5."""
        inflight: int | None = None  # mid of the message waiting for its PUBACK
        inflight_msg: dict | None = None  # and the queue entry it was made from
        while True:
            with self._cond:
                while True:
                    if self._downgrade:
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
                if inflight is not None and inflight in self._acked:
                    self._acked.discard(inflight)
                    # a full offline buffer may already have dropped it (paho still re-sent it)
                    if self._queue and self._queue[0] is inflight_msg:
                        self._queue.popleft()
                    inflight = inflight_msg = None
                    continue
                if not downgrade:
                    inflight_msg = self._queue[0]
                    msg = dict(inflight_msg)
            if downgrade:
                old = self._client
                old.loop_stop()
                try:
                    old.disconnect()
                except Exception:
                    pass
                self.protocol = "3.1.1"
                self._acked.clear()
                inflight = inflight_msg = None
                self._client = self._make_client()
                self._connect(self._client)
                continue
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
