"""Latency statistics the benchmarks report: percentiles and the run-to-run spread over blocks.

A camera pipeline is judged by its worst frames, so p99 sits beside the median; and one block of
runs can hide a stall that the next block shows (issue 44: open_nsfw's INT8 hybrid 5.18 ms in one
block, 15.97 ms in the next), so the runs are timed in blocks and the spread is the worst block's
median over the best block's. ``np.percentile``'s linear interpolation: with 30 runs p99 lies
between the two slowest, with 300 it is the 3rd slowest.
"""

from __future__ import annotations

import statistics

import numpy as np

PERCENTILES = (50, 95, 99)


def summary(times_ms: list[float], block_sizes: list[int] | None = None) -> dict:
    """p50/p95/p99 of ``times_ms``, p99/p50, and per block of ``block_sizes`` consecutive runs its
    median, with ``block_spread`` = worst block median / best block median (1.0 for one block)."""
    if not times_ms:
        raise ValueError("no runs to summarise")
    ps = {f"p{q}_ms": round(float(np.percentile(times_ms, q)), 3) for q in PERCENTILES}
    sizes = [n for n in (block_sizes or [len(times_ms)]) if n > 0]
    if sum(sizes) != len(times_ms):
        raise ValueError(f"block sizes {sizes} do not add up to {len(times_ms)} runs")
    meds, k = [], 0
    for n in sizes:
        meds.append(statistics.median(times_ms[k:k + n]))
        k += n
    return {**ps, "p99_over_p50": round(ps["p99_ms"] / ps["p50_ms"], 3) if ps["p50_ms"] else None,
            "blocks": len(meds), "block_medians_ms": [round(m, 3) for m in meds],
            "block_spread": round(max(meds) / min(meds), 3) if min(meds) > 0 else None}
