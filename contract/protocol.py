"""The MQTT protocol between the fleet (host) and the agent (device), defined once.

Topics: every device's topics are under ``<prefix>/<device_id>/`` (docs/protocol.md):

    status, telemetry, results, cmd, response           the service
    update/job, update/chunk/<job_id>/<index>,         model updates (docs/updates.md)
    update/ack, update/need, update/cancel, update/keys

and one level no device can be named (device ids are ``A-Z a-z 0-9 _ . -``), read by every device
and written only by the fleet: ``<prefix>/~fleet/update/chunk/<job_id>/<index>``, where a job's
chunks go once per wave (a device subscribes to its job's chunks while it runs the job).

Update jobs move through ``JOB_STATES`` (the device acks each state it reaches on
``update/ack``); ``FINAL_STATES`` end a job. The fleet reads the same table to know when a device
is done, so a state exists here or nowhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DEFAULT_PREFIX = "tandoor"
PROTOCOL_VERSION = 1

# --- topics ---------------------------------------------------------------------------------

STATUS = "status"
TELEMETRY = "telemetry"
RESULTS = "results"
SNAPSHOT = "snapshot"
CMD = "cmd"
RESPONSE = "response"
UPDATE_JOB = "update/job"
UPDATE_CHUNK = "update/chunk"
UPDATE_ACK = "update/ack"
UPDATE_NEED = "update/need"
UPDATE_CANCEL = "update/cancel"
UPDATE_KEYS = "update/keys"
FLEET_LEVEL = "~fleet"          # not a legal device id: the fleet-wide topics


def base(prefix: str, device_id: str) -> str:
    return f"{prefix}/{device_id}"


def topic(prefix: str, device_id: str, leaf: str) -> str:
    """``topic("tandoor", "rk1", STATUS)`` -> ``tandoor/rk1/status``."""
    return f"{prefix}/{device_id}/{leaf}"


def chunk_topic(prefix: str, device_id: str, job_id: str, index: int) -> str:
    return f"{prefix}/{device_id}/{UPDATE_CHUNK}/{job_id}/{index}"


def group_chunk_topic(prefix: str, job_id: str, index: int) -> str:
    """A job's chunk for every device of the wave: ``tandoor/~fleet/update/chunk/<job>/<i>``."""
    return f"{prefix}/{FLEET_LEVEL}/{UPDATE_CHUNK}/{job_id}/{index}"


def group_chunk_filter(prefix: str, job_id: str) -> str:
    return f"{prefix}/{FLEET_LEVEL}/{UPDATE_CHUNK}/{job_id}/#"


def fleet_filter(prefix: str, leaf: str) -> str:
    """Every device's ``leaf``: ``tandoor/+/status``."""
    return f"{prefix}/+/{leaf}"


def device_of(prefix: str, topic_name: str) -> str | None:
    """The device id in ``<prefix>/<device_id>/...``, or None for another topic."""
    head = prefix + "/"
    if not topic_name.startswith(head):
        return None
    dev = topic_name[len(head):].split("/", 1)[0]
    return dev or None


def json_object(payload: bytes, max_bytes: int, what: str) -> dict[str, Any]:
    """A message that must be one JSON object of at most ``max_bytes``; ValueError naming the
    problem ("<what> of N bytes is over ...", "<what> is not JSON (...)", ...) otherwise."""
    if len(payload) > max_bytes:
        raise ValueError(f"{what} of {len(payload)} bytes is over the {max_bytes} byte limit")
    try:
        o = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(f"{what} is not JSON ({type(e).__name__ if isinstance(e, RecursionError) else e})") from None
    if not isinstance(o, dict):
        raise ValueError(f"{what} must be a JSON object")
    return o


# --- update job states ------------------------------------------------------------------------

@dataclass(frozen=True)
class JobState:
    name: str
    final: bool
    doc: str
    ok: bool = False          # a final state that means the device runs the new model


JOB_STATES: dict[str, JobState] = {s.name: s for s in [
    JobState("received", False, "offer accepted (count 0) and chunk progress; count == n_chunks when complete"),
    JobState("verified", False, "whole-file sha256, signature, format and arch checked"),
    JobState("staged", False, "installed into the inactive slot"),
    JobState("trial", False, "the new slot is on trial: the health gate runs"),
    JobState("confirming", False, "committed, but the agent restarted before it answered: it starts the model "
                                  "again, counting the starts it dies in, until it has served (then committed) or "
                                  "the starts run out (then rolled_back, kind crash_loop)"),
    JobState("committed", True, "the health gate passed; the device serves the new model", ok=True),
    JobState("rolled_back", True, "the trial failed (health gate, swap, restart): the old model serves"),
    JobState("failed", True, "refused or abandoned before a trial (kind and reason say why)"),
    JobState("cancelled", True, "dropped before a trial: `tandoor fleet cancel`, or a newer job superseded it"),
]}
FINAL_STATES: tuple[str, ...] = tuple(s.name for s in JOB_STATES.values() if s.final)


def is_final(state: str) -> bool:
    s = JOB_STATES.get(state)
    return bool(s and s.final)


#: The order of a job's states, as the device acks them: from the state a job was last acked in
#: (None: none yet in this agent process: a new offer, or a job known only from before a restart,
#: whose answer is rolled_back, confirming or committed), the states it may go to next. Acking the
#: same state again (progress, a repeated answer, a note) is not a step. The device advances a job
#: in one place (``agent/update/jobs.py: Updater._advance``), which refuses a step not listed here.
JOB_STEPS: dict[str | None, tuple[str, ...]] = {
    None: ("received", "failed", "cancelled", "confirming", "committed", "rolled_back"),
    "received": ("verified", "failed", "cancelled"),
    "verified": ("staged", "failed"),
    "staged": ("trial", "failed"),
    # the gate's verdict (committed / rolled_back), or an I/O fault once the trial is gone (failed)
    "trial": ("committed", "rolled_back", "failed"),
    "confirming": ("committed", "rolled_back"),
    "committed": ("rolled_back", "failed"),   # the operator's rollback; a fault after the commit
    "rolled_back": (),
    "failed": (),
    "cancelled": (),
}


def step_allowed(last: str | None, state: str) -> bool:
    """Whether a job last acked in ``last`` may be acked ``state`` now (the same state again: yes)."""
    return state == last or state in JOB_STEPS.get(last, ())



# --- why a job ended (the ``kind`` of a final ack) ----------------------------------------------

@dataclass(frozen=True)
class Kind:
    name: str
    states: tuple[str, ...]   # the final state(s) it goes with (an I/O error before or during a trial)
    recorded: bool            # kept in finals.json: the same job offered again gets the same answer
    doc: str


KINDS: dict[str, Kind] = {k.name: k for k in [
    # refused before anything was downloaded or installed
    Kind("malformed", ("failed",), False, "the offer breaks the rules of the offer (reason names the field)"),
    Kind("busy", ("failed",), False, "another job runs (reason names it, its progress and when it expires)"),
    Kind("stale", ("failed",), True, "the job's deadline had passed when it was offered"),
    Kind("not_supported", ("failed",), False, "the agent serves an explicit bundle (no slot_dir)"),
    Kind("downgrade", ("failed",), True, "older than the committed model (version or build time); "
                                         "the job may say allow_downgrade"),
    # the transfer
    Kind("expired", ("failed",), True, "the deadline passed before the download was complete"),
    Kind("stalled", ("failed",), False, "no progress for the job's stall timeout"),
    Kind("chunk_hash", ("failed",), True, "a chunk failed its sha256 check too many times"),
    Kind("download", ("failed",), False, "the artifact URL kept failing until the stall timeout"),
    Kind("sha256_mismatch", ("failed",), True, "the whole file is not the job's sha256"),
    Kind("no_space", ("failed", "rolled_back"), False,
         "the disk was full (staging, installing, or writing the trial's outcome: then rolled back); "
         "the running model is untouched"),
    Kind("io_error", ("failed", "rolled_back"), False,
         "a read or write failed (before or during the trial: then rolled back); the running model is untouched"),
    # the bundle (hmod errors, through slots.InstallRefused)
    Kind("bad_signature", ("failed",), True, "not signed by a trusted key"),
    Kind("retired_key", ("failed",), True, "signed by a key that was retired (update/keys)"),
    Kind("unsigned", ("failed",), True, "no signature while keys are trusted"),
    Kind("hash_mismatch", ("failed",), True, "a member's sha256 differs from the manifest"),
    Kind("not_a_bundle", ("failed",), True, "not a bundle (truncated, not a ZIP, no manifest)"),
    Kind("unsafe_member", ("failed",), True, "a member name that could escape (path tricks, links)"),
    Kind("missing_member", ("failed",), True, "a member the manifest lists is not there"),
    Kind("extra_member", ("failed",), True, "a member the manifest does not list"),
    Kind("format_version", ("failed",), True, "a format version this agent does not read"),
    Kind("wrong_arch", ("failed",), True, "no library for this machine"),
    Kind("key_file", ("failed",), True, "a trusted key file could not be read (the device's configuration)"),
    Kind("bundle_error", ("failed",), True, "another bundle refusal (reason says which)"),
    Kind("internal", ("failed", "rolled_back"), True, "a bug: the reason carries the error"),
    # after the trial started
    Kind("unhealthy", ("rolled_back",), True, "the health gate failed (golden, errors, p95 or p99 over its budget)"),
    Kind("swap_failed", ("rolled_back",), True, "the committed model did not load in the agent"),
    Kind("swap_timeout", ("rolled_back",), True, "the committed model did not load in the agent within "
                                                 "update.swap_timeout_s (a hung library): the old one serves on"),
    Kind("rollback", ("rolled_back",), True, "the operator rolled the committed model back (`tandoor fleet rollback`)"),
    Kind("restarted", ("rolled_back",), True, "the agent restarted before the trial was committed"),
    Kind("crash_loop", ("rolled_back",), True, "the committed model crashed the agent at N starts in a row"),
    # cancelled
    Kind("cancelled", ("cancelled",), True, "the fleet cancelled the job"),
    Kind("superseded", ("cancelled",), True, "a newer job was offered while this one was still downloading"),
]}


def kind_fits(kind: str | None, state: str) -> bool:
    """Whether a final ack in ``state`` may carry ``kind`` (no kind: yes; an unknown kind: no)."""
    return kind is None or (kind in KINDS and state in KINDS[kind].states)


def recorded(kind: str | None) -> bool:
    """Whether a final ack of this kind is kept for the same job offered again (unknown: yes)."""
    k = KINDS.get(kind or "")
    return True if k is None else k.recorded
