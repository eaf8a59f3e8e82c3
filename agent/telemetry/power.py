"""Power readers: one small reader per kind of sensor, each found in sysfs by reading names.

Every reader takes a ``root`` (default ``/``) and looks only below it, so tests point it at a
temporary tree built exactly like the kernel lays it out (tests/sysfs_trees.py).

Interface shared by all readers (:class:`PowerReader`):

``name``       the source, e.g. ``"ina3221-hwmon"``
``read()``     takes a sample now; returns ``{rail: watts}``
``total_w()``  the board total in watts for the latest sample (taking one when the latest is older
               than ``max_age`` seconds); ``None`` when nothing could be read
``estimated``  ``True`` only for :class:`EstimatedPower`

Sources, in the order :func:`discover` tries them:

* :class:`Ina3221Hwmon` - Jetson, JetPack 5+: an I2C device whose ``name`` contains ``ina3221``
  with ``hwmon/hwmonN/`` below it: ``inN_label``, ``inN_input`` (bus voltage, mV),
  ``currN_input`` (mA). Channels labelled ``NC`` (not connected) and the sum-of-shunts channel
  (``in7_label`` = "sum of shunt voltages"; its ``in7_input`` is a shunt drop in uV, not a rail)
  are skipped.
* :class:`Ina3221Iio` - Jetson, JetPack 4: the same chip through the ``ina3221x`` IIO driver:
  ``iio:deviceN/rail_name_K``, ``in_powerK_input`` (mW), ``in_voltageK_input`` (mV),
  ``in_currentK_input`` (mA).
* :class:`Rapl` - x86 powercap: ``intel-rapl:N[:M]/energy_uj`` sampled over time, wrapping at
  ``max_energy_range_uj``.
* :class:`HwmonPower` - any other hwmon device with ``powerN_input`` / ``powerN_average`` (uW),
  or ``currN_input`` (mA) with a matching ``inN_input`` (mV).
* :class:`EstimatedPower` - no sensor (e.g. RK3588): ``idle_w + (max_w - idle_w) * cpu_load``
  from a per-board table keyed by the device-tree model, flagged ``estimated = True``.

Which INA3221 rail is the board total differs per board: ``VDD_IN`` (Orin NX/Nano, TX2) and
``POM_5V_IN`` (Nano, TX1) measure the module input and are used as the total when present;
otherwise (AGX Xavier, AGX Orin) the total is the sum of the real rails, as jetson-stats does.
The ``rails`` dict keeps the total rail too, so do not sum ``rails`` when a total rail exists.
"""

from __future__ import annotations

import os
import logging
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Protocol, runtime_checkable

log = logging.getLogger("tandoor.telemetry.power")

# rails that measure the whole module's input on the boards that have one
TOTAL_RAILS = ("VDD_IN", "POM_5V_IN")

# "sum of shunt voltages" (mainline), "summation of shunt voltages" (some vendor kernels)
_SUM_LABEL = re.compile(r"\bsum(mation)?\b", re.IGNORECASE)


@runtime_checkable
class PowerReader(Protocol):
    name: str
    estimated: bool

    def read(self) -> dict[str, float]: ...

    def total_w(self) -> float | None: ...


# ---------------------------------------------------------------------------------------- sysfs


def read_text(path: Path) -> str | None:
    """A sysfs attribute's text, stripped (device-tree strings lose their trailing NUL).
    None when it is missing or the driver refuses the read (EIO, EINVAL, ENODATA, EACCES)."""
    try:
        return path.read_text(errors="replace").strip().strip("\x00").strip()
    except (OSError, ValueError):
        return None


def read_int(path: Path) -> int | None:
    text = read_text(path)
    if not text:
        return None
    try:
        return int(text.split()[0])  # some drivers append a unit ("32760 ma")
    except ValueError:
        return None


def natural_key(path: Path) -> tuple:
    """hwmon2 < hwmon10; in2_label < in10_label."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name))


def _i2c_devices(root: Path, name_contains: str) -> list[Path]:
    """I2C devices whose ``name`` attribute contains ``name_contains`` (adapters have names too,
    e.g. "Tegra I2C adapter", and are left out by the match)."""
    base = root / "sys" / "bus" / "i2c" / "devices"
    if not base.is_dir():
        return []
    found = []
    for dev in sorted(base.iterdir(), key=natural_key):
        name = read_text(dev / "name")
        if name and name_contains in name.lower():
            found.append(dev)
    return found


def _skip_label(label: str) -> bool:
    """Not a rail: not connected, or the sum-of-shunts channel."""
    return label.strip().upper() == "NC" or bool(_SUM_LABEL.search(label))


def _unique(key: str, used: Iterable[str], tag: str) -> str:
    used = set(used)
    if key not in used:
        return key
    key2 = f"{key}@{tag}"
    n = 2
    while key2 in used:
        key2 = f"{key}@{tag}#{n}"
        n += 1
    return key2


def _total_of(rails: dict[str, float], total_names: Iterable[str] = TOTAL_RAILS) -> float | None:
    for name in total_names:
        if name in rails:
            return rails[name]
    return sum(rails.values()) if rails else None


# -------------------------------------------------------------------------------------- readers


class _Reader:
    """Shared sampling bookkeeping: ``read()`` samples, ``total_w()`` reuses a fresh sample."""

    name = "?"
    estimated = False
    max_age = 0.1  # seconds a sample is reused by total_w()

    def __init__(self, root: str | Path = "/", clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.clock = clock
        self._rails: dict[str, float] = {}
        self._total: float | None = None
        self._sampled_at: float | None = None

    @property
    def available(self) -> bool:  # pragma: no cover - overridden
        return False

    def _sample(self) -> dict[str, float]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _compute_total(self, rails: dict[str, float]) -> float | None:
        return _total_of(rails)

    def read(self) -> dict[str, float]:
        rails = self._sample()
        self._rails = rails
        self._total = self._compute_total(rails)
        self._sampled_at = self.clock()
        return dict(rails)

    def total_w(self) -> float | None:
        if self._sampled_at is None or self.clock() - self._sampled_at > self.max_age:
            self.read()
        return self._total

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} root={self.root}>"


class _Channel:
    """One rail: either a power file (scale to W) or a voltage x current pair."""

    __slots__ = ("label", "power", "power_scale", "volt", "curr")

    def __init__(self, label: str, power: Path | None = None, power_scale: float = 0.0,
                 volt: Path | None = None, curr: Path | None = None) -> None:
        self.label, self.power, self.power_scale, self.volt, self.curr = label, power, power_scale, volt, curr

    def watts(self) -> float | None:
        if self.power is not None:
            raw = read_int(self.power)
            if raw is not None:
                return raw * self.power_scale
        if self.volt is not None and self.curr is not None:
            mv, ma = read_int(self.volt), read_int(self.curr)
            if mv is not None and ma is not None:
                return mv * ma / 1e6  # mV x mA = uW
        return None


class _ChannelReader(_Reader):
    channels: list[_Channel]

    @property
    def available(self) -> bool:
        return bool(self.channels)

    def _sample(self) -> dict[str, float]:
        rails = {}
        for ch in self.channels:
            w = ch.watts()
            if w is not None:
                rails[ch.label] = w
        return rails


class Ina3221Hwmon(_ChannelReader):
    """Jetson INA3221 through the hwmon driver (JetPack 5 and later)."""

    name = "ina3221-hwmon"

    def __init__(self, root: str | Path = "/", clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(root, clock)
        self.channels = []
        self.hwmon_dirs: list[Path] = []
        for dev in _i2c_devices(self.root, "ina3221"):
            for hw in sorted((dev / "hwmon").glob("hwmon*"), key=natural_key):
                self.hwmon_dirs.append(hw)
                for label_file in sorted(hw.glob("in*_label"), key=natural_key):
                    n = label_file.name[len("in"):-len("_label")]
                    label = read_text(label_file)
                    if not label or _skip_label(label):
                        continue
                    volt, curr = hw / f"in{n}_input", hw / f"curr{n}_input"
                    if not (volt.exists() and curr.exists()):
                        continue
                    key = _unique(label, (c.label for c in self.channels), dev.name)
                    self.channels.append(_Channel(key, volt=volt, curr=curr))


class Ina3221Iio(_ChannelReader):
    """Jetson INA3221 through NVIDIA's ina3221x IIO driver (JetPack 4)."""

    name = "ina3221-iio"

    def __init__(self, root: str | Path = "/", clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(root, clock)
        self.channels = []
        for dev in _i2c_devices(self.root, "ina3221"):
            for iio in sorted(dev.glob("iio:device*"), key=natural_key):
                for name_file in sorted(iio.glob("rail_name_*"), key=natural_key):
                    k = name_file.name[len("rail_name_"):]
                    label = read_text(name_file)
                    if not label or _skip_label(label):
                        continue
                    power = iio / f"in_power{k}_input"
                    volt, curr = iio / f"in_voltage{k}_input", iio / f"in_current{k}_input"
                    if not (power.exists() or (volt.exists() and curr.exists())):
                        continue
                    key = _unique(label, (c.label for c in self.channels), dev.name)
                    self.channels.append(_Channel(key, power=power if power.exists() else None,
                                                  power_scale=1e-3, volt=volt, curr=curr))


class HwmonPower(_ChannelReader):
    """Any hwmon device reporting power (uW) or current (mA) with a matching voltage (mV).

    Devices named in ``skip_names`` have their own reader (the INA3221) and are left out, so one
    chip is never counted twice. Rails are keyed ``"<hwmon name>:<label or chN>"``; the total is
    their sum.
    """

    name = "hwmon"

    def __init__(self, root: str | Path = "/", clock: Callable[[], float] = time.monotonic,
                 skip_names: Iterable[str] = ("ina3221",)) -> None:
        super().__init__(root, clock)
        self.channels = []
        skip = {s.lower() for s in skip_names}
        base = self.root / "sys" / "class" / "hwmon"
        hwmons = sorted(base.glob("hwmon*"), key=natural_key) if base.is_dir() else []
        for hw in hwmons:
            dev_name = read_text(hw / "name") or hw.name
            if dev_name.lower() in skip:
                continue
            indexes: set[int] = set()
            for f in list(hw.glob("power*_input")) + list(hw.glob("power*_average")) + list(hw.glob("curr*_input")):
                m = re.fullmatch(r"(?:power|curr)(\d+)_(?:input|average)", f.name)
                if m:
                    indexes.add(int(m.group(1)))
            for n in sorted(indexes):
                label = next((t for t in (read_text(hw / f"{kind}{n}_label") for kind in ("power", "curr", "in")) if t), None)
                if label and _skip_label(label):
                    continue
                power = next((p for p in (hw / f"power{n}_input", hw / f"power{n}_average") if p.exists()), None)
                volt, curr = hw / f"in{n}_input", hw / f"curr{n}_input"
                if power is None and not (volt.exists() and curr.exists()):
                    continue
                key = _unique(f"{dev_name}:{label or f'ch{n}'}", (c.label for c in self.channels), hw.name)
                self.channels.append(_Channel(key, power=power, power_scale=1e-6,
                                              volt=volt if power is None else None,
                                              curr=curr if power is None else None))

    def _compute_total(self, rails: dict[str, float]) -> float | None:
        return sum(rails.values()) if rails else None


class Rapl(_Reader):
    """x86 RAPL energy counters (powercap), turned into watts between two samples.

    The first sample is taken at construction, so the first ``read()`` already reports the mean
    power since then. Counters wrap at ``max_energy_range_uj``. Rails are the zone names
    (``package-0``, ``package-0/core``, ``psys``...); the total is ``psys`` (the whole platform)
    when present, else the sum of the top-level zones. ``energy_uj`` is root-only on kernels
    patched for CVE-2020-8694; unreadable zones make the reader unavailable.
    """

    name = "rapl"
    min_interval = 0.01  # below this, deltas are noise: the previous values are returned

    def __init__(self, root: str | Path = "/", clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(root, clock)
        self.zones: list[tuple[str, Path, int, bool]] = []  # (rail, energy file, range, top-level)
        base = self.root / "sys" / "class" / "powercap"
        entries = sorted(base.glob("intel-rapl:*"), key=natural_key) if base.is_dir() else []
        names: dict[str, str] = {}
        for zone in entries:
            if not re.fullmatch(r"intel-rapl(:\d+)+", zone.name):
                continue
            zname = read_text(zone / "name") or zone.name
            names[zone.name] = zname
            energy = zone / "energy_uj"
            if read_int(energy) is None:
                continue
            top = zone.name.count(":") == 1
            parent = zone.name.rsplit(":", 1)[0]
            rail = zname if top else f"{names.get(parent, parent)}/{zname}"
            rng = read_int(zone / "max_energy_range_uj") or 2**32
            self.zones.append((rail, energy, rng, top))
        self._prev: dict[str, int] = {}
        self._prev_t: float | None = None
        if self.zones:
            self._prev_t = self.clock()
            for rail, energy, _, _ in self.zones:
                e = read_int(energy)
                if e is not None:
                    self._prev[rail] = e

    @property
    def available(self) -> bool:
        return bool(self.zones)

    def _sample(self) -> dict[str, float]:
        now = self.clock()
        if self._prev_t is not None and now - self._prev_t < self.min_interval:
            return dict(self._rails)
        rails = {}
        current = {}
        for rail, energy, rng, _ in self.zones:
            e = read_int(energy)
            if e is None:
                continue
            current[rail] = e
            prev = self._prev.get(rail)
            if prev is None or self._prev_t is None:
                continue
            delta = e - prev
            if delta < 0:  # the counter wrapped
                delta += rng
            rails[rail] = delta / 1e6 / (now - self._prev_t)
        self._prev, self._prev_t = current, now
        return rails

    def _compute_total(self, rails: dict[str, float]) -> float | None:
        if "psys" in rails:
            return rails["psys"]
        tops = [rails[rail] for rail, _, _, top in self.zones if top and rail in rails]
        return sum(tops) if tops else None


# (substring of the device-tree model/compatible, lowercased) -> board, idle W, max W.
# Rough whole-board figures under an all-core CPU load; they are what the estimate is made of,
# and the snapshot says so.
BOARD_MODELS: list[tuple[str, str, float, float]] = [
    ("rk3588", "Rockchip RK3588", 2.5, 10.0),
    ("raspberry pi 5", "Raspberry Pi 5", 2.7, 8.0),
    ("raspberry pi 4", "Raspberry Pi 4", 2.7, 6.4),
]
GENERIC_BOARD = ("generic", "generic board", 2.0, 8.0)


def device_tree_ids(root: str | Path = "/") -> tuple[str, str]:
    """(model, compatible) from the device tree, either path; empty strings when absent."""
    root = Path(root)
    for base in (root / "proc" / "device-tree", root / "sys" / "firmware" / "devicetree" / "base"):
        model = read_text(base / "model")
        if model is not None:
            compat = read_text(base / "compatible") or ""
            return model, " ".join(p for p in compat.split("\x00") if p)
    return "", ""


def _cpu_busy_total() -> tuple[float, float]:
    """System-wide (busy, total) CPU seconds so far."""
    import psutil

    t = psutil.cpu_times()
    # guest time is already inside user/nice on Linux
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


class EstimatedPower(_Reader):
    """No power sensor: ``idle_w + (max_w - idle_w) * cpu_load`` for the board, flagged estimated.

    ``cpu_load`` is a fraction 0..1: a number, a callable returning one, or None to read the
    system-wide load with psutil (busy share of all CPUs since the previous read).
    """

    name = "estimated"
    estimated = True
    MIN_WINDOW_S = 0.5

    def __init__(self, root: str | Path = "/", cpu_load: float | Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(root, clock)
        self.model, self.compatible = device_tree_ids(self.root)
        haystack = f"{self.model} {self.compatible}".lower()
        key, board, idle, peak = GENERIC_BOARD
        for sub, name, i, m in BOARD_MODELS:
            if sub in haystack:
                key, board, idle, peak = sub, name, i, m
                break
        self.board, self.board_name, self.idle_w, self.max_w = key, board, idle, peak
        self._cpu_load = cpu_load
        self._cpu_prev = _cpu_busy_total() if cpu_load is None else None
        self._last_load: float | None = None

    @property
    def available(self) -> bool:
        return True

    @property
    def basis(self) -> str:
        return (f"{self.board_name}: {self.idle_w:g} W idle + {self.max_w - self.idle_w:g} W x cpu load"
                + (f" (model {self.model!r})" if self.model else ""))

    def cpu_load(self) -> float:
        if self._cpu_load is None:
            # our own baseline, not psutil.cpu_percent()'s module-wide one that other callers reset
            # Measure over at least MIN_WINDOW_S of wall time: a read a few ms after the last
            # one sees a handful of ticks and flips between idle and full load.
            now = _cpu_busy_total()
            busy, total = now[0] - self._cpu_prev[0], now[1] - self._cpu_prev[1]
            if total < self.MIN_WINDOW_S * (os.cpu_count() or 1) and self._last_load is not None:
                load = self._last_load
            else:
                self._cpu_prev = now
                load = busy / total if total > 0 else 0.0
                self._last_load = load
        elif callable(self._cpu_load):
            load = float(self._cpu_load())
        else:
            load = float(self._cpu_load)
        return min(max(load, 0.0), 1.0)

    def _sample(self) -> dict[str, float]:
        return {"board": self.idle_w + (self.max_w - self.idle_w) * self.cpu_load()}


# RAPL before generic hwmon: on x86 the hwmon power attributes are often a GPU's own
# (amdgpu power1_average), while RAPL covers the CPU package the models run on.
SOURCES = (Ina3221Hwmon, Ina3221Iio, Rapl, HwmonPower)


def discover(root: str | Path = "/") -> list[PowerReader]:
    """Every real power source found under ``root``, best first; ``[EstimatedPower]`` if none."""
    readers: list[PowerReader] = []
    for cls in SOURCES:
        try:
            reader = cls(root)
        except OSError as err:  # a tree we cannot even list
            log.debug("power source %s unusable: %s", cls.__name__, err)
            continue
        if reader.available:
            readers.append(reader)
    if not readers:
        est = EstimatedPower(root)
        if _i2c_devices(Path(root), "ina3221"):
            log.warning("an INA3221 is present but its rails cannot be read (permissions on %s?); "
                        "estimating power from CPU load", Path(root) / "sys/bus/i2c/devices")
        else:
            log.info("no power sensor found; estimating: %s", est.basis)
        readers.append(est)
    return readers
