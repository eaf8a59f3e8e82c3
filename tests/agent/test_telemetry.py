"""Telemetry: power readers and thermal zones on fake sysfs trees shaped like the real ones
(tests/sysfs_trees.py), latency/FPS/energy metrics, and the snapshot layout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tandoor_agent.telemetry import (
    EnergyMeter,
    EstimatedPower,
    FpsMeter,
    HwmonPower,
    Ina3221Hwmon,
    Ina3221Iio,
    LatencyStats,
    PowerReader,
    Rapl,
    StageTimer,
    Telemetry,
    discover,
    read_temperatures,
)
from support import sysfs_trees as trees


class Clock:
    """A clock the test moves by hand (readers and meters take any callable)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def watts(d: dict) -> dict:
    return {k: pytest.approx(v, abs=1e-9) for k, v in d.items()}


# ------------------------------------------------------------------------------------- Jetson


@pytest.mark.parametrize("sum_label", ["sum of shunt voltages", "summation of shunt voltages", "Sum of shunts"])
def test_agx_orin_jp5_two_ina3221_skip_nc_and_sum(tmp_path, sum_label):
    want = trees.jetson_agx_orin_jp5(tmp_path, sum_label=sum_label)
    readers = discover(tmp_path)
    assert [r.name for r in readers] == ["ina3221-hwmon"]  # the ina3221 is not counted again as generic hwmon
    r = readers[0]
    assert isinstance(r, Ina3221Hwmon) and isinstance(r, PowerReader)
    assert r.estimated is False
    rails = r.read()
    assert rails == watts(want["rails"])
    assert "NC" not in rails and not any("sum" in k.lower() for k in rails)
    # no total rail on AGX Orin: the sum of the rails, 18.89 W
    assert r.total_w() == pytest.approx(want["total"])
    assert round(r.total_w()) == 19


def test_orin_nano_jp5_vdd_in_is_the_total(tmp_path):
    want = trees.jetson_orin_nano_jp5(tmp_path)
    r = Ina3221Hwmon(tmp_path)
    assert r.read() == watts(want["rails"])
    assert r.total_w() == pytest.approx(want["total"]) == pytest.approx(7.41184)


def test_nano_jp4_iio_pom_5v_in_is_the_total(tmp_path):
    want = trees.jetson_nano_jp4(tmp_path)
    readers = discover(tmp_path)
    assert [r.name for r in readers] == ["ina3221-iio"]
    r = readers[0]
    assert isinstance(r, Ina3221Iio)
    assert r.read() == watts(want["rails"])
    assert r.total_w() == pytest.approx(4.534)  # POM_5V_IN, not the sum of the three rails
    assert Ina3221Hwmon(tmp_path).available is False  # no hwmon dir on JetPack 4


def test_ina3221_rail_going_unreadable_is_left_out(tmp_path):
    trees.jetson_orin_nano_jp5(tmp_path)
    r = Ina3221Hwmon(tmp_path)
    hw = next((tmp_path / "sys/bus/i2c/devices/1-0040/hwmon").glob("hwmon*"))
    trees.make_unreadable(hw / "curr2_input")
    rails = r.read()
    assert set(rails) == {"VDD_IN", "VDD_SOC"}


# ------------------------------------------------------------------------------ generic hwmon


def test_generic_hwmon_power1_input(tmp_path):
    want = trees.hwmon_ina226(tmp_path, uw=4_113_120)
    readers = discover(tmp_path)
    assert [r.name for r in readers] == ["hwmon"]
    r = readers[0]
    assert isinstance(r, HwmonPower)
    assert r.read() == watts(want["rails"])  # power1 in uW, not in1 x curr1
    assert r.total_w() == pytest.approx(4.11312)


def test_generic_hwmon_current_times_voltage(tmp_path):
    want = trees.hwmon_ltc4151(tmp_path, mv=11980, ma=850)
    r = HwmonPower(tmp_path)
    assert r.read() == watts(want["rails"])
    assert r.total_w() == pytest.approx(10.183)


# --------------------------------------------------------------------------------------- RAPL


def test_rapl_counter_advancing_and_wrapping(tmp_path):
    trees.rapl(tmp_path, package_uj=1_000_000, core_uj=400_000)
    clock = Clock(100.0)
    r = Rapl(tmp_path, clock=clock)
    assert r.available and r.estimated is False
    assert [r.name for r in discover(tmp_path)] == ["rapl"]

    # 2 s later: package +30 J, core +12 J, uncore unchanged
    trees.set_rapl_energy(tmp_path, "intel-rapl:0", 31_000_000)
    trees.set_rapl_energy(tmp_path, "intel-rapl:0:0", 12_400_000)
    clock.t += 2.0
    rails = r.read()
    assert rails == watts({"package-0": 15.0, "package-0/core": 6.0, "package-0/uncore": 0.0})
    assert r.total_w() == pytest.approx(15.0)  # the package, subzones not added again

    # close to the top of the range, then past it: the counter wraps to a small value
    trees.set_rapl_energy(tmp_path, "intel-rapl:0", trees.RAPL_RANGE - 2_000_000)
    clock.t += 1.0
    r.read()
    trees.set_rapl_energy(tmp_path, "intel-rapl:0", 6_000_000)
    trees.set_rapl_energy(tmp_path, "intel-rapl:0:0", 12_400_000 + 3_000_000)
    clock.t += 0.5
    rails = r.read()
    assert rails["package-0"] == pytest.approx(8_000_000 / 1e6 / 0.5)  # 16 W, not negative
    assert r.total_w() == pytest.approx(16.0)


def test_rapl_psys_is_the_total_and_unreadable_counters_are_not_a_source(tmp_path):
    trees.rapl(tmp_path, package_uj=0, core_uj=0, psys=True)
    clock = Clock()
    r = Rapl(tmp_path, clock=clock)
    trees.set_rapl_energy(tmp_path, "intel-rapl:0", 5_000_000)
    trees.set_rapl_energy(tmp_path, "intel-rapl:1", 8_000_000)
    clock.t += 1.0
    r.read()
    assert r.total_w() == pytest.approx(8.0)

    # kernels that keep energy_uj root-only: the read fails, so no RAPL source
    for zone in ("intel-rapl:0", "intel-rapl:0:0", "intel-rapl:0:1", "intel-rapl:1"):
        trees.make_unreadable(tmp_path / "sys/class/powercap" / zone / "energy_uj")
    assert Rapl(tmp_path).available is False
    assert [r.name for r in discover(tmp_path)] == ["estimated"]


# ------------------------------------------------------------------------------- no sensors


def test_rk3588_no_sensor_gives_a_flagged_estimate(tmp_path):
    trees.rk3588_board(tmp_path)
    readers = discover(tmp_path)
    assert [type(r) for r in readers] == [EstimatedPower]
    r = readers[0]
    assert r.estimated is True and r.board == "rk3588"
    assert (r.idle_w, r.max_w) == (2.5, 10.0)

    half = EstimatedPower(tmp_path, cpu_load=0.5)
    assert half.read() == {"board": pytest.approx(6.25)}
    assert half.total_w() == pytest.approx(6.25)
    assert EstimatedPower(tmp_path, cpu_load=lambda: 1.0).total_w() == pytest.approx(10.0)
    assert EstimatedPower(tmp_path, cpu_load=0.0).total_w() == pytest.approx(2.5)
    assert "estimated" not in r.basis and "RK3588" in r.basis


def test_estimate_board_table_and_generic_default(tmp_path):
    pi = tmp_path / "pi"
    trees.device_tree(pi, "Raspberry Pi 5 Model B Rev 1.0", ["raspberrypi,5-model-b", "brcm,bcm2712"])
    r = EstimatedPower(pi, cpu_load=1.0)
    assert r.board == "raspberry pi 5" and r.total_w() == pytest.approx(8.0)
    # a board whose model string does not say RK3588 is still found by its compatible list
    rock = tmp_path / "rock"
    trees.device_tree(rock, "Radxa ROCK 5B", ["radxa,rock-5b", "rockchip,rk3588"])
    assert EstimatedPower(rock, cpu_load=0.0).board == "rk3588"
    bare = tmp_path / "bare"
    bare.mkdir()
    g = EstimatedPower(bare, cpu_load=0.0)
    assert g.board == "generic" and g.estimated is True


# ------------------------------------------------------------------------------------ thermal


def test_thermal_zones_skip_unreadable_and_bogus(tmp_path):
    want = trees.jetson_orin_thermal(tmp_path)
    with pytest.raises(OSError):  # the tree really has a zone whose read() fails
        (tmp_path / "sys/class/thermal/thermal_zone2/temp").read_text()
    temps = read_temperatures(tmp_path)
    assert temps == pytest.approx(want)
    assert set(temps) == {"cpu-thermal", "gpu-thermal", "soc0-thermal", "tj-thermal"}
    assert temps["cpu-thermal"] == pytest.approx(48.562)


def test_thermal_rk3588_and_hwmon_sensors_the_zones_miss(tmp_path):
    rk = tmp_path / "rk"
    trees.rk3588_board(rk)
    temps = read_temperatures(rk)
    assert len(temps) == 7 and temps["npu-thermal"] == pytest.approx(41.153)  # hwmon mirrors not repeated

    x86 = tmp_path / "x86"
    want = trees.x86_thermal(x86)
    assert read_temperatures(x86) == pytest.approx(want)

    assert read_temperatures(tmp_path / "nothing") == {}


# ------------------------------------------------------------------------------------ metrics


def test_latency_percentiles_on_known_samples():
    stats = LatencyStats(window=1000)
    for ms in range(1, 101):
        stats.add("inference", ms / 1000)
    s = stats.stage("inference")
    assert s["p50"] == pytest.approx(50.5)
    assert s["p95"] == pytest.approx(95.05)
    assert s["p99"] == pytest.approx(99.01)
    assert s["mean"] == pytest.approx(50.5) and s["count"] == 100
    assert stats.stage("capture") == {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}


def test_latency_window_is_bounded():
    stats = LatencyStats(window=10)
    for ms in range(1, 101):
        stats.add("preprocess", ms / 1000)
    s = stats.stage("preprocess")
    assert s["count"] == 10
    assert s["p50"] == pytest.approx(float(np.percentile(np.arange(91, 101), 50)))


def test_stage_timer_and_fps():
    tel_stats = LatencyStats()
    with StageTimer(tel_stats, "postprocess") as t:
        sum(range(1000))
    assert t.seconds is not None and t.seconds >= 0
    assert tel_stats.stage("postprocess")["count"] == 1

    clock = Clock(0.0)
    fps = FpsMeter(window_s=5.0, clock=clock)
    for i in range(11):
        clock.t = i * 0.1
        fps.tick()
    assert fps.fps() == pytest.approx(10.0)
    clock.t += 10
    assert fps.fps() == 0.0  # frames stopped


def test_energy_meter_integrates_trapezoids():
    clock = Clock(0.0)
    e = EnergyMeter(clock=clock)
    e.add(2.0)
    clock.t = 1.0
    e.add(4.0)
    clock.t = 3.0
    e.add(4.0)
    assert e.energy_j == pytest.approx(3.0 + 8.0)
    assert e.mean_power_w() == pytest.approx(11.0 / 3.0)
    assert e.per_inference_mj(0.010) == pytest.approx(11.0 / 3.0 * 10)


def test_energy_per_inference_on_constant_power(tmp_path):
    trees.hwmon_ina226(tmp_path, uw=5_000_000)  # 5 W, constant
    clock = Clock(0.0)
    tel = Telemetry(tmp_path, clock=clock)
    for ms in (10, 20, 30):
        tel.record("inference", ms / 1000)
        tel.frame()
    clock.t = 10.0
    snap = tel.snapshot()
    # 5 W x 20 ms mean inference = 100 mJ
    assert snap["energy_per_inference_mj"] == pytest.approx(100.0)
    assert snap["energy_j"] == pytest.approx(50.0)  # 5 W over 10 s
    assert snap["power"] == {"source": "hwmon", "estimated": False, "total_w": 5.0, "rails": {"ina226:ch1": 5.0}}


def test_snapshot_layout_is_json_with_every_key(tmp_path):
    trees.jetson_agx_orin_jp5(tmp_path)
    trees.jetson_orin_thermal(tmp_path)
    tel = Telemetry(tmp_path, window=100)
    for i in range(20):
        with tel.time("capture"):
            pass
        tel.record("preprocess", 0.002)
        tel.record("inference", 0.015)
        tel.record("postprocess", 0.001)
        tel.frame(dropped=1 if i % 5 == 0 else 0)
    tel.error()
    snap = tel.snapshot()
    text = json.dumps(snap, allow_nan=False)
    back = json.loads(text)
    assert set(back) == {"ts", "fps", "frames", "dropped", "errors", "latency_ms", "cpu_percent", "rss_mb",
                         "temperatures_c", "power", "energy_j", "energy_per_inference_mj", "objects"}
    assert back["objects"] is None  # no detector frame was counted
    assert (back["frames"], back["dropped"], back["errors"]) == (20, 4, 1)
    assert set(back["latency_ms"]) == {"capture", "preprocess", "inference", "postprocess"}
    for stage in back["latency_ms"].values():
        assert set(stage) == {"p50", "p95", "p99", "mean", "count"} and stage["count"] == 20
    assert back["latency_ms"]["inference"]["p95"] == pytest.approx(15.0)
    assert back["fps"] > 0 and back["rss_mb"] > 1 and back["cpu_percent"] >= 0
    assert back["temperatures_c"]["cpu-thermal"] == pytest.approx(48.6)
    p = back["power"]
    assert set(p) == {"source", "estimated", "total_w", "rails"}
    assert p["source"] == "ina3221-hwmon" and p["estimated"] is False
    assert round(p["total_w"]) == 19 and "VDDQ_VDD2_1V8AO" in p["rails"]
    assert back["energy_per_inference_mj"] == pytest.approx(p["total_w"] * 15.0, rel=1e-3)


def test_snapshot_estimated_power_says_so(tmp_path):
    trees.rk3588_board(tmp_path)
    tel = Telemetry(tmp_path, power=EstimatedPower(tmp_path, cpu_load=0.2))
    tel.record("inference", 0.040)
    snap = json.loads(json.dumps(tel.snapshot(), allow_nan=False))
    assert snap["power"]["estimated"] is True and snap["power"]["source"] == "estimated"
    assert snap["power"]["total_w"] == pytest.approx(4.0)
    assert "RK3588" in snap["power"]["basis"]
    assert snap["energy_per_inference_mj"] == pytest.approx(160.0)
    assert snap["fps"] == 0.0 and snap["latency_ms"]["capture"]["p50"] is None


@pytest.mark.skipif(not os.path.isdir("/sys/class"), reason="no sysfs here")
def test_real_root_does_not_fail():
    tel = Telemetry()  # whatever this machine has; an estimate at worst
    snap = tel.snapshot()
    json.dumps(snap, allow_nan=False)
    assert snap["power"]["source"] in {"ina3221-hwmon", "ina3221-iio", "hwmon", "rapl", "estimated"}


def test_estimate_reads_cpu_load_itself(tmp_path):
    trees.rk3588_board(tmp_path)
    r = EstimatedPower(tmp_path)  # system-wide load from psutil, since the previous read
    x = 0
    for i in range(2_000_000):
        x += i
    w = r.total_w()
    assert 2.5 <= w <= 10.0


def test_unreadable_ina3221_falls_back_to_estimate_with_a_warning(tmp_path, caplog):
    trees.jetson_orin_nano_jp5(tmp_path)
    hw = next((tmp_path / "sys/bus/i2c/devices/1-0040/hwmon").glob("hwmon*"))
    for label in hw.glob("in*_label"):  # rails root-only, agent running as its own user
        trees.make_unreadable(label)
    with caplog.at_level("WARNING", logger="tandoor.telemetry.power"):
        readers = discover(tmp_path)
    assert [r.name for r in readers] == ["estimated"]
    assert "INA3221" in caplog.text


def test_rapl_preferred_over_generic_hwmon(tmp_path):
    trees.rapl(tmp_path)
    trees.hwmon_ina226(tmp_path)
    assert [r.name for r in discover(tmp_path)] == ["rapl", "hwmon"]


def test_object_counts_per_window():
    """Per-class detections over the frames of one window, then the next window starts empty."""
    from tandoor_agent.telemetry import ObjectCounts

    c = ObjectCounts()
    assert c.take() is None
    for labels in (["face", "face", "car"], [], ["face"], ["car", "car", "car"]):
        c.add(labels)
    w = c.take()
    assert w == {"frames": 4, "counts": {"car": 4, "face": 3}, "max": {"car": 3, "face": 2},
                 "mean": {"car": 1.0, "face": 0.75}}
    assert c.take() == {"frames": 0, "counts": {}, "max": {}, "mean": {}}
    c.add(["person"])
    assert c.take()["counts"] == {"person": 1}
