"""MQTT -> database: what the console hears from every device, written in batches.

One paho client per broker (a console may read several brokers, each holding a share of the
devices) subscribes to ``$share/<group>/<prefix>/+/<leaf>`` for every leaf of ``LEAVES`` (MQTT 5
shared subscriptions: consoles of one group split the messages). Shared subscriptions get no
retained messages, so at every connect the client also subscribes plainly to the retained leaves
for ``RETAINED_S`` seconds (the fleet as it is now). Each message is taken from one of them only,
told apart by the MQTT 5 subscription identifier: retained ones from the plain subscription, live
ones from the shared one (mosquitto also sends retained messages to shared subscriptions).

Every payload is checked against its leaf's size limit and parsed (JSON object, or a JPEG for
snapshots); a bad one is one log line and a counter, never an exception out of the callback.
Parsed messages go through a bounded queue to one writer thread, which applies them to the store
in one transaction per batch (at most ``BATCH_S`` s or ``BATCH_N`` messages) and then calls the
``on_change`` hooks (the pages' server-sent events).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tandoor_contract import protocol

from ..client import BrokerURL
from .store import Msg, Store, StoreError

log = logging.getLogger("tandoor.console")


@dataclass(frozen=True)
class Leaf:
    name: str
    max_bytes: int
    retained: bool
    binary: bool = False


LEAVES: dict[str, Leaf] = {leaf.name: leaf for leaf in [
    Leaf(protocol.STATUS, 64 * 1024, True),
    Leaf(protocol.TELEMETRY, 64 * 1024, False),
    Leaf(protocol.RESULTS, 256 * 1024, False),
    Leaf(protocol.SNAPSHOT, 1024 * 1024, True, binary=True),   # the broker's max_packet_size
    Leaf(protocol.UPDATE_ACK, 64 * 1024, True),
]}
QUEUE_MAX = 20000
BATCH_S = 0.2
BATCH_N = 2000
RETAINED_S = 3.0
RESULTS_EVERY_S = 5.0  # a device's results kept at most this often (the agent sends up to results_max_rate_hz)
RETAINED_SUB_ID = 1   # MQTT 5 subscription identifier of the plain subscription to the retained leaves
PRUNE_EVERY_S = 60.0
DEVICE_ID_MAX = 200


class BrokerLink:
    """One broker: connection state (``connected``, ``stale_since``) and its paho client."""

    def __init__(self, url: str, prefix: str, group: str, sink: Callable[[Msg], None], cafile: str | None = None,
                 counters: Counter | None = None, leaves: tuple[str, ...] = tuple(LEAVES)) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.url = BrokerURL.parse(url)
        self.name = f"{self.url.host}:{self.url.port}"
        self.prefix, self.group, self.sink, self.leaves = prefix, group, sink, leaves
        self._result_at: dict[str, float] = {}
        self.counters = counters if counters is not None else Counter()
        self.connected = False
        self.stale_since: float | None = time.time()     # not yet connected: nothing is fresh
        self.last_error: str | None = None
        self._mqtt = mqtt
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"tandoor-console-{uuid.uuid4().hex[:8]}",
                             protocol=mqtt.MQTTv5)
        if self.url.username:
            self.c.username_pw_set(self.url.username, self.url.password)
        if self.url.tls or cafile:
            self.c.tls_set(ca_certs=cafile)
        self.c.reconnect_delay_set(0.5, 5)
        self.c.on_connect = self._on_connect
        self.c.on_disconnect = self._on_disconnect
        self.c.on_message = self._on_message
        self._retained_mids: list[str] = []

    def start(self) -> BrokerLink:
        self.c.connect_async(self.url.host, self.url.port, 30, clean_start=True)
        self.c.loop_start()
        return self

    def stop(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        if reason.is_failure:
            self.last_error = f"the broker {self.name} refused the connection: {reason}"
            log.warning("%s", self.last_error)
            return
        self.connected, self.stale_since, self.last_error = True, None, None
        log.info("connected to the broker %s", self.name)
        shared = [(f"$share/{self.group}/{protocol.fleet_filter(self.prefix, leaf)}", 1) for leaf in self.leaves]
        client.subscribe(shared)
        plain = [protocol.fleet_filter(self.prefix, leaf) for leaf, spec in LEAVES.items() if spec.retained]
        props = self._mqtt.Properties(self._mqtt.PacketTypes.SUBSCRIBE)
        props.SubscriptionIdentifier = RETAINED_SUB_ID   # what it delivers live came through the shared one too
        client.subscribe([(t, 1) for t in plain], properties=props)
        t = threading.Timer(RETAINED_S, lambda: client.unsubscribe(plain) if self.connected else None)
        t.daemon = True
        t.start()

    def _on_disconnect(self, client, userdata, flags, reason, props) -> None:
        if self.connected:
            self.stale_since = time.time()
            log.warning("lost the broker %s (%s): serving what the database has, stale since %s", self.name,
                        reason, time.strftime("%H:%M:%S"))
        self.connected = False

    def _on_message(self, client, userdata, msg) -> None:
        ids = getattr(getattr(msg, "properties", None), "SubscriptionIdentifier", None) or []
        on_plain = RETAINED_SUB_ID in (ids if isinstance(ids, list) else [ids])
        if on_plain != bool(msg.retain):
            # a live message on the plain subscription (the shared one has it), or a retained one on
            # the shared subscription (mosquitto sends those too; the plain one has it)
            return
        if msg.topic.endswith("/" + protocol.RESULTS):   # the latest result is what a page shows: one per period
            now = time.monotonic()
            if now - self._result_at.get(msg.topic, -RESULTS_EVERY_S) < RESULTS_EVERY_S:
                self.counters["results_skipped"] += 1
                return
            if len(self._result_at) > 1_000_000:
                self._result_at.clear()
            self._result_at[msg.topic] = now
        try:
            m = parse(self.prefix, msg.topic, bytes(msg.payload), getattr(msg, "properties", None))
        except ValueError as e:
            self.counters["rejected"] += 1
            log.warning("dropped a message on %r: %s", msg.topic[:200], e)
            return
        except Exception as e:  # noqa: BLE001 (a callback must never die)
            self.counters["rejected"] += 1
            log.warning("dropped a message on %r: %s: %s", msg.topic[:200], type(e).__name__, e)
            return
        if m is not None:
            self.sink(m)


def parse(prefix: str, topic: str, payload: bytes, props=None) -> Msg | None:
    """The message on ``<prefix>/<device>/<leaf>``, checked; None for a topic the console does
    not keep; ValueError naming the problem for a bad one."""
    head = prefix + "/"
    if not topic.startswith(head):
        return None
    dev, _, leaf = topic[len(head):].partition("/")
    spec = LEAVES.get(leaf)
    if spec is None or not dev or dev == protocol.FLEET_LEVEL:
        return None
    if len(dev) > DEVICE_ID_MAX:
        raise ValueError(f"a device id of {len(dev)} characters is over the {DEVICE_ID_MAX} limit")
    if spec.binary:
        if len(payload) > spec.max_bytes:
            raise ValueError(f"{leaf} of {len(payload)} bytes is over the {spec.max_bytes} byte limit")
        if not payload.startswith(b"\xff\xd8"):
            raise ValueError(f"{leaf} is not a JPEG")
        body = {}
        for k, v in (getattr(props, "UserProperty", None) or []):
            if k == "detections" and str(v).isdigit():
                body["detections"] = int(v)
        return Msg(leaf, dev, body, jpeg=payload)
    return Msg(leaf, dev, protocol.json_object(payload, spec.max_bytes, leaf))


class Ingest:
    """The brokers' messages into the store: ``start()``, ``stop()``, ``health()``."""

    def __init__(self, store: Store, brokers: list[str], prefix: str = protocol.DEFAULT_PREFIX,
                 group: str = "tandoor-console", cafile: str | None = None, results: bool = True) -> None:
        self.store = store
        self.counters: Counter = Counter()
        self.q: queue.Queue[Msg] = queue.Queue(QUEUE_MAX)
        leaves = tuple(k for k in LEAVES if results or k != protocol.RESULTS)
        self.links = [BrokerLink(b, prefix, group, self._put, cafile, self.counters, leaves) for b in brokers]
        self.on_change: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="console-writer")
        self.last_write: float | None = None
        self.ingest_lag: list[float] = []   # seconds from a telemetry's ts to its commit, the last 1000

    def start(self) -> Ingest:
        self._writer.start()
        for link in self.links:
            link.start()
        return self

    def stop(self) -> None:
        for link in self.links:
            link.stop()
        self._stop.set()
        self._writer.join(10)

    def _put(self, m: Msg) -> None:
        try:
            self.q.put_nowait(m)
            self.counters["received"] += 1
        except queue.Full:
            self.counters["dropped_queue_full"] += 1
            if self.counters["dropped_queue_full"] in (1, 10, 100, 1000) or self.counters["dropped_queue_full"] % 10000 == 0:
                log.warning("the writer is behind: %d messages dropped (queue of %d full)",
                            self.counters["dropped_queue_full"], QUEUE_MAX)

    def _write_loop(self) -> None:
        next_prune = time.monotonic() + 5.0
        while not self._stop.is_set() or not self.q.empty():
            batch: list[Msg] = []
            try:
                batch.append(self.q.get(timeout=BATCH_S))
            except queue.Empty:
                pass
            deadline = time.monotonic() + BATCH_S
            while batch and len(batch) < BATCH_N and time.monotonic() < deadline:
                try:
                    batch.append(self.q.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_EVERY_S
                try:
                    gone = self.store.prune()
                    if any(gone.values()):
                        log.info("retention: deleted %s", ", ".join(f"{v} {k}" for k, v in gone.items() if v))
                except StoreError as e:
                    log.warning("retention: %s", e)
        self.store.close()

    def _write(self, batch: list[Msg]) -> None:
        try:
            self.store.apply(batch)
        except StoreError as e:
            self.counters["lost_store_error"] += len(batch)
            log.error("%s; %d message(s) not kept", e, len(batch))
            self._notify()
            return
        except Exception as e:  # noqa: BLE001 (one bad message must not stop the writer)
            # a message the store could not take (a value of an unexpected type): apply one by one
            log.warning("a batch failed (%s: %s); writing its messages one at a time", type(e).__name__, e)
            self.store.close()
            for m in batch:
                try:
                    self.store.apply([m])
                except Exception as e1:  # noqa: BLE001
                    self.counters["rejected"] += 1
                    log.warning("dropped a %s message from %r: %s: %s", m.kind, m.device[:200], type(e1).__name__, e1)
                    self.store.close()
        now = time.time()
        self.last_write = now
        self.counters["written"] += len(batch)
        for m in batch:
            if m.kind == protocol.TELEMETRY and isinstance(m.body.get("ts"), (int, float)):
                self.ingest_lag.append(now - float(m.body["ts"]))
        del self.ingest_lag[:-1000]
        self._notify()

    def _notify(self) -> None:
        for fn in list(self.on_change):
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log.warning("a change hook failed: %s", e)

    def health(self) -> dict:
        """What the pages say about the console itself: brokers, staleness, the database."""
        stale = [link.stale_since for link in self.links if link.stale_since is not None]
        return {"brokers": [{"name": link.name, "connected": link.connected, "stale_since": link.stale_since,
                             "error": link.last_error} for link in self.links],
                "stale_since": min(stale) if stale else None,
                "db_error": self.store.write_error, "db_error_since": self.store.write_error_since,
                "counters": dict(self.counters), "queue": self.q.qsize()}
