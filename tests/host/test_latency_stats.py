"""host/latency.py, the numbers `tandoor bench` and scripts/bench-steady.py report, against values
worked out by hand; and bench-steady's refusals, one line each (no timing here: the numbers are
docs/benchmarks.md's)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.cli import ROOT
from tandoor_host.latency import summary


def test_percentiles_and_block_spread_of_1_to_100():
    # linear interpolation: p50 of 1..100 lies halfway between 50 and 51, p95 at 95 + 0.05, p99 at 99 + 0.01
    s = summary([float(v) for v in range(1, 101)], [50, 50])
    assert (s["p50_ms"], s["p95_ms"], s["p99_ms"]) == (50.5, 95.05, 99.01)
    assert s["p99_over_p50"] == round(99.01 / 50.5, 3)
    assert s["blocks"] == 2 and s["block_medians_ms"] == [25.5, 75.5] and s["block_spread"] == round(75.5 / 25.5, 3)


def test_one_stalled_block_shows_as_the_spread_not_in_the_median():
    times = [10.0] * 90 + [30.0] * 30          # the last of 4 blocks of 30 stalled
    s = summary(times, [30] * 4)
    assert s["p50_ms"] == 10.0 and s["p99_ms"] == 30.0 and s["block_spread"] == 3.0
    assert summary(times)["block_spread"] == 1.0 and summary(times)["blocks"] == 1


def test_blocks_that_do_not_cover_the_runs_are_refused():
    with pytest.raises(ValueError, match="do not add up to 3 runs"):
        summary([1.0, 2.0, 3.0], [2, 2])
    with pytest.raises(ValueError, match="no runs"):
        summary([])


@pytest.mark.parametrize("args,says", [
    (["resnet1000"], "unknown model(s) resnet1000; choose from efficientnet_lite0, "),
    (["--blocks", "0"], "--blocks and --runs must be at least 1"),
])
def test_bench_steady_refuses_in_one_line(args, says):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench-steady.py"), *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"bench-steady: error: {says}" in r.stderr, r.stderr
