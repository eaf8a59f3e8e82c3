"""On-device telemetry: per-stage latency, FPS, drops, CPU/RSS, temperatures, power and energy.

See :mod:`tandoor_agent.telemetry.metrics` for the snapshot layout published on the telemetry
topic, :mod:`tandoor_agent.telemetry.power` for the power sources and
:mod:`tandoor_agent.telemetry.thermal` for temperatures. Every sysfs reader takes a ``root`` so tests can point it at a fake tree.
"""

from .metrics import STAGES, EnergyMeter, FpsMeter, LatencyStats, ObjectCounts, ProcessStats, StageTimer, Telemetry
from .power import (
    EstimatedPower,
    HwmonPower,
    Ina3221Hwmon,
    Ina3221Iio,
    PowerReader,
    Rapl,
    discover,
)
from .thermal import read_temperatures

__all__ = [
    "STAGES",
    "EnergyMeter",
    "EstimatedPower",
    "FpsMeter",
    "HwmonPower",
    "Ina3221Hwmon",
    "Ina3221Iio",
    "LatencyStats",
    "ObjectCounts",
    "PowerReader",
    "ProcessStats",
    "Rapl",
    "StageTimer",
    "Telemetry",
    "discover",
    "read_temperatures",
]
