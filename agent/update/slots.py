"""A/B model slots with one persisted, explicit state machine (RAUC/Mender vocabulary: slots,
install, mark-good/commit, rollback), safe against kill -9 and power loss at every step.

Layout under ``slot_dir``::

    state.json          the one persisted state (below); replaced atomically, never edited in place
    a/model.hmod        slot a's bundle
    b/model.hmod        slot b's bundle
    staging/            partial downloads (the update job writes chunks here; see staging_path())
    .lock               flock()ed while the state changes (one writer at a time, across processes)
    .reserve            space kept so that a rollback can be written on a full disk (UNDO_WRITES)
    state.json.prev     the state the last write replaced (record.py: checksummed, kept copy)

``state.json``::

    {"version": 1,
     "primary": "a" | "b" | null,           # the committed slot the agent serves
     "slots": {"a": {"bundle": "a/model.hmod", "sha256": ..., "model": {name, version},
                     "state": "empty" | "installing" | "trial" | "good" | "bad",
                     "installed_at": ..., "job_id": ..., "reason": ...},
               "b": {...}},
     # each slot also records "verified_by" and "signer_key": the key that verified it at install
    "trial": null | {"slot": "b", "job_id": ..., "started_at": ..., "previous": "a" | null},
     "jobs": {job_id: {"outcome": "trial" | "committed" | "rolled_back" | "failed",
                       "slot": ..., "reason": ..., "sha256": ..., "at": ...}},   # last 32 jobs
     "history": [{"at", "slot", "from", "to", "reason", "job_id"}, ...],        # last 20
     "boot": null | {"slot", "job_id", "attempts"},   # a commit that has not served yet (starts counted)
     "checksum": "<sha256 of the rest>"}

Slot states and the only allowed transitions (TRANSITIONS; anything else raises
TransitionError)::

    empty | bad | good(not primary) --install--> installing --bundle in place--> trial
    installing --failure / crash recovery--> empty
    trial --commit / mark_good--> good (becomes primary; the previous primary stays good)
    trial --rollback / failed health / crash recovery--> bad (primary stays the previous slot)
    good(primary) --rollback of a committed update--> bad (the other, good slot becomes primary)
    good(primary) --its file is missing or changed (recovery)--> bad

Every change is one atomic replacement of state.json (write temp, fsync, os.replace, fsync dir),
and a bundle only becomes part of the state after its own bytes and rename are durable, so
after a crash at any point the state names either the old or the new situation, never a mix;
:meth:`SlotStore.recover_on_start` then rolls back a trial that was never committed and
forgets an install that never finished. A damaged state.json (or anything unreadable in its
place) is moved aside and recovered from its previous copy or the verified bundles, made to
agree with the acks journal (``evidence``), and described in ``recovery`` for the status
message. See docs/updates.md for the argument in full.

Errors are :class:`SlotError` subclasses with a one-line message, an ``exit_code`` and a
machine-readable ``kind`` (for the update job's failed ack).
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import threading
import zipfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandoor_contract import hmod
from tandoor_contract import durable

from . import record

log = logging.getLogger("tandoor.slots")

__all__ = [
    "SLOTS", "SLOT_STATES", "TRANSITIONS", "STATE_VERSION", "SlotStore",
    "SlotError", "TransitionError", "InstallRefused", "Busy", "StateCorrupt",
]


from .install import Install
from .recovery import Recovery
from .slot_state import (  # noqa: F401  (re-exported: the store's vocabulary)
    BUNDLE_NAME, Busy, DEFAULT_RESERVE, HISTORY_MAX, InstallRefused, JOBS_MAX, RESERVE_BYTES,
    RESERVE_NAME, SLOTS, SLOT_STATES, STATE_NAME, STATE_VERSION, SlotError, StateCorrupt, TRANSITIONS,
    TransitionError, UNDO_WRITES, BUNDLE_KINDS, check_state, empty_state, state_step, io_kind,
    refusal_from
)


class SlotStore(Install, Recovery):
    """The slot directory and its state machine. Methods re-read state.json under a lock, so
    several SlotStore objects (threads, processes) on one directory stay consistent.

    ``trusted_keys`` are used when the store must re-verify bundles on its own (rebuilding a lost
    state.json, adopting current.hmod); ``install`` takes the keys of the job explicitly."""

    def __init__(self, slot_dir: str | os.PathLike, trusted_keys: Iterable[hmod.KeySource] = (),
                 reserve_bytes: int = DEFAULT_RESERVE) -> None:
        self.dir = Path(slot_dir)
        self.trusted_keys = list(trusted_keys)
        self.reserve_bytes = reserve_bytes
        self.notes: list[str] = []  # what load()/recover_on_start() had to repair, for the log
        self.recovery: dict[str, Any] | None = None  # the last recovery of a damaged or lost state.json
        #: the acks journal's events ({"sha256", "outcome", "job_id", "at"}): the evidence a recovery
        #: uses to find the committed bundle (set by the update job layer, which keeps the journal)
        self.evidence: Callable[[], Iterable[dict[str, Any]]] | None = None
        self.retired_keys: list[hmod.KeySource] = []  # keys once trusted (a journal-proven bundle's signer)
        self._history_mark = 0
        self._reserve_wanted = False  # the agent's store keeps one (recover_on_start); a bare store does not
        self._tlock = threading.RLock()
        self._depth = 0
        self._state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ paths and locking
    @property
    def state_path(self) -> Path:
        return self.dir / STATE_NAME

    @property
    def staging_dir(self) -> Path:
        return self.dir / "staging"

    def bundle_path(self, slot: str) -> Path:
        self._check_slot(slot)
        return self.dir / slot / BUNDLE_NAME

    def staging_path(self, job_id: str) -> Path:
        """Where an update job should assemble its download (install() then moves it, no copy)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(job_id))[:120] or "job"
        return self.staging_dir / f"{safe}.hmod.part"

    def clean_staging(self, keep_jobs: Iterable[str] = ()) -> list[str]:
        """Remove staged downloads except those of ``keep_jobs`` (the update job layer decides
        which downloads are still resumable). Returns the names removed."""
        keep = {self.staging_path(j).name for j in keep_jobs}
        gone = []
        for p in sorted(self.staging_dir.glob("*")):
            if p.is_file() and p.name not in keep:
                p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone

    @staticmethod
    def _check_slot(slot: str) -> None:
        if slot not in SLOTS:
            raise SlotError(f"unknown slot {slot!r}; slots are {', '.join(SLOTS)}", kind="bad_slot")

    @contextmanager
    def _locked(self):
        """Re-entrant: the thread lock, and (outermost only) an flock on <slot_dir>/.lock that
        serialises writers across processes; the kernel drops it when a process dies."""
        with self._tlock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._depth = 1
                yield
            finally:
                self._depth = 0
                os.close(fd)  # releases the flock

    # --------------------------------------------------------------------- reading state
    def load(self) -> dict[str, Any]:
        """Read state.json (creating the layout and an empty state if there is none). A damaged
        state.json (or anything unreadable in its place) is moved aside as
        state.json.corrupt-<time> and the state recovered (``_recover_corrupt``); what was done
        is logged, listed in ``self.notes`` and described in ``self.recovery``. Returns a copy.

        Reading takes no lock (state.json is only ever replaced whole), so the serving loop never
        waits for an install in progress; only creating or repairing the state does."""
        try:
            st = record.read(self.state_path)
            if st is None:
                raise FileNotFoundError(self.state_path)
            check_state(st)
        except (FileNotFoundError, ValueError):
            with self._locked():
                st = self._read()
        self._state = st
        return copy.deepcopy(st)

    def _read(self) -> dict[str, Any]:
        for d in (self.dir / "a", self.dir / "b", self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        try:
            st = record.read(self.state_path)
            if st is not None:
                check_state(st)
        except ValueError as e:  # record.Damaged (unreadable, not JSON, checksum) or a broken invariant
            st = self._recover_corrupt(str(e))
        if st is None:
            st = self._initial_state()
        self._state = st
        return st

    def _initial_state(self) -> dict[str, Any]:
        st = empty_state()
        if any(self.bundle_path(s).exists() for s in SLOTS):
            self._note("state.json is missing but slot bundles exist: rebuilt the state from disk")
            st, how = self._rebuild_from_disk("state.json was missing")
            self._recovered("it was missing", None, st, how)
        elif (self.dir / "current.hmod").is_file():
            st = self._adopt_current(st)
        self._write(st, "init")
        return st

    @property
    def state(self) -> dict[str, Any]:
        """A copy of the state as last read or written (call load() to re-read)."""
        if self._state is None:
            return self.load()
        return copy.deepcopy(self._state)

    def primary(self) -> str | None:
        return self.load()["primary"]

    def primary_bundle(self) -> Path | None:
        st = self.load()
        return None if st["primary"] is None else self.dir / st["slots"][st["primary"]]["bundle"]

    def inactive_slot(self) -> str:
        """The slot an install goes to: the one that is not primary (a when there is none)."""
        primary = self.load()["primary"]
        return "b" if primary == "a" else "a"

    def trial(self) -> dict[str, Any] | None:
        return self.load()["trial"]

    def primary_manifest(self) -> dict[str, Any] | None:
        """The committed bundle's manifest (read, not re-verified: the file's sha256 is the
        one recorded at install), or None without a readable primary. For the downgrade check."""
        p = self.primary_bundle()
        if p is None:
            return None
        try:
            with zipfile.ZipFile(p) as z:
                m = json.loads(z.read(hmod.MANIFEST))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile):
            return None
        return m if isinstance(m, dict) else None

    def job(self, job_id: str) -> dict[str, Any] | None:
        """What became of a job: {"outcome": trial|committed|rolled_back|failed, "slot", "reason",
        "sha256", "at", "kind"} or None if this store never finished anything for it."""
        rec = self.load()["jobs"].get(str(job_id))
        return copy.deepcopy(rec) if rec is not None else None

    def status(self) -> dict[str, Any]:
        """A compact summary for the agent's status message."""
        st = self.load()
        return {"primary": st["primary"], "trial": st["trial"],
                "slots": {s: {k: v.get(k) for k in ("state", "model", "sha256", "installed_at", "job_id", "verified_by")}
                          for s, v in st["slots"].items()}}

    def install_trust(self, slot: str) -> tuple[list[Any], str] | None:
        """([the key that verified it at install], its sha256) for a good slot, or None when
        the slot recorded no key (installed without trusted keys, or by an older agent): trust is
        decided at install, so a committed bundle opens with the key that verified it, and only
        if it is still those bytes, even after that key was retired."""
        rec = self.load()["slots"].get(slot) or {}
        if rec.get("state") != "good" or not rec.get("signer_key") or not rec.get("sha256"):
            return None
        try:
            return [hmod.public_key_from_pem(rec["signer_key"])], rec["sha256"]
        except hmod.BundleError:
            return None

    def boot(self) -> dict[str, Any] | None:
        """The commit that has not served yet ({"slot", "job_id", "attempts"}), or None."""
        st = self.load()
        b = st.get("boot")
        return copy.deepcopy(b) if b and b.get("slot") == st["primary"] else None

    # --------------------------------------------------------------------- writing state
    def _write(self, st: dict[str, Any], what: str) -> None:
        """The only way state.json changes: record.write (temp file, fsync, the old state kept
        as state.json.prev, atomic rename, fsync the dir). A write that undoes something
        (UNDO_WRITES) may spend the reserve when the disk is full: a rollback must never be
        what a full disk prevents."""
        st.pop(record.CHECKSUM, None)  # the one it was read with; record.write stamps a new one
        check_state(st)
        st["history"] = st["history"][-HISTORY_MAX:]
        if len(st["jobs"]) > JOBS_MAX:
            for old in sorted(st["jobs"], key=lambda j: st["jobs"][j].get("at") or "")[:len(st["jobs"]) - JOBS_MAX]:
                del st["jobs"][old]
        step = lambda name: state_step(f"{what}:{name}")  # noqa: E731
        try:
            record.write(self.state_path, st, step)
        except OSError as e:
            if e.errno != durable.NO_SPACE or what not in UNDO_WRITES or not self._release_reserve():
                raise
            log.warning("%s: the disk is full: released the %d byte reserve to write the %s", self.dir,
                        RESERVE_BYTES, what)
            record.write(self.state_path, st, step)
        self._state = st
        self._keep_reserve()

    def _set(self, st: dict[str, Any], slot: str, to: str, op: str, reason: str,
             job_id: str | None = None) -> None:
        """Change one slot's state in ``st`` (not yet written), if the table allows it."""
        frm = st["slots"][slot]["state"]
        allowed = TRANSITIONS.get((frm, to), frozenset())
        if op not in allowed:
            raise TransitionError(f"slot {slot}: {op} cannot move it from {frm} to {to} "
                                  f"(allowed from {frm}: "
                                  f"{', '.join(sorted(f'{t} by {o}' for (f, t), ops in TRANSITIONS.items() if f == frm for o in ops)) or 'nothing'})")
        if op == "install" and frm == "good" and st["primary"] == slot:
            raise TransitionError(f"slot {slot} is primary: install only into the other slot")
        st["slots"][slot]["state"] = to
        st["slots"][slot]["reason"] = reason
        st["history"].append({"at": durable.now_iso(), "slot": slot, "from": frm, "to": to, "op": op,
                              "reason": reason, "job_id": job_id})

    @staticmethod
    def _record_job(st: dict[str, Any], job_id: str, outcome: str, slot: str | None,
                    reason: str | None, sha: str | None = None, kind: str | None = None) -> None:
        st["jobs"][str(job_id)] = {"outcome": outcome, "slot": slot, "reason": reason,
                                   "sha256": sha, "kind": kind, "at": durable.now_iso()}

    # -------------------------------------------------------------------------- install
    # ------------------------------------------------------------------ commit / rollback
    def mark_good(self, slot: str, reason: str = "marked good") -> dict[str, Any]:
        """The trial slot ``slot`` passed: it becomes primary (RAUC's mark-good)."""
        self._check_slot(slot)
        return self._commit(slot, reason)

    def commit(self, reason: str = "committed") -> dict[str, Any]:
        """Commit the trial in progress: its slot becomes primary, state good. Returns the state."""
        return self._commit(None, reason)

    def _commit(self, slot: str | None, reason: str) -> dict[str, Any]:
        with self._locked():
            st = self._read()
            trial = st["trial"]
            if trial is None:
                raise TransitionError("no trial in progress: nothing to commit"
                                      + (f" (slot {slot} is {st['slots'][slot]['state']})" if slot else ""))
            if slot is not None and slot != trial["slot"]:
                raise TransitionError(f"slot {slot} is not in trial (slot {trial['slot']} is)")
            s = trial["slot"]
            state_step("commit:begin")
            self._set(st, s, "good", "commit", reason, trial.get("job_id"))
            st["primary"] = s
            st["trial"] = None
            st["boot"] = {"slot": s, "job_id": trial.get("job_id"), "attempts": 0}  # until it serves
            if trial.get("job_id") is not None:
                self._record_job(st, trial["job_id"], "committed", s, reason, st["slots"][s]["sha256"])
            self._write(st, "commit")
            log.info("slot %s committed (%s)", s, reason)
            return copy.deepcopy(st)

    def rollback(self, reason: str) -> dict[str, Any]:
        """Undo the trial in progress (its slot becomes bad; the primary stays the previous slot),
        or, with no trial, undo the last commit: the primary becomes bad and the other slot,
        which must be good, becomes primary again. Returns the state."""
        with self._locked():
            st = self._read()
            trial = st["trial"]
            if trial is not None:
                s = trial["slot"]
                self._set(st, s, "bad", "rollback", reason, trial.get("job_id"))
                st["trial"] = None
                if trial.get("job_id") is not None:
                    self._record_job(st, trial["job_id"], "rolled_back", s, reason,
                                     st["slots"][s]["sha256"])
                self._write(st, "rollback")
                log.warning("slot %s rolled back: %s", s, reason)
                return copy.deepcopy(st)
            cur = st["primary"]
            other = "b" if cur == "a" else "a"
            if cur is None or st["slots"][other]["state"] != "good":
                raise TransitionError("nothing to roll back: no trial in progress and no good "
                                      "previous slot" + (f" (slot {other} is {st['slots'][other]['state']})"
                                                         if cur else ""))
            self._set(st, cur, "bad", "rollback", reason, st["slots"][cur].get("job_id"))
            st["primary"] = other
            st["boot"] = None
            job = st["slots"][cur].get("job_id")
            if job is not None and job in st["jobs"]:
                self._record_job(st, job, "rolled_back", cur, reason, st["slots"][cur]["sha256"])
            self._write(st, "rollback")
            log.warning("slot %s rolled back to slot %s: %s", cur, other, reason)
            return copy.deepcopy(st)

    # ----------------------------------------------------------------------- boot attempts
    def begin_boot(self, max_attempts: int) -> dict[str, Any] | None:
        """Count one start of a committed model that has not served yet (RAUC's boot attempts,
        persisted before the model is opened, so a native crash cannot skip it). Past
        ``max_attempts`` starts the commit is rolled back (the other good slot serves) and
        {"job_id", "slot", "attempts", "reason", "to"} returned; else None."""
        with self._locked():
            st = self._read()
            b = st.get("boot")
            if not b or b.get("slot") != st["primary"]:
                return None
            b["attempts"] = int(b.get("attempts") or 0) + 1
            cur, other = st["primary"], "b" if st["primary"] == "a" else "a"
            if b["attempts"] <= max_attempts:
                self._write(st, "boot")
                return None
            reason = (f"crash loop: the committed model of slot {cur} did not serve at {max_attempts} starts in "
                      f"a row (the agent died each time)")
            if st["slots"][other]["state"] != "good":
                st["boot"] = None
                self._write(st, "boot")
                log.error("%s; nothing to roll back to (slot %s is %s)", reason, other, st["slots"][other]["state"])
                return None
            job = b.get("job_id")
            self._set(st, cur, "bad", "rollback", reason, job)
            st["primary"], st["boot"] = other, None
            if job is not None and job in st["jobs"]:
                self._record_job(st, job, "rolled_back", cur, reason, st["slots"][cur]["sha256"], kind="crash_loop")
            self._write(st, "boot_rollback")
            log.error("%s: rolled back to slot %s", reason, other)
            return {"job_id": job, "slot": cur, "attempts": b["attempts"] - 1, "reason": reason, "to": other,
                    "sha256": st["slots"][cur]["sha256"]}

    def boot_pending(self) -> bool:
        return self.boot() is not None

    def confirm_boot(self, slot: str | None = None, job_id: str | None = None) -> None:
        """The committed model served: its starts no longer count. With ``slot``/``job_id``, only
        if the pending commit is that one (a newer commit's count is not cleared by an older one's
        frames)."""
        with self._locked():
            st = self._read()
            b = st.get("boot")
            if b and (slot is None or (b.get("slot"), b.get("job_id")) == (slot, job_id)):
                st["boot"] = None
                self._write(st, "boot_ok")

    # ------------------------------------------------------------------------- recovery
