"""Fleet model updates over MQTT, the device side (docs/protocol.md, "Model updates").

Topics under ``<prefix>/<device_id>/update/``::

    job                          -> device  a job offer (JSON; below)
    chunk/<job_id>/<index>       -> device  one chunk of the bundle (binary, QoS 1)
    ack                          device ->  progress and the final answer (JSON, QoS 1, retained)
    need                         device ->  chunk indices the device still misses (JSON, QoS 1)

The offer::

    {"job_id": "m-v2-1a2b3c4d", "sha256": "<whole bundle>", "size": 295276, "chunk_size": 65536,
     "n_chunks": 5, "chunk_sha256": ["<chunk 0>", ...], "deadline": 1718000600 | "2024-06-10T06:23:20Z",
     "latency_budget_ms": 50, "health_frames": 20, "model": {"name", "version"}}

A job goes: offer accepted (``received`` with count 0) -> chunks written at their offsets into
``SlotStore.staging_path(job_id)`` (duplicates and any order are fine; every chunk's sha256 is
checked, a bad one is asked for again at most ``max_chunk_retries`` times, then the job fails) ->
``received`` (all chunks) -> whole-file sha256 and the bundle's signature, format and arch ->
``verified`` -> ``SlotStore.install`` -> ``staged`` -> ``trial`` -> the health gate (golden
self-test, p95 within the job's budget, no errors over N frames) -> ``committed`` (the agent
swaps the new model in) or ``rolled_back`` (with the reason). Any refusal is ``failed`` with a
``kind`` and a one-line ``reason``.

Missing chunks are asked for on ``need`` when nothing arrived for ``need_interval_s`` (backing
off to 30 s), right after a reconnect, and when a chunk fails its check, so a transfer resumes
after a disconnect, a broker restart or an agent restart (the offer is persisted under
``<slot_dir>/updates/`` and the partial file re-checked chunk by chunk).

One job at a time: an offer while another job runs is refused (``failed``, kind ``busy``,
"busy: job X running"), not queued; the host may offer it again later. The same job again gets
the recorded final ack again (``repeated: true``) and changes nothing. A job whose deadline has
passed is refused (``stale``); MQTT 5 message expiry makes the broker drop a stale offer itself.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import os
import queue
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tandoor_contract import durable, protocol
from tandoor_contract.protocol import FINAL_STATES
from tandoor_contract.errors import TandoorError

log = logging.getLogger("tandoor.updater")

MAX_OFFER_BYTES = 1 << 20           # the offer JSON
MAX_CHUNK_BYTES = 4 << 20           # one chunk
MAX_BUNDLE_BYTES = 4 << 30          # the whole bundle
MAX_CHUNKS = 100_000
MAX_NEED_LIST = 512                 # indices per need message
FINALS_KEPT = 64
JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
CRASH_ENV = "TANDOOR_UPDATE_CRASH_AT"  # tests: SIGKILL the agent right after acking this state


class JobError(TandoorError):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg, kind=kind)


def parse_deadline(v: Any) -> float | None:
    """Epoch seconds (number or numeric string) or ISO-8601 -> epoch seconds; None for None."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError("deadline must be epoch seconds or ISO-8601")
    if isinstance(v, (int, float)):
        if not math.isfinite(v):
            raise ValueError("deadline must be finite")
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
        t = _dt.datetime.fromisoformat(v.replace("Z", "+00:00"))
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp()
    raise ValueError("deadline must be epoch seconds or ISO-8601")


def parse_offer(payload: bytes) -> dict[str, Any]:
    """Validate a job offer; raises JobError("malformed", ...) naming the first problem."""
    if len(payload) > MAX_OFFER_BYTES:
        raise JobError("malformed", f"offer of {len(payload)} bytes is over the {MAX_OFFER_BYTES} byte limit")
    try:
        o = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise JobError("malformed", f"malformed job: not JSON ({e})") from None
    if not isinstance(o, dict):
        raise JobError("malformed", "malformed job: the offer must be a JSON object")
    jid = o.get("job_id")
    if not isinstance(jid, str) or not JOB_ID_RE.match(jid):
        raise JobError("malformed", "malformed job: job_id must be 1-100 of A-Z a-z 0-9 . _ -")

    def need_int(k, lo, hi):
        v = o.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise JobError("malformed", f"malformed job: {k} must be an integer in {lo}..{hi}, got {v!r}")
        return v

    size = need_int("size", 1, MAX_BUNDLE_BYTES)
    cs = need_int("chunk_size", 1, MAX_CHUNK_BYTES)
    n = need_int("n_chunks", 1, MAX_CHUNKS)
    if n != -(-size // cs):
        raise JobError("malformed", f"malformed job: n_chunks {n} does not fit size {size} / chunk_size {cs}")
    sha = o.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise JobError("malformed", "malformed job: sha256 must be 64 lowercase hex digits")
    shas = o.get("chunk_sha256")
    if not isinstance(shas, list) or len(shas) != n or not all(
            isinstance(s, str) and re.fullmatch(r"[0-9a-f]{64}", s) for s in shas):
        raise JobError("malformed", f"malformed job: chunk_sha256 must be {n} sha256 hex strings")
    try:
        o["_deadline"] = parse_deadline(o.get("deadline"))
    except (ValueError, TypeError) as e:
        raise JobError("malformed", f"malformed job: deadline: {e}") from None
    for k in ("latency_budget_ms",):
        v = o.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
            raise JobError("malformed", f"malformed job: {k} must be a positive number")
    hf = o.get("health_frames", 20)
    if not isinstance(hf, int) or isinstance(hf, bool) or not 0 <= hf <= 100_000:
        raise JobError("malformed", "malformed job: health_frames must be an integer in 0..100000")
    o["health_frames"] = hf
    return o


class _Job:
    def __init__(self, offer: dict[str, Any], path: Path) -> None:
        self.offer = offer
        self.id: str = offer["job_id"]
        self.size: int = offer["size"]
        self.chunk_size: int = offer["chunk_size"]
        self.n: int = offer["n_chunks"]
        self.shas: list[str] = offer["chunk_sha256"]
        self.deadline: float | None = offer.get("_deadline")
        self.path = path
        self.received: set[int] = set()
        self.bad: dict[int, int] = {}
        self.fd: int | None = None
        self.finishing = False
        self.t_start = time.monotonic()
        self.last_progress = time.monotonic()
        self.last_need = 0.0
        self.need_backoff = 0.0
        self.chunks_in = 0
        self.duplicates = 0

    def chunk_len(self, i: int) -> int:
        return self.chunk_size if i < self.n - 1 else self.size - self.chunk_size * (self.n - 1)

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.received]


class Updater:
    """The device side of update jobs. Transport-agnostic: ``publish(topic, payload: bytes,
    qos, retain)`` sends, :meth:`on_message` receives (call it from the MQTT thread; it only
    queues), :meth:`on_connected` after every (re)connect.

    ``gate(store, trusted_keys, latency_budget_ms=, frames=, delegate=)`` decides commit or
    rollback (default: agent.health.gate, the check in a child process). ``swap(timeout)``,
    called after a commit, loads the newly committed slot into the serving loop and returns when
    it serves (raise to refuse: the commit is then rolled back)."""

    def __init__(self, store, base: str, publish: Callable[..., Any],
                 trusted_keys: Iterable[Any] = (), delegate: str = "auto",
                 gate: Callable[..., Any] | None = None, swap: Callable[[], Any] | None = None,
                 device_id: str | None = None, need_interval_s: float = 2.0,
                 max_chunk_retries: int = 3, stall_timeout_s: float = 600.0,
                 health_timeout_s: float = 300.0) -> None:
        self.store = store
        self.base = base
        self.device_id = device_id or base.rsplit("/", 1)[-1]
        self.publish = publish
        self.trusted_keys = list(trusted_keys)
        self.delegate = delegate
        self.gate = gate
        self.swap = swap
        self.need_interval_s = need_interval_s
        self.max_chunk_retries = max_chunk_retries
        self.stall_timeout_s = stall_timeout_s
        self.health_timeout_s = health_timeout_s
        self.topic_job = f"{base}/{protocol.UPDATE_JOB}"
        self.topic_chunk = f"{base}/{protocol.UPDATE_CHUNK}/"
        self.topic_ack = f"{base}/{protocol.UPDATE_ACK}"
        self.topic_need = f"{base}/{protocol.UPDATE_NEED}"
        self.subscriptions = [self.topic_job, self.topic_chunk + "#"]
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.RLock()
        self._active: _Job | None = None
        self._pending_acks: list[dict] = []
        self._finals: dict[str, dict] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.dir = Path(store.dir) / "updates" if store is not None else None
        self.counters = {"offers": 0, "chunks": 0, "duplicates": 0, "bad_chunks": 0, "needs": 0, "acks": 0}

    # ------------------------------------------------------------------------ lifecycle
    def recover(self) -> list[str]:
        """At agent start, before the model is opened: the store's recovery (a trial that was
        never committed is rolled back and reported), then resume a persisted download."""
        if self.store is None:
            return []
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load_finals()
        before = self.store.load().get("trial")
        notes = self.store.recover_on_start()
        for n in notes:
            log.warning("slot recovery: %s", n)
        if before and before.get("job_id"):
            jid = before["job_id"]
            rec = self.store.job(jid) or {}
            self._final(jid, "rolled_back", rec.get("reason") or "the agent restarted before the trial was committed",
                        kind="restarted", publish_now=False)
        for p in sorted(self.dir.glob("*.offer.json")):
            try:
                offer = json.loads(p.read_text())
                offer["_deadline"] = parse_deadline(offer.get("deadline"))
            except Exception:
                p.unlink(missing_ok=True)
                continue
            jid = offer.get("job_id")
            if jid in self._finals or self._active is not None:
                p.unlink(missing_ok=True)
                self.store.staging_path(jid).unlink(missing_ok=True)
                continue
            job = _Job(offer, self.store.staging_path(jid))
            self._rescan(job)
            self._active = job
            log.info("resuming job %s: %d of %d chunks on disk", jid, len(job.received), job.n)
            notes.append(f"resumed job {jid} ({len(job.received)}/{job.n} chunks)")
        keep = [self._active.id] if self._active else []
        try:
            self.store.clean_staging(keep)
        except OSError:
            pass
        return notes

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandoor-updater", daemon=True)
        self._thread.start()
        if self._active is not None and len(self._active.received) == self._active.n:
            self._q.put(("complete", self._active.id))

    def stop(self) -> None:
        """The agent is stopping: a health check in progress is killed and its outcome not
        recorded; the trial stays for recover_on_start (rolled back and reported at the next start,
        as after a crash)."""
        self._stop = True
        self._q.put(("stop",))
        from . import health

        health.stop_running()

    @property
    def busy(self) -> str | None:
        a = self._active
        return a.id if a is not None else None

    # ------------------------------------------------------------------- MQTT callbacks
    def on_message(self, topic: str, payload: bytes, properties: Any = None) -> None:
        if topic == self.topic_job:
            self._q.put(("offer", bytes(payload)))
        elif topic.startswith(self.topic_chunk):
            self._q.put(("chunk", topic[len(self.topic_chunk):], bytes(payload)))

    def on_connected(self) -> None:
        self._q.put(("connected",))

    # --------------------------------------------------------------------------- sending
    def _ack(self, job_id: str | None, state: str, **fields: Any) -> dict:
        body = {"job_id": job_id, "device_id": self.device_id, "state": state,
                "ts": round(time.time(), 3), **{k: v for k, v in fields.items() if v is not None}}
        self._send(self.topic_ack, body, retain=True)
        self.counters["acks"] += 1
        log.info("job %s: %s%s", job_id, state, f" ({fields['reason']})" if fields.get("reason") else "")
        crash = os.environ.get(CRASH_ENV)
        if crash and crash == state and (state != "received" or fields.get("missing") == 0):
            log.warning("%s=%s: killing this process (test failpoint)", CRASH_ENV, state)
            time.sleep(0.5)  # let the ack reach the broker
            os.kill(os.getpid(), signal.SIGKILL)
        return body

    def _send(self, topic: str, body: dict, retain: bool = False) -> None:
        data = json.dumps(body, separators=(",", ":"), default=str).encode()
        try:
            self.publish(topic, data, 1, retain)
        except Exception as e:  # offline: paho queues QoS 1; anything else is only logged
            log.warning("cannot publish on %s: %s", topic, e)

    def _need(self, job: _Job) -> None:
        miss = job.missing()
        if not miss:
            return
        job.last_need = time.monotonic()
        job.need_backoff = min(30.0, max(self.need_interval_s, job.need_backoff * 2 or self.need_interval_s))
        self.counters["needs"] += 1
        self._send(self.topic_need, {"job_id": job.id, "device_id": self.device_id,
                                     "missing": miss[:MAX_NEED_LIST], "n_missing": len(miss),
                                     "count": len(job.received), "n_chunks": job.n, "ts": round(time.time(), 3)})

    # ----------------------------------------------------------------------- final acks
    def _finals_path(self) -> Path:
        return self.dir / "finals.json"

    def _load_finals(self) -> None:
        try:
            d = json.loads(self._finals_path().read_text())
            if isinstance(d, dict):
                self._finals = d
        except (OSError, ValueError):
            self._finals = {}

    def _save_finals(self) -> None:
        if self.dir is None:
            return
        items = sorted(self._finals.items(), key=lambda kv: kv[1].get("ts", 0))[-FINALS_KEPT:]
        self._finals = dict(items)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            durable.atomic_write(self._finals_path(), json.dumps(self._finals).encode())
        except OSError as e:  # a full disk must not stop the answer going out
            log.warning("cannot record the final ack: %s", e)

    def _final(self, job_id: str | None, state: str, reason: str | None, kind: str | None = None,
               record: bool = True, publish_now: bool = True, **fields: Any) -> None:
        body = {"job_id": job_id, "device_id": self.device_id, "state": state, "reason": reason,
                "kind": kind, "ts": round(time.time(), 3), **fields}
        body = {k: v for k, v in body.items() if v is not None}
        if record and job_id is not None:
            self._finals[job_id] = body
            self._save_finals()
        if publish_now:
            self._ack(job_id, state, **{k: v for k, v in body.items()
                                        if k not in ("job_id", "device_id", "state", "ts")})
        else:
            self._pending_acks.append(body)

    def _end_job(self, job: _Job, keep_part: bool = False) -> None:
        if job.fd is not None:
            try:
                os.close(job.fd)
            except OSError:
                pass
            job.fd = None
        if not keep_part:
            job.path.unlink(missing_ok=True)
        if self.dir is not None:
            (self.dir / f"{job.path.name}.offer.json").unlink(missing_ok=True)
        with self._lock:
            if self._active is job:
                self._active = None

    # ---------------------------------------------------------------------------- worker
    def _run(self) -> None:
        while not self._stop:
            try:
                ev = self._q.get(timeout=0.5)
            except queue.Empty:
                ev = ("tick",)
            try:
                kind = ev[0]
                if kind == "stop":
                    return
                if kind == "offer":
                    self._on_offer(ev[1])
                elif kind == "chunk":
                    self._on_chunk(ev[1], ev[2])
                elif kind == "connected":
                    pending, self._pending_acks = self._pending_acks, []
                    for body in pending:
                        self._ack(body["job_id"], body["state"], **{k: v for k, v in body.items()
                                                                    if k not in ("job_id", "device_id", "state", "ts")})
                    a = self._active
                    if a is not None and not a.finishing:
                        if not a.received:
                            self._ack(a.id, "received", count=0, n_chunks=a.n, missing=a.n)
                        self._need(a)
                elif kind == "complete":
                    a = self._active
                    if a is not None and a.id == ev[1] and not a.finishing:
                        self._complete(a)
                self._tick()
            except Exception as e:  # never let one message take the updater down
                log.exception("update worker: %s", e)
                a = self._active
                if a is not None and not a.finishing:
                    self._final(a.id, "failed", f"internal error: {e}", kind="internal")
                    self._end_job(a)

    def _tick(self) -> None:
        a = self._active
        if a is None or a.finishing:
            return
        now = time.monotonic()
        if a.deadline is not None and time.time() > a.deadline:
            self._final(a.id, "failed", f"expired: the deadline passed with {len(a.received)} of {a.n} chunks received",
                        kind="expired", count=len(a.received), n_chunks=a.n)
            self._end_job(a)
            return
        if now - a.last_progress > self.stall_timeout_s:
            self._final(a.id, "failed", f"transfer stalled: no chunk for {self.stall_timeout_s:g} s "
                        f"({len(a.received)} of {a.n} received)", kind="stalled", record=False)
            self._end_job(a)
            return
        wait = max(self.need_interval_s, a.need_backoff)
        if now - a.last_progress >= self.need_interval_s and now - a.last_need >= wait:
            self._need(a)

    def _on_offer(self, payload: bytes) -> None:
        self.counters["offers"] += 1
        try:
            offer = parse_offer(payload)
        except JobError as e:
            jid = None
            try:
                o = json.loads(payload.decode("utf-8"))
                if isinstance(o, dict) and isinstance(o.get("job_id"), str) and JOB_ID_RE.match(o["job_id"]):
                    jid = o["job_id"]
            except Exception:
                pass
            self._final(jid, "failed", str(e), kind=e.kind, record=False)
            return
        jid = offer["job_id"]
        done = self._finals.get(jid)
        if done is None and self.store is not None:
            rec = self.store.job(jid)
            if rec and rec.get("outcome") in FINAL_STATES:
                done = {"job_id": jid, "device_id": self.device_id, "state": rec["outcome"],
                        "reason": rec.get("reason"), "kind": rec.get("kind"), "sha256": rec.get("sha256")}
        if done is not None:
            log.info("job %s again: answering with its final ack (%s)", jid, done["state"])
            self._ack(jid, done["state"], **{k: v for k, v in done.items()
                                             if k not in ("job_id", "device_id", "state", "ts")}, repeated=True)
            return
        a = self._active
        if a is not None:
            if a.id == jid:  # the host offered it again: resume
                if not a.finishing:
                    self._ack(jid, "received", count=len(a.received), n_chunks=a.n, missing=a.n - len(a.received))
                    self._need(a)
                return
            self._final(jid, "failed", f"busy: job {a.id} running", kind="busy", record=False, running=a.id)
            return
        if self.store is None:
            self._final(jid, "failed", "updates need slot_dir: this agent serves an explicit bundle",
                        kind="not_supported", record=False)
            return
        if offer["_deadline"] is not None and time.time() > offer["_deadline"]:
            self._final(jid, "failed", f"stale: the job's deadline {offer.get('deadline')} has passed", kind="stale")
            return
        if self.store.trial() is not None:
            t = self.store.trial()
            self._final(jid, "failed", f"busy: job {t.get('job_id')} running (in trial)", kind="busy", record=False)
            return
        path = self.store.staging_path(jid)
        job = _Job(offer, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(path.parent).free
            need = offer["size"] + getattr(self.store, "reserve_bytes", 0)
            if free < need:
                raise OSError(28, f"not enough disk space to stage the bundle: {free} bytes free, "
                                  f"{need} needed; the running model is untouched")
            job.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(job.fd, 0, offer["size"])
            except (AttributeError, OSError) as e:
                if getattr(e, "errno", None) == 28:
                    raise
                os.ftruncate(job.fd, offer["size"])
            self._persist_offer(offer, path)
        except OSError as e:
            self._end_job(job)
            msg = e.strerror if isinstance(e.strerror, str) else str(e)
            kind = "no_space" if e.errno == 28 else "io_error"
            if e.errno == 28 and "running model" not in msg:
                msg = f"staging: {msg}; the running model is untouched"
            self._final(jid, "failed", msg, kind=kind, record=False)
            return
        with self._lock:
            self._active = job
        self._ack(jid, "received", count=0, n_chunks=job.n, missing=job.n)

    def _persist_offer(self, offer: dict, path: Path) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.dir / f"{path.name}.offer.json"
        durable.atomic_write(p, json.dumps({k: v for k, v in offer.items() if not k.startswith("_")}).encode())

    def _rescan(self, job: _Job) -> None:
        """Which chunks of a resumed job's partial file are already right."""
        try:
            with open(job.path, "rb") as f:
                for i in range(job.n):
                    f.seek(i * job.chunk_size)
                    data = f.read(job.chunk_len(i))
                    if len(data) == job.chunk_len(i) and hashlib.sha256(data).hexdigest() == job.shas[i]:
                        job.received.add(i)
            job.fd = os.open(job.path, os.O_RDWR)
        except OSError:
            job.received.clear()
            job.fd = os.open(job.path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(job.fd, job.size)

    def _on_chunk(self, rest: str, data: bytes) -> None:
        jid, _, idx = rest.rpartition("/")
        a = self._active
        if a is None or a.id != jid or a.finishing:
            return
        try:
            i = int(idx)
        except ValueError:
            return
        if not 0 <= i < a.n:
            return
        self.counters["chunks"] += 1
        a.chunks_in += 1
        if i in a.received:
            a.duplicates += 1
            self.counters["duplicates"] += 1
            return
        if len(data) != a.chunk_len(i) or hashlib.sha256(data).hexdigest() != a.shas[i]:
            self.counters["bad_chunks"] += 1
            a.bad[i] = a.bad.get(i, 0) + 1
            if a.bad[i] > self.max_chunk_retries:
                self._final(a.id, "failed", f"chunk {i} failed its sha256 check {a.bad[i]} times "
                            f"(corrupted or tampered in transit); gave up", kind="chunk_hash",
                            count=len(a.received), n_chunks=a.n)
                self._end_job(a)
                return
            log.warning("job %s: chunk %d failed its sha256 check (%d); asking again", a.id, i, a.bad[i])
            self._send(self.topic_need, {"job_id": a.id, "device_id": self.device_id, "missing": [i],
                                         "n_missing": a.n - len(a.received), "count": len(a.received),
                                         "n_chunks": a.n, "bad": [i], "ts": round(time.time(), 3)})
            self.counters["needs"] += 1
            return
        try:
            os.pwrite(a.fd, data, i * a.chunk_size)
        except OSError as e:
            kind = "no_space" if e.errno == 28 else "io_error"
            self._final(a.id, "failed", f"staging: {e.strerror or e}; the running model is untouched", kind=kind,
                        record=False)
            self._end_job(a)
            return
        a.received.add(i)
        a.last_progress = time.monotonic()
        a.need_backoff = 0.0
        if len(a.received) == a.n:
            self._complete(a)

    # ------------------------------------------------------------------- install + gate
    def _complete(self, job: _Job) -> None:
        job.finishing = True
        try:
            os.fsync(job.fd)
        except OSError:
            pass
        self._ack(job.id, "received", count=job.n, n_chunks=job.n, missing=0, duplicates=job.duplicates,
                  seconds=round(time.monotonic() - job.t_start, 3))
        threading.Thread(target=self._finish, args=(job,), name=f"tandoor-update-{job.id}", daemon=True).start()

    def _finish(self, job: _Job) -> None:
        try:
            self._finish_inner(job)
        except Exception as e:
            log.exception("job %s failed", job.id)
            try:
                if self.store.trial() is not None and self.store.trial().get("job_id") == job.id:
                    self.store.rollback(f"internal error: {e}")
                    self._final(job.id, "rolled_back", f"internal error: {e}", kind="internal")
                else:
                    self._final(job.id, "failed", f"internal error: {e}", kind="internal")
            except Exception:
                log.exception("job %s: cannot report", job.id)
        finally:
            self._end_job(job)

    def _finish_inner(self, job: _Job) -> None:
        from tandoor_contract import hmod
        from .slots import Busy, InstallRefused, _refusal_from

        offer = job.offer
        h = hashlib.sha256()
        with open(job.path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        if h.hexdigest() != offer["sha256"]:
            self._final(job.id, "failed", f"bundle sha256 {h.hexdigest()[:16]}... differs from the job's "
                        f"{offer['sha256'][:16]}...", kind="sha256_mismatch")
            return
        try:
            with hmod.open_bundle(job.path, self.trusted_keys) as b:
                b.lib_for()
                model = {"name": (b.manifest.get("model") or {}).get("name"),
                         "version": (b.manifest.get("model") or {}).get("version")}
        except hmod.BundleError as e:
            r = _refusal_from(e)
            self._final(job.id, "failed", str(r), kind=r.kind)
            return
        self._ack(job.id, "verified", sha256=offer["sha256"], model=model)
        try:
            slot = self.store.install(job.path, job.id, self.trusted_keys, expected_sha256=offer["sha256"],
                                      size=job.size)
        except Busy as e:
            self._final(job.id, "failed", f"busy: {e}", kind="busy", record=False)
            return
        except InstallRefused as e:
            self._final(job.id, "failed", str(e), kind=e.kind, record=e.kind not in ("no_space", "io_error"))
            return
        self._ack(job.id, "staged", slot=slot, model=model)
        self._ack(job.id, "trial", slot=slot, model=model)
        from . import health

        gate = self.gate or health.gate
        kw = dict(latency_budget_ms=offer.get("latency_budget_ms"), frames=offer["health_frames"],
                  delegate=self.delegate)
        if gate is health.gate:
            kw["timeout_s"] = self.health_timeout_s
        try:
            if self._stop:
                raise health.CheckStopped("the agent is stopping")
            report = gate(self.store, self.trusted_keys, **kw)
        except health.CheckStopped:  # the agent is stopping: no verdict, the trial waits for the next start
            log.warning("job %s: the health check was ended by the stop; the trial is rolled back at the next start",
                        job.id)
            return
        hrep = {k: getattr(report, k, None) for k in ("p95_ms", "median_ms", "golden_max_abs_err", "frames",
                                                          "errors", "seconds")}
        if not report.ok:
            self._final(job.id, "rolled_back", f"health gate failed: {report.reason}", kind="unhealthy",
                        slot=slot, model=model, health=hrep)
            return
        if self.swap is not None:
            try:
                self.swap()
            except Exception as e:
                reason = f"the committed model failed to load in the agent: {' '.join(str(e).split())}"
                try:
                    self.store.rollback(reason)
                except Exception:
                    log.exception("rollback after a failed swap")
                self._final(job.id, "rolled_back", reason, kind="swap_failed", slot=slot, model=model, health=hrep)
                return
        self._final(job.id, "committed", f"health gate passed ({report.summary()})" if hasattr(report, "summary")
                    else "health gate passed", slot=slot, model=model, sha256=offer["sha256"], health=hrep,
                    p95_ms=hrep.get("p95_ms"))

    # ---------------------------------------------------------------------- rollback cmd
    def rollback_committed(self, reason: str = "rollback requested by the operator") -> dict:
        """Undo the last commit: the primary becomes bad, the other good slot serves."""
        if self.store is None:
            raise JobError("not_supported", "rollback needs slot_dir: this agent serves an explicit bundle")
        a = self._active
        if a is not None:
            raise JobError("busy", f"busy: job {a.id} running")
        before = self.store.load()
        self.store.rollback(reason)
        after = self.store.load()
        if self.swap is not None:
            self.swap()
        p = after["primary"]
        return {"from": before["primary"], "slot": p, "model": after["slots"][p]["model"] if p else None,
                "sha256": after["slots"][p]["sha256"] if p else None}
