"""Getting a job's bundle onto the device: staging the file, chunks over MQTT (fleet-wide once
per wave, re-sent on ``need``), or the URL download with Range requests; resuming after a restart;
the stall and deadline watch. Mixed into :class:`jobs.Updater`, whose worker thread calls it."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

from tandoor_contract import durable, protocol

from .offer import DOWNLOAD_QUEUE, MAX_NEED_LIST, Job
from .slots import io_kind

log = logging.getLogger("tandoor.updater")


class Transfer:
    """The transfer half of the updater (uses its ``store``, ``_q``, ``_active``, ``counters``,
    ``_ack``/``_final``/``_send``/``_end_job``)."""

    def _follow(self, job: Job, on: bool) -> None:
        fn = self.subscribe if on else self.unsubscribe
        if fn is None or job.transport != "mqtt":
            return
        try:
            fn(protocol.group_chunk_filter(self.prefix, job.id))
        except Exception as e:  # offline: the next connect subscribes from `subscriptions`
            log.warning("cannot %s the chunks of job %s: %s", "subscribe to" if on else "unsubscribe from", job.id, e)

    def _accept(self, offer: dict) -> None:
        """Stage the download (room checked, preallocated), persist the offer, follow the job's
        chunks, then say ``received``; refusals are ``failed`` and leave nothing behind."""
        jid = offer["job_id"]
        path = self.store.staging_path(jid)
        job = Job(offer, path, self.stall_timeout_s)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(path.parent).free
            need = offer["size"] + getattr(self.store, "reserve_bytes", 0)
            if free < need:
                raise OSError(durable.NO_SPACE, f"not enough disk space to stage the bundle: {free} bytes free, "
                                                f"{need} needed; the running model is untouched")
            job.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(job.fd, 0, offer["size"])
            except (AttributeError, OSError) as e:
                if getattr(e, "errno", None) == durable.NO_SPACE:
                    raise
                os.ftruncate(job.fd, offer["size"])
            self._persist_offer(offer, path)
        except OSError as e:
            self._end_job(job)
            msg = e.strerror if isinstance(e.strerror, str) else str(e)
            kind = io_kind(e)
            if kind == "no_space" and "running model" not in msg:
                msg = f"staging: {msg}; the running model is untouched"
            self._final(jid, "failed", msg, kind=kind)
            return
        with self._lock:
            self._active = job
        self._follow(job, True)  # before the ack: the broker then has the subscription when the host sees it
        self._ack(jid, "received", count=0, n_chunks=job.n, missing=job.n, transport=job.transport)
        if job.transport == "url":
            self._start_download(job)

    def _persist_offer(self, offer: dict, path: Path) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.dir / f"{path.name}.offer.json"
        durable.atomic_write(p, json.dumps({k: v for k, v in offer.items() if not k.startswith("_")}).encode())

    def _rescan(self, job: Job) -> None:
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
        if now - a.last_progress > a.stall_s:
            why = f"; the download's last error: {a.last_error}" if a.last_error else ""
            self._final(a.id, "failed", f"transfer stalled: no progress for {a.stall_s:g} s "
                        f"({len(a.received)} of {a.n} chunks received){why}; the job was dropped",
                        kind="download" if a.last_error else "stalled", count=len(a.received), n_chunks=a.n)
            self._end_job(a)
            return
        wait = max(self.need_interval_s, a.need_backoff)
        idle = self._q.empty()  # chunks still queued here are not missing, only not yet written
        if idle and now - a.last_progress >= self.need_interval_s and now - a.last_need >= wait:
            self._need(a)

    def _need(self, job: Job, bad: list[int] | None = None, reconnected: bool = False) -> None:
        miss = bad or job.missing()
        if not miss or job.transport != "mqtt":
            return
        if bad is None:
            job.last_need = time.monotonic()
            job.need_backoff = min(30.0, max(self.need_interval_s, job.need_backoff * 2 or self.need_interval_s))
        self.counters["needs"] += 1
        self._send(self.topic[protocol.UPDATE_NEED], {
            "job_id": job.id, "device_id": self.device_id, "missing": miss[:MAX_NEED_LIST],
            "n_missing": job.n - len(job.received), "count": len(job.received), "n_chunks": job.n,
            **({"bad": bad} if bad else {}), **({"reconnected": True} if reconnected else {}),
            # how long this MQTT session has been subscribed: anything sent before is lost to it
            **({"session_s": round(time.monotonic() - self._connected_at, 3)} if self._connected_at else {}),
            "ts": round(time.time(), 3)})

    def _on_chunk(self, rest: str, data: bytes) -> None:
        jid, _, idx = rest.rpartition("/")
        a = self._active
        if a is None or a.id != jid or a.finishing:
            return
        try:
            i = int(idx)
        except ValueError:
            return
        if 0 <= i < a.n:
            self._take(a, i, data)

    def _on_data(self, job: Job, i: int, data: bytes) -> None:
        """A chunk from the URL download."""
        if self._active is job and not job.finishing:
            self._take(job, i, data)

    def _take(self, a: Job, i: int, data: bytes) -> None:
        """Check one chunk and write it at its offset; the last one completes the download."""
        self.counters["chunks"] += 1
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
            a.fetched.discard(i)
            self._need(a, bad=[i])
            return
        try:
            os.pwrite(a.fd, data, i * a.chunk_size)
        except OSError as e:
            self._final(a.id, "failed", f"staging: {e.strerror or e}; the running model is untouched", kind=io_kind(e))
            self._end_job(a)
            return
        a.received.add(i)
        a.last_progress = time.monotonic()
        a.need_backoff = 0.0
        if len(a.received) == a.n:
            self._complete(a)

    def _start_download(self, job: Job) -> None:
        threading.Thread(target=self._download, args=(job,), name=f"tandoor-download-{job.id}", daemon=True).start()

    def _download(self, job: Job) -> None:
        """Fetch what is missing with Range requests, chunk by chunk into the worker's queue;
        after any failure wait (1 s doubling to 30 s) and resume from the first missing chunk.
        The worker's stall timeout ends a download that never gets anywhere."""
        backoff = 1.0
        while not job.ended.is_set() and not self._stop and not job.finishing:
            miss = [i for i in job.missing() if i not in job.fetched]
            if not miss:  # everything is fetched; the worker is still checking the last ones
                job.ended.wait(0.1)
                continue
            try:
                self._fetch_from(job, miss[0])
                backoff = 1.0
            except (OSError, http.client.HTTPException, ValueError) as e:
                job.last_error = " ".join(str(e).split())[:300]
                self.counters["download_errors"] += 1
                log.warning("job %s: download from %s failed (%s); retrying in %g s", job.id,
                            job.offer["url"], job.last_error, backoff)
                job.ended.wait(backoff)
                backoff = min(30.0, backoff * 2)

    def _fetch_from(self, job: Job, first: int) -> None:
        start = first * job.chunk_size
        req = urllib.request.Request(job.offer["url"], headers={
            "Range": f"bytes={start}-{job.size - 1}", "User-Agent": f"tandoor-agent/{self.device_id}"})
        self.counters["downloads"] += 1
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status == 206:
                got = (r.headers.get("Content-Range") or "").split()
                if len(got) < 2 or not got[1].startswith(f"{start}-"):
                    raise ValueError(f"asked for bytes {start}- and got Content-Range {r.headers.get('Content-Range')!r}")
                i = first
            elif r.status == 200:  # the server ignores Range: the whole file again, skip what we have
                i = 0
            else:
                raise ValueError(f"HTTP {r.status} from {job.offer['url']}")
            while i < job.n and not job.ended.is_set() and not self._stop:
                want = job.chunk_len(i)
                data = r.read(want)
                while len(data) < want:
                    more = r.read(want - len(data))
                    if not more:
                        raise ValueError(f"the download ended early, in chunk {i}")
                    data += more
                while self._q.qsize() > DOWNLOAD_QUEUE and not job.ended.is_set():
                    time.sleep(0.01)  # the worker writes as fast as the disk allows
                if i not in job.received:
                    job.fetched.add(i)
                    self._q.put(("data", job, i, data))
                i += 1

    def _complete(self, job: Job) -> None:
        job.finishing = True
        try:
            os.fsync(job.fd)
        except OSError:
            pass
        self._follow(job, False)
        self._ack(job.id, "received", count=job.n, n_chunks=job.n, missing=0, duplicates=job.duplicates,
                  seconds=round(time.monotonic() - job.t_start, 3))
        threading.Thread(target=self._finish, args=(job,), name=f"tandoor-update-{job.id}", daemon=True).start()
