"""An update job's offer, as the device checks it, and the record of one accepted job
(docs/protocol.md, "Model updates"; the lifecycle is jobs.py, the transfer transfer.py)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

from tandoor_contract import protocol
from tandoor_contract.errors import TandoorError

MAX_OFFER_BYTES = 1 << 20           # the offer JSON
MAX_CHUNK_BYTES = 4 << 20           # one chunk
MAX_BUNDLE_BYTES = 4 << 30          # the whole bundle
MAX_CHUNKS = 100_000
MAX_NEED_LIST = 512                 # indices per need message
MAX_STALL_S = 7 * 86400
FINALS_KEPT = 64
DOWNLOAD_QUEUE = 8                  # chunks a URL download may have waiting for the worker
JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
TRANSPORTS = ("mqtt", "url")
BOOT_ATTEMPTS = 3                   # starts a new commit may die in before it is rolled back
CONFIRM_FRAMES = 10                 # frames a new commit serves before its starts stop counting
CRASH_ENV = "TANDOOR_UPDATE_CRASH_AT"  # tests: SIGKILL the agent right after acking this state


class JobError(TandoorError):
    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg, kind=kind)


class SwapTimeout(TandoorError):
    """The hot swap did not finish within its deadline (raised by the ``swap`` callable)."""


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


def iso(epoch: float) -> str:
    return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_offer(payload: bytes) -> dict[str, Any]:
    """Validate a job offer; raises JobError("malformed", ...) naming the first problem."""
    try:
        o = protocol.json_object(payload, MAX_OFFER_BYTES, "the offer")
    except ValueError as e:
        raise JobError("malformed", f"malformed job: {e}") from None
    jid = o.get("job_id")
    if not isinstance(jid, str) or not JOB_ID_RE.match(jid):
        raise JobError("malformed", "malformed job: job_id must be 1-100 of A-Z a-z 0-9 . _ -")

    def bad(msg: str) -> JobError:
        return JobError("malformed", f"malformed job: {msg}")

    def need_int(k, lo, hi):
        v = o.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise bad(f"{k} must be an integer in {lo}..{hi}, got {v!r}")
        return v

    def opt_number(k, lo, hi):
        v = o.get(k)
        if v is None:
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo < v <= hi:
            raise bad(f"{k} must be a number in ({lo}, {hi}], got {v!r}")
        return float(v)

    size = need_int("size", 1, MAX_BUNDLE_BYTES)
    cs = need_int("chunk_size", 1, MAX_CHUNK_BYTES)
    n = need_int("n_chunks", 1, MAX_CHUNKS)
    if n != -(-size // cs):
        raise bad(f"n_chunks {n} does not fit size {size} / chunk_size {cs}")
    sha = o.get("sha256")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise bad("sha256 must be 64 lowercase hex digits")
    shas = o.get("chunk_sha256")
    if not isinstance(shas, list) or len(shas) != n or not all(
            isinstance(s, str) and re.fullmatch(r"[0-9a-f]{64}", s) for s in shas):
        raise bad(f"chunk_sha256 must be {n} sha256 hex strings")
    try:
        o["_deadline"] = parse_deadline(o.get("deadline"))
    except (ValueError, TypeError) as e:
        raise bad(f"deadline: {e}") from None
    p95_budget = opt_number("latency_budget_ms", 0, 1e9)
    p99_budget = opt_number("p99_budget_ms", 0, 1e9)
    if p95_budget is not None and p99_budget is not None and p99_budget < p95_budget:
        raise bad(f"p99_budget_ms {p99_budget:g} is below latency_budget_ms {p95_budget:g} (the p95 budget): "
                  "a p99 is never under its p95")
    o["_stall_s"] = opt_number("stall_timeout_s", 0, MAX_STALL_S)
    o["_issued"] = opt_number("issued", 0, 1e11) or 0.0
    hf = o.get("health_frames", 20)
    if not isinstance(hf, int) or isinstance(hf, bool) or not 0 <= hf <= 100_000:
        raise bad("health_frames must be an integer in 0..100000")
    o["health_frames"] = hf
    if not isinstance(o.get("allow_downgrade", False), bool):
        raise bad("allow_downgrade must be true or false")
    transport = o.get("transport", "mqtt")
    if transport not in TRANSPORTS:
        raise bad(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    o["transport"] = transport
    if transport == "url":
        url = o.get("url")
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url) or len(url) > 4096:
            raise bad("url must be an http:// or https:// URL (at most 4096 characters)")
    return o


class Job:
    """One accepted job: its offer, its partial file, what has arrived."""

    def __init__(self, offer: dict[str, Any], path: Path, stall_s: float) -> None:
        self.offer = offer
        self.id: str = offer["job_id"]
        self.size: int = offer["size"]
        self.chunk_size: int = offer["chunk_size"]
        self.n: int = offer["n_chunks"]
        self.shas: list[str] = offer["chunk_sha256"]
        self.deadline: float | None = offer.get("_deadline")
        self.issued: float = offer.get("_issued") or 0.0
        self.stall_s: float = offer.get("_stall_s") or stall_s
        self.transport: str = offer.get("transport", "mqtt")
        self.path = path
        self.state = "received"          # the last state acked
        self.received: set[int] = set()
        self.bad: dict[int, int] = {}
        self.fd: int | None = None
        self.finishing = False
        self.ended = threading.Event()
        self.t_start = time.monotonic()
        self.last_progress = time.monotonic()
        self.last_need = 0.0
        self.need_backoff = 0.0
        self.duplicates = 0
        self.last_error: str | None = None  # the URL download's last failure
        self.fetched: set[int] = set()      # chunks the URL download handed to the worker

    def chunk_len(self, i: int) -> int:
        return self.chunk_size if i < self.n - 1 else self.size - self.chunk_size * (self.n - 1)

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.received]

    def expires_at(self) -> float:
        """Epoch seconds when this job ends by itself: its deadline, or a stall."""
        stall = time.time() + self.stall_s - (time.monotonic() - self.last_progress)
        return min(stall, self.deadline) if self.deadline is not None else stall

    def describe(self) -> str:
        return (f"job {self.id} running ({self.state}, {len(self.received)} of {self.n} chunks; "
                f"expires {iso(self.expires_at())} unless it progresses)")



def job_id_of(payload: bytes) -> str | None:
    """The job id of an offer that failed validation, when it can be read (for the answer)."""
    try:
        o = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        # not JSON as a whole (too deeply nested, cut short): a leading "job_id" still names it
        m = re.match(rb'\s*\{\s*"job_id"\s*:\s*"([^"\\]{1,128})"', payload[:512])
        o = {"job_id": m.group(1).decode("utf-8", "replace")} if m else None
    jid = o.get("job_id") if isinstance(o, dict) else None
    return jid if isinstance(jid, str) and JOB_ID_RE.match(jid) else None
