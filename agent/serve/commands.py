"""The agent's MQTT commands (``<base>/cmd``; docs/protocol.md, "Commands") as one table, as
config.KEYS is for its settings: each entry names the command, what it needs and the service
method that runs it. The service dispatches on the table; docs and tests read it too."""

from __future__ import annotations

from dataclasses import dataclass

#: a handler's return value for a command answered later, off the loop (capture, rollback)
ANSWERED_LATER = object()


@dataclass(frozen=True)
class Command:
    name: str
    handler: str                 # the Service method: handler(req, args) -> result | ANSWERED_LATER
    doc: str
    needs_slots: bool = False    # refused without slot_dir (an agent serving an explicit bundle)


COMMANDS: dict[str, Command] = {c.name: c for c in [
    Command("ping", "_cmd_ping", "liveness: state, uptime, frames served"),
    Command("get-config", "_cmd_get_config", "the effective configuration, secrets redacted"),
    Command("set-config", "_cmd_set_config", "change safe keys at run time, all or nothing"),
    Command("reload", "_cmd_reload", "re-open, verify and swap in the bundle (or the committed slot)"),
    Command("rollback", "_cmd_rollback", "undo the last commit; the other good slot serves", needs_slots=True),
    Command("update-status", "_cmd_update_status", "the update job, slots, counters, deadlines, keyring",
            needs_slots=True),
    Command("snapshot", "_cmd_snapshot", "publish a snapshot of the latest frame"),
    Command("capture", "_cmd_capture", "save the next camera frames for INT8 calibration"),
]}


def unknown(cmd: str) -> str:
    return f"unknown command {cmd!r}; commands: {', '.join(COMMANDS)}"
