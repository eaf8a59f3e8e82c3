"""The finals journal: each job's final ack, kept on disk (``<slot_dir>/updates/finals.json``,
the last ``FINALS_KEPT``) so that the same job offered again gets the same answer, and the slot
store's recovery follows what the fleet was told. Mixed into :class:`jobs.Updater`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tandoor_contract import durable, protocol

from .offer import FINALS_KEPT

log = logging.getLogger("tandoor.updater")


class Finals:
    """The journal half of the updater (uses its ``dir``, ``store``, ``device_id``, ``_finals``,
    ``_unconfirmed``, ``_pending_acks``, ``_advance`` and ``_publish_ack``)."""

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
               publish_now: bool = True, **fields: Any) -> None:
        """A final ack; recorded for the same job again unless ``protocol.KINDS`` says the kind
        is transient."""
        if not protocol.is_final(state):
            raise ValueError(f"{state!r} is not a final job state")
        if not protocol.kind_fits(kind, state):  # a kind exists in the contract, for its states, or nowhere
            raise ValueError(f"kind {kind!r} is not one of tandoor_contract.protocol.KINDS for {state!r}")
        body = {"job_id": job_id, "device_id": self.device_id, "state": state, "reason": reason,
                "kind": kind, "ts": round(time.time(), 3), **fields}
        body = {k: v for k, v in body.items() if v is not None}
        self._advance(job_id, state)
        if job_id is not None and protocol.recorded(kind):
            self._finals[job_id] = body
            self._save_finals()
        if publish_now:
            self._publish_ack(job_id, state, **{k: v for k, v in body.items()
                                        if k not in ("job_id", "device_id", "state", "ts")})
        else:
            self._pending_acks.append(body)

    def journal(self) -> list[dict[str, Any]]:
        """The acks journal's word on bundles, for the slot store's recovery: every recorded
        final that names a sha256 and committed or rolled back it ({"sha256", "outcome",
        "job_id", "at"}). The finals are the answers the fleet saw, so a recovery that follows
        them never contradicts an ack."""
        if not self._finals and self.dir is not None:
            self._load_finals()
        return [{"sha256": f["sha256"], "outcome": f["state"], "job_id": j, "at": f.get("ts") or 0}
                for j, f in self._finals.items()
                if isinstance(f, dict) and f.get("state") in ("committed", "rolled_back") and f.get("sha256")]

    def _recorded_final(self, jid: str) -> dict | None:
        done = self._finals.get(jid)
        if done is None and jid == self._unconfirmed:
            return None  # committed in the slots, but not yet known to serve: not final yet
        if done is None and self.store is not None:
            rec = self.store.job(jid)
            if rec and protocol.is_final(rec.get("outcome") or ""):
                done = {"job_id": jid, "device_id": self.device_id, "state": rec["outcome"],
                        "reason": rec.get("reason"), "kind": rec.get("kind"), "sha256": rec.get("sha256")}
        return done

    def _repeat_confirming(self, jid: str) -> None:
        boot = self.store.boot() or {}
        body = self._confirming_ack(jid, boot)
        self._publish_ack(jid, "confirming", **{k: v for k, v in body.items()
                                                if k not in ("job_id", "device_id", "state", "ts")})

    def _repeat_final(self, done: dict) -> None:
        log.info("job %s again: answering with its final ack (%s)", done["job_id"], done["state"])
        self._publish_ack(done["job_id"], done["state"], **{k: v for k, v in done.items()
                                                            if k not in ("job_id", "device_id", "state", "ts")},
                          repeated=True)
