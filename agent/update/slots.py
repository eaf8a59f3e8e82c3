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
import datetime as _dt
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import zipfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Union

from tandoor_contract import hmod
from tandoor_contract.errors import TandoorError
from tandoor_contract import durable

from . import record

log = logging.getLogger("tandoor.slots")

__all__ = [
    "SLOTS", "SLOT_STATES", "TRANSITIONS", "STATE_VERSION", "SlotStore",
    "SlotError", "TransitionError", "InstallRefused", "Busy", "StateCorrupt",
]

STATE_VERSION = 1
SLOTS = ("a", "b")
SLOT_STATES = ("empty", "installing", "trial", "good", "bad")
BUNDLE_NAME = "model.hmod"
STATE_NAME = "state.json"
PREV_NAME = "state.json.prev"  # the state before the last write (recovery from a damaged state.json)
HISTORY_MAX = 20
JOBS_MAX = 32
DEFAULT_RESERVE = 256 * 1024  # bytes kept free after an install (state.json, logs, temp files)
RESERVE_NAME = ".reserve"     # a file the agent keeps so that a rollback can be written on a full disk
RESERVE_BYTES = 64 * 1024     # a state.json of JOBS_MAX jobs and HISTORY_MAX transitions is ~20 KiB
#: writes that undo something: they may spend the reserve when the disk is full
UNDO_WRITES = frozenset({"rollback", "install_failed", "recover", "restore", "rebuild", "boot", "boot_rollback"})
_CHUNK = 1 << 20

# (from, to) -> the operations allowed to make that change. The one table of legal moves.
TRANSITIONS: dict[tuple[str, str], frozenset[str]] = {
    ("empty", "installing"): frozenset({"install"}),
    ("bad", "installing"): frozenset({"install"}),
    ("good", "installing"): frozenset({"install"}),      # only a slot that is not primary
    ("installing", "trial"): frozenset({"install"}),
    ("installing", "empty"): frozenset({"install_failed", "recover"}),
    ("trial", "good"): frozenset({"commit"}),
    ("trial", "bad"): frozenset({"rollback", "recover"}),
    ("good", "bad"): frozenset({"rollback", "recover"}),  # only the primary (recovery: any)
    ("empty", "good"): frozenset({"adopt"}),              # rebuilding a lost state.json from disk
    ("empty", "bad"): frozenset({"adopt"}),
}

SourceLike = Union[str, "os.PathLike[str]", IO[bytes]]

# Failpoint for crash tests: called with the name of each step (e.g. "install:copy_synced",
# "commit:replaced"). A test process sets it to stop or kill itself there. None in production.
_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _hook is not None:
        _hook(name)


# ----------------------------------------------------------------------------------- errors
class SlotError(TandoorError):
    """Base of slot errors: one line, with ``exit_code`` and a machine-readable ``kind``."""

    exit_code = 20
    kind = "slot_error"

    def __init__(self, msg: str, kind: str | None = None, exit_code: int | None = None) -> None:
        super().__init__(msg, exit_code=exit_code, kind=kind)


class TransitionError(SlotError):
    """A state change the state machine does not allow (a programming or protocol error)."""

    exit_code = 21
    kind = "bad_transition"


class InstallRefused(SlotError):
    """The bundle was not installed; the running slot is untouched. ``kind`` says why:
    bad_signature, unsigned, hash_mismatch, not_a_bundle, format_version, wrong_arch,
    sha256_mismatch, no_space, io_error, ... ``repeated`` is True when this is the recorded
    answer to a job that was already refused."""

    exit_code = 22
    kind = "install_refused"
    repeated = False


class Busy(SlotError):
    """Another job's trial is in progress: commit or roll it back first."""

    exit_code = 23
    kind = "busy"


class StateCorrupt(SlotError):
    exit_code = 24
    kind = "state_corrupt"


_BUNDLE_KINDS = {
    hmod.NotABundle: "not_a_bundle", hmod.UnsafeMember: "unsafe_member",
    hmod.HashMismatch: "hash_mismatch", hmod.MissingMember: "missing_member",
    hmod.BadSignature: "bad_signature", hmod.UnsignedBundle: "unsigned",
    hmod.FormatVersionError: "format_version", hmod.NoLibForArch: "wrong_arch",
    hmod.ExtraMember: "extra_member", hmod.KeyFileError: "key_file",
}


io_kind = durable.io_kind


def _io_refusal(err: OSError, what: str) -> InstallRefused:
    return InstallRefused(f"{what}: {err.strerror or err}; the running model is untouched", kind=io_kind(err))


def refusal_from(err: hmod.BundleError) -> InstallRefused:
    kind = next((k for cls, k in _BUNDLE_KINDS.items() if isinstance(err, cls)), "bundle_error")
    return InstallRefused(f"bundle refused: {err}", kind=kind, exit_code=err.exit_code)


# ---------------------------------------------------------------------------------- helpers
def _empty_slot(name: str) -> dict[str, Any]:
    return {"bundle": f"{name}/{BUNDLE_NAME}", "sha256": None, "model": None, "state": "empty",
            "installed_at": None, "job_id": None, "reason": None, "verified_by": None, "signer_key": None}


def _empty_state() -> dict[str, Any]:
    return {"version": STATE_VERSION, "primary": None, "slots": {s: _empty_slot(s) for s in SLOTS},
            "trial": None, "jobs": {}, "history": []}


def _check_state(st: Any) -> None:
    """Schema, checksum and invariants; raises ValueError naming the first problem."""
    if not isinstance(st, dict):
        raise ValueError("not a JSON object")
    if record.CHECKSUM in st and st[record.CHECKSUM] != record.checksum(st):
        raise ValueError("its checksum does not match its content (a damaged file)")
    if st.get("version") != STATE_VERSION:
        raise ValueError(f"version {st.get('version')!r}, expected {STATE_VERSION}")
    slots = st.get("slots")
    if not isinstance(slots, dict) or sorted(slots) != sorted(SLOTS):
        raise ValueError(f"slots must be exactly {list(SLOTS)}")
    for name, s in slots.items():
        if not isinstance(s, dict) or s.get("state") not in SLOT_STATES:
            raise ValueError(f"slot {name}: bad state {s.get('state') if isinstance(s, dict) else s!r}")
        if s.get("bundle") != f"{name}/{BUNDLE_NAME}":
            raise ValueError(f"slot {name}: bundle must be {name}/{BUNDLE_NAME}")
        if s["state"] in ("trial", "good") and not isinstance(s.get("sha256"), str):
            raise ValueError(f"slot {name}: {s['state']} without a sha256")
    primary = st.get("primary")
    if primary is not None:
        if primary not in SLOTS:
            raise ValueError(f"primary {primary!r} is not a slot")
        if slots[primary]["state"] != "good":
            raise ValueError(f"primary slot {primary} is {slots[primary]['state']}, not good")
    trial = st.get("trial")
    in_trial = [n for n in SLOTS if slots[n]["state"] == "trial"]
    if trial is None:
        if in_trial:
            raise ValueError(f"slot {in_trial[0]} is in trial but no trial is recorded")
    else:
        if not isinstance(trial, dict) or trial.get("slot") not in SLOTS:
            raise ValueError("trial must name a slot")
        if in_trial != [trial["slot"]]:
            raise ValueError(f"trial names slot {trial['slot']} but slots in trial are {in_trial}")
        if trial["slot"] == primary:
            raise ValueError("the trial slot cannot be primary")
    if sum(slots[n]["state"] in ("installing", "trial") for n in SLOTS) > 1:
        raise ValueError("more than one slot is installing or in trial")
    if not isinstance(st.get("history"), list) or not isinstance(st.get("jobs"), dict):
        raise ValueError("history must be a list and jobs an object")


# ---------------------------------------------------------------------------------- the store
class SlotStore:
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
            _check_state(st)
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
                _check_state(st)
        except ValueError as e:  # record.Damaged (unreadable, not JSON, checksum) or a broken invariant
            st = self._recover_corrupt(str(e))
        if st is None:
            st = self._initial_state()
        self._state = st
        return st

    def _initial_state(self) -> dict[str, Any]:
        st = _empty_state()
        if any(self.bundle_path(s).exists() for s in SLOTS):
            self._note("state.json is missing but slot bundles exist: rebuilt the state from disk")
            st, how = self._rebuild_from_disk("state.json was missing")
            self._recovered("it was missing", None, st, how)
        elif (self.dir / "current.hmod").is_file():
            st = self._adopt_current(st)
        self._write(st, "init")
        return st

    def _recover_corrupt(self, err: str) -> dict[str, Any]:
        """A damaged state.json (truncated, bit-flipped, breaking an invariant, or a directory or
        an unreadable file in its place): moved aside, then the previous state if it is sound and
        its primary's bundle is the one recorded (a state one step older is consistent too: every
        step is safe to lose), else rebuilt from the bundles that verify; either way made to agree
        with the acks journal's last word (``evidence``), so a committed update is not lost. With
        nothing to serve: StateCorrupt, saying how to repair."""
        keep = record.move_aside(self.state_path)
        if keep is None and self.state_path.exists() and not self.state_path.is_file():
            raise StateCorrupt(f"{self.state_path} is unusable ({err}) and cannot be moved aside; remove it "
                               f"and start again (the state is then rebuilt from the slot bundles)")
        where = f"kept it as {keep.name}" if keep else "it could not be kept"
        st = self._previous_state()
        if st is not None:
            self._note(f"state.json was corrupt ({err}); {where} and went back to the previous state ({PREV_NAME})")
            how = f"the previous state ({PREV_NAME})"
            fixed = self._reconcile(st)
            if fixed:
                self._note(fixed)
                how += f"; {fixed}"
            self._recovered(err, keep, st, how)
            self._write(st, "restore")
            return st
        self._note(f"state.json was corrupt ({err}); {where} and rebuilt the state from the bundles on disk")
        st, how = self._rebuild_from_disk(f"state.json was corrupt ({err})")
        if st["primary"] is None and any(self.bundle_path(s).exists() for s in SLOTS):
            raise StateCorrupt(f"{self.state_path} is corrupt ({err}), {PREV_NAME} is no help and no slot bundle "
                               f"verifies with the trusted keys: nothing safe to serve; to repair, copy a signed "
                               f"bundle to {self.dir / 'current.hmod'} and remove {self.state_path} (it is adopted "
                               f"at the next start), or set bundle = PATH in the agent's config")
        self._recovered(err, keep, st, how)
        self._write(st, "rebuild")
        return st

    def _recovered(self, reason: str, kept: Path | None, st: dict[str, Any], how: str) -> None:
        """What this recovery did, for the status message and telemetry (``self.recovery``)."""
        p = st["primary"]
        chose = None if p is None else {"slot": p, "model": st["slots"][p]["model"], "sha256": st["slots"][p]["sha256"],
                                         "how": how}
        marked = [{"slot": h["slot"], "reason": h["reason"]} for h in st["history"][self._history_mark:]
                  if h["to"] == "bad"]
        self.recovery = {"damaged": STATE_NAME, "reason": reason, "kept_as": kept.name if kept else None,
                         "chose": chose, "marked_bad": marked, "at": durable.now_iso()}

    def _previous_state(self) -> dict[str, Any] | None:
        st = record.previous(self.state_path)
        try:
            if st is None:
                return None
            _check_state(st)
        except ValueError:
            return None
        p = st["primary"]
        if p is not None:
            try:
                if durable.sha256_file(self.bundle_path(p)) != st["slots"][p]["sha256"]:
                    return None
            except OSError:
                return None
        self._history_mark = len(st["history"])
        return st

    def _journal(self) -> list[dict[str, Any]]:
        """The acks journal's events about bundles ({"sha256", "outcome", "job_id", "at"}), oldest
        first; empty when there is none or it cannot be read."""
        if self.evidence is None:
            return []
        try:
            return sorted((e for e in self.evidence() if isinstance(e.get("sha256"), str)),
                          key=lambda e: e.get("at") or 0)
        except Exception as e:  # evidence is a hint: never a reason to fail the recovery
            log.warning("cannot read the acks journal: %s", e)
            return []

    def _last_word(self, shas: dict[str, str]) -> dict[str, Any] | None:
        """The journal's latest event about one of ``shas`` ({sha256: slot})."""
        last = None
        for ev in self._journal():
            if ev["sha256"] in shas and ev.get("outcome") in ("committed", "rolled_back"):
                last = ev
        return last

    def _reconcile(self, st: dict[str, Any]) -> str | None:
        """Make a recovered state agree with the journal's last word on the bundles it holds: a
        trial (or good slot) the journal says was committed becomes primary; a primary the
        journal says was rolled back gives way to the other good slot. Returns what it changed."""
        live = {st["slots"][s]["sha256"]: s for s in SLOTS if st["slots"][s]["state"] in ("trial", "good")}
        ev = self._last_word(live)
        if ev is None:
            return None
        s, job = live[ev["sha256"]], ev.get("job_id")
        other = "b" if s == "a" else "a"
        if ev["outcome"] == "committed" and st["primary"] != s:
            if st["slots"][s]["state"] == "trial":
                self._set(st, s, "good", "commit", f"recovered: the acks journal says job {job} committed it", job)
                st["trial"] = None
                st["boot"] = {"slot": s, "job_id": job, "attempts": 0}
            st["primary"] = s
            return f"slot {s} is primary: the acks journal says job {job} committed it"
        if ev["outcome"] == "rolled_back" and st["primary"] == s and st["slots"][other]["state"] == "good":
            self._set(st, s, "bad", "recover", f"recovered: the acks journal says job {job} was rolled back", job)
            st["primary"], st["boot"] = other, None
            return f"slot {s} is bad and slot {other} primary: the acks journal says job {job} was rolled back"
        return None

    def _verify_file(self, p: Path, keys: Iterable[hmod.KeySource]) -> dict[str, Any]:
        """What the slot records of a bundle that opens, verifies and has a lib for here: its
        sha256, model, and the key that verified it (fingerprint and PEM: trust is decided at
        install, so the bundle keeps serving after that key is retired)."""
        keys = list(keys)
        with hmod.open_bundle(p, keys) as b:
            b.lib_for()
            model = b.manifest.get("model") or {}
            manifest = b.manifest
            by = b.verified_by
        pem = None
        for k in keys:
            obj = k if hasattr(k, "verify") else hmod.load_public_key(k)
            if by is not None and hmod.key_fingerprint(obj) == by:
                pem = hmod.public_key_pem(obj)
                break
        return {"sha256": durable.sha256_file(p), "model": {"name": model.get("name"), "version": model.get("version")},
                "verified_by": by, "signer_key": pem, "_manifest": manifest}

    def _rebuild_from_disk(self, why: str) -> tuple[dict[str, Any], str]:
        """The state was lost: trust only bundles that verify, with the trusted keys (or, for a
        bundle the acks journal says was committed, with a key since retired: it was verified at
        install). The journal's last word names the committed one; without one, installs always go
        to the slot that is not primary, so of two valid bundles the older (by build, version,
        then signing time) was committed when the newer one was installed: it becomes primary and
        the newer one, which might never have passed its gate, is marked bad. Returns the state
        and how the primary was chosen."""
        st = _empty_state()
        self._history_mark = 0
        valid: dict[str, dict[str, Any]] = {}
        journal_shas = {e["sha256"] for e in self._journal() if e.get("outcome") == "committed"}
        for s in SLOTS:
            p = self.bundle_path(s)
            if not p.exists():
                continue
            try:
                facts = self._verify_file(p, self.trusted_keys)
            except hmod.BundleError as e:
                facts = self._proven_by_journal(p, journal_shas, e)
                if facts is None:
                    self._set(st, s, "bad", "adopt", f"{why}; bundle does not verify: {e}")
                    self._note(f"slot {s}: bundle does not verify ({e}); marked bad")
                    continue
            facts["_mtime"] = p.stat().st_mtime_ns
            valid[s] = facts
            st["slots"][s].update({k: v for k, v in facts.items() if not k.startswith("_")},
                                  installed_at=durable.now_iso())
        if not valid:
            return st, "nothing verifies"
        ev = self._last_word({f["sha256"]: s for s, f in valid.items()})
        if ev is not None and ev["outcome"] == "committed":
            primary = next(s for s, f in valid.items() if f["sha256"] == ev["sha256"])
            how = f"rebuilt from the bundles on disk: the acks journal says job {ev.get('job_id')} committed it"
        else:
            primary = next(s for s in valid if not any(self._newer(valid[s], f) for f in valid.values()))
            how = ("rebuilt from the bundles on disk: " + ("the older valid bundle (nothing says the newer one was "
                                                           "committed)" if len(valid) > 1 else "the one valid bundle"))
        for s in sorted(valid, key=lambda s: s != primary):
            if s == primary:
                self._set(st, s, "good", "adopt", f"{why}; {how}")
                st["primary"] = s
                self._note(f"slot {s} is primary again ({how})")
                continue
            newer = self._newer(valid[s], valid[primary])
            rolled = self._last_word({valid[s]["sha256"]: s})
            if (rolled is not None and rolled["outcome"] == "rolled_back") or (newer and ev is None):
                reason = ("the acks journal says it was rolled back" if rolled is not None
                          and rolled["outcome"] == "rolled_back" else "newer bundle, not known to be committed")
                self._set(st, s, "bad", "adopt", f"{why}; {reason}")
                self._note(f"slot {s}: {reason}; marked bad")
            else:
                self._set(st, s, "good", "adopt", f"{why}; a valid bundle committed before slot {primary}'s")
        return st, how

    def _proven_by_journal(self, p: Path, committed: set[str], err: hmod.BundleError) -> dict[str, Any] | None:
        """A bundle that no trusted key verifies any more, but whose sha256 the acks journal
        records as committed: verified at install, so proven; it must still verify with a key
        once trusted (``retired_keys``) and be whole."""
        if not isinstance(err, (hmod.BadSignature, hmod.UnsignedBundle)) or not committed:
            return None
        try:
            if durable.sha256_file(p) not in committed:
                return None
            return self._verify_file(p, list(self.trusted_keys) + list(self.retired_keys))
        except (OSError, hmod.BundleError):
            return None

    @staticmethod
    def _newer(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Whether bundle ``a`` is newer than ``b``: by their manifests' build, version, then
        signing time (hmod.downgrade_reason's order), else by the files' times."""
        if hmod.downgrade_reason(b["_manifest"], a["_manifest"]) is not None:
            return True
        if hmod.downgrade_reason(a["_manifest"], b["_manifest"]) is not None:
            return False
        return a["_mtime"] > b["_mtime"]

    def _adopt_current(self, st: dict[str, Any]) -> dict[str, Any]:
        """A directory from before slots (<slot_dir>/current.hmod): copy it into slot a."""
        src = self.dir / "current.hmod"
        try:
            facts = self._verify_file(src, self.trusted_keys)
        except hmod.BundleError as e:
            self._note(f"current.hmod does not verify ({e}); starting with empty slots")
            return st
        self._copy_durably(src, self.bundle_path("a"), facts["sha256"])
        st["slots"]["a"].update({k: v for k, v in facts.items() if not k.startswith("_")},
                                installed_at=durable.now_iso())
        self._set(st, "a", "good", "adopt", "adopted current.hmod")
        st["primary"] = "a"
        self._note("adopted current.hmod into slot a as primary")
        return st

    def _note(self, msg: str) -> None:
        self.notes.append(msg)
        log.warning("%s: %s", self.dir, msg)

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
        _check_state(st)
        st["history"] = st["history"][-HISTORY_MAX:]
        if len(st["jobs"]) > JOBS_MAX:
            for old in sorted(st["jobs"], key=lambda j: st["jobs"][j].get("at") or "")[:len(st["jobs"]) - JOBS_MAX]:
                del st["jobs"][old]
        step = lambda name: _step(f"{what}:{name}")  # noqa: E731
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

    @property
    def _reserve_path(self) -> Path:
        return self.dir / RESERVE_NAME

    def _keep_reserve(self) -> None:
        """Put the reserve back once there is room (best effort: a full disk stays full)."""
        p = self._reserve_path
        if p.exists() or not self._reserve_wanted:
            return
        try:
            durable.atomic_write(p, bytes(RESERVE_BYTES), mode=0o600)
        except OSError:
            pass

    def _release_reserve(self) -> bool:
        try:
            self._reserve_path.unlink()
            return True
        except OSError:
            return False

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
    def install(self, source: SourceLike, job_id: str, trusted_keys: Iterable[hmod.KeySource] = (),
                expected_sha256: str | None = None, size: int | None = None) -> str:
        """Install a bundle into the inactive slot and start its trial; returns the slot name.

        ``source`` is a path (a file in staging_dir() is moved, anything else copied) or a
        binary stream (written to staging first; ``size``, if known, is checked against the free
        space up front). Before anything is written: signature against ``trusted_keys``, every
        sha256, the format version, a lib for this machine, ``expected_sha256`` of the whole
        file, and the free space. Refusals raise InstallRefused (``kind`` says why) and leave
        the running slot untouched.

        Idempotent: a job_id that already reached trial (or later) returns its slot without
        doing anything; one that was refused raises the same refusal again (``repeated``)."""
        job_id = str(job_id)
        keys = list(trusted_keys)
        with self._locked():
            st = self._read()
            done = st["jobs"].get(job_id)
            if done is not None:
                return self._repeat(job_id, done)
            for s in SLOTS:  # an install that died without recover_on_start(): forget it
                if st["slots"][s]["state"] == "installing":
                    self._forget_install(st, s, "an earlier install was interrupted")
                    self._write(st, "recover")
            if st["trial"] is not None:
                t = st["trial"]
                raise Busy(f"job {t.get('job_id')} is in trial on slot {t['slot']}; "
                           f"commit or roll it back before job {job_id}")
            slot = "b" if st["primary"] == "a" else "a"
            try:
                return self._install(st, slot, source, job_id, keys, expected_sha256, size)
            except InstallRefused as e:
                self._fail_job(job_id, e)
                raise

    def _repeat(self, job_id: str, done: dict[str, Any]) -> str:
        if done["outcome"] == "failed" or done.get("slot") is None:
            e = InstallRefused(done.get("reason") or "refused", kind=done.get("kind") or "install_refused")
            e.repeated = True
            raise e
        log.info("job %s already done (%s on slot %s): nothing to do", job_id, done["outcome"], done["slot"])
        return done["slot"]

    def _fail_job(self, job_id: str, e: InstallRefused) -> None:
        """Record a refusal so that the same job gets the same answer; transient refusals (disk
        space, I/O) are not recorded, so a retry of the job may succeed later."""
        if e.kind in ("no_space", "io_error"):
            return
        try:
            st = self._read()
            self._record_job(st, job_id, "failed", None, str(e), kind=e.kind)
            self._write(st, "refused")
        except OSError as err:  # e.g. the disk is full: the refusal itself still stands
            log.warning("could not record the refusal of job %s: %s", job_id, err)

    def _install(self, st: dict[str, Any], slot: str, source: SourceLike, job_id: str,
                 keys: list, expected_sha256: str | None, size: int | None) -> str:
        staged: Path | None = None
        owns_staged = False
        if hasattr(source, "read"):
            # not staging_path(): the caller may be streaming from that very file
            staged = self.staging_path(job_id).with_suffix(".stream")
            owns_staged = True
            if size is not None:
                self._check_space(st, slot, size)
            self._stream_to(source, staged)
            _step("install:staged")
            src = staged
        else:
            src = Path(source)
            if src.resolve().parent == self.staging_dir.resolve():
                staged = src  # already on this filesystem: moved, not copied
        try:
            # 1. verify everything before anything is written to a slot
            try:
                facts = self._verify_file(src, keys)
            except hmod.BundleError as e:
                raise refusal_from(e) from None
            file_sha, model = facts["sha256"], facts["model"]
            if expected_sha256 and file_sha != expected_sha256.lower():
                raise InstallRefused(f"bundle sha256 {file_sha[:16]}... differs from the job's "
                                     f"{expected_sha256[:16]}...", kind="sha256_mismatch")
            _step("install:verified")
            # 2. room for it (a move needs none)
            need = 0 if staged is not None else src.stat().st_size
            self._check_space(st, slot, need)
            # 3. the slot is being overwritten: say so durably before touching its file
            self._set(st, slot, "installing", "install", f"installing job {job_id}", job_id)
            st["slots"][slot].update(sha256=None, model=None, installed_at=None, job_id=job_id,
                                     verified_by=None, signer_key=None)
            try:
                self._write(st, "installing")
            except OSError as e:  # nothing changed: state.json is the old one
                raise _io_refusal(e, f"cannot write {STATE_NAME}") from None
            dst = self.bundle_path(slot)
            try:
                if dst.exists():
                    dst.unlink()  # frees its space before the copy (it is no longer referenced)
                    durable.fsync_dir(dst.parent)
                    _step("install:reclaimed")
                if staged is not None:
                    os.replace(staged, dst)
                    durable.fsync_dir(staged.parent)
                    durable.fsync_dir(dst.parent)
                    owns_staged = False
                    if durable.sha256_file(dst) != file_sha:
                        raise InstallRefused("the staged bundle changed while it was installed",
                                             kind="hash_mismatch")
                else:
                    self._copy_durably(src, dst, file_sha)
                _step("install:copy_renamed")
                # 4. trial: the new slot is on disk; the primary is still the old one
                st = self._read()
                self._set(st, slot, "trial", "install", f"installed by job {job_id}", job_id)
                st["slots"][slot].update(sha256=file_sha, model=model, installed_at=durable.now_iso(), job_id=job_id,
                                         verified_by=facts["verified_by"], signer_key=facts["signer_key"])
                st["trial"] = {"slot": slot, "job_id": job_id, "started_at": durable.now_iso(),
                               "previous": st["primary"]}
                self._record_job(st, job_id, "trial", slot, None, file_sha)
                self._write(st, "trial")
            except BaseException as e:
                self._abort_install(slot, job_id, e)
                if isinstance(e, OSError):
                    raise _io_refusal(e, f"cannot write the bundle into slot {slot}") from None
                raise
            log.info("job %s: %s installed in slot %s, in trial", job_id, model, slot)
            return slot
        finally:
            if owns_staged and staged is not None:
                staged.unlink(missing_ok=True)

    def _abort_install(self, slot: str, job_id: str, err: BaseException) -> None:
        """installing -> empty after a failed write; the primary was never touched."""
        try:
            self.bundle_path(slot).unlink(missing_ok=True)
            for t in (self.dir / slot).glob(".*.tmp"):
                t.unlink(missing_ok=True)
            st = self._read()
            if st["slots"][slot]["state"] == "installing":
                self._set(st, slot, "empty", "install_failed", f"job {job_id} failed: {err}", job_id)
                self._write(st, "install_failed")
        except OSError as e2:  # recover_on_start finishes this on the next start
            log.warning("slot %s: could not clean up after a failed install: %s", slot, e2)

    def _check_space(self, st: dict[str, Any], slot: str, need: int) -> None:
        free = shutil.disk_usage(self.dir).free
        reclaim = 0
        old = self.bundle_path(slot)
        if old.exists():
            reclaim = old.stat().st_size  # the inactive slot's old bundle is overwritten
        if need + self.reserve_bytes > free + reclaim:
            mib = 1024 * 1024
            raise InstallRefused(
                f"not enough disk space in {self.dir}: the bundle needs {need / mib:.2f} MiB plus "
                f"{self.reserve_bytes / mib:.2f} MiB reserve, {free / mib:.2f} MiB free"
                + (f" (+{reclaim / mib:.2f} MiB from slot {slot}'s old bundle)" if reclaim else "")
                + "; the running model is untouched", kind="no_space")

    def _stream_to(self, stream: IO[bytes], dst: Path) -> None:
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                while chunk := stream.read(_CHUNK):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            dst.unlink(missing_ok=True)
            raise _io_refusal(e, f"cannot stage the bundle in {dst.parent}") from None

    @staticmethod
    def _copy_durably(src: Path, dst: Path, want_sha: str) -> None:
        """Copy to a temp file beside dst, fsync, check it is the verified bytes, rename, fsync."""
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        try:
            h = hashlib.sha256()
            with open(src, "rb") as sf, open(tmp, "wb") as df:
                while chunk := sf.read(_CHUNK):
                    h.update(chunk)
                    df.write(chunk)
                df.flush()
                _step("install:copy_written")
                os.fsync(df.fileno())
            if h.hexdigest() != want_sha:
                raise InstallRefused(f"{src} changed between verification and copy",
                                     kind="hash_mismatch")
            _step("install:copy_synced")
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        durable.fsync_dir(dst.parent)

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
            _step("commit:begin")
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
    def recover_on_start(self, verify: bool = True) -> list[str]:
        """Call once when the agent starts, before serving. Rolls back a trial that was never
        committed, forgets an install that never finished, removes temp files, and (``verify``)
        checks that the primary's bundle is still the one recorded, falling back to the other
        good slot if not. Returns what it did (also logged), empty when nothing was needed."""
        with self._locked():
            self.notes = []
            self._reserve_wanted = True
            st = self._read()
            done = list(self.notes)
            changed = False
            for s in SLOTS:
                for t in (self.dir / s).glob(".*.tmp"):
                    t.unlink(missing_ok=True)
                    done.append(f"removed the temp file {s}/{t.name}")
            for t in self.dir.glob(f".{STATE_NAME}.*.tmp"):
                t.unlink(missing_ok=True)
            for pattern in ("*.tmp", "*.stream"):  # ours: a stream being staged by install()
                for t in self.staging_dir.glob(pattern):
                    t.unlink(missing_ok=True)
                    done.append(f"removed the staged file staging/{t.name}")
            for s in SLOTS:
                if st["slots"][s]["state"] == "installing":
                    job = self._forget_install(st, s, "the install was interrupted (agent restarted)")
                    done.append(f"slot {s}: install of job {job} was interrupted; slot emptied")
                    changed = True
            trial = st["trial"]
            if trial is not None:
                s = trial["slot"]
                reason = "the agent restarted before the trial was committed"
                self._set(st, s, "bad", "recover", reason, trial.get("job_id"))
                st["trial"] = None
                if trial.get("job_id") is not None:
                    self._record_job(st, trial["job_id"], "rolled_back", s, reason, st["slots"][s]["sha256"])
                done.append(f"slot {s}: trial of job {trial.get('job_id')} rolled back ({reason})")
                changed = True
            if verify:
                changed |= self._verify_primary(st, done)
            if changed:
                self._write(st, "recover")
            self._keep_reserve()
            for msg in done[len(self.notes):]:
                log.warning("%s: %s", self.dir, msg)
            return done

    def _forget_install(self, st: dict[str, Any], s: str, reason: str) -> str | None:
        """installing -> empty in ``st`` (not yet written); removes the half-written bundle."""
        slot = st["slots"][s]
        job = slot.get("job_id")
        self.bundle_path(s).unlink(missing_ok=True)
        for t in (self.dir / s).glob(".*.tmp"):
            t.unlink(missing_ok=True)
        self._set(st, s, "empty", "recover", reason, job)
        slot.update(sha256=None, model=None, installed_at=None)
        return job

    def _verify_primary(self, st: dict[str, Any], done: list[str]) -> bool:
        changed = False
        for _ in SLOTS:  # at most one fallback per slot
            cur = st["primary"]
            if cur is None:
                return changed
            p = self.bundle_path(cur)
            want = st["slots"][cur]["sha256"]
            try:
                got = durable.sha256_file(p)
                problem = None if got == want else f"its bundle's sha256 is {got[:16]}..., recorded {want[:16]}..."
            except OSError as e:
                problem = f"its bundle is unreadable ({e.strerror or e})"
            if problem is None:
                return changed
            self._set(st, cur, "bad", "recover", f"primary bundle damaged: {problem}")
            other = "b" if cur == "a" else "a"
            st["primary"] = other if st["slots"][other]["state"] == "good" else None
            done.append(f"slot {cur}: {problem}; marked bad, primary is now {st['primary']}")
            changed = True
        return changed
