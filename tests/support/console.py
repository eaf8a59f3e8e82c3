"""A real `tandoor fleet console` process for tests, and an HTTP client with a session cookie.

    c = ConsoleProcess(tmp_path, broker_port, db=..., users={"op": ("operator", "token:...")}).start()
    web = WebClient(c.url); web.login("op", "token...")
    c.stop()
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .cli import BIN


class ConsoleProcess:
    def __init__(self, d: Path, broker_port: int, db: str | None = None, users: dict[str, tuple[str, str]] | None = None,
                 bundles: Path | None = None, extra: list[str] | None = None) -> None:
        self.dir = Path(d)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.db = db or f"sqlite:///{self.dir / 'console.db'}"
        self.args = ["--db", self.db, "--listen", "127.0.0.1:0", "--broker", f"mqtt://127.0.0.1:{broker_port}"]
        if users:
            f = self.dir / "users"
            f.write_text("".join(f"{role} {name} {secret}\n" for name, (role, secret) in users.items()))
            os.chmod(f, 0o600)
            self.args += ["--users", str(f)]
        if bundles:
            self.args += ["--bundles", str(bundles)]
        self.args += extra or []
        self.log = self.dir / "console.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> ConsoleProcess:
        self.proc = subprocess.Popen([str(BIN / "tandoor"), "fleet", "console", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"serving on (http://\S+)/", self.output())
            if m:
                self.url = m.group(1)
                return self
            assert self.proc.poll() is None, f"the console exited {self.proc.returncode}: {self.output()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"the console did not serve within {timeout} s: {self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


class WebClient:
    """urllib with a cookie jar: ``get``/``post`` return (status, body text); no redirects followed
    for POST answers unless asked."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        return self._do(urllib.request.Request(self.base + path, headers=headers or {}))

    def post(self, path: str, form: dict) -> tuple[int, str]:
        data = urllib.parse.urlencode(form).encode()
        return self._do(urllib.request.Request(self.base + path, data=data, method="POST"))

    def _do(self, req) -> tuple[int, str]:
        try:
            with self.opener.open(req, timeout=30) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def login(self, name: str, secret: str) -> str:
        """Logs in; the CSRF token of the new session (from the page it lands on)."""
        st, body = self.post("/login", {"name": name, "secret": secret})
        assert st == 200 and "log out" in body, (st, body[:500])
        return csrf_of(body)


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)
