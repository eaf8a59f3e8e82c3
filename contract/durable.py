"""Writing files so that a crash leaves the old file or the new one, never half of either, and
the clocks and digests both halves stamp on what they write.

    atomic_write(path, data, mode=0o644)   temp file beside it, fsync, rename, fsync the directory
    fsync_dir(d)                           make a rename in d durable (best effort where unsupported)
    sha256_file(path)                      hex digest, streamed
    now_iso()                              UTC now as ISO-8601 with milliseconds and a Z
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import os
import tempfile
from pathlib import Path

CHUNK = 1 << 20
NO_SPACE = errno.ENOSPC


def io_kind(err: OSError) -> str:
    """The kind of an expected I/O failure: a full disk, or any other error of the device."""
    return "no_space" if err.errno == NO_SPACE else "io_error"


def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename in ``d`` durable. Filesystems that cannot fsync a directory say EINVAL."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: a reader sees the old bytes or the new, whatever happens."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
