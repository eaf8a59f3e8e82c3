"""The host's own small artifact server for ``tandoor fleet deploy --transport url --serve``:
one bundle over HTTP with Range requests (RFC 9110 single ranges), so devices on a LAN download
it themselves and resume where they stopped. Any object store URL serves the same purpose
(``--artifact-url``); the device verifies the bytes either way (chunk sha256s, whole-file sha256,
signature), so the server needs no trust.

    with ArtifactServer(path, "127.0.0.1", 0) as srv:   # srv.url, srv.stats
        ...
"""

from __future__ import annotations

import os
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(first, last) byte of a single ``Range`` header; None for no header (the whole file);
    "unsatisfiable" when it asks for nothing inside the file. Several ranges or a malformed
    header: the whole file (a server may ignore Range)."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix: the last N bytes
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n > 0 and size else "unsatisfiable"
    first = int(m.group(1))
    last = int(m.group(2)) if m.group(2) else size - 1
    if first >= size or last < first:
        return "unsatisfiable"
    return first, min(last, size - 1)


class ArtifactServer:
    """Serves ``path`` at ``/<name>`` on ``host:port`` (port 0: a free one), one thread per
    connection; ``stats`` counts requests, ranged requests and bytes sent."""

    def __init__(self, path: str | os.PathLike, host: str = "127.0.0.1", port: int = 0,
                 name: str | None = None, advertise: str | None = None) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.name = name or self.path.name
        self.stats = {"requests": 0, "ranged": 0, "bytes": 0}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args) -> None:  # quiet: the deploy's progress says enough
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                if self.path.split("?", 1)[0] != f"/{server.name}":
                    self.send_error(HTTPStatus.NOT_FOUND, "no such artifact")
                    return
                size = server.size
                rng = parse_range(self.headers.get("Range"), size)
                if rng == "unsatisfiable":
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                first, last = rng if rng else (0, size - 1)
                self.send_response(HTTPStatus.PARTIAL_CONTENT if rng else HTTPStatus.OK)
                if rng:
                    self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(last - first + 1))
                self.end_headers()
                with server._lock:
                    server.stats["requests"] += 1
                    server.stats["ranged"] += bool(rng)
                if not body:
                    return
                with open(server.path, "rb") as f:
                    sent = self.connection.sendfile(f, offset=first, count=last - first + 1)
                with server._lock:
                    server.stats["bytes"] += sent

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024  # a wave of devices connects at once (the default is 5)

            def handle_error(self, request, client_address) -> None:  # a device went away mid-download:
                with server._lock:                                    # it resumes with a Range request
                    server.stats["aborted"] += 1

        self.stats["aborted"] = 0
        self.httpd = Server((host, port), Handler)
        self.host = advertise or host
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/{self.name}"

    def start(self) -> ArtifactServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tandoor-artifacts", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ArtifactServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
