"""The agent's TOML configuration (/etc/tandoor/agent.toml): one table of keys, each with its
type, default, check and one-line doc; loading refuses unknown keys and bad values with the key
named (ConfigError, exit code 2), before anything heavy is imported or opened.

The key table below is the single source of truth; systemd/agent.toml.example and
docs/protocol.md document every key in it (tests check that they do).

Relative paths in the file are taken relative to the directory of the config file.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandoor_contract import media, protocol
from tandoor_contract.errors import TandoorError
from ..run import executors

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

DEFAULT_PATH = "/etc/tandoor/agent.toml"
SAFE_KEYS = ("telemetry_period_s", "results_max_rate_hz", "top_k")  # changeable at run time (set-config)
SECRET_KEYS = ("broker.password",)
DELEGATES = executors.CHOICES
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ConfigError(TandoorError):
    """A bad config file: one line naming the key. Exit code 2 (like a usage error)."""

    exit_code = 2


# ------------------------------------------------------------------------------ value checkers
Check = Callable[[Any, "Context"], Any]


@dataclass
class Context:
    base: Path          # directory of the config file, for relative paths
    check_files: bool   # refuse paths that do not exist (off when only validating syntax)


class Bad(Exception):
    """Raised by a checker: what is wrong with the value (the loader adds the key name)."""


def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(v), type(v).__name__)


def integer(lo: int, hi: int) -> Check:
    def check(v, ctx):
        if type(v) is not int:
            raise Bad(f"must be an integer in {lo}..{hi}, got {_type_name(v)} {v!r}")
        if not lo <= v <= hi:
            raise Bad(f"must be in {lo}..{hi}, got {v}")
        return v
    check.doc = f"integer {lo}..{hi}"
    return check


def number(lo: float, hi: float, lo_open: bool = False) -> Check:
    def check(v, ctx):
        if type(v) not in (int, float) or isinstance(v, bool):
            raise Bad(f"must be a number, got {_type_name(v)} {v!r}")
        v = float(v)
        if math.isnan(v) or v > hi or v < lo or (lo_open and v == lo):
            raise Bad(f"must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}, got {v:g}")
        return v
    check.doc = f"number {'>' if lo_open else '>='} {lo:g}, <= {hi:g}"
    return check


def boolean(v, ctx):
    if type(v) is not bool:
        raise Bad(f"must be true or false, got {_type_name(v)} {v!r}")
    return v


boolean.doc = "boolean"


def string(allow_empty: bool = True, pattern: re.Pattern | None = None, what: str = "") -> Check:
    def check(v, ctx):
        if type(v) is not str:
            raise Bad(f"must be a string, got {_type_name(v)} {v!r}")
        if not v and not allow_empty:
            raise Bad("must not be empty")
        if v and pattern is not None and not pattern.match(v):
            raise Bad(f"must be {what}, got {v!r}")
        return v
    check.doc = "string"
    return check


def choice(*options: str) -> Check:
    def check(v, ctx):
        if type(v) is not str or v not in options:
            raise Bad(f"must be one of {', '.join(options)}, got {v!r}")
        return v
    check.doc = " | ".join(options)
    return check


def path(must_exist: str | None = None, optional: bool = True) -> Check:
    """A filesystem path (relative to the config file). ``must_exist``: "file" | "dir" | None;
    the empty string means "not set" when ``optional``."""

    def check(v, ctx):
        if type(v) is not str:
            raise Bad(f"must be a path (string), got {_type_name(v)} {v!r}")
        if not v:
            if optional:
                return ""
            raise Bad("must not be empty")
        p = Path(os.path.expanduser(v))
        if not p.is_absolute():
            p = ctx.base / p
        if ctx.check_files and must_exist == "file" and not p.is_file():
            raise Bad(f"no such file: {p}")
        if ctx.check_files and must_exist == "dir" and not p.is_dir():
            raise Bad(f"no such directory: {p}")
        return str(p)
    check.doc = "path"
    return check


def path_list(must_exist: str | None = "file") -> Check:
    one = path(must_exist, optional=False)

    def check(v, ctx):
        if type(v) is not list:
            raise Bad(f"must be a list of paths, got {_type_name(v)} {v!r}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(one(x, ctx))
            except Bad as e:
                raise Bad(f"[{i}] {e}") from None
        return out
    check.doc = "list of paths"
    return check


def str_list(options: tuple[str, ...]) -> Check:
    def check(v, ctx):
        if type(v) is not list or not v or any(type(x) is not str or x not in options for x in v):
            raise Bad(f"must be a non-empty list of {', '.join(options)}, got {v!r}")
        return list(v)
    check.doc = "list of " + " | ".join(options)
    return check


def int_list(options: tuple[int, ...]) -> Check:
    def check(v, ctx):
        if type(v) is not list or not v or any(type(x) is not int or x not in options for x in v):
            raise Bad(f"must be a non-empty list of {', '.join(map(str, options))}, got {v!r}")
        return sorted(set(v))
    check.doc = "list of " + " | ".join(map(str, options))
    return check


def camera_source(v, ctx):
    """A frame-source spec as agent/serve/camera.py reads it; file:/images: paths made absolute."""
    from . import camera  # light: numpy only (OpenCV is imported when a source opens)

    if type(v) is not str or not v.strip():
        raise Bad(f"must be a camera spec string, got {v!r}")
    try:
        kind, args = camera.parse_spec(v)
    except ValueError as e:
        raise Bad(str(e)) from None
    if kind in ("file", "images"):
        p = Path(os.path.expanduser(args["path"]))
        if not p.is_absolute():
            p = ctx.base / p
        if ctx.check_files and not (p.is_file() if kind == "file" else p.is_dir()):
            raise Bad(f"no such {'file' if kind == 'file' else 'directory'}: {p}")
        return f"{kind}:{p}"
    return v


camera_source.doc = "camera spec"


# -------------------------------------------------------------------------------- the key table
@dataclass(frozen=True)
class Key:
    name: str        # dotted: "broker.tls.ca"
    default: Any     # a callable is called for the default (device_id: the hostname)
    check: Check
    doc: str


def _hostname() -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "device"
    return name[:64]


KEYS: tuple[Key, ...] = (
    Key("device_id", _hostname, string(False, _NAME_RE, "1-64 of A-Z a-z 0-9 _ . - (no / + #)"),
        "Name of this device in MQTT topics (tandoor/<device_id>/...). Default: the hostname."),
    Key("slot_dir", "/var/lib/tandoor", path(None, optional=False),
        "Slot directory: <slot_dir>/state.json names the committed slot and its bundle."),
    Key("bundle", "", path("file"),
        "Explicit bundle path; when set, the slot directory's state.json is not consulted."),
    Key("trusted_keys", [], path_list("file"),
        "Ed25519 public keys (.pub.pem); when non-empty, only bundles signed by one of them run."),
    Key("delegate", "auto", choice(*DELEGATES),
        "Executor tried first for delegated subgraphs (auto: rknn for rknn orders, then armnn where Arm NN has ACL (CpuAcc/GpuAcc), else onnxruntime > armnn > tvm)."),
    Key("armnn_backends", ["CpuAcc", "GpuAcc", "CpuRef"], str_list(("CpuAcc", "GpuAcc", "CpuRef")),
        "Arm NN backend preference, first that can run a subgraph wins."),
    Key("npu_cores", [0, 1, 2], int_list((0, 1, 2)),
        "RK3588 NPU cores an rknn order runs on (its core mask); default all three for one model."),
    Key("top_k", 5, integer(1, 100), "Classes reported per result for classifiers. Safe: set-config."),
    Key("telemetry_period_s", 5.0, number(0.1, 86400.0),
        "Seconds between telemetry messages. Safe: set-config."),
    Key("telemetry_window", 1000, integer(10, 1_000_000),
        "Latency percentiles (p50/p95/p99, mean) are computed over the last N frames."),
    Key("results_max_rate_hz", 2.0, number(0.0, 1000.0),
        "At most this many result messages per second (the latest result each time); 0 disables "
        "results. Safe: set-config."),
    Key("offline_buffer", 1000, integer(0, 1_000_000),
        "Telemetry messages kept while the broker is unreachable (oldest dropped first), "
        "delivered in order after reconnecting."),
    Key("sysfs_root", "/", path("dir", optional=False),
        "Root under which /sys is read for temperatures and power (tests point it at a fake tree)."),
    Key("log_level", "info", choice("debug", "info", "warning", "error"), "Log verbosity (stderr/journal)."),
    Key("max_consecutive_errors", 50, integer(1, 1_000_000),
        "Exit non-zero (systemd restarts the agent) after this many failed frames in a row."),

    Key("broker.host", "localhost", string(False), "MQTT broker host name or address."),
    Key("broker.port", 1883, integer(1, 65535), "MQTT broker port (8883 is usual with TLS)."),
    Key("broker.protocol", "auto", choice("auto", "5", "3.1.1"),
        "MQTT version: auto tries 5 and falls back to 3.1.1 when the broker refuses it."),
    Key("broker.client_id", "", string(True, re.compile(r"^[A-Za-z0-9_.:-]{1,64}$"), "1-64 of A-Z a-z 0-9 _ . : -"),
        "MQTT client id. Default: tandoor-<device_id>."),
    Key("broker.keepalive_s", 30, integer(5, 3600),
        "MQTT keepalive; the broker publishes the will after 1.5x this without traffic."),
    Key("broker.topic_prefix", "tandoor", string(False, re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$"),
                                                   "topic levels without wildcards or empty levels"),
        "First topic level(s): topics are <topic_prefix>/<device_id>/<name>."),
    Key("broker.username", "", string(), "MQTT user name (empty: no authentication)."),
    Key("broker.password", "", string(), "MQTT password (prefer password_file). Never echoed by get-config."),
    Key("broker.password_file", "", path("file"),
        "File whose first line is the MQTT password (e.g. mode 0600, owned by the tandoor user)."),
    Key("broker.reconnect_min_s", 1.0, number(0.1, 3600.0), "First reconnect delay; doubles per failure."),
    Key("broker.reconnect_max_s", 30.0, number(0.1, 3600.0), "Longest reconnect delay."),
    Key("broker.tls.enabled", False, boolean, "Use TLS (implied by ca)."),
    Key("broker.tls.ca", "", path("file"), "CA bundle (PEM) that signed the broker's certificate; empty: system CAs."),
    Key("broker.tls.cert", "", path("file"), "Client certificate (PEM) for mutual TLS; needs broker.tls.key."),
    Key("broker.tls.key", "", path("file"), "Client private key (PEM) for mutual TLS; needs broker.tls.cert."),
    Key("broker.tls.insecure", False, boolean, "Skip the broker host name check (testing only)."),

    Key("camera.source", "synthetic", camera_source,
        "Frame source: synthetic[:WxH[@FPS]][:bars|noise] | file:VIDEO | images:DIR | v4l2:/dev/videoN | "
        "usb:N | csi:N (Jetson CSI) | gst:PIPELINE (needs an OpenCV with GStreamer)."),
    Key("camera.width", 0, integer(0, 8192), "Requested capture width for v4l2/synthetic; 0: the source's own."),
    Key("camera.height", 0, integer(0, 8192), "Requested capture height for v4l2/synthetic; 0: the source's own."),
    Key("camera.fps", 0.0, number(0.0, 1000.0),
        "Requested frame rate; 0: the source's own (a video file's rate, synthetic 30, image folder lock-step)."),
    Key("camera.realtime", True, boolean,
        "Video files: deliver at the frame rate like a camera (frames dropped when the model is slower); "
        "false: every frame, lock-step, as fast as the loop runs (benchmarks)."),
    Key("camera.loop", True, boolean, "Start a video file or image folder over at its end (false: the agent stops there)."),
    Key("camera.reconnect_min_s", 1.0, number(0.05, 3600.0),
        "A source that fails while running (unplugged, removed) is reopened after this long, the delay "
        "doubling per failed attempt; the agent keeps running meanwhile (status: camera-lost)."),
    Key("camera.reconnect_max_s", 30.0, number(0.05, 3600.0), "Longest delay between two attempts to reopen a lost source."),

    # detectors: the bundle's decoder and thresholds (tandoor compile --decoder/--conf/...), overridden here
    Key("postprocess.decoder", "auto", choice("auto", *media.DECODERS),
        "Decoder of the model's outputs; auto: the bundle's (tandoor compile --decoder), else classifier or raw."),
    Key("postprocess.conf", -1.0, number(-1.0, 1.0), "Score threshold 0..1; -1: the bundle's, else the decoder's default."),
    Key("postprocess.iou", -1.0, number(-1.0, 1.0), "NMS IoU threshold 0..1; -1: the bundle's, else the decoder's default."),
    Key("postprocess.max_det", 0, integer(0, 10000), "Detections per frame at most; 0: the bundle's, else the decoder's default."),
    Key("snapshot.period_s", 10.0, number(0.0, 86400.0),
        "Seconds between retained JPEG snapshots (the frame with its boxes) on <base>/snapshot; 0: only on "
        "request (cmd snapshot)."),
    Key("snapshot.quality", 80, integer(10, 100), "JPEG quality of the snapshots."),
    Key("capture_dir", "", path(None),
        "Where the capture command saves camera frames for calibration; empty: <slot_dir>/captures."),

    # an update's two steps that run the new model's library, each with a deadline (update/deadlines.py)
    Key("update.health_timeout_s", 0.0, number(0.0, 3600.0),
        "Seconds the health gate's check may run before it fails (a hung library); 0: 10x the load time "
        "measured on this device, 60..300 s."),
    Key("update.swap_timeout_s", 0.0, number(0.0, 3600.0),
        "Seconds the hot swap may take to load the committed model before the commit is rolled back "
        "(swap_timeout; the previous model serves on); 0: 10x the load time its gate measured, at least 15 s."),
)
KEY_BY_NAME = {k.name: k for k in KEYS}
TABLES = sorted({k.name.rsplit(".", 1)[0] for k in KEYS if "." in k.name})


# ---------------------------------------------------------------------------------- the config
class Config:
    """Effective configuration: ``cfg["broker.port"]`` or ``cfg.get(...)``; ``path`` is the file."""

    def __init__(self, values: dict[str, Any], path: Path | None) -> None:
        self._v = values
        self.path = path

    def __getitem__(self, key: str) -> Any:
        return self._v[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._v.get(key, default)

    def as_dict(self, redact: bool = True) -> dict[str, Any]:
        """Nested dict like the TOML file, secrets replaced by "***" (when set)."""
        out: dict[str, Any] = {}
        for name, v in self._v.items():
            if redact and name in SECRET_KEYS and v:
                v = "***"
            node = out
            *parents, leaf = name.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = copy.deepcopy(v)
        return out

    def set_safe(self, key: str, value: Any) -> Any:
        """Change one run-time-safe key (set-config); returns the checked value."""
        if key not in SAFE_KEYS:
            if key in KEY_BY_NAME:
                raise ConfigError(f"{key}: not changeable at run time (safe keys: {', '.join(SAFE_KEYS)})")
            raise ConfigError(f"{key}: unknown key (safe keys: {', '.join(SAFE_KEYS)})")
        try:
            v = KEY_BY_NAME[key].check(value, Context(Path("."), False))
        except Bad as e:
            raise ConfigError(f"{key}: {e}") from None
        self._v[key] = v
        return v

    def set_safe_many(self, changes: dict[str, Any]) -> dict[str, Any]:
        """set-config: every key checked before any is changed; returns the checked values."""
        if not changes:
            raise ConfigError(f"set-config needs at least one key; safe keys: {', '.join(SAFE_KEYS)}")
        saved = dict(self._v)
        try:
            return {k: self.set_safe(k, v) for k, v in changes.items()}
        except ConfigError:
            self._v = saved
            raise

    # -- derived values
    @property
    def client_id(self) -> str:
        return self["broker.client_id"] or f"tandoor-{self['device_id']}"[:64]

    @property
    def topic_base(self) -> str:
        return protocol.base(self["broker.topic_prefix"], self["device_id"])

    def password(self) -> str | None:
        if self["broker.password_file"]:
            try:
                text = Path(self["broker.password_file"]).read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"broker.password_file: cannot read it ({e.strerror or e})") from None
            return text.splitlines()[0] if text else ""
        return self["broker.password"] or None

    @property
    def tls(self) -> bool:
        return bool(self["broker.tls.enabled"] or self["broker.tls.ca"])


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in table.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and name in TABLES:
            out.update(_flatten(v, name + "."))
        elif isinstance(v, dict) and any(t.startswith(name + ".") for t in TABLES):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _suggest(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(KEY_BY_NAME) + TABLES, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def from_dict(data: dict[str, Any], base: Path = Path("."), check_files: bool = True,
              path_: Path | None = None) -> Config:
    ctx = Context(base, check_files)
    flat = _flatten(data)
    for name, v in flat.items():
        if name in TABLES:
            raise ConfigError(f"{name}: must be a table ([{name}]), got {_type_name(v)} {v!r}")
        if name not in KEY_BY_NAME:
            raise ConfigError(f"{name}: unknown key{_suggest(name)}")
    values: dict[str, Any] = {}
    for key in KEYS:
        if key.name in flat:
            try:
                values[key.name] = key.check(flat[key.name], ctx)
            except Bad as e:
                raise ConfigError(f"{key.name}: {e}") from None
        else:
            d = key.default() if callable(key.default) else copy.deepcopy(key.default)
            values[key.name] = d
    # keys that only make sense together
    if values["broker.password"] and values["broker.password_file"]:
        raise ConfigError("broker.password_file: set either broker.password or broker.password_file, not both")
    if (values["broker.password"] or values["broker.password_file"]) and not values["broker.username"]:
        raise ConfigError("broker.username: a password is set but no user name")
    if bool(values["broker.tls.cert"]) != bool(values["broker.tls.key"]):
        missing = "broker.tls.key" if values["broker.tls.cert"] else "broker.tls.cert"
        raise ConfigError(f"{missing}: broker.tls.cert and broker.tls.key go together")
    for t in ("broker", "camera"):
        lo, hi = values[f"{t}.reconnect_min_s"], values[f"{t}.reconnect_max_s"]
        if lo > hi:
            raise ConfigError(f"{t}.reconnect_max_s: must be >= {t}.reconnect_min_s ({hi:g} < {lo:g})")
    return Config(values, path_)


def load(path: str | os.PathLike, check_files: bool = True) -> Config:
    """Read and check a config file; ConfigError (one line, key named) on any problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {p}: cannot read it ({e.strerror or e})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p}: not UTF-8 ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: not valid TOML ({e})") from None
    return from_dict(data, base=p.resolve().parent, check_files=check_files, path_=p)


# --------------------------------------------------------------------------- the bundle to run
def committed_bundle(slot_dir: str | os.PathLike) -> tuple[Path, str | None]:
    """The bundle of the committed slot: ``<slot_dir>/state.json`` is
    ``{"primary": "a", "slots": {"a": {"bundle": "a/model.hmod"}, ...}}`` (bundle paths relative to
    slot_dir). Without state.json: ``<slot_dir>/current.hmod``. Returns (path, slot name or None).

    The update machinery owns state.json; this reader only needs these two fields."""
    d = Path(slot_dir)
    state_path = d / "state.json"
    if not state_path.exists():
        fallback = d / "current.hmod"
        if fallback.exists():
            return fallback, None
        raise ConfigError(f"slot_dir: {d} has no state.json (and no current.hmod); "
                          f"install a bundle there or set bundle = PATH")
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        slot = state["primary"]
        rel = state["slots"][slot]["bundle"]
        if not isinstance(slot, str) or not isinstance(rel, str) or not rel:
            raise TypeError("primary/bundle must be strings")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"slot_dir: {state_path} is unreadable or lacks primary/slots.<primary>.bundle "
                          f"({type(e).__name__}: {e})") from None
    p = Path(rel)
    return (p if p.is_absolute() else d / p), slot


def decoder_overrides(cfg: Config) -> dict:
    """The postprocess.* keys that override the bundle's decoder options (the others are unset)."""
    out = {k: cfg[f"postprocess.{k}"] for k in ("conf", "iou") if cfg[f"postprocess.{k}"] >= 0}
    if cfg["postprocess.max_det"] > 0:
        out["max_det"] = cfg["postprocess.max_det"]
    return out


def resolve_bundle(cfg: Config) -> tuple[Path, str | None]:
    """(bundle path, slot name or None) from ``bundle`` or the slot directory."""
    if cfg["bundle"]:
        return Path(cfg["bundle"]), None
    return committed_bundle(cfg["slot_dir"])
