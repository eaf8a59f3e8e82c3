"""A real mosquitto broker for tests: a free port, a temp config, start / kill -9 / restart on
the same port, and a small paho client that records what it receives.

    with Broker(tmp_path) as b:      # b.port
        b.kill(); b.start()          # broker crash and comeback on the same port
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> bool:
    return os.access(MOSQUITTO, os.X_OK)


class Broker:
    def __init__(self, workdir: Path, port: int | None = None, extra_config: str = "",
                 allow_anonymous: bool = True, listener_config: str = "") -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.conf = self.dir / "mosquitto.conf"
        self.log = self.dir / "mosquitto.log"
        # No persistence: a restarted broker has lost every retained message and session, like a
        # broker that crashed on a fresh disk; the agent must publish its status again.
        self.conf.write_text(
            f"listener {self.port} 127.0.0.1\n"
            + listener_config
            + f"allow_anonymous {'true' if allow_anonymous else 'false'}\n"
            "persistence false\n"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            + extra_config
        )
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> Broker:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    time.sleep(0.05)  # listening is not yet serving: give it a moment
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not listen on {self.port}")

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, connections drop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def restart(self) -> None:
        self.kill()
        self.start()

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_tls_files(d: Path) -> dict[str, Path]:
    """A CA and a server certificate for localhost/127.0.0.1 (PEM), made with cryptography."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("tandoor test CA")).issuer_name(name("tandoor test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    os.chmod(files["key"], 0o644)  # mosquitto may run as another user
    return files


class Recorder:
    """A paho subscriber that keeps every message: (topic, payload bytes, properties, retain).

    ``wait_for(pred, timeout)`` waits until some recorded message satisfies pred(msg);
    ``subscribe(topic)`` returns once the broker's SUBACK granted it."""

    def __init__(self, port: int, topics: list[str] | str = "#", protocol: int | None = None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self._mqtt = mqtt
        self.port = port
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.messages: list[Message] = []
        self._cond = threading.Condition()
        self.subscribed = threading.Event()
        self._subacks: dict[int, list[bool]] = {}  # mid -> failure flag per topic, from each SUBACK
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"rec-{uuid.uuid4().hex[:8]}",
                                  protocol=protocol or mqtt.MQTTv5)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.reconnect_delay_set(0.2, 1)

    def start(self, timeout: float = 10.0) -> Recorder:
        self.client.connect_async("127.0.0.1", self.port, 30)
        self.client.loop_start()
        assert self.subscribed.wait(timeout), "recorder did not subscribe"
        return self

    def _on_connect(self, client, userdata, flags, reason, props) -> None:
        client.subscribe([(t, 1) for t in self.topics])  # one SUBACK for all: `subscribed` means all

    def _on_subscribe(self, client, userdata, mid, reason_codes, props) -> None:
        with self._cond:
            self._subacks[mid] = [rc.is_failure for rc in reason_codes]
            self._cond.notify_all()
        self.subscribed.set()

    def subscribe(self, topic: str, qos: int = 1, timeout: float = 10.0) -> None:
        """Subscribe and wait for the SUBACK: from then on the broker delivers topic to us."""
        rc, mid = self.client.subscribe(topic, qos=qos)
        assert rc == self._mqtt.MQTT_ERR_SUCCESS, f"subscribe {topic}: {self._mqtt.error_string(rc)}"
        with self._cond:
            assert self._cond.wait_for(lambda: mid in self._subacks, timeout), f"no SUBACK for {topic} in {timeout} s"
            assert not any(self._subacks[mid]), f"the broker refused the subscription to {topic}"

    def _on_message(self, client, userdata, msg) -> None:
        m = Message(msg.topic, bytes(msg.payload), getattr(msg, "properties", None), bool(msg.retain), time.time())
        with self._cond:
            self.messages.append(m)
            self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 30.0, what: str = "a message"):
        """The first recorded message satisfying pred, waiting up to timeout. A predicate that
        raises fails the test naming the message: a malformed message is a finding, not "no match"
        (predicates check the topic before they parse the payload)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for m in self.messages:
                    try:
                        if pred(m):
                            return m
                    except Exception as e:
                        raise AssertionError(f"waiting for {what}: the predicate raised "
                                             f"{type(e).__name__}: {e} on {m!r}") from e
                left = deadline - time.monotonic()
                if left <= 0:
                    topics = [x.topic for x in self.messages[-10:]]
                    raise AssertionError(f"timed out waiting for {what}; last topics: {topics}")
                self._cond.wait(min(left, 0.5))

    def on(self, suffix: str) -> list[Message]:
        with self._cond:
            return [m for m in self.messages if m.topic.endswith(suffix)]

    def clear(self) -> None:
        with self._cond:
            self.messages.clear()

    def publish(self, topic: str, payload: bytes | str, qos: int = 1, properties=None, retain: bool = False):
        info = self.client.publish(topic, payload, qos=qos, properties=properties, retain=retain)
        info.wait_for_publish(10)
        return info

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Message:
    __slots__ = ("topic", "payload", "properties", "retain", "t")

    def __init__(self, topic, payload, properties, retain, t) -> None:
        self.topic, self.payload, self.properties, self.retain, self.t = topic, payload, properties, retain, t

    def json(self):
        return json.loads(self.payload)

    def __repr__(self) -> str:
        return f"<{self.topic} retain={self.retain} {self.payload[:80]!r}>"


# --- the shipped, secured broker config (mosquitto/tandoor.conf + acl) --------------------------------------------------------------------

def secured_broker(d: Path, users: dict[str, str], tls: dict[str, Path] | None = None) -> Broker:
    """mosquitto/tandoor.conf with its global part as shipped (auth, ACL file, limits), the file
    paths pointed at temp files, and on a free port either a plain listener or (``tls``: the
    make_tls_files certificates) the shipped TLS listener with its certificate paths replaced."""
    passwd = d / "tandoor.passwd"
    for i, (u, p) in enumerate(users.items()):
        tool = shutil.which("mosquitto_passwd") or str(Path(MOSQUITTO).with_name("mosquitto_passwd"))
        subprocess.run([tool, *(["-c"] if i == 0 else []), "-b", str(passwd), u, p], check=True)
    conf = (ROOT / "mosquitto" / "tandoor.conf").read_text()
    glob, listeners = conf.split("# ---- listeners")
    assert re.search(r"^allow_anonymous false$", glob, re.M) and re.search(r"^acl_file ", glob, re.M)
    glob = re.sub(r"^password_file .*$", f"password_file {passwd}", glob, flags=re.M)
    glob = re.sub(r"^acl_file .*$", f"acl_file {ROOT / 'mosquitto' / 'acl'}", glob, flags=re.M)
    glob = re.sub(r"^persistence true$", "persistence false", glob, flags=re.M)
    glob = re.sub(r"^(persistence_location|autosave_interval|log_dest) .*$", "", glob, flags=re.M)
    b = Broker(d / "broker")
    listener = f"listener {b.port} 127.0.0.1\n"
    if tls is not None:
        m = re.search(r"^listener 8883\n(.*?)\n\n", listeners, re.M | re.S)
        assert m and "certfile" in m.group(1), "the shipped TLS listener"
        listener += re.sub(r"^(cafile|certfile|keyfile) .*$",
                           lambda k: f"{k.group(1)} {tls[{'cafile': 'ca', 'certfile': 'cert', 'keyfile': 'key'}[k.group(1)]]}",
                           m.group(1), flags=re.M) + "\n"
    # started as root, mosquitto would drop to user mosquitto, who cannot read pytest's temp dir
    b.conf.write_text(glob + f"\nuser root\nlog_dest stderr\n" + listener)
    return b.start()


class Client:
    def __init__(self, port: int, user: str | None, pw: str | None) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.msgs: list = []
        self.sub_rc: list = []
        self.pub_rc: dict[int, int] = {}
        self.conn_rc = None
        self.ev = threading.Event()
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"t-{user}-{time.monotonic_ns()}",
                             protocol=mqtt.MQTTv5)
        if user:
            self.c.username_pw_set(user, pw)
        self.c.on_connect = lambda c, u, f, rc, p: (setattr(self, "conn_rc", rc), self.ev.set())
        self.c.on_message = lambda c, u, m: self.msgs.append((m.topic, bytes(m.payload)))
        self.c.on_subscribe = lambda c, u, mid, rcs, p: self.sub_rc.append([r.value for r in rcs])
        self.c.on_publish = lambda c, u, mid, rc, p: self.pub_rc.__setitem__(mid, rc.value)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.ev.wait(10)

    def sub(self, topic: str) -> int:
        n = len(self.sub_rc)
        self.c.subscribe(topic, qos=1)
        deadline = time.monotonic() + 10
        while len(self.sub_rc) == n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.sub_rc[-1][0]

    def pub(self, topic: str, payload: bytes = b"{}", retain: bool = False) -> int:
        info = self.c.publish(topic, payload, qos=1, retain=retain)
        deadline = time.monotonic() + 10
        while info.mid not in self.pub_rc and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.pub_rc.get(info.mid)

    def expect(self, messages: list[tuple[str, bytes]], timeout: float = 10) -> None:
        """Until every (topic, payload) in messages was delivered to this client, with a deadline."""
        deadline = time.monotonic() + timeout
        while not all(m in self.msgs for m in messages):
            assert time.monotonic() < deadline, ([m for m in messages if m not in self.msgs], self.msgs)
            time.sleep(0.02)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()
