"""A durable JSON record on the device: checksummed, only ever replaced whole, the copy it
replaces kept beside it (``<name>.prev``), and a damaged one moved aside
(``<name>.corrupt-<time>``) instead of being read. slots.py keeps ``state.json`` this way and
keys.py ``keys/keyring.json``.

    write(path, obj, step=None)   temp file, fsync, link the current file to .prev, rename, fsync dir
    read(path)                    the object, None when there is none; Damaged (one line) otherwise
    previous(path)                the same for <path>.prev
    move_aside(path)              rename a damaged file (or a directory in its place) to .corrupt-<time>

"Damaged" covers everything that is not a sound record: truncated, zero bytes, not JSON, not an
object, a checksum that does not match (a flipped bit anywhere), and a path that cannot be read
at all (a directory in its place, permissions, an I/O error). A record is sealed with the sha256
of its canonical JSON under ``checksum``; one written without a checksum (by hand, or by an
older agent) is read without that check.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandoor_contract import durable

log = logging.getLogger("tandoor.record")

CHECKSUM = "checksum"
PREV_SUFFIX = ".prev"
CORRUPT_SUFFIX = ".corrupt-"


class Damaged(ValueError):
    """A record that cannot be used; the message says why, in one line."""


def checksum(obj: dict[str, Any]) -> str:
    """sha256 of the record without its checksum (canonical JSON): a bit flipped anywhere shows."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def parse(raw: bytes) -> dict[str, Any]:
    """A record's bytes -> the object; Damaged naming the first problem."""
    if not raw:
        raise Damaged("it is empty (0 bytes)")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Damaged(f"not JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(obj, dict):
        raise Damaged("not a JSON object")
    if CHECKSUM in obj and obj[CHECKSUM] != checksum(obj):
        raise Damaged("its checksum does not match its content (a damaged file)")
    return obj


def read(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when nothing is there; Damaged when it cannot be used,
    including a path that cannot be read (a directory, permissions, an I/O error)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Damaged(f"unreadable ({e.strerror or e})") from None
    return parse(raw)


def prev_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + PREV_SUFFIX)


def previous(path: Path) -> dict[str, Any] | None:
    """The copy kept by the last write, or None when it is missing or damaged too."""
    try:
        return read(prev_path(path))
    except Damaged:
        return None


def move_aside(path: Path) -> Path | None:
    """Rename a damaged record (file or directory) to ``<name>.corrupt-<time>``, kept for
    inspection; returns the new path, or None when nothing was there or it could not be moved
    (then the next write replaces it, if the filesystem lets it)."""
    path = Path(path)
    keep = path.with_name(f"{path.name}{CORRUPT_SUFFIX}{_dt.datetime.now().strftime('%Y%m%dT%H%M%S%f')}")
    try:
        os.rename(path, keep)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot move the damaged %s aside: %s", path, e.strerror or e)
        return None
    durable.fsync_dir(path.parent)
    return keep


def seal(obj: dict[str, Any]) -> bytes:
    """Stamp the checksum into ``obj`` (in place) and return the bytes to write."""
    obj.pop(CHECKSUM, None)
    obj[CHECKSUM] = checksum(obj)
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def keep_previous(path: Path) -> None:
    """The file about to be replaced stays as ``<name>.prev`` (a hard link: no copy, and ``path``
    never goes missing), the fallback when ``path`` is found damaged."""
    path = Path(path)
    prev, link = prev_path(path), path.with_name(f".{path.name}{PREV_SUFFIX}.{os.getpid()}.tmp")
    try:
        link.unlink(missing_ok=True)
        os.link(path, link)
        os.replace(link, prev)
    except FileNotFoundError:
        pass
    except OSError:  # a filesystem without hard links (or a full one): copy it
        link.unlink(missing_ok=True)
        try:
            durable.atomic_write(prev, path.read_bytes())
        except OSError as e:
            log.warning("cannot keep the previous %s: %s", path.name, e.strerror or e)


def write(path: Path, obj: dict[str, Any], step: Callable[[str], None] | None = None) -> None:
    """The only way a record changes: temp file beside it, fsync, keep the old one as .prev,
    atomic rename, fsync the directory. ``step("tmp_written")`` / ``step("replaced")`` are the
    crash tests' failpoints. Raises OSError (ENOSPC, EIO) with the record unchanged."""
    path = Path(path)
    data = seal(obj)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if step is not None:
            step("tmp_written")
        keep_previous(path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if step is not None:
        step("replaced")
    durable.fsync_dir(path.parent)
