"""The MQTT protocol between the fleet (host) and the agent (device), defined once.

Topics: every device's topics are under ``<prefix>/<device_id>/`` (docs/protocol.md):

    status, telemetry, results, cmd, response           the service
    update/job, update/chunk/<job_id>/<index>,         model updates (docs/updates.md)
    update/ack, update/need

Update jobs move through ``JOB_STATES`` (the device acks each state it reaches on
``update/ack``); ``FINAL_STATES`` end a job. The fleet reads the same table to know when a device
is done, so a state exists here or nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def base(prefix: str, device_id: str) -> str:
    return f"{prefix}/{device_id}"


def topic(prefix: str, device_id: str, leaf: str) -> str:
    """``topic("tandoor", "rk1", STATUS)`` -> ``tandoor/rk1/status``."""
    return f"{prefix}/{device_id}/{leaf}"


def chunk_topic(prefix: str, device_id: str, job_id: str, index: int) -> str:
    return f"{prefix}/{device_id}/{UPDATE_CHUNK}/{job_id}/{index}"


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
    JobState("committed", True, "the health gate passed; the device serves the new model", ok=True),
    JobState("rolled_back", True, "the trial failed (health gate, swap, restart): the old model serves"),
    JobState("failed", True, "refused or abandoned before a trial (kind and reason say why)"),
]}
FINAL_STATES: tuple[str, ...] = tuple(s.name for s in JOB_STATES.values() if s.final)


def is_final(state: str) -> bool:
    s = JOB_STATES.get(state)
    return bool(s and s.final)
