"""A real PostgreSQL for tests: Debian's initdb / pg_ctl (/usr/lib/postgresql/*/bin) on a temp data
directory and a free port, with a unix socket in the same directory; stopped (immediate) after.

    with Postgres() as pg:      # pg.url: postgresql://tandoor@127.0.0.1:PORT/tandoor
        ...

Run as root (CI), the server runs as the ``postgres`` user (initdb refuses root): the directory is
made under /tmp and handed to that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .mosquitto import free_port


def bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


def available() -> bool:
    return bindir() is not None


class Postgres:
    def __init__(self) -> None:
        b = bindir()
        assert b is not None, "PostgreSQL is not installed (scripts/setup.sh installs it: apt install postgresql)"
        self.bin = b
        self.dir = Path(tempfile.mkdtemp(prefix="tandoor-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql://tandoor@127.0.0.1:{self.port}/tandoor"
        self.user = "postgres" if os.geteuid() == 0 else None

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def start(self) -> Postgres:
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "tandoor", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        r = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "60",
                      "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start",
                      check=False)
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stderr}{self.log()}")
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "tandoor", "tandoor")
        return self

    def log(self) -> str:
        try:
            return (self.dir / "log").read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Postgres:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
