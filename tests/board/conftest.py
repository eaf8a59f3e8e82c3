"""tests/board runs last, after the host tests; the board is built meanwhile.

When board tests are collected (and the board is the emulated one), scripts/board/build.sh starts
in the background as soon as collection ends: building the board from a cold cache takes minutes
of mostly single-threaded emulation, which overlaps with the host tests on a second core; its
progress lines show between host tests. The `board_ready` fixture then waits for it, showing its
log, live. TANDOOR_BOARD_BACKGROUND=0 builds
in the foreground instead (when the first board test starts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BUILD_SH = HERE.parents[1] / "scripts" / "board" / "build.sh"
EXIT_CANNOT = 77  # build.sh: this machine cannot run an arm64 board


def _on_board(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(session, config, items):
    items[:] = [i for i in items if not _on_board(i)] + [i for i in items if _on_board(i)]


class _Build:
    """build.sh running with its output in a log file."""

    def __init__(self) -> None:
        self.log = Path(tempfile.mkstemp(prefix="tandoor-board-build-", suffix=".log")[1])
        self.t0 = time.monotonic()
        self._shown = 0  # bytes of the log whose status lines were already shown
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([str(BUILD_SH)], stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def follow(self, out) -> int:
        """Write the log so far, then what comes, until build.sh exits; returns its status."""
        with open(self.log, "rb") as f:
            while True:
                chunk = f.read()
                if chunk:
                    out.write(chunk.decode(errors="replace"))
                    out.flush()
                elif self.proc.poll() is not None:
                    rest = f.read()
                    if rest:
                        out.write(rest.decode(errors="replace"))
                    return self.proc.returncode
                else:
                    time.sleep(0.5)

    def new_status_lines(self) -> list[str]:
        """build.sh's own progress lines ("[board 123s] ...") written since the last call; the
        tools' output under them stays in the log."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._shown)
                chunk = f.read()
        except OSError:
            return []
        end = chunk.rfind(b"\n") + 1   # whole lines only
        self._shown += end
        return [ln for ln in chunk[:end].decode(errors="replace").splitlines() if ln.startswith("[board")]

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:  # the session ended first (-x, ^C): stop the whole build
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.unlink(missing_ok=True)


_build: _Build | None = None
_reporter = None            # pytest's terminal reporter, for progress lines between host tests
_follow_started = False     # the board tests began: from then on the log is shown live


def _emulated() -> bool:
    return os.environ.get("TANDOOR_BOARD") != "0" and not os.environ.get("TANDOOR_BOARD_SSH")


def pytest_collection_finish(session):
    global _build
    if (session.config.option.collectonly or not _emulated()
            or os.environ.get("TANDOOR_BOARD_BACKGROUND") == "0"
            or not any(_on_board(i) for i in session.items)):
        return
    _build = _Build()
    global _reporter
    _reporter = tr = session.config.pluginmanager.get_plugin("terminalreporter")
    session.config.pluginmanager.register(_Progress(), "tandoor-board-progress")
    if tr is not None:
        tr.write_line(f"[tests/board] building or reusing the emulated arm64 board in the background "
                      f"(scripts/board/build.sh, log {_build.log}); the board tests run last")


class _Progress:
    """While host tests run, shows the background board build's progress between them. A plugin
    registered at run time: a hook in this conftest would only see the tests of tests/board."""

    @staticmethod
    def pytest_runtest_logfinish(nodeid, location):
        if _build is None or _follow_started or _reporter is None:
            return
        lines = _build.new_status_lines()
        if lines:
            _reporter.write("\n")  # the progress dots do not end their line
            for ln in lines:
                _reporter.write_line(f"[tests/board] {ln}")


def pytest_sessionfinish(session, exitstatus):
    if _build is not None:
        _build.stop()


@pytest.fixture(scope="session")
def board_ready(request) -> None:
    """The emulated board is built (or the tests skip with the reason it cannot be)."""
    global _build, _follow_started
    _follow_started = True
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled():
        err = sys.stderr
        if _build is None:
            err.write("\n[tests/board] building or reusing the emulated arm64 board (scripts/board/build.sh)\n")
            _build = _Build()
        else:
            err.write(f"\n[tests/board] the board build started {time.monotonic() - _build.t0:.0f} s ago; "
                      "its log so far, then live:\n")
        rc = _build.follow(err)
        if rc == 0:
            err.write(f"[tests/board] board ready ({time.monotonic() - _build.t0:.0f} s after the build started)\n")
    text = _build.text()
    if rc == EXIT_CANNOT:
        reason = next((ln.split(": ", 1)[1].strip() for ln in reversed(text.splitlines())
                       if "cannot run an arm64 board" in ln), "see the scripts/board/build.sh output")
        if os.environ.get("TANDOOR_BOARD") == "1":
            pytest.fail(f"TANDOOR_BOARD=1 but this machine cannot run the arm64 board: {reason}")
        pytest.skip(f"this machine cannot run arm64 binaries for the emulated board: {reason}")
    if rc != 0:
        pytest.fail(f"scripts/board/build.sh failed (exit {rc}):\n" + "\n".join(text.splitlines()[-40:]))
