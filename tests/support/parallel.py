"""The suite on every core: how pytest-xdist's workers share it (tests/conftest.py registers this).

Work goes out in units, each run whole by one worker so that its module-scoped fixtures are made
once:

* a board's tests (xdist group ``board-NAME``, set by tests/board/conftest.py): one unit per
  emulated board, so each board's fork server and bundles live in one worker while the other
  board runs in the other;
* an explicit ``xdist_group`` (tests sharing something costly across modules);
* otherwise a test module.

Units go longest first (tests/durations.json, the seconds each unit took in a recorded run; an
unknown unit counts as DEFAULT_S), which keeps the cores busy to the end; a board's unit goes out
only once that board's build has ended (the builds run in the background from the moment the
workers have collected), unless nothing else is left. ``scripts/test.sh --record-durations``
rewrites tests/durations.json from the run.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from .board_builds import ENV, Builds, emulated_boards

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:   # without pytest-xdist the suite runs in one process (tests/conftest.py)
    LoadGroupScheduling = object

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
DEFAULT_S = 10.0
BOARD_GROUP = "board-"


def scope_of(nodeid: str) -> str:
    """The unit a test belongs to: its xdist group (the ``@group`` suffix xdist gives the
    scheduler's ids; a report's id has none, so a board test is known by its board parameter),
    else its module."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.split("@")[-1]
    if nodeid.startswith("tests/board/") and nodeid.endswith("]"):
        params = nodeid[nodeid.index("[") + 1:-1].split("-")
        board = next((b for b in emulated_boards() if b in params), None)
        if board is not None:
            return BOARD_GROUP + board
    return nodeid.split("::", 1)[0]


def recorded() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


class Scheduler(LoadGroupScheduling):
    """LoadGroupScheduling with units as described above, longest first, boards when built."""

    def __init__(self, config, log, controller: Controller) -> None:
        super().__init__(config, log)
        self.controller = controller
        self.estimates = recorded()

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _ready(self, scope: str) -> bool:
        if not scope.startswith(BOARD_GROUP):
            return True
        return self.controller.board_built(scope[len(BOARD_GROUP):])

    def _assign_work_unit(self, node) -> None:
        """The longest unit that can start now (or, when only unbuilt boards are left, the longest)."""
        ready = [s for s in self.workqueue if self._ready(s)] or list(self.workqueue)
        scope = max(ready, key=lambda s: self.estimates.get(s, DEFAULT_S * len(self.workqueue[s])))
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)


class Durations:
    """--record-durations: the seconds each unit took (setup, call and teardown of its tests),
    merged into tests/durations.json at the end."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.times[scope_of(report.nodeid)] += getattr(report, "duration", 0.0)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.times:
            data = {**recorded(), **{k: round(v, 1) for k, v in self.times.items()}}
            DURATIONS.write_text(json.dumps(dict(sorted(data.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


class Controller:
    """The xdist controller's side: starts the board builds once the workers have collected
    board tests, shows their progress between test results, hands out work (Scheduler) and stops
    the builds at the end."""

    def __init__(self, config, boards: list[str]) -> None:
        import tempfile

        self.config = config
        self.boards = boards
        self.builds: Builds | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="tandoor-board-build-"))
        os.environ[ENV] = str(self.dir)      # the workers, started after this, attach to it

    def board_built(self, name: str) -> bool:
        if self.builds is None:     # no build started (a real board over ssh): nothing to wait for
            return True
        return name not in self.builds.boards or self.builds.status(name) is not None

    def pytest_xdist_make_scheduler(self, config, log):
        return Scheduler(config, log, self)

    def pytest_xdist_node_collection_finished(self, node, ids):
        if self.builds is not None or not self.boards or os.environ.get("TANDOOR_BOARD_SSH"):
            return
        if any(scope_of(i).startswith(BOARD_GROUP) for i in ids):
            self.builds = Builds(self.boards, self.dir)
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            if tr is not None:
                tr.write_line(f"[tests/board] building or reusing the emulated arm64 boards {', '.join(self.boards)} "
                              f"side by side in the background (scripts/board/build.sh, logs in {self.dir}); each "
                              "board's tests start when its build ends")

    def pytest_runtest_logreport(self, report):
        if self.builds is None or report.when != "teardown":
            return
        lines = self.builds.new_status_lines()
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if lines and tr is not None:
            tr.write("\n")
            for ln in lines:
                tr.write_line(f"[tests/board] {ln}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        if self.builds is not None:
            self.builds.stop()
