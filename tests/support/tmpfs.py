"""A real tmpfs of a given size, for full-disk tests (mounting needs root; elsewhere the test skips)."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


@contextmanager
def small_tmpfs(mnt: Path, size: int) -> Iterator[Path]:
    """``mnt`` (created) with a tmpfs of ``size`` bytes (rounded up to pages) on it, unmounted after."""
    mnt.mkdir(parents=True, exist_ok=True)
    size = (size + 4095) // 4096 * 4096
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
