"""Temperatures in degrees C from sysfs, under a ``root`` that tests point at a temporary tree.

Thermal zones first: ``/sys/class/thermal/thermal_zoneN/type`` names the zone and ``temp`` is in
millidegrees. A zone whose ``temp`` the driver refuses to read (EIO/EINVAL/ENODATA: a sensor that
is powered off, e.g. Jetson's cv*-thermal on some modules) is skipped, and so is a bogus reading
at or below -40 C (Jetson reports -256 C for an offline sensor) or at/above 200 C.

Then hwmon ``tempN_input`` (millidegrees) with ``tempN_label`` for the sensors the zones do not
already cover (e.g. ``coretemp`` on x86, ``nvme``): hwmon devices that mirror a thermal zone
(registered under ``.../thermal_zoneN/hwmonM``, named after the zone type with ``-`` -> ``_``)
are left out. Their keys are ``"<hwmon name>:<label or tempN>"``.

Duplicate zone types (two ``acpitz``) get ``_1``, ``_2``... suffixes.
"""

from __future__ import annotations

import os
from pathlib import Path

from .power import natural_key, read_int, read_text

MIN_C = -40.0
MAX_C = 200.0


def _plausible(celsius: float) -> bool:
    return MIN_C < celsius < MAX_C


def _key(base: str, out: dict) -> str:
    if base not in out:
        return base
    n = 1
    while f"{base}_{n}" in out:
        n += 1
    return f"{base}_{n}"


def read_thermal_zones(root: str | Path = "/") -> dict[str, float]:
    base = Path(root) / "sys" / "class" / "thermal"
    out: dict[str, float] = {}
    if not base.is_dir():
        return out
    for zone in sorted(base.glob("thermal_zone*"), key=natural_key):
        milli = read_int(zone / "temp")
        if milli is None:
            continue
        celsius = milli / 1000.0
        if not _plausible(celsius):
            continue
        out[_key(read_text(zone / "type") or zone.name, out)] = celsius
    return out


def _zone_types(root: Path) -> set[str]:
    base = root / "sys" / "class" / "thermal"
    types = set()
    for zone in base.glob("thermal_zone*") if base.is_dir() else []:
        t = read_text(zone / "type")
        if t:
            types.add(t.replace("-", "_"))
    return types


def read_hwmon_temperatures(root: str | Path = "/", skip_zone_mirrors: bool = True) -> dict[str, float]:
    root = Path(root)
    base = root / "sys" / "class" / "hwmon"
    out: dict[str, float] = {}
    if not base.is_dir():
        return out
    zone_types = _zone_types(root) if skip_zone_mirrors else set()
    for hw in sorted(base.glob("hwmon*"), key=natural_key):
        name = read_text(hw / "name") or hw.name
        if skip_zone_mirrors:
            try:  # /sys/class/hwmon/hwmonN -> ../../devices/virtual/thermal/thermal_zoneK/hwmonN
                target = os.readlink(hw)
            except OSError:
                target = str(hw)
            if "/thermal_zone" in target or name.replace("-", "_") in zone_types:
                continue
        for inp in sorted(hw.glob("temp*_input"), key=natural_key):
            n = inp.name[len("temp"):-len("_input")]
            milli = read_int(inp)
            if milli is None or not _plausible(milli / 1000.0):
                continue
            label = read_text(hw / f"temp{n}_label")
            out[_key(f"{name}:{label or f'temp{n}'}", out)] = milli / 1000.0
    return out


def read_temperatures(root: str | Path = "/") -> dict[str, float]:
    """Thermal zones, plus hwmon sensors the zones do not cover; degrees C."""
    temps = read_thermal_zones(root)
    for key, value in read_hwmon_temperatures(root).items():
        temps[_key(key, temps)] = value
    return temps
