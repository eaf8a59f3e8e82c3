"""Who may use the console: a users file, sessions, CSRF tokens.

The users file (``--users FILE``), one user a line, ``#`` comments::

    operator  alice  pbkdf2_sha256$200000$<salt hex>$<hash hex>     # `tandoor fleet console --hash-password`
    viewer    grafana  token:<a long random string>                  # also a Bearer token (/metrics)

``operator`` may deploy, cancel and roll back; ``viewer`` only reads. Without a users file every
page is readable without a login (the console binds to localhost by default) and the actions are
off. A session is a random cookie (HttpOnly, SameSite=Strict) with its own CSRF token, which every
form posts back.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

ROLES = ("operator", "viewer")
SESSION_S = 12 * 3600
PBKDF2_ITER = 200_000


class AuthError(Exception):
    pass


@dataclass(frozen=True)
class User:
    name: str
    role: str
    secret: str


@dataclass
class Session:
    user: User
    csrf: str
    expires: float


def hash_password(password: str, iterations: int = PBKDF2_ITER) -> str:
    salt = secrets.token_bytes(16)
    h = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${h.hex()}"


def check_secret(secret: str, given: str) -> bool:
    if secret.startswith("token:"):
        return hmac.compare_digest(secret[6:].encode(), given.encode())
    try:
        algo, it, salt, h = secret.split("$")
        assert algo == "pbkdf2_sha256"
        got = hashlib.pbkdf2_hmac("sha256", given.encode(), bytes.fromhex(salt), int(it))
    except (ValueError, AssertionError):
        return False
    return hmac.compare_digest(got.hex(), h)


def load_users(path: Path) -> dict[str, User]:
    """The users file; AuthError naming the line that is wrong."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as e:
        raise AuthError(f"cannot read the users file {path}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and os.name == "posix":
        raise AuthError(f"the users file {path} is readable by others: chmod 600 {path}")
    users: dict[str, User] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ROLES or not (parts[2].startswith("token:")
                                                               or parts[2].startswith("pbkdf2_sha256$")):
            raise AuthError(f"{path}:{n}: expected 'operator|viewer NAME pbkdf2_sha256$...|token:...'")
        if parts[2].startswith("token:") and len(parts[2]) < 6 + 16:
            raise AuthError(f"{path}:{n}: a token must be at least 16 characters")
        users[parts[1]] = User(parts[1], parts[0], parts[2])
    if not users:
        raise AuthError(f"the users file {path} names no user")
    return users


class Auth:
    def __init__(self, users: dict[str, User] | None) -> None:
        self.users = users
        self.sessions: dict[str, Session] = {}

    @property
    def enabled(self) -> bool:
        return self.users is not None

    def login(self, name: str, secret: str) -> tuple[str, Session] | None:
        u = (self.users or {}).get(name)
        if u is None or not check_secret(u.secret, secret):
            return None
        sid = secrets.token_urlsafe(32)
        s = self.sessions[sid] = Session(u, secrets.token_urlsafe(32), time.time() + SESSION_S)
        return sid, s

    def bearer(self, token: str) -> User | None:
        for u in (self.users or {}).values():
            if u.secret.startswith("token:") and check_secret(u.secret, token):
                return u
        return None

    def session(self, sid: str | None) -> Session | None:
        s = self.sessions.get(sid or "")
        if s is None or s.expires < time.time():
            self.sessions.pop(sid or "", None)
            return None
        return s

    def logout(self, sid: str | None) -> None:
        self.sessions.pop(sid or "", None)
