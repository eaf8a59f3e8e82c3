"""The host's artifact server (fleet/artifacts.py) on 127.0.0.1, asked with the standard
library's HTTP client: whole file, single ranges (first-last, open-ended, suffix), a range past
the end (416), an unknown path (404); and a device-side URL download that resumes with a Range
request after the server went away mid-transfer."""

from __future__ import annotations

import hashlib
import http.client
import os
from pathlib import Path

from tandoor_fleet.artifacts import ArtifactServer, parse_range


def get(srv: ArtifactServer, path: str, rng: str | None = None) -> tuple[int, dict, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    c.request("GET", path, headers={"Range": rng} if rng else {})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def settled(srv: ArtifactServer, want: int, timeout: float = 10) -> None:
    import time

    deadline = time.monotonic() + timeout
    while srv.stats["bytes"] < want and time.monotonic() < deadline:
        time.sleep(0.02)


def test_ranges_as_rfc_9110_says(tmp_path):
    data = os.urandom(100_003)
    f = tmp_path / "b.hmod"
    f.write_bytes(data)
    with ArtifactServer(f, "127.0.0.1", 0, name="x.hmod") as srv:
        st, h, body = get(srv, "/x.hmod")
        assert st == 200 and body == data and h["accept-ranges"] == "bytes"
        st, h, body = get(srv, "/x.hmod", "bytes=10-19")
        assert st == 206 and body == data[10:20] and h["content-range"] == f"bytes 10-19/{len(data)}"
        st, h, body = get(srv, "/x.hmod", "bytes=65536-")
        assert st == 206 and body == data[65536:] and h["content-range"] == f"bytes 65536-{len(data) - 1}/{len(data)}"
        st, h, body = get(srv, "/x.hmod", "bytes=-7")
        assert st == 206 and body == data[-7:]
        st, h, body = get(srv, "/x.hmod", "bytes=99999999-")
        assert st == 416 and h["content-range"] == f"bytes */{len(data)}"
        st, _, _ = get(srv, "/other.hmod")
        assert st == 404
        want = len(data) + 10 + len(data) - 65536 + 7
        settled(srv, want)  # the server counts a body after its last byte left
        assert srv.stats["requests"] == 4 and srv.stats["ranged"] == 3  # served ones: not the 416, not the 404
        assert srv.stats["bytes"] == want
    assert parse_range("bytes=5-1", 10) == "unsatisfiable" and parse_range("bytes=0-1,4-5", 10) is None
    assert parse_range("bytes=2-100", 10) == (2, 9)


def test_a_url_download_retries_and_resumes_with_a_range_request(tmp_path):
    """The device side (agent/update/jobs.py) with two chunks already on disk (as after an agent
    restart) and no server yet: it retries with backoff, and once the server is up asks only for
    the bytes from the first chunk it lacks; the file comes out whole."""
    import json
    import socket
    import time

    from tandoor_agent.update.jobs import Updater, _Job, parse_offer

    data = os.urandom(5 * 4096 + 123)
    f = tmp_path / "b.hmod"
    f.write_bytes(data)
    chunks = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    with socket.socket() as s:  # a free port, nobody listening yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    offer = parse_offer(json.dumps({
        "job_id": "j", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "chunk_size": 4096,
        "n_chunks": len(chunks), "chunk_sha256": [hashlib.sha256(c).hexdigest() for c in chunks],
        "transport": "url", "url": f"http://127.0.0.1:{port}/b.hmod"}).encode())
    up = Updater(None, "tandoor/d", lambda *a: None)
    part = tmp_path / "j.part"
    part.write_bytes(data[:2 * 4096] + bytes(len(data) - 2 * 4096))
    job = _Job(offer, part, 60)
    up._rescan(job)
    assert job.received == {0, 1}
    up._start_download(job)
    deadline = time.monotonic() + 30
    while not up.counters["download_errors"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert up.counters["download_errors"] >= 1  # connection refused: it waits and tries again
    with ArtifactServer(f, "127.0.0.1", port, name="b.hmod") as srv:
        while len(job.received) < job.n and time.monotonic() < deadline:
            try:
                ev = up._q.get(timeout=0.2)  # the agent's worker thread does this part
            except Exception:
                continue
            if ev[0] == "data":
                assert hashlib.sha256(ev[3]).hexdigest() == job.shas[ev[2]]
                os.pwrite(job.fd, ev[3], ev[2] * job.chunk_size)
                job.received.add(ev[2])
        job.ended.set()
        settled(srv, len(data) - 2 * 4096)
        assert srv.stats["ranged"] == 1 and srv.stats["bytes"] == len(data) - 2 * 4096, srv.stats
    os.close(job.fd)
    assert part.read_bytes() == data
