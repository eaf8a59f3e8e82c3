"""Fleet model updates over MQTT, the device side (docs/protocol.md, "Model updates").

Topics under ``<prefix>/<device_id>/update/`` (and the fleet-wide chunk topic)::

    job                          -> device  a job offer (JSON; below)
    chunk/<job_id>/<index>       -> device  one chunk of the bundle (binary, QoS 1): re-sends
    <prefix>/~fleet/update/chunk/<job_id>/<index>
                                 -> device  the same, once per wave for every device of the job
    cancel                       -> device  {"job_id": ..., "reason": ...}: drop that job
    keys                         -> device  a signed add-key / retire-key command (keys.py)
    ack                          device ->  progress and the final answer (JSON, QoS 1, retained)
    need                         device ->  chunk indices the device still misses (JSON, QoS 1)

The offer::

    {"job_id": "m-v2-1a2b3c4d", "sha256": "<whole bundle>", "size": 295276, "chunk_size": 65536,
     "n_chunks": 5, "chunk_sha256": ["<chunk 0>", ...], "deadline": 1718000600 | "2024-06-10T06:23:20Z",
     "issued": 1718000000.0, "stall_timeout_s": 120, "allow_downgrade": false,
     "transport": "mqtt" | "url", "url": "http://host:port/<sha>.hmod",
     "latency_budget_ms": 50, "p99_budget_ms": 80, "health_frames": 20, "model": {"name", "version"}}

A job goes through the states of ``tandoor_contract.protocol.JOB_STATES`` (every ack names one):
offer accepted (``received`` with count 0; the device first subscribes to the job's fleet-wide
chunk topic) -> chunks written at their offsets into ``SlotStore.staging_path(job_id)``
(duplicates and any order are fine; every chunk's sha256 is checked, a bad one is asked for again
at most ``max_chunk_retries`` times) -> ``received`` (all chunks) -> whole-file sha256, the
bundle's signature, format and arch, and no downgrade -> ``verified`` -> ``SlotStore.install`` ->
``staged`` -> ``trial`` -> the health gate -> ``committed`` (the agent swaps the new model in)
or ``rolled_back``. A refusal is ``failed``, a cancel ``cancelled``; the ``kind`` of every final
ack is one of ``protocol.KINDS``, which also says whether it is recorded (the same job offered
again gets the same answer, ``repeated: true``) or transient (the job may be offered again).

Transports. ``mqtt`` (the default): chunks arrive on the fleet-wide topic, once per wave; the
device asks on ``need`` for what it misses when nothing arrived for ``need_interval_s`` (backing
off to 30 s), right after a reconnect and when a chunk fails its check, and the host re-sends
those on the device's own topic. ``url``: the device downloads the bundle itself with HTTP Range
requests from the first chunk it lacks, checking each chunk as it comes, and resumes the same
way after any error (retrying with backoff). Either way a transfer survives a disconnect, a
broker restart or an agent restart (the offer is persisted under ``<slot_dir>/updates/`` and the
partial file re-checked chunk by chunk).

One job at a time. An offer while another job downloads supersedes it when it was issued later
(the old one ends ``cancelled``, kind ``superseded``); otherwise it is refused ``busy``, naming
the running job, its progress and when it expires. A job that made no progress for its stall
timeout (the offer's ``stall_timeout_s``, else the agent's) is dropped (``failed``, ``stalled``),
so a dead host never wedges a device; ``tandoor fleet cancel`` drops it at once. A job whose
deadline has passed is refused (``stale``); MQTT 5 message expiry makes the broker drop a stale
offer itself.
"""

from __future__ import annotations


from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandoor_contract import durable, hmod, protocol

from . import health
from .deadlines import Deadlines
from .finals import Finals
from .keys import KeyOpError, Keyring
from .offer import (BOOT_ATTEMPTS, CONFIRM_FRAMES, CRASH_ENV, JOB_ID_RE, Job, JobError, SwapTimeout,  # noqa: F401
                    iso, job_id_of, parse_deadline, parse_offer)
from .slots import Busy, InstallRefused, io_kind, refusal_from
from .transfer import Transfer

log = logging.getLogger("tandoor.updater")

_Job = Job  # the name tests and older callers import
STEPS_KEPT = 256   # jobs whose last state the updater remembers for JOB_STEPS (the finals cover the rest)


def settle(store, report) -> bool:
    """The trial's outcome from the health gate's verdict: a healthy trial is committed, a sick one
    rolled back with the gate's reason. The job's own step (``Updater._finish_inner``) calls it;
    the gate only judges."""
    if report.ok:
        store.commit(reason=f"health gate passed ({report.summary()})")
    else:
        store.rollback(f"health gate failed: {report.reason}")
    return bool(report.ok)


class Updater(Transfer, Finals):
    """The device side of update jobs. Transport-agnostic: ``publish(topic, payload: bytes,
    qos, retain)`` sends, ``subscribe(topic)`` / ``unsubscribe(topic)`` follow a job's fleet-wide
    chunk topic, :meth:`on_message` receives (call it from the MQTT thread; it only queues),
    :meth:`on_connected` after every (re)connect (subscribing :attr:`subscriptions` first).

    ``gate(store, trusted_keys, latency_budget_ms=, frames=, delegate=, timeout_s=[, p99_budget_ms=])``
    (the p99 budget only when the offer has one) returns the
    trial's verdict (default: health.gate, the check in a child process); the job then commits or
    rolls back itself (:func:`settle`). ``swap(timeout_s)``,
    called after a commit, loads the newly committed slot into the serving loop and returns when
    it serves (raise to refuse, SwapTimeout past its deadline: the commit is then rolled back).
    ``deadlines`` says how long each may take (deadlines.py; 0 = sized from measured load times).
    ``trusted_keys`` is kept current by the keyring (keys.py: signed add-key / retire-key
    commands), in place."""

    def __init__(self, store, base: str, publish: Callable[..., Any],
                 trusted_keys: list[Any] | None = None, delegate: str = "auto",
                 gate: Callable[..., Any] | None = None, swap: Callable[[float], Any] | None = None,
                 device_id: str | None = None, need_interval_s: float = 2.0,
                 max_chunk_retries: int = 3, stall_timeout_s: float = 600.0,
                 deadlines: Deadlines | None = None, subscribe: Callable[[str], Any] | None = None,
                 unsubscribe: Callable[[str], Any] | None = None, served: Callable[[], int] | None = None,
                 boot_attempts: int = BOOT_ATTEMPTS, confirm_frames: int = CONFIRM_FRAMES) -> None:
        self.store = store
        self.base = base
        self.prefix = base.rsplit("/", 1)[0]
        self.device_id = device_id or base.rsplit("/", 1)[-1]
        self.publish = publish
        self.subscribe = subscribe
        self.unsubscribe = unsubscribe
        self.dir = Path(store.dir) / "updates" if store is not None else None
        if not isinstance(trusted_keys, list):  # the keyring updates the caller's list in place
            trusted_keys = list(trusted_keys or ())
        self.keys = Keyring(trusted_keys, Path(store.dir) / "keys" if store is not None else None,
                            installed=self._installed)
        self.trusted_keys = self.keys.trusted   # the live list (paths and keys)
        self.delegate = delegate
        self.gate = gate or health.gate
        self.swap = swap
        self.deadlines = deadlines or Deadlines()
        self.need_interval_s = need_interval_s
        self.max_chunk_retries = max_chunk_retries
        self.stall_timeout_s = stall_timeout_s
        self.topic = {leaf: protocol.topic(self.prefix, self.device_id, leaf) for leaf in (
            protocol.UPDATE_JOB, protocol.UPDATE_CHUNK, protocol.UPDATE_ACK, protocol.UPDATE_NEED,
            protocol.UPDATE_CANCEL, protocol.UPDATE_KEYS)}
        self.served = served              # frames served so far (the crash-loop counter needs it)
        self.boot_attempts, self.confirm_frames = boot_attempts, confirm_frames
        self._boot_base: int | None = None  # frames served when the unconfirmed commit started serving
        self._boot_of: tuple[str | None, str | None] = (None, None)  # (slot, job) of that commit
        self.notice: dict | None = None     # for the next birth message: a crash loop rolled back
        self._unconfirmed: str | None = None  # a committed job whose final waits for its first serving
        self._confirm_retry = 0.0
        self._connected_at: float | None = None  # when the current MQTT session began (monotonic)
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.RLock()
        self._active: Job | None = None
        self._pending_acks: list[dict] = []
        self._steps: dict[str, str] = {}   # job id -> the state it was last advanced to (this process)
        self._finals: dict[str, dict] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = {"offers": 0, "chunks": 0, "duplicates": 0, "bad_chunks": 0, "needs": 0, "acks": 0,
                         "downloads": 0, "download_errors": 0}

    # ------------------------------------------------------------------------ topics
    @property
    def subscriptions(self) -> list[str]:
        """What to subscribe to at every (re)connect: the device's topics, and the running
        job's fleet-wide chunks."""
        subs = [self.topic[protocol.UPDATE_JOB], self.topic[protocol.UPDATE_CHUNK] + "/#",
                self.topic[protocol.UPDATE_CANCEL], self.topic[protocol.UPDATE_KEYS]]
        a = self._active
        if a is not None and a.transport == "mqtt" and not a.finishing:
            subs.append(protocol.group_chunk_filter(self.prefix, a.id))
        return subs

    def wants(self, topic: str) -> bool:
        """Whether an incoming message is the updater's (the link routes it here)."""
        return topic.startswith(self.base + "/update/") or topic.startswith(
            f"{self.prefix}/{protocol.FLEET_LEVEL}/{protocol.UPDATE_CHUNK}/")

    # ------------------------------------------------------------------------ lifecycle
    def recover(self) -> list[str]:
        """At agent start, before the model is opened: the store's recovery (a trial that was
        never committed is rolled back and reported), then resume a persisted download."""
        if self.store is None:
            return []
        self.dir.mkdir(parents=True, exist_ok=True)
        self._load_finals()
        self.keys.load()
        self.store.trusted_keys = self.trusted_keys
        self.store.retired_keys = self.keys.retired_keys()
        self.store.evidence = self.journal
        before = self.store.load().get("trial")
        notes = self.store.recover_on_start()
        for n in notes:
            log.warning("slot recovery: %s", n)
        if self.served is not None:
            self._count_boot(notes)
        if before and before.get("job_id"):
            jid = before["job_id"]
            rec = self.store.job(jid) or {}
            self._final(jid, "rolled_back", rec.get("reason") or "the agent restarted before the trial was committed",
                        kind="restarted", publish_now=False)
        for p in sorted(self.dir.glob("*.offer.json")):
            job = self._resumable(p)
            if job is not None:
                self._active = job
                log.info("resuming job %s: %d of %d chunks on disk", job.id, len(job.received), job.n)
                notes.append(f"resumed job {job.id} ({len(job.received)}/{job.n} chunks)")
        keep = [self._active.id] if self._active else []
        try:
            self.store.clean_staging(keep)
        except OSError:
            pass
        return notes

    def _count_boot(self, notes: list[str]) -> None:
        """A committed model that has not served yet counts this start; past the limit it is
        rolled back and reported (the final ack once connected, and the birth message). A job
        committed but not yet answered (the agent died in its hot swap) is answered when its
        model has served (``committed``) or the starts run out (``rolled_back [crash_loop]``);
        until then a repeated offer of it is answered ``confirming``."""
        r = self.store.begin_boot(self.boot_attempts)
        if r is not None:
            self._final(r["job_id"], "rolled_back", r["reason"], kind="crash_loop", publish_now=False,
                        slot=r["slot"], attempts=r["attempts"], sha256=r.get("sha256"))
            self.notice = {"rolled_back": r["job_id"], "kind": "crash_loop", "reason": r["reason"],
                           "slot": r["slot"], "serving": r["to"], "attempts": r["attempts"]}
            notes.append(r["reason"])
        boot = self.store.boot()
        if boot is not None:
            self._boot_base, self._boot_of = 0, (boot.get("slot"), boot.get("job_id"))
            job = boot.get("job_id")
            # started before (its hot swap counted one): the agent died with the job unanswered
            if job is not None and job not in self._finals and int(boot.get("attempts") or 0) >= 2:
                self._unconfirmed = job
                self._advance(job, "confirming")
                self._pending_acks.append(self._confirming_ack(job, boot))

    def _confirming_ack(self, job: str, boot: dict) -> dict:
        return {"job_id": job, "device_id": self.device_id, "state": "confirming", "slot": boot.get("slot"),
                "attempts": boot.get("attempts"), "max_attempts": self.boot_attempts,
                "reason": f"committed; the agent restarted and starts it again (start {boot.get('attempts')} of "
                          f"{self.boot_attempts} it may die in) until it has served {self.confirm_frames} frames",
                "ts": round(time.time(), 3)}

    def _confirm_boot(self) -> None:
        if self._boot_base is not None and self.served is not None and \
                self.served() - self._boot_base >= self.confirm_frames and time.monotonic() >= self._confirm_retry:
            try:
                self.store.confirm_boot(*self._boot_of)
            except OSError as e:  # a full disk: it stays counted; tried again later
                self._confirm_retry = time.monotonic() + 30.0
                log.warning("cannot record that the committed model served (%s); trying again in 30 s",
                            e.strerror or e)
                return
            self._boot_base = None
            log.info("the committed model served %d frames: confirmed", self.confirm_frames)
            job, self._unconfirmed = self._unconfirmed, None
            rec = self.store.job(job) if job is not None else None
            if rec is not None and rec.get("outcome") == "committed" and job not in self._finals:
                self._final(job, "committed", f"committed; after the agent restarted the model served "
                                              f"{self.confirm_frames} frames", slot=rec.get("slot"),
                            sha256=rec.get("sha256"))

    def _resumable(self, p: Path) -> Job | None:
        """The persisted offer at ``p`` as a job to resume, or None (and the files removed)."""
        try:
            offer = parse_offer(p.read_bytes())
        except (OSError, JobError):
            p.unlink(missing_ok=True)
            return None
        jid = offer["job_id"]
        # a job the slots already know went past its download (installed, then committed or
        # rolled back): never downloaded again; its answer comes from the record
        if jid in self._finals or self._active is not None or self.store.job(jid) is not None:
            p.unlink(missing_ok=True)
            self.store.staging_path(jid).unlink(missing_ok=True)
            return None
        job = Job(offer, self.store.staging_path(jid), self.stall_timeout_s)
        self._rescan(job)
        return job

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandoor-updater", daemon=True)
        self._thread.start()
        a = self._active
        if a is not None:
            if len(a.received) == a.n:
                self._q.put(("complete", a.id))
            elif a.transport == "url":
                self._start_download(a)

    def stop(self) -> None:
        """The agent is stopping: a health check in progress is killed and its outcome not
        recorded; the trial stays for recover_on_start (rolled back and reported at the next start,
        as after a crash)."""
        self._stop = True
        self._q.put(("stop",))
        health.stop_running()

    def recovered(self) -> list[dict[str, Any]]:
        """What this start had to repair (a damaged or lost state.json, a damaged keyring): for
        the status message and telemetry, so the fleet learns that a device lost its state."""
        out = []
        if self.store is not None and self.store.recovery:
            out.append(self.store.recovery)
        if self.keys.recovered:
            out.append(self.keys.recovered)
        return out

    @property
    def busy(self) -> str | None:
        a = self._active
        return a.id if a is not None else None

    # ------------------------------------------------------------------- MQTT callbacks
    def on_message(self, topic: str, payload: bytes, properties: Any = None) -> None:
        t = self.topic
        if topic == t[protocol.UPDATE_JOB]:
            self._q.put(("offer", bytes(payload)))
        elif topic == t[protocol.UPDATE_CANCEL]:
            self._q.put(("cancel", bytes(payload)))
        elif topic == t[protocol.UPDATE_KEYS]:
            self._q.put(("keys", bytes(payload)))
        elif topic.startswith(t[protocol.UPDATE_CHUNK] + "/"):
            self._q.put(("chunk", topic[len(t[protocol.UPDATE_CHUNK]) + 1:], bytes(payload)))
        elif self.wants(topic):
            rest = topic.split(f"/{protocol.FLEET_LEVEL}/{protocol.UPDATE_CHUNK}/", 1)[-1]
            self._q.put(("chunk", rest, bytes(payload)))

    def on_connected(self) -> None:
        self._q.put(("connected",))

    # ------------------------------------------------------------------ advancing a job
    def _advance(self, job_id: str | None, state: str) -> None:
        """The one place a job moves to its next state: the step must be one of
        ``protocol.JOB_STEPS`` from the state the job was last acked in (a bug otherwise)."""
        if state not in protocol.JOB_STATES:  # a state exists in the contract or nowhere
            raise ValueError(f"{state!r} is not a job state of tandoor_contract.protocol.JOB_STATES")
        if job_id is None:  # an offer too broken to name its job: no job to advance
            return
        last = self._steps.get(job_id)
        if not protocol.step_allowed(last, state):
            raise ValueError(f"job {job_id}: {last} -> {state} is not a step of tandoor_contract.protocol.JOB_STEPS")
        self._steps.pop(job_id, None)
        self._steps[job_id] = state
        while len(self._steps) > STEPS_KEPT:
            self._steps.pop(next(iter(self._steps)))
        a = self._active
        if a is not None and a.id == job_id:
            a.state = state

    def _ack(self, job_id: str | None, state: str, **fields: Any) -> dict:
        """Advance the job to ``state`` and say so on ``update/ack``."""
        self._advance(job_id, state)
        return self._publish_ack(job_id, state, **fields)

    def _publish_ack(self, job_id: str | None, state: str, **fields: Any) -> dict:
        """Send an ack (retained) without advancing: a step's own ack, a queued final sent at the
        reconnect, or a job's state said again (a repeated offer, a refused cancel)."""
        if state not in protocol.JOB_STATES:
            raise ValueError(f"{state!r} is not a job state of tandoor_contract.protocol.JOB_STATES")
        body = {"job_id": job_id, "device_id": self.device_id, "state": state,
                "ts": round(time.time(), 3), **{k: v for k, v in fields.items() if v is not None}}
        self._send(self.topic[protocol.UPDATE_ACK], body, retain=True)
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

    def _end_job(self, job: Job, keep_part: bool = False) -> None:
        job.ended.set()
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
        self._follow(job, False)

    # ---------------------------------------------------------------------------- worker
    def _run(self) -> None:
        handlers = {"offer": self._on_offer, "chunk": self._on_chunk, "data": self._on_data,
                    "cancel": self._on_cancel, "keys": self._on_keys, "connected": self._on_reconnect,
                    "complete": self._on_complete, "tick": lambda: None}
        while not self._stop:
            try:
                ev = self._q.get(timeout=0.5)
            except queue.Empty:
                ev = ("tick",)
            if ev[0] == "stop":
                return
            try:
                handlers[ev[0]](*ev[1:])
                self._confirm_boot()
                self._tick()
            except OSError as e:  # an expected fault (a full disk, an I/O error): one line, the job ends
                log.warning("update worker: %s", e.strerror or e)
                a = self._active
                if a is not None and not a.finishing:
                    self._final(a.id, "failed", f"{e.strerror or e}; the running model is untouched", kind=io_kind(e))
                    self._end_job(a)
            except Exception as e:  # never let one message take the updater down
                log.exception("update worker: %s", e)
                a = self._active
                if a is not None and not a.finishing:
                    self._final(a.id, "failed", f"internal error: {e}", kind="internal")
                    self._end_job(a)

    def _on_reconnect(self) -> None:
        self._connected_at = time.monotonic()
        pending, self._pending_acks = self._pending_acks, []
        for body in pending:
            self._publish_ack(body["job_id"], body["state"], **{k: v for k, v in body.items()
                                                        if k not in ("job_id", "device_id", "state", "ts")})
        a = self._active
        if a is not None and not a.finishing:
            if not a.received:
                self._ack(a.id, "received", count=0, n_chunks=a.n, missing=a.n)
            self._need(a, reconnected=True)  # a new session: chunks sent while away are lost

    def _on_complete(self, jid: str) -> None:
        a = self._active
        if a is not None and a.id == jid and not a.finishing:
            self._complete(a)

    # ---------------------------------------------------------------------------- offers
    def _on_offer(self, payload: bytes) -> None:
        self.counters["offers"] += 1
        try:
            offer = parse_offer(payload)
        except JobError as e:
            self._final(job_id_of(payload), "failed", str(e), kind=e.kind)
            return
        jid = offer["job_id"]
        if jid == self._unconfirmed:
            self._repeat_confirming(jid)
            return
        done = self._recorded_final(jid)
        if done is not None:
            self._repeat_final(done)
            return
        a = self._active
        if a is not None:
            if a.id == jid:  # the host offered it again: resume
                if not a.finishing:
                    self._ack(jid, "received", count=len(a.received), n_chunks=a.n, missing=a.n - len(a.received))
                    self._need(a)
                return
            if a.finishing or offer["_issued"] <= a.issued:
                self._final(jid, "failed", f"busy: {a.describe()}", kind="busy", running=a.id,
                            running_expires=round(a.expires_at(), 3))
                return
            self._final(a.id, "cancelled", f"superseded by job {jid}, issued later", kind="superseded",
                        superseded_by=jid, count=len(a.received), n_chunks=a.n)
            self._end_job(a)
        refusal = self._refusal(offer)
        if refusal is not None:
            self._final(jid, "failed", refusal[1], kind=refusal[0])
            return
        self._accept(offer)

    def _refusal(self, offer: dict) -> tuple[str, str] | None:
        """(kind, reason) when this device cannot take the offer now."""
        if self.store is None:
            return "not_supported", "updates need slot_dir: this agent serves an explicit bundle"
        if offer["_deadline"] is not None and time.time() > offer["_deadline"]:
            return "stale", f"stale: the job's deadline {offer.get('deadline')} has passed"
        t = self.store.trial()
        if t is not None:
            return "busy", f"busy: job {t.get('job_id')} running (in trial)"
        return None

    # ---------------------------------------------------------------------------- cancel
    def _on_cancel(self, payload: bytes) -> None:
        """``{"job_id": J, "reason"?}``: drop J if it is downloading; a J not seen yet is
        recorded as cancelled (a late offer of it is answered so); a J past its download cannot
        be cancelled (the trial ends by itself) and the answer says so."""
        try:
            body = json.loads(payload.decode("utf-8"))
            jid = body["job_id"]
            if not isinstance(jid, str) or not JOB_ID_RE.match(jid):
                raise ValueError("job_id")
            why = " ".join(str(body.get("reason") or "cancelled by the fleet").split())[:200]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
            log.warning("ignoring a malformed cancel (%s)", type(e).__name__ if isinstance(e, RecursionError) else e)
            return
        if jid == self._unconfirmed:
            self._publish_ack(jid, "confirming", note=f"cancel refused: job {jid} is committed; it ends by itself "
                                              f"(committed once it serves, or rolled back)")
            return
        done = self._recorded_final(jid)
        if done is not None:
            self._repeat_final(done)
            return
        a = self._active
        if a is not None and a.id == jid:
            if a.finishing:
                self._publish_ack(jid, a.state, note=f"cancel refused: job {jid} is past its download ({a.state}); "
                                             f"it commits or rolls back by itself")
                return
            self._final(jid, "cancelled", f"cancelled: {why}", kind="cancelled", count=len(a.received), n_chunks=a.n)
            self._end_job(a)
            return
        self._final(jid, "cancelled", f"cancelled before it arrived: {why}", kind="cancelled")

    # ------------------------------------------------------------------------------ keys
    def _on_keys(self, payload: bytes) -> None:
        ack = {"device_id": self.device_id, "ts": round(time.time(), 3)}
        try:
            op = self.keys.apply(payload)
        except KeyOpError as e:     # a keyring that could not be written too (kind no_space/io_error)
            if self.store is not None:
                self.store.retired_keys = self.keys.retired_keys()
            self._send(self.topic[protocol.UPDATE_ACK], {"key_op": e.op_id, **ack, "ok": False, "kind": e.kind,
                                                         "reason": str(e), **e.extra})
            return
        self.store.trusted_keys = self.trusted_keys
        self.store.retired_keys = self.keys.retired_keys()
        self._send(self.topic[protocol.UPDATE_ACK], {"key_op": op["id"], **ack, "ok": True, "op": op["op"],
                                                     "fingerprint": op["fingerprint"], "trusted": self.keys.fingerprints(),
                                                     **({"affects": op["affects"]} if "affects" in op else {})},
                   retain=False)

    def _installed(self) -> list[dict[str, Any]]:
        """The slots and the key that verified each (retire-key's answer says which it affects)."""
        if self.store is None:
            return []
        st = self.store.status()
        return [{"slot": s, "primary": st["primary"] == s, **v} for s, v in st["slots"].items()]

    # ------------------------------------------------------------------- install + gate
    def _finish(self, job: Job) -> None:
        try:
            self._finish_inner(job)
        except OSError as e:  # an expected fault (a full disk, an I/O error): named, no traceback
            self._end_in_error(job, io_kind(e), f"{e.strerror or e} in {e.filename or self.store.dir}")
        except Exception as e:
            log.exception("job %s failed", job.id)
            self._end_in_error(job, "internal", f"internal error: {' '.join(str(e).split()) or type(e).__name__}")
        finally:
            self._end_job(job)

    def _end_in_error(self, job: Job, kind: str, why: str) -> None:
        """A job that broke off: its trial (if it got that far) is rolled back, the running model
        stays, the final ack names the kind; the device takes the next job at once."""
        try:
            t = self.store.trial()
            if t is not None and t.get("job_id") == job.id:
                self.store.rollback(f"{why}; rolled back")
                self._final(job.id, "rolled_back", f"{why}; the trial was rolled back, the running model is untouched",
                            kind=kind, slot=t["slot"], sha256=job.offer["sha256"])
            else:
                self._final(job.id, "failed", f"{why}; the running model is untouched", kind=kind)
            log.warning("job %s ended (%s): %s", job.id, kind, why)
        except Exception as e:  # not even the rollback could be written: the next start rolls the trial back
            log.error("job %s: %s, and the trial could not be rolled back (%s); it is rolled back at the next "
                      "start", job.id, why, " ".join(str(e).split()))
            self._final(job.id, "failed", f"{why}; the trial could not be rolled back ({e}): it is at the "
                                          f"agent's next start", kind=kind)

    def _finish_inner(self, job: Job) -> None:
        """received -> verified -> staged -> trial -> the gate's verdict -> committed (settled, then
        swapped in) | rolled_back; each step either hands on or has already sent the final ack."""
        model = self._verify(job)
        if model is None:
            return
        slot = self._install(job, model)
        if slot is None:
            return
        report = self._gate(job)
        if report is None:
            return
        self.deadlines.measured(getattr(report, "load_s", None))
        hrep = {k: getattr(report, k, None) for k in ("p95_ms", "p99_ms", "median_ms", "golden_max_abs_err", "frames",
                                                          "errors", "seconds", "load_s")}
        sha = job.offer["sha256"]
        if not settle(self.store, report):  # the verdict decides: commit, or roll back with its reason
            self._final(job.id, "rolled_back", f"health gate failed: {report.reason}", kind="unhealthy",
                        slot=slot, model=model, health=hrep, sha256=sha)
            return
        swap_error = self._swap_in(report)
        if swap_error is not None:
            kind, reason = swap_error
            self._final(job.id, "rolled_back", reason, kind=kind, slot=slot, model=model, health=hrep, sha256=sha)
            return
        if self.served is not None:
            self._boot_base, self._boot_of = self.served(), (slot, job.id)  # it serves from here; its frames confirm it
        self._final(job.id, "committed", f"health gate passed ({report.summary()})", slot=slot, model=model,
                    sha256=sha, health=hrep, p95_ms=hrep.get("p95_ms"))

    def _verify(self, job: Job) -> dict | None:
        """Whole-file sha256, signature (a retired key's said so), format, arch, and not older
        than the committed model unless the job allows it: -> ``verified``; the model."""
        want = job.offer["sha256"]
        got = durable.sha256_file(job.path)
        if got != want:
            self._final(job.id, "failed", f"bundle sha256 {got[:16]}... differs from the job's {want[:16]}...",
                        kind="sha256_mismatch")
            return None
        try:
            nothing_trusted = self.keys.refusal()
            if nothing_trusted:  # fail closed: an empty list must not mean "signatures not checked"
                raise hmod.BadSignature(f"bundle refused: {nothing_trusted}")
            with hmod.open_bundle(job.path, self.trusted_keys) as b:
                b.lib_for()
                manifest = b.manifest
        except hmod.BundleError as e:
            r = refusal_from(e)
            retired = self.keys.retired_signer(job.path) if isinstance(e, hmod.BadSignature) else None
            if retired:
                self._final(job.id, "failed", f"bundle refused: signed by the retired key {retired}",
                            kind="retired_key")
            else:
                self._final(job.id, "failed", str(r), kind=r.kind)
            return None
        model = {"name": (manifest.get("model") or {}).get("name"),
                 "version": (manifest.get("model") or {}).get("version")}
        current = self.store.primary_manifest()
        why = hmod.downgrade_reason(manifest, current) if current is not None else None
        if why is not None and not job.offer.get("allow_downgrade"):
            self._final(job.id, "failed", f"downgrade refused: {why}; deploy with --allow-downgrade to "
                                          f"install it anyway (or `tandoor fleet rollback`)", kind="downgrade",
                        model=model)
            return None
        self._ack(job.id, "verified", sha256=want, model=model, **({"downgrade": why} if why else {}))
        return model

    def _install(self, job: Job, model: dict) -> str | None:
        """Into the inactive slot: -> ``staged`` then ``trial``; the slot."""
        try:
            slot = self.store.install(job.path, job.id, self.trusted_keys, expected_sha256=job.offer["sha256"],
                                      size=job.size)
        except Busy as e:
            self._final(job.id, "failed", f"busy: {e}", kind="busy")
            return None
        except InstallRefused as e:
            self._final(job.id, "failed", str(e), kind=e.kind)
            return None
        self._ack(job.id, "staged", slot=slot, model=model)
        self._ack(job.id, "trial", slot=slot, model=model)
        return slot

    def _gate(self, job: Job):
        """The health gate's verdict (it changes nothing), or None when the agent is stopping (no
        verdict: the trial is rolled back at the next start, as after a crash)."""
        try:
            if self._stop:
                raise health.CheckStopped("the agent is stopping")
            timeout, why = self.deadlines.health()
            log.info("job %s: health gate, at most %g s (%s)", job.id, timeout, why)
            # the p99 budget only when the offer has one: a gate that predates it takes the offer as before
            p99 = {"p99_budget_ms": job.offer["p99_budget_ms"]} if job.offer.get("p99_budget_ms") is not None else {}
            return self.gate(self.store, self.trusted_keys, latency_budget_ms=job.offer.get("latency_budget_ms"),
                             frames=job.offer["health_frames"], delegate=self.delegate, timeout_s=timeout, **p99)
        except health.CheckStopped:
            log.warning("job %s: the health check was ended by the stop; the trial is rolled back at the next start",
                        job.id)
            return None

    def _swap_in(self, report: Any = None) -> tuple[str, str] | None:
        """Serve the committed slot within the swap's deadline; on failure roll the commit back
        and return (kind, why). The swap is the commit's first start: counted like one (a model
        that kills the agent here is rolled back by the crash-loop counter)."""
        if self.swap is None:
            return None
        timeout, why = self.deadlines.swap(report)
        self._boot_base = None  # frames of the model serving now confirm nothing from here
        try:
            self.store.begin_boot(self.boot_attempts)
        except OSError as e:  # the commit stands: serve it; only its crash-loop count is lost
            log.warning("cannot count the committed model's first start (%s); swapping it in", e.strerror or e)
        try:
            self.swap(timeout)
        except Exception as e:
            if isinstance(e, SwapTimeout):
                kind, reason = "swap_timeout", (f"the committed model did not load in the agent within {timeout:g} s "
                                                f"({why}); the previous model serves on")
            else:
                kind, reason = "swap_failed", f"the committed model failed to load in the agent: {' '.join(str(e).split())}"
            log.warning("%s", reason)
            self.store.rollback(reason)
            return kind, reason
        return None

    # ---------------------------------------------------------------------- rollback cmd
    def rollback_committed(self, reason: str = "rollback requested by the operator") -> dict:
        """Undo the last commit: the primary becomes bad, the other good slot serves."""
        if self.store is None:
            raise JobError("not_supported", "rollback needs slot_dir: this agent serves an explicit bundle")
        a = self._active
        if a is not None:
            raise JobError("busy", f"busy: {a.describe()}")
        before = self.store.load()
        cur = before["primary"]
        self.store.rollback(reason)
        after = self.store.load()
        job = before["slots"][cur]["job_id"] if cur else None
        if job is not None and (self._finals.get(job) or {}).get("state") == "committed":
            # the job's answer follows the slots: offered again, it is rolled_back, not committed
            self._final(job, "rolled_back", reason, kind="rollback", slot=cur, sha256=before["slots"][cur]["sha256"])
        if self.swap is not None:
            self.swap(self.deadlines.swap()[0])
        p = after["primary"]
        return {"from": before["primary"], "slot": p, "model": after["slots"][p]["model"] if p else None,
                "sha256": after["slots"][p]["sha256"] if p else None}
