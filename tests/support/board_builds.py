"""The emulated boards' builds (scripts/board/build.sh), side by side in the background while the
host tests run; shared by the process that starts them and the test workers that wait for them.

One build.sh per board, all started at once (each is mostly one emulated dpkg or pip at a time, so
two boards share two cores with the host tests); each writes its output to ``DIR/NAME.log`` and,
when it ends, its exit status to ``DIR/NAME.rc``. The process that started them (pytest itself,
or the xdist controller) owns them and stops them if the session ends first; a worker attaches to
DIR (``TANDOOR_BOARD_BUILDS``) and only reads.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_SH = ROOT / "scripts" / "board" / "build.sh"
EXIT_CANNOT = 77   # build.sh: this machine cannot run an arm64 board
ENV = "TANDOOR_BOARD_BUILDS"
COMMON_SH = ROOT / "scripts" / "board" / "common.sh"


@functools.lru_cache(maxsize=1)
def emulated_boards() -> list[str]:
    """The emulated boards scripts/board/common.sh knows, the default first."""
    m = re.search(r"^BOARDS=\(([^)]*)\)", COMMON_SH.read_text(), re.M)
    assert m, f"no BOARDS=(...) in {COMMON_SH}"
    return list(m.group(1).split())


def selected_boards() -> list[str]:
    """The boards TANDOOR_BOARD asks for ([] for 0); a name that is no board is a usage error.
    Unset, "all" or "1": every one; "0": none; a name or a comma-separated list: those."""
    import pytest

    want = os.environ.get("TANDOOR_BOARD", "").strip()
    known = emulated_boards()
    if want == "0":
        return []
    if want in ("", "1", "all"):
        return known
    names = [n.strip() for n in want.split(",") if n.strip()]
    if bad := [n for n in names if n not in known]:
        raise pytest.UsageError(f"TANDOOR_BOARD={want}: no board {', '.join(bad)}; "
                                f"choose all, 0 or from {', '.join(known)}")
    return [n for n in known if n in names]


class Builds:
    """build.sh --board NAME for each board, each in its own background process."""

    def __init__(self, boards: list[str], directory: Path | None = None, *, start: bool = True) -> None:
        self.boards = list(boards)
        self.dir = directory or Path(tempfile.mkdtemp(prefix="tandoor-board-build-"))
        self.t0 = time.monotonic()
        self._shown = dict.fromkeys(self.boards, 0)   # bytes of each log whose status lines were shown
        self.procs: dict[str, subprocess.Popen] = {}
        if start:
            for b in self.boards:
                self.procs[b] = subprocess.Popen(
                    ["bash", "-c", '"$0" --board "$1" > "$2/$1.log" 2>&1; echo $? > "$2/$1.rc.tmp"; '
                     'mv "$2/$1.rc.tmp" "$2/$1.rc"', str(BUILD_SH), b, str(self.dir)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True)

    @classmethod
    def attach(cls, directory: str | Path, boards: list[str]) -> Builds:
        """The builds another process started in ``directory``: read-only."""
        return cls(boards, Path(directory), start=False)

    @property
    def owner(self) -> bool:
        return bool(self.procs)

    def log(self, board: str) -> Path:
        return self.dir / f"{board}.log"

    def status(self, board: str) -> int | None:
        """build.sh's exit status for this board, or None while it has not ended."""
        try:
            return int((self.dir / f"{board}.rc").read_text())
        except (OSError, ValueError):
            p = self.procs.get(board)
            if p is not None and p.poll() is not None:   # the driver is gone without a status (killed)
                return p.returncode or 1
            return None

    def wait(self, board: str, out=None, poll: float = 0.5) -> int:
        """Wait for this board's build to end; with ``out``, its log so far and then what comes."""
        shown = 0
        while True:
            rc = self.status(board)
            if out is not None:
                text = self.text(board)
                if len(text) > shown:
                    out.write(text[shown:])
                    out.flush()
                    shown = len(text)
            if rc is not None:
                return rc
            time.sleep(poll)

    def new_status_lines(self) -> list[str]:
        """build.sh's own progress lines ("[board NAME 123s] ...") written since the last call;
        the tools' output under them stays in the logs."""
        lines = []
        for b in self.boards:
            try:
                with open(self.log(b), "rb") as f:
                    f.seek(self._shown[b])
                    chunk = f.read()
            except OSError:
                continue
            end = chunk.rfind(b"\n") + 1   # whole lines only
            self._shown[b] += end
            lines += [ln for ln in chunk[:end].decode(errors="replace").splitlines() if ln.startswith("[board")]
        return lines

    def text(self, board: str) -> str:
        try:
            return self.log(board).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop builds still running (the session ended first: -x, ^C) and remove the logs."""
        if not self.owner:
            return
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
