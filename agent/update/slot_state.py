"""The slot store's vocabulary: the state file's schema and its checks, the one table of legal
slot moves (``TRANSITIONS``), the errors with their exit codes and kinds, and the failpoint hook.
Shared by slots.py (the store), install.py and recovery.py; the store re-exports all of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any, Union

from tandoor_contract import hmod
from tandoor_contract.errors import TandoorError
from tandoor_contract import durable

from . import record

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
CHUNK = 1 << 20

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
# "commit:replaced"). A test process sets slot_state._hook to stop or kill itself there (the
# store and its install and recovery halves all call state_step). None in production.
_hook: Callable[[str], None] | None = None


def state_step(name: str) -> None:
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


BUNDLE_KINDS = {
    hmod.NotABundle: "not_a_bundle", hmod.UnsafeMember: "unsafe_member",
    hmod.HashMismatch: "hash_mismatch", hmod.MissingMember: "missing_member",
    hmod.BadSignature: "bad_signature", hmod.UnsignedBundle: "unsigned",
    hmod.FormatVersionError: "format_version", hmod.NoLibForArch: "wrong_arch",
    hmod.ExtraMember: "extra_member", hmod.KeyFileError: "key_file",
}


io_kind = durable.io_kind


def io_refusal(err: OSError, what: str) -> InstallRefused:
    return InstallRefused(f"{what}: {err.strerror or err}; the running model is untouched", kind=io_kind(err))


def refusal_from(err: hmod.BundleError) -> InstallRefused:
    kind = next((k for cls, k in BUNDLE_KINDS.items() if isinstance(err, cls)), "bundle_error")
    return InstallRefused(f"bundle refused: {err}", kind=kind, exit_code=err.exit_code)


# ---------------------------------------------------------------------------------- helpers
def _empty_slot(name: str) -> dict[str, Any]:
    return {"bundle": f"{name}/{BUNDLE_NAME}", "sha256": None, "model": None, "state": "empty",
            "installed_at": None, "job_id": None, "reason": None, "verified_by": None, "signer_key": None}


def empty_state() -> dict[str, Any]:
    return {"version": STATE_VERSION, "primary": None, "slots": {s: _empty_slot(s) for s in SLOTS},
            "trial": None, "jobs": {}, "history": []}


def check_state(st: Any) -> None:
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
