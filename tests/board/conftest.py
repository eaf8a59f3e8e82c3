"""tests/board: bundles run on the emulated arm64 boards, built in the background meanwhile.

Under pytest-xdist (how scripts/test.sh runs the suite) each board's tests are one unit of work
(xdist group ``board-NAME``), handed to a worker once that board's build has ended, so the two
boards run side by side while the other worker runs host tests (tests/support/parallel.py); the
builds themselves start, both at once, as soon as the workers have collected board tests, and
their progress lines show between test results. In one process (``-n 0``) the board tests run
last, one board after the other, and the builds start when collection ends.
TANDOOR_BOARD_BACKGROUND=0 builds in the foreground instead (when the first board test starts).

Fixtures: ``board`` (where bundles run: tests/board/boards.py) and ``blockers``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from support.board_builds import ENV, EXIT_CANNOT, Builds

from .boards import Board, EmulatedBoard, SshBoard, selected_boards

HERE = Path(__file__).resolve().parent
BLOCKED = ("pyarmnn", "onnxruntime")
SELECTED = selected_boards()
# the board fixture's parameters: the emulated boards, or the real one over ssh, or none
BOARD_PARAMS = ["ssh"] if os.environ.get("TANDOOR_BOARD_SSH") else (SELECTED or ["off"])
WORKER = os.environ.get("PYTEST_XDIST_WORKER") is not None


def _on_board(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def _board_param(item) -> str | None:
    return getattr(getattr(item, "callspec", None), "params", {}).get("board")


def _board_of(item) -> int:
    """Board tests in the order of BOARD_PARAMS (the ones without a board first)."""
    name = _board_param(item)
    return BOARD_PARAMS.index(name) + 1 if name in BOARD_PARAMS else 0


def pytest_collection_modifyitems(session, config, items):
    for item in items:     # one unit of work per board (tests/support/parallel.py)
        if _on_board(item) and _board_param(item) in SELECTED:
            item.add_marker(pytest.mark.xdist_group(f"board-{_board_param(item)}"))
    items[:] = [i for i in items if not _on_board(i)] + sorted((i for i in items if _on_board(i)), key=_board_of)


_build: Builds | None = None
_reporter = None            # pytest's terminal reporter, for progress lines between host tests
_follow_started = False     # the board tests began: from then on the logs are shown live
_ready: dict[str, int] = {}  # board -> build.sh's exit status, once waited for


def _emulated() -> bool:
    return bool(SELECTED) and not os.environ.get("TANDOOR_BOARD_SSH")


def pytest_collection_finish(session):
    """One process (no xdist): start the builds now. An xdist worker leaves that to the controller
    (tests/support/parallel.py), which starts them once for both workers."""
    global _build, _reporter
    if (WORKER or session.config.option.collectonly or not _emulated()
            or os.environ.get("TANDOOR_BOARD_BACKGROUND") == "0"
            or not any(_on_board(i) for i in session.items)):
        return
    _build = Builds(SELECTED)
    _reporter = tr = session.config.pluginmanager.get_plugin("terminalreporter")
    session.config.pluginmanager.register(_Progress(), "tandoor-board-progress")
    if tr is not None:
        tr.write_line(f"[tests/board] building or reusing the emulated arm64 boards {', '.join(SELECTED)} side by "
                      f"side in the background (scripts/board/build.sh, logs in {_build.dir}); the board tests run last")


class _Progress:
    """While host tests run in this process, shows the background board builds' progress between
    them. A plugin registered at run time: a hook in this conftest would only see tests/board."""

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
        if _build is None and WORKER and os.environ.get(ENV):
            _build = Builds.attach(os.environ[ENV], SELECTED)   # the controller's builds
            _ready[name] = _build.wait(name)
        else:
            capman = config.pluginmanager.getplugin("capturemanager")
            with capman.global_and_fixture_disabled():
                err = sys.stderr
                if _build is None:
                    err.write(f"\n[tests/board] building or reusing the emulated arm64 boards {', '.join(SELECTED)} "
                              "(scripts/board/build.sh)\n")
                    _build = Builds(SELECTED)
                else:
                    err.write(f"\n[tests/board] the board builds started {time.monotonic() - _build.t0:.0f} s ago; "
                              f"the {name} board's log so far, then live:\n")
                _ready[name] = rc = _build.wait(name, out=err)
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
