"""Shared fixtures; the helpers themselves are the ``support`` package (tests/support/).

Under CI=true (how CI runs .ci/run) a skipped test fails the run: the set-up installs everything the
suite needs (mosquitto, Arm NN, the emulated board, root for tmpfs), so a skip there means a whole
area went untested while CI stayed green. There is no exemption: a test that depends on the build
of a library (OpenCV with or without GStreamer) asserts what that build must do instead of skipping.
Locally, skips stay skips (README: "Tests").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write the seconds each unit of work took to tests/durations.json (the order "
                          "pytest-xdist's workers take work in: tests/support/parallel.py)")


def pytest_configure(config):
    from support import parallel

    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(parallel.Durations(), "tandoor-durations")
    # the xdist controller (it runs no tests): builds the boards, hands out the work
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        from support.board_builds import selected_boards

        config.pluginmanager.register(parallel.Controller(config, selected_boards()), "tandoor-parallel")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (CI and rep.skipped and not hasattr(rep, "wasxfail")):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"{item.nodeid} was skipped under CI=true ({reason}): the set-up (scripts/setup.sh, "
                    "scripts/board/build.sh) is meant to make it runnable, so the missing piece is a set-up bug")


@pytest.fixture(scope="session")
def bundles_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bundles")
