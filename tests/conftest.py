"""Shared fixtures; the helpers themselves are the ``support`` package (tests/support/)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bundles_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bundles")
