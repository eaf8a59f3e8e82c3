"""sd_notify(3) without libsystemd: one datagram per state to $NOTIFY_SOCKET.

    n = Notifier.from_env()
    n.ready(); n.status("running"); n.watchdog(); n.stopping()

Without NOTIFY_SOCKET (not started by systemd with Type=notify) every call is a no-op.
An abstract socket is written "@name" in the variable. ``watchdog_interval()`` is half of
$WATCHDOG_USEC (when $WATCHDOG_PID, if set, is this process): ping at least that often.
"""

from __future__ import annotations

import os
import socket
import threading


class Notifier:
    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one state string (e.g. "READY=1\\nSTATUS=ok"); False when disabled or on error."""
        if not self.address:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(state.encode("utf-8"), addr)
                return True
            except OSError:
                return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half the watchdog timeout), or None when not enabled."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        n = int(usec)
    except ValueError:
        return None
    return n / 2e6 if n > 0 else None
