"""Latency, throughput, process and energy metrics, and the telemetry snapshot.

:class:`Telemetry` is what the agent's loop feeds and what the MQTT ``telemetry`` topic publishes::

    tel = Telemetry(root="/", window=1000)
    with tel.time("inference"):          # or tel.record("inference", seconds)
        ...
    tel.frame(dropped=n)                  # one frame processed, n skipped since the previous one
    tel.error()
    payload = json.dumps(tel.snapshot())

Snapshot layout (every value JSON-able; no NaN; ``null`` where there is nothing to report)::

    {
      "ts": 1718000000.123,            # unix time of the snapshot, seconds
      "fps": 29.97,                    # processed frames/s over the last fps_window_s (5 s)
      "frames": 1234,                  # processed frames since start
      "dropped": 17,                   # frames skipped (latest-frame policy) since start
      "errors": 0,                     # failed frames since start
      "latency_ms": {                  # per stage, over the last `window` samples (1000) of the
                                       # model now serving (reset_latency() at a hot swap)
        "capture":     {"p50": 1.2, "p95": 1.9, "p99": 2.4, "mean": 1.3, "count": 1000},
        "preprocess":  {...}, "inference": {...}, "postprocess": {...}
                                       # the four stages always present (values null until
                                       # recorded), plus any other stage recorded
      },
      "cpu_percent": 87.5,             # this process, since the previous snapshot (100 = one core)
      "rss_mb": 212.4,                 # this process's resident memory, MiB
      "temperatures_c": {"cpu-thermal": 48.5, "gpu-thermal": 46.9},
      "power": {
        "source": "ina3221-hwmon",     # ina3221-hwmon | ina3221-iio | hwmon | rapl | estimated
        "estimated": false,            # true: computed from CPU load and a board model, not measured
        "total_w": 7.41,               # board total, W (null when unreadable)
        "rails": {"VDD_IN": 7.41, "VDD_CPU_GPU_CV": 2.1, "VDD_SOC": 1.6},   # W; may contain the
                                       # total rail itself: do not sum them
        "basis": "Rockchip RK3588: 2.5 W idle + 7.5 W x cpu load"   # only when estimated
      },
      "energy_j": 1234.5,              # integrated total power since start, J
      "energy_per_inference_mj": 88.2, # mean power over the last power window x mean inference
                                       # latency, mJ (W x ms); null before both exist
      "objects": {"frames": 125, "counts": {"face": 212}, "max": {"face": 3}, "mean": {"face": 1.7}}
                                       # detections per class since the previous snapshot
                                       # (ObjectCounts); null for models that are not detectors
    }

Energy per inference is the board's mean power while inference runs times how long it runs: it
includes the board's baseline, like every whole-board meter, and excludes the idle time between
frames a camera-limited loop spends waiting (integrated energy / frames would charge that to the
model). When ``power.estimated`` is true, so is this number.

Latencies are kept in seconds and reported in milliseconds; percentiles are numpy's default
(linear interpolation), so samples 1..100 ms give p50 50.5, p95 95.05, p99 99.01.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from .power import EstimatedPower, PowerReader, discover
from .thermal import read_temperatures

STAGES = ("capture", "preprocess", "inference", "postprocess")


def _r(x: float | None, nd: int = 3) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), nd)


class LatencyStats:
    """A bounded window of the latest samples per stage (seconds in, milliseconds out)."""

    def __init__(self, window: int = 1000, stages: tuple[str, ...] = STAGES) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._samples: dict[str, deque[float]] = {s: deque(maxlen=window) for s in stages}
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            q = self._samples.get(stage)
            if q is None:
                q = self._samples[stage] = deque(maxlen=self.window)
            q.append(float(seconds))

    def samples_ms(self, stage: str) -> np.ndarray:
        with self._lock:
            return np.asarray(self._samples.get(stage, ()), dtype=np.float64) * 1000.0

    def mean_s(self, stage: str) -> float | None:
        ms = self.samples_ms(stage)
        return float(ms.mean()) / 1000.0 if ms.size else None

    def stage(self, stage: str) -> dict:
        ms = self.samples_ms(stage)
        if not ms.size:
            return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
        p50, p95, p99 = np.percentile(ms, [50, 95, 99])
        return {"p50": _r(p50), "p95": _r(p95), "p99": _r(p99), "mean": _r(ms.mean()), "count": int(ms.size)}

    def summary(self) -> dict[str, dict]:
        with self._lock:
            stages = list(self._samples)
        return {s: self.stage(s) for s in stages}

    def reset(self) -> None:
        """Forget every sample (the agent swapped models: the next numbers are the new model's)."""
        with self._lock:
            for q in self._samples.values():
                q.clear()


class StageTimer:
    """``with StageTimer(stats, "inference"):`` records the block's wall time (perf_counter)."""

    def __init__(self, stats: LatencyStats, stage: str) -> None:
        self.stats, self.stage = stats, stage
        self.seconds: float | None = None

    def __enter__(self) -> "StageTimer":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.stats.add(self.stage, self.seconds)


class FpsMeter:
    """Frames per second over the last ``window_s`` seconds (0 once frames stop for that long)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic, maxlen: int = 10000) -> None:
        self.window_s, self.clock = window_s, clock
        self._ticks: deque[float] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def tick(self, t: float | None = None) -> None:
        with self._lock:
            self._ticks.append(self.clock() if t is None else t)

    def fps(self) -> float:
        now = self.clock()
        with self._lock:
            while self._ticks and self._ticks[0] < now - self.window_s:
                self._ticks.popleft()
            if len(self._ticks) < 2:
                return 0.0
            span = self._ticks[-1] - self._ticks[0]
            return (len(self._ticks) - 1) / span if span > 0 else 0.0


class ProcessStats:
    """This process's CPU % (since the previous call; 100 = one core) and RSS, via psutil."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self._proc.cpu_percent(interval=None)  # prime

    def cpu_percent(self) -> float:
        return float(self._proc.cpu_percent(interval=None))

    def rss_mb(self) -> float:
        return self._proc.memory_info().rss / (1024 * 1024)


class EnergyMeter:
    """Integrates total power samples over time and attributes energy to inferences.

    ``add(watts)`` appends a sample; energy is integrated with the trapezoid rule between
    consecutive samples. ``mean_power_w()`` is the time-weighted mean over the samples of the
    last ``window_s`` seconds (the single sample's value when there is one).
    ``per_inference_mj(mean_inference_s)`` = mean power x mean inference latency, in mJ.
    ``estimated`` comes from the power reader.
    """

    def __init__(self, estimated: bool = False, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.estimated, self.window_s, self.clock = estimated, window_s, clock
        self.energy_j = 0.0
        self._samples: deque[tuple[float, float]] = deque()
        self._last: tuple[float, float] | None = None
        self._lock = threading.Lock()

    def add(self, watts: float, t: float | None = None) -> None:
        t = self.clock() if t is None else t
        with self._lock:
            if self._last is not None and t > self._last[0]:
                self.energy_j += (t - self._last[0]) * (watts + self._last[1]) / 2.0
            self._last = (t, float(watts))
            self._samples.append(self._last)
            while len(self._samples) > 1 and self._samples[0][0] < t - self.window_s:
                self._samples.popleft()

    def mean_power_w(self) -> float | None:
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        span = samples[-1][0] - samples[0][0]
        if len(samples) == 1 or span <= 0:
            return float(np.mean([w for _, w in samples]))
        area = sum((t1 - t0) * (w0 + w1) / 2.0 for (t0, w0), (t1, w1) in zip(samples, samples[1:]))
        return area / span

    def per_inference_mj(self, mean_inference_s: float | None) -> float | None:
        p = self.mean_power_w()
        if p is None or mean_inference_s is None:
            return None
        return p * mean_inference_s * 1000.0


class ObjectCounts:
    """Detections per class over a window (the telemetry period): ``add(labels)`` once per
    detector frame, ``take()`` returns the window and starts the next::

        {"frames": 125, "counts": {"face": 212}, "max": {"face": 3}, "mean": {"face": 1.7}}

    ``counts``: detections summed over the window's frames; ``max``: most in one frame;
    ``mean``: per frame (``counts / frames``). None before any detector frame."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._frames = 0
        self._counts: dict[str, int] = {}
        self._max: dict[str, int] = {}
        self.seen = False

    def add(self, labels: list[str]) -> None:
        from collections import Counter

        frame = Counter(labels)
        with self._lock:
            self.seen = True
            self._frames += 1
            for k, n in frame.items():
                self._counts[k] = self._counts.get(k, 0) + n
                if n > self._max.get(k, 0):
                    self._max[k] = n

    def take(self) -> dict | None:
        with self._lock:
            if not self.seen:
                return None
            frames, counts, most = self._frames, self._counts, self._max
            self._frames, self._counts, self._max = 0, {}, {}
        return {"frames": frames, "counts": dict(sorted(counts.items())), "max": dict(sorted(most.items())),
                "mean": {k: round(v / frames, 3) for k, v in sorted(counts.items())} if frames else {}}


class Telemetry:
    """Everything the agent reports, fed from the loop and read as one :meth:`snapshot`.

    ``power`` overrides discovery (otherwise the best reader :func:`discover` finds under
    ``root``); power is sampled at most every ``power_interval`` seconds from :meth:`frame`, and
    at every snapshot. Thread-safe: the loop records while the publisher snapshots.
    """

    def __init__(self, root: str | Path = "/", window: int = 1000, *, power: PowerReader | None = None,
                 power_interval: float = 1.0, fps_window_s: float = 5.0, energy_window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.clock = clock
        self.latency = LatencyStats(window)
        self.fps_meter = FpsMeter(fps_window_s, clock)
        self.process = ProcessStats()
        self.power = power if power is not None else discover(self.root)[0]
        self.energy = EnergyMeter(self.power.estimated, energy_window_s, clock)
        self.power_interval = power_interval
        self.frames = self.dropped = self.errors = 0
        self.objects = ObjectCounts()
        self._rails: dict[str, float] = {}
        self._total: float | None = None
        self._power_at: float | None = None
        self._lock = threading.Lock()
        self._power_lock = threading.Lock()

    # -- fed by the loop
    def record(self, stage: str, seconds: float) -> None:
        self.latency.add(stage, seconds)

    def time(self, stage: str) -> StageTimer:
        return StageTimer(self.latency, stage)

    def frame(self, dropped: int = 0) -> None:
        with self._lock:
            self.frames += 1
            self.dropped += int(dropped)
        self.fps_meter.tick()
        if self._power_at is None or self.clock() - self._power_at >= self.power_interval:
            self.sample_power()

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def reset_latency(self) -> None:
        """A new model serves: latency percentiles start over so they describe it alone."""
        self.latency.reset()

    def sample_power(self) -> tuple[dict[str, float], float | None]:
        """Read the power source now and feed the energy meter."""
        with self._power_lock:  # readers keep state (RAPL's previous counter)
            try:
                rails = self.power.read()
                total = self.power.total_w()
            except OSError:
                rails, total = {}, None
        now = self.clock()
        with self._lock:
            self._rails, self._total, self._power_at = rails, total, now
        if total is not None and math.isfinite(total):
            self.energy.add(total, now)
        return rails, total

    # -- read by the publisher
    def snapshot(self) -> dict:
        rails, total = self.sample_power()
        latency = self.latency.summary()
        power = {
            "source": self.power.name,
            "estimated": bool(self.power.estimated),
            "total_w": _r(total),
            "rails": {k: _r(v) for k, v in rails.items() if _r(v) is not None},
        }
        if isinstance(self.power, EstimatedPower):
            power["basis"] = self.power.basis
        with self._lock:
            frames, dropped, errors = self.frames, self.dropped, self.errors
        return {
            "ts": round(time.time(), 3),
            "fps": _r(self.fps_meter.fps(), 2),
            "frames": frames,
            "dropped": dropped,
            "errors": errors,
            "latency_ms": latency,
            "cpu_percent": _r(self.process.cpu_percent(), 1),
            "rss_mb": _r(self.process.rss_mb(), 1),
            "temperatures_c": {k: _r(v, 1) for k, v in read_temperatures(self.root).items()},
            "power": power,
            "energy_j": _r(self.energy.energy_j),
            "energy_per_inference_mj": _r(self.energy.per_inference_mj(self.latency.mean_s("inference"))),
            "objects": self.objects.take(),
        }
