"""tests/board runs last, after the host tests, one board after the other; the boards are built meanwhile.

When board tests are collected (and the boards are the emulated ones), scripts/board/build.sh
starts in the background for each board TANDOOR_BOARD selects (tests/board/boards.py), one after
the other, as soon as collection ends: building a board from a cold cache takes minutes of mostly
single-threaded emulation, which overlaps with the host tests on a second core; the progress lines
show between host tests. The ``board`` fixture (one parameter per board) waits for its board,
showing its log live; the first board's tests run while the next board still builds.
TANDOOR_BOARD_BACKGROUND=0 builds in the foreground instead (when the first board test starts).

Fixtures: ``board`` (where bundles run: tests/board/boards.py) and ``blockers``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .boards import Board, EmulatedBoard, SshBoard, selected_boards

HERE = Path(__file__).resolve().parent
BUILD_SH = HERE.parents[1] / "scripts" / "board" / "build.sh"
EXIT_CANNOT = 77  # build.sh: this machine cannot run an arm64 board
BLOCKED = ("pyarmnn", "onnxruntime")
SELECTED = selected_boards()
# the board fixture's parameters: the emulated boards, or the real one over ssh, or none
BOARD_PARAMS = ["ssh"] if os.environ.get("TANDOOR_BOARD_SSH") else (SELECTED or ["off"])


def _on_board(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def _board_of(item) -> int:
    """Board tests in the order of BOARD_PARAMS (the ones without a board first)."""
    name = getattr(getattr(item, "callspec", None), "params", {}).get("board")
    return BOARD_PARAMS.index(name) + 1 if name in BOARD_PARAMS else 0


def pytest_collection_modifyitems(session, config, items):
    items[:] = [i for i in items if not _on_board(i)] + sorted((i for i in items if _on_board(i)), key=_board_of)


class _Builds:
    """build.sh --board NAME for each board, one after another, in one background driver; each
    board's output in its own log and its exit status in NAME.rc when it ends (so the tests of
    the first board start while the next one still builds)."""

    DRIVER = 'for b in "$@"; do "$0" --board "$b" > "$D/$b.log" 2>&1; echo $? > "$D/$b.rc"; done'

    def __init__(self, boards: list[str]) -> None:
        self.boards = boards
        self.dir = Path(tempfile.mkdtemp(prefix="tandoor-board-build-"))
        self.t0 = time.monotonic()
        self._shown = dict.fromkeys(boards, 0)  # bytes of each log whose status lines were shown
        self.proc = subprocess.Popen(["bash", "-c", self.DRIVER, str(BUILD_SH), *boards],
                                     env={**os.environ, "D": str(self.dir)}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def log(self, board: str) -> Path:
        return self.dir / f"{board}.log"

    def status(self, board: str) -> int | None:
        """build.sh's exit status for this board, or None while it has not ended."""
        try:
            return int((self.dir / f"{board}.rc").read_text())
        except (OSError, ValueError):
            if self.proc.poll() is not None:  # the driver is gone without a status (killed)
                return self.proc.returncode or 1
            return None

    def follow(self, board: str, out) -> int:
        """Write this board's log so far, then what comes, until its build ends; its status."""
        while not self.log(board).exists() and self.status(board) is None:
            time.sleep(0.5)
        with open(self.log(board), "rb") if self.log(board).exists() else open(os.devnull, "rb") as f:
            while True:
                chunk = f.read()
                if chunk:
                    out.write(chunk.decode(errors="replace"))
                    out.flush()
                elif (rc := self.status(board)) is not None:
                    rest = f.read()
                    if rest:
                        out.write(rest.decode(errors="replace"))
                    return rc
                else:
                    time.sleep(0.5)

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
        if self.proc.poll() is None:  # the session ended first (-x, ^C): stop every build
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_build: _Builds | None = None
_reporter = None            # pytest's terminal reporter, for progress lines between host tests
_follow_started = False     # the board tests began: from then on the logs are shown live
_ready: dict[str, int] = {}  # board -> build.sh's exit status, once waited for


def _emulated() -> bool:
    return bool(SELECTED) and not os.environ.get("TANDOOR_BOARD_SSH")


def pytest_collection_finish(session):
    global _build
    if (session.config.option.collectonly or not _emulated()
            or os.environ.get("TANDOOR_BOARD_BACKGROUND") == "0"
            or not any(_on_board(i) for i in session.items)):
        return
    _build = _Builds(SELECTED)
    global _reporter
    _reporter = tr = session.config.pluginmanager.get_plugin("terminalreporter")
    session.config.pluginmanager.register(_Progress(), "tandoor-board-progress")
    if tr is not None:
        tr.write_line(f"[tests/board] building or reusing the emulated arm64 boards {', '.join(SELECTED)} in the "
                      f"background (scripts/board/build.sh, logs in {_build.dir}); the board tests run last")


class _Progress:
    """While host tests run, shows the background board builds' progress between them. A plugin
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


def _board_ready(config, name: str) -> None:
    """The emulated board NAME is built (or the tests skip with the reason it cannot be)."""
    global _build, _follow_started
    _follow_started = True
    if name not in _ready:
        capman = config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled():
            err = sys.stderr
            if _build is None:
                err.write(f"\n[tests/board] building or reusing the emulated arm64 boards {', '.join(SELECTED)} "
                          "(scripts/board/build.sh)\n")
                _build = _Builds(SELECTED)
            else:
                err.write(f"\n[tests/board] the board builds started {time.monotonic() - _build.t0:.0f} s ago; "
                          f"the {name} board's log so far, then live:\n")
            _ready[name] = rc = _build.follow(name, err)
            if rc == 0:
                err.write(f"[tests/board] board {name} ready ({time.monotonic() - _build.t0:.0f} s after the "
                          "builds started)\n")
    rc, text = _ready[name], _build.text(name)
    if rc == EXIT_CANNOT:
        reason = next((ln.split(": ", 1)[1].strip() for ln in reversed(text.splitlines())
                       if "cannot run an arm64 board" in ln), "see the scripts/board/build.sh output")
        if os.environ.get("TANDOOR_BOARD") == "1":
            pytest.fail(f"TANDOOR_BOARD=1 but this machine cannot run the arm64 board: {reason}")
        pytest.skip(f"this machine cannot run arm64 binaries for the emulated board: {reason}")
    if rc != 0:
        pytest.fail(f"scripts/board/build.sh --board {name} failed (exit {rc}):\n" + "\n".join(text.splitlines()[-40:]))


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session", params=BOARD_PARAMS)
def board(request, tmp_path_factory):
    """Each selected board in turn: an emulated one (built first), or the real one over ssh."""
    name = request.param
    if name == "off":
        pytest.skip("TANDOOR_BOARD=0")
    if name == "ssh":
        b: Board = SshBoard(os.environ["TANDOOR_BOARD_SSH"])
    else:
        _board_ready(request.config, name)
        b = EmulatedBoard(name, tmp_path_factory.mktemp(f"board-share-{name}"))
    yield b
    b.close()


@pytest.fixture(scope="session")
def blockers(board, tmp_path_factory) -> str:
    """A directory for PYTHONPATH whose packages shadow pyarmnn and onnxruntime with an ImportError:
    a board that has neither."""
    d = tmp_path_factory.mktemp("blockers") / "blockers"
    for mod in BLOCKED:
        (d / mod).mkdir(parents=True)
        (d / mod / "__init__.py").write_text(
            f"raise ImportError('{mod} made unavailable by tests/board (a board without it)')\n")
    if isinstance(board, EmulatedBoard):
        shutil.copytree(d, board.share / "blockers", dirs_exist_ok=True)
        return "/work/blockers"
    board._scp(str(d), f"{board.target}:{board.home}/blockers")
    return f"{board.home}/blockers"


@pytest.fixture(scope="session")
def op_bundles(tmp_path_factory) -> dict[str, Path]:
    """Every model of tests/board/op_models.py compiled here for host + aarch64 with policy all
    (every supported op delegated, however small), keyed by the op type it exercises."""
    from tandoor_compiler.pipeline import Options, compile_model

    from .op_models import MODELS

    d = tmp_path_factory.mktemp("op_bundles")
    out = {}
    for op_type, make in MODELS.items():
        src = d / f"{op_type}.onnx"
        src.write_bytes(make().onnx_bytes())
        out[op_type] = d / f"op_{op_type}.hmod"
        compile_model(src, out[op_type], Options(targets=["aarch64"], policy="all"))
    return out
