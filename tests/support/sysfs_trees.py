"""Fake sysfs trees under a temporary root, laid out the way the kernel lays them out.

Devices live under ``sys/devices/...``; ``sys/bus/i2c/devices/<addr>``, ``sys/class/hwmon/hwmonN``,
``sys/class/thermal/thermal_zoneN`` and ``sys/class/powercap/intel-rapl:N`` are relative symlinks
into them, as on a real system. Attribute files hold what the driver prints (value + newline;
device-tree strings NUL-terminated). Symlinks that are absolute on a real system
(``/proc/device-tree -> /sys/firmware/devicetree/base``) are made relative so they stay inside
the tree.

A sensor the driver refuses to read (the kernel returns EIO/EINVAL from read()) cannot be a
regular file when tests run as root (permissions do not stop root), so its attribute is a
symlink to ``/proc/self/mem``, whose read at offset 0 fails with EIO - a real read() error.

Each builder returns what a correct reader must report (watts or degrees C), computed from the
raw values it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

UNREADABLE = object()


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def write(self, rel: str, value, nul: bool = False) -> Path:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or (value is UNREADABLE and p.exists()):
            p.unlink()
        if value is UNREADABLE:
            p.symlink_to("/proc/self/mem")
        else:
            p.write_text(f"{value}\x00" if nul else f"{value}\n")
        return p

    def attrs(self, rel: str, values: dict) -> Path:
        for name, value in values.items():
            self.write(f"{rel}/{name}", value)
        return self.path(rel)

    def link(self, rel_link: str, rel_target: str) -> None:
        """A relative symlink, as sysfs makes them."""
        link, target = self.path(rel_link), self.path(rel_target)
        link.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def next_index(self, class_dir: str, prefix: str) -> int:
        d = self.path(class_dir)
        used = {int(p.name[len(prefix):]) for p in d.glob(f"{prefix}*") if p.name[len(prefix):].isdigit()} if d.is_dir() else set()
        return max(used, default=-1) + 1

    # -- building blocks
    def i2c_adapter(self, parent: str, bus: int, name: str) -> str:
        rel = f"sys/devices/{parent}/i2c-{bus}"
        self.attrs(rel, {"name": name, "new_device": "", "delete_device": ""})
        if not self.path(f"sys/bus/i2c/devices/i2c-{bus}").exists():
            self.link(f"sys/bus/i2c/devices/i2c-{bus}", rel)
        return rel

    def i2c_device(self, parent: str, bus: int, addr: int, name: str, driver: str) -> str:
        adapter = f"sys/devices/{parent}/i2c-{bus}"
        dev = f"{bus}-{addr:04x}"
        rel = f"{adapter}/{dev}"
        self.attrs(rel, {"name": name, "modalias": f"i2c:{name}"})
        self.link(f"sys/bus/i2c/devices/{dev}", rel)
        self.link(f"sys/bus/i2c/drivers/{driver}/{dev}", rel)
        return rel

    def hwmon(self, device_rel: str, name: str, values: dict) -> str:
        """``<device>/hwmon/hwmonN`` with its attributes, and /sys/class/hwmon/hwmonN -> it."""
        n = self.next_index("sys/class/hwmon", "hwmon")
        rel = f"{device_rel}/hwmon/hwmon{n}"
        self.attrs(rel, {"name": name, **values})
        self.link(f"sys/class/hwmon/hwmon{n}", rel)
        return rel


# ------------------------------------------------------------------------------------- Jetson

def _ina3221_hwmon_values(channels: list[tuple[str | None, int, int]], sum_label: str | None) -> dict:
    """Attributes of the mainline ina3221 hwmon driver for three channels
    (label or None, bus mV, mA). Shunt voltages (in4..in6, uV) have no labels; in7 is the sum."""
    values: dict = {"samples": 512, "update_interval": 2}
    shunt_sum = 0
    for i, (label, mv, ma) in enumerate(channels, start=1):
        shunt_uv = ma * 5  # 5 mOhm shunt
        shunt_sum += shunt_uv
        if label is not None:
            values[f"in{i}_label"] = label
        values.update({
            f"in{i}_enable": 1,
            f"in{i}_input": mv,
            f"curr{i}_input": ma,
            f"curr{i}_max": 32760,
            f"curr{i}_crit": 32760,
            f"curr{i}_max_alarm": 0,
            f"curr{i}_crit_alarm": 0,
            f"shunt{i}_resistor": 5000,
            f"in{i + 3}_input": shunt_uv,
        })
    if sum_label is not None:
        values["in7_label"] = sum_label
        values["in7_input"] = shunt_sum
        values["curr4_input"] = sum(ma for _, _, ma in channels)
        values["curr4_crit"] = 32760
        values["curr4_crit_alarm"] = 0
    return values


def _orin_i2c(t: Tree) -> str:
    parent = "platform/c240000.i2c"
    t.i2c_adapter("platform/c240000.i2c", 1, "Tegra I2C adapter")
    return parent


def jetson_agx_orin_jp5(root: Path, sum_label: str = "sum of shunt voltages") -> dict:
    """Jetson AGX Orin on JetPack 5: two INA3221s at 1-0040 and 1-0041; the second has NC
    channels (with junk readings) and no total rail, so the total is the sum of the rails."""
    t = Tree(root)
    parent = _orin_i2c(t)
    a = t.i2c_device(parent, 1, 0x40, "ina3221", "ina3221")
    t.hwmon(a, "ina3221", _ina3221_hwmon_values(
        [("VDD_GPU_SOC", 19008, 420), ("VDD_CPU_CV", 19000, 260), ("VIN_SYS_5V0", 4976, 900)], sum_label))
    b = t.i2c_device(parent, 1, 0x41, "ina3221", "ina3221")
    t.hwmon(b, "ina3221", _ina3221_hwmon_values(
        [("NC", 4000, 100), ("VDDQ_VDD2_1V8AO", 4960, 300), ("NC", 4000, 200)], sum_label))
    # other hwmon devices a Jetson has, which are not power monitors
    t.hwmon("sys/devices/platform/pwm-fan", "pwmfan", {"pwm1": 80})
    rails = {
        "VDD_GPU_SOC": 19008 * 420 / 1e6,
        "VDD_CPU_CV": 19000 * 260 / 1e6,
        "VIN_SYS_5V0": 4976 * 900 / 1e6,
        "VDDQ_VDD2_1V8AO": 4960 * 300 / 1e6,
    }
    return {"rails": rails, "total": sum(rails.values())}


def jetson_orin_nano_jp5(root: Path) -> dict:
    """Orin Nano/NX on JetPack 5: one INA3221 whose first rail, VDD_IN, is the module input."""
    t = Tree(root)
    parent = _orin_i2c(t)
    dev = t.i2c_device(parent, 1, 0x40, "ina3221", "ina3221")
    t.hwmon(dev, "ina3221", _ina3221_hwmon_values(
        [("VDD_IN", 5008, 1480), ("VDD_CPU_GPU_CV", 4992, 360), ("VDD_SOC", 4992, 520)], "sum of shunt voltages"))
    rails = {"VDD_IN": 5008 * 1480 / 1e6, "VDD_CPU_GPU_CV": 4992 * 360 / 1e6, "VDD_SOC": 4992 * 520 / 1e6}
    return {"rails": rails, "total": rails["VDD_IN"]}


def jetson_nano_jp4(root: Path) -> dict:
    """Jetson Nano on JetPack 4: NVIDIA's ina3221x IIO driver at 6-0040, iio:device0, rails
    POM_5V_IN (the module input), POM_5V_GPU, POM_5V_CPU; power in mW."""
    t = Tree(root)
    parent = "50000000.host1x/546c0000.i2c"
    t.i2c_adapter(parent, 6, "546c0000.i2c")
    dev = t.i2c_device(parent, 6, 0x40, "ina3221x", "ina3221x")
    iio = f"{dev}/iio:device0"
    rails_raw = [("POM_5V_IN", 5016, 904), ("POM_5V_GPU", 5008, 80), ("POM_5V_CPU", 5008, 336)]
    values: dict = {"name": "ina3221x", "dev": "251:0", "running_mode": 1}
    rails = {}
    for k, (name, mv, ma) in enumerate(rails_raw):
        mw = mv * ma // 1000  # the driver reports integer mW
        values.update({
            f"rail_name_{k}": name,
            f"in_voltage{k}_input": mv,
            f"in_current{k}_input": ma,
            f"in_power{k}_input": mw,
            f"crit_current_limit_{k}": 32760,
            f"warn_current_limit_{k}": 32760,
        })
        rails[name] = mw / 1000
    t.attrs(iio, values)
    t.link("sys/bus/iio/devices/iio:device0", iio)
    return {"rails": rails, "total": rails["POM_5V_IN"]}


# --------------------------------------------------------------------------- generic hwmon

def hwmon_ina226(root: Path, bus_mv: int = 12048, ma: int = 415, uw: int | None = None) -> dict:
    """An INA226 on the ina2xx hwmon driver: in0 = shunt mV, in1 = bus mV, curr1 mA, power1 uW."""
    t = Tree(root)
    t.i2c_adapter("platform/fe804000.i2c", 1, "bcm2835 (i2c@7e804000)")
    dev = t.i2c_device("platform/fe804000.i2c", 1, 0x40, "ina226", "ina2xx")
    uw = bus_mv * ma if uw is None else uw
    t.hwmon(dev, "ina226", {
        "in0_input": 2, "in1_input": bus_mv, "curr1_input": ma, "power1_input": uw,
        "shunt_resistor": 2000, "update_interval": 35,
    })
    return {"rails": {"ina226:ch1": uw / 1e6}, "total": uw / 1e6}


def hwmon_ltc4151(root: Path, mv: int = 11980, ma: int = 850) -> dict:
    """An LTC4151 on its hwmon driver: in1 = input voltage mV, in2 = ADIN mV, curr1 mA, no power
    attribute - the reader multiplies curr1 by in1."""
    t = Tree(root)
    t.i2c_adapter("platform/fe804000.i2c", 1, "bcm2835 (i2c@7e804000)")
    dev = t.i2c_device("platform/fe804000.i2c", 1, 0x6F, "ltc4151", "ltc4151")
    t.hwmon(dev, "ltc4151", {"in1_input": mv, "in2_input": 1204, "curr1_input": ma})
    return {"rails": {"ltc4151:ch1": mv * ma / 1e6}, "total": mv * ma / 1e6}


# ------------------------------------------------------------------------------------- RAPL

RAPL_RANGE = 262143328850  # a real package max_energy_range_uj


def rapl(root: Path, package_uj: int = 1_000_000, core_uj: int = 400_000, psys: bool = False) -> None:
    """intel-rapl:0 (package-0) with subzones core and uncore, optionally intel-rapl:1 (psys)."""
    t = Tree(root)
    base = "sys/devices/virtual/powercap/intel-rapl"
    t.attrs(base, {"enabled": 1})
    t.link("sys/class/powercap/intel-rapl", base)

    def zone(zid: str, rel: str, name: str, uj: int) -> None:
        t.attrs(rel, {
            "name": name, "energy_uj": uj, "max_energy_range_uj": RAPL_RANGE, "enabled": 1,
            "constraint_0_name": "long_term", "constraint_0_power_limit_uw": 15000000,
            "constraint_0_time_window_us": 27983872,
        })
        t.link(f"sys/class/powercap/{zid}", rel)

    zone("intel-rapl:0", f"{base}/intel-rapl:0", "package-0", package_uj)
    zone("intel-rapl:0:0", f"{base}/intel-rapl:0/intel-rapl:0:0", "core", core_uj)
    zone("intel-rapl:0:1", f"{base}/intel-rapl:0/intel-rapl:0:1", "uncore", 10_000)
    if psys:
        zone("intel-rapl:1", f"{base}/intel-rapl:1", "psys", 3 * package_uj)
    # the MMIO interface sits alongside and is not a RAPL MSR zone
    t.attrs("sys/devices/virtual/powercap/intel-rapl-mmio", {"enabled": 1})
    t.link("sys/class/powercap/intel-rapl-mmio", "sys/devices/virtual/powercap/intel-rapl-mmio")


def make_unreadable(path: Path) -> None:
    """From now on, read() of this attribute fails with EIO (a sensor that went away)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to("/proc/self/mem")


def set_rapl_energy(root: Path, zone: str, uj: int) -> None:
    """Advance a zone's counter (what the hardware does between two reads)."""
    (Path(root) / "sys" / "class" / "powercap" / zone / "energy_uj").write_text(f"{uj}\n")


# ------------------------------------------------------------------------------ device tree

def device_tree(root: Path, model: str, compatible: list[str]) -> None:
    t = Tree(root)
    base = "sys/firmware/devicetree/base"
    t.write(f"{base}/model", model, nul=True)
    t.path(f"{base}/compatible").write_bytes(b"".join(c.encode() + b"\x00" for c in compatible))
    t.link("proc/device-tree", base)


def rk3588_board(root: Path) -> None:
    """Rockchip RK3588 EVB: no power sensor; its device tree and thermal zones."""
    device_tree(root, "Rockchip RK3588 EVB1 LP4 V10 Board", ["rockchip,rk3588-evb1-lp4-v10", "rockchip,rk3588"])
    thermal_zones(root, [("soc-thermal", 41615), ("bigcore0-thermal", 42538), ("bigcore1-thermal", 42538),
                         ("littlecore-thermal", 41615), ("center-thermal", 40692), ("gpu-thermal", 40692),
                         ("npu-thermal", 41153)])


# ---------------------------------------------------------------------------------- thermal

def thermal_zones(root: Path, zones: list[tuple[str, object]], mirror_hwmon: bool = True) -> dict:
    """thermal_zoneN for each (type, millidegrees | UNREADABLE), with a trip point and the hwmon
    device the thermal core registers for each zone (name = type with '-' -> '_'), plus a
    cooling device. Returns the temperatures a reader should report for the readable ones."""
    t = Tree(root)
    expected = {}
    for type_, temp in zones:
        n = t.next_index("sys/class/thermal", "thermal_zone")
        rel = f"sys/devices/virtual/thermal/thermal_zone{n}"
        t.attrs(rel, {"type": type_, "mode": "enabled", "policy": "step_wise",
                      "available_policies": "fair_share bang_bang step_wise user_space power_allocator",
                      "trip_point_0_temp": 95000, "trip_point_0_type": "passive"})
        t.write(f"{rel}/temp", temp)
        t.link(f"sys/class/thermal/thermal_zone{n}", rel)
        if mirror_hwmon:
            t.hwmon(rel, type_.replace("-", "_"), {"temp1_input": temp if temp is not UNREADABLE else UNREADABLE})
        if temp is not UNREADABLE and -40 < temp / 1000 < 200:
            expected[type_] = temp / 1000
    c = t.next_index("sys/class/thermal", "cooling_device")
    crel = f"sys/devices/virtual/thermal/cooling_device{c}"
    t.attrs(crel, {"type": "pwm-fan", "cur_state": 1, "max_state": 3})
    t.link(f"sys/class/thermal/cooling_device{c}", crel)
    return expected


def jetson_orin_thermal(root: Path) -> dict:
    """Orin zones: cv0 cannot be read (EIO), cv1 reports the -256 C an offline sensor gives."""
    return thermal_zones(root, [("cpu-thermal", 48562), ("gpu-thermal", 46968), ("cv0-thermal", UNREADABLE),
                                ("cv1-thermal", -256000), ("soc0-thermal", 47437), ("tj-thermal", 48562)])


def x86_thermal(root: Path) -> dict:
    """A laptop: one ACPI zone (no hwmon mirror on this kernel), coretemp and nvme hwmon sensors."""
    expected = thermal_zones(root, [("acpitz", 52000)], mirror_hwmon=False)
    t = Tree(root)
    t.hwmon("sys/devices/platform/coretemp.0", "coretemp", {
        "temp1_label": "Package id 0", "temp1_input": 61000, "temp1_crit": 100000,
        "temp2_label": "Core 0", "temp2_input": 58000, "temp2_crit": 100000,
    })
    t.hwmon("sys/devices/pci0000:00/0000:00:1d.0/0000:3d:00.0/nvme/nvme0", "nvme", {
        "temp1_label": "Composite", "temp1_input": 38850,
    })
    expected.update({"coretemp:Package id 0": 61.0, "coretemp:Core 0": 58.0, "nvme:Composite": 38.85})
    return expected
