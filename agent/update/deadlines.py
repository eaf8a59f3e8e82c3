"""How long the health gate and the hot swap may take before the update job gives up on them.

A native library can hang instead of crashing: in the gate's child process (killed at the gate's
deadline: a failed check) or in the agent itself while the committed model is built for the hot
swap (given up at the swap's deadline: the commit is rolled back, the old model serves on, the job
ends ``swap_timeout``). Both are configurable (``update.health_timeout_s``,
``update.swap_timeout_s``); 0, the default, sizes them from what was measured on this device:

    gate   GATE_FACTOR x the last measured load time (the previous gate's, else the serving
           model's at this start), within GATE_MIN_S..GATE_MAX_S; GATE_MAX_S before any measure
    swap   SWAP_FACTOR x what this job's gate measured for the same bundle (load, and the two
           warm-up runs at its p95), at least SWAP_MIN_S

The gate's child also starts a Python and imports the runtime, hence its larger floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GATE_FACTOR = 10.0
GATE_MIN_S = 60.0
GATE_MAX_S = 300.0
SWAP_FACTOR = 10.0
SWAP_MIN_S = 15.0
WARMUP_RUNS = 2  # the hot swap runs the new model this often before it serves (service.py)


@dataclass
class Deadlines:
    health_timeout_s: float = 0.0   # configured; 0: sized from load_s
    swap_timeout_s: float = 0.0     # configured; 0: sized from the job's gate
    load_s: float | None = None     # the last load time measured here (seconds)
    last_swap_s: float | None = None  # the swap deadline of the last job, as used

    def measured(self, load_s: float | None) -> None:
        if load_s is not None and load_s > 0:
            self.load_s = float(load_s)

    def health(self) -> tuple[float, str]:
        """(seconds, why) for the next gate."""
        if self.health_timeout_s > 0:
            return self.health_timeout_s, "update.health_timeout_s"
        if self.load_s is None:
            return GATE_MAX_S, "nothing measured yet"
        s = min(GATE_MAX_S, max(GATE_MIN_S, GATE_FACTOR * self.load_s))
        return round(s, 1), f"{GATE_FACTOR:g} x the load time {self.load_s:.2f} s measured here, {GATE_MIN_S:g}..{GATE_MAX_S:g} s"

    def swap(self, report: Any = None) -> tuple[float, str]:
        """(seconds, why) for the hot swap of the bundle ``report`` (its gate's HealthReport) is about."""
        if self.swap_timeout_s > 0:
            s, why = self.swap_timeout_s, "update.swap_timeout_s"
        else:
            load = getattr(report, "load_s", None) or self.load_s
            if load is None:
                s, why = GATE_MAX_S, "nothing measured"
            else:
                run_s = WARMUP_RUNS * (getattr(report, "p95_ms", None) or 0.0) / 1e3
                s = round(max(SWAP_MIN_S, SWAP_FACTOR * (load + run_s)), 1)
                why = f"{SWAP_FACTOR:g} x the gate's load time {load:.2f} s (+ {WARMUP_RUNS} runs), at least {SWAP_MIN_S:g} s"
        self.last_swap_s = s
        return s, why

    def status(self) -> dict[str, Any]:
        h, hwhy = self.health()
        s, swhy = (self.swap_timeout_s, "update.swap_timeout_s") if self.swap_timeout_s > 0 else \
            (self.last_swap_s, "the last job's") if self.last_swap_s is not None else (None, "sized at each job")
        return {"health_timeout_s": h, "health_basis": hwhy, "swap_timeout_s": s, "swap_basis": swhy,
                "load_s": self.load_s}
