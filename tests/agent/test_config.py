"""The agent's TOML config (agent/serve/config.py): every key documented, unknown keys and bad values
refused with the key named, defaults, secrets redacted, run-time safe keys, the slot reader; and
the real `tandoor-agent` refusing a bad file in one line before anything heavy is imported."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from support.bundle_edit import stderr_imports
from support.cli import BIN, ROOT
from tandoor_agent.serve import config
from tandoor_agent.serve.config import ConfigError

EXAMPLE = ROOT / "systemd" / "agent.toml.example"
PROTOCOL = ROOT / "docs" / "protocol.md"
HEAVY = ("tvm", "tvm_ffi", "onnxruntime", "pyarmnn", "paho", "cv2", "torch")
# the console script; TANDOOR_AGENT overrides it (e.g. "python /path/to/other/cli.py")
AGENT = os.environ.get("TANDOOR_AGENT", "").split() or [str(BIN / "tandoor-agent")]


def load_text(tmp_path: Path, text: str, check_files: bool = True) -> config.Config:
    p = tmp_path / "agent.toml"
    p.write_text(text)
    return config.load(p, check_files=check_files)


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_text(tmp_path, text)
    msg = str(e.value)
    assert "\n" not in msg
    assert e.value.exit_code == 2
    return msg


# --- documentation -------------------------------------------------------------------------------

def test_every_key_is_documented_in_the_example_and_the_protocol_doc():
    example = EXAMPLE.read_text()
    doc = PROTOCOL.read_text()
    for key in config.KEYS:
        table, _, leaf = key.name.rpartition(".")
        # in the example: under its [table], as "leaf =" (commented out when it shows the default)
        section = example if not table else example.split(f"[{table}]\n", 1)[1]
        section = re.split(r"^\[", section, flags=re.M)[0] if table else example.split("\n[", 1)[0]
        assert re.search(rf"^#? ?{re.escape(leaf)} = ", section, re.M), f"{key.name} not in {EXAMPLE.name}"
        assert f"`{key.name}`" in doc, f"{key.name} not in docs/protocol.md"


def test_example_parses_with_every_commented_key_enabled(tmp_path):
    text = EXAMPLE.read_text()
    cfg = load_text(tmp_path, text, check_files=False)
    assert cfg["device_id"] == "rk3588-01" and cfg["broker.host"] == "mqtt.example.net"
    # uncomment every "# key = value" line: still valid, still only known keys
    enabled = re.sub(r"^# ([a-z_]+ = .*)$", r"\1", text, flags=re.M)
    assert enabled.count("\n# ") < text.count("\n# ")
    enabled = enabled.replace('bundle = ""', 'bundle = "x.hmod"')
    cfg = load_text(tmp_path, enabled, check_files=False)
    for key in config.KEYS:  # the commented values are the defaults
        if key.name not in ("device_id", "broker.host", "camera.source", "trusted_keys", "bundle"):
            default = key.default() if callable(key.default) else key.default
            got = cfg[key.name]
            assert got == default or (isinstance(default, str) and default == "" and got == ""), key.name


# --- defaults and derived values ----------------------------------------------------------------

def test_defaults(tmp_path):
    cfg = load_text(tmp_path, "")
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", cfg["device_id"])
    assert cfg["device_id"].split(".")[0] in re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())
    assert cfg["slot_dir"] == "/var/lib/tandoor" and cfg["bundle"] == "" and cfg["trusted_keys"] == []
    assert cfg["broker.host"] == "localhost" and cfg["broker.port"] == 1883 and cfg["broker.protocol"] == "auto"
    assert cfg.client_id == f"tandoor-{cfg['device_id']}"[:64]
    assert cfg.topic_base == f"tandoor/{cfg['device_id']}"
    assert cfg["camera.source"] == "synthetic" and cfg["telemetry_period_s"] == 5.0
    assert cfg.password() is None and not cfg.tls


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "k.pub.pem").write_text("x")
    (tmp_path / "m.hmod").write_bytes(b"x")
    (tmp_path / "clip.mp4").write_bytes(b"x")
    cfg = load_text(tmp_path, 'bundle = "m.hmod"\ntrusted_keys = ["keys/k.pub.pem"]\n'
                              '[camera]\nsource = "file:clip.mp4"\n')
    assert cfg["bundle"] == str(tmp_path / "m.hmod")
    assert cfg["trusted_keys"] == [str(tmp_path / "keys" / "k.pub.pem")]
    assert cfg["camera.source"] == f"file:{tmp_path / 'clip.mp4'}"
    assert config.resolve_bundle(cfg) == (tmp_path / "m.hmod", None)


def test_password_file_and_tls(tmp_path):
    (tmp_path / "pw").write_text("s3cret\nignored\n")
    for name in ("ca.pem", "c.pem", "k.pem"):
        (tmp_path / name).write_text("x")
    cfg = load_text(tmp_path, '[broker]\nusername = "dev"\npassword_file = "pw"\n'
                              '[broker.tls]\nca = "ca.pem"\ncert = "c.pem"\nkey = "k.pem"\n')
    assert cfg.password() == "s3cret" and cfg.tls
    assert cfg.as_dict()["broker"]["password_file"] == str(tmp_path / "pw")


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, key, why", [
    ('devise_id = "x"', "devise_id", "unknown key (did you mean device_id?)"),
    ('[broker]\nhots = "x"', "broker.hots", "unknown key (did you mean broker.host?)"),
    ('[brokr]\nhost = "x"', "brokr", "unknown key (did you mean broker?)"),
    ('[broker.tls]\nca_file = "x"', "broker.tls.ca_file", "unknown key"),
    ('broker = "localhost"', "broker", "must be a table"),
    ('[broker]\nport = "1883"', "broker.port", "must be an integer in 1..65535, got a string"),
    ('[broker]\nport = 70000', "broker.port", "must be in 1..65535, got 70000"),
    ('[broker]\nport = true', "broker.port", "must be an integer"),
    ('[broker]\nprotocol = "4"', "broker.protocol", "must be one of auto, 5, 3.1.1"),
    ('[broker]\ntopic_prefix = "a/#"', "broker.topic_prefix", "topic levels without wildcards"),
    ('[broker]\nkeepalive_s = 1', "broker.keepalive_s", "must be in 5..3600"),
    ('[broker]\nreconnect_min_s = 10\nreconnect_max_s = 2', "broker.reconnect_max_s", "must be >= broker.reconnect_min_s"),
    ('[broker]\npassword = "x"', "broker.username", "a password is set but no user name"),
    ('[broker]\nusername = "u"\npassword = "x"\npassword_file = "/etc/hostname"', "broker.password_file", "not both"),
    ('[broker.tls]\ncert = "/etc/hostname"', "broker.tls.key", "go together"),
    ('[broker.tls]\nca = "/nonexistent/ca.pem"', "broker.tls.ca", "no such file: /nonexistent/ca.pem"),
    ('device_id = "a/b"', "device_id", "must be 1-64 of"),
    ('device_id = ""', "device_id", "must not be empty"),
    ('telemetry_period_s = 0', "telemetry_period_s", "must be >= 0.1"),
    ('telemetry_period_s = "5"', "telemetry_period_s", "must be a number"),
    ('telemetry_period_s = nan', "telemetry_period_s", "must be >= 0.1"),
    ('results_max_rate_hz = -1', "results_max_rate_hz", "must be >= 0"),
    ('top_k = 0', "top_k", "must be in 1..100"),
    ('offline_buffer = 1.5', "offline_buffer", "must be an integer"),
    ('delegate = "gpu"', "delegate", "must be one of auto, armnn, onnxruntime, tvm"),
    ('armnn_backends = ["NPU"]', "armnn_backends", "must be a non-empty list of CpuAcc, GpuAcc, CpuRef"),
    ('trusted_keys = "/etc/k.pem"', "trusted_keys", "must be a list of paths"),
    ('trusted_keys = ["/nonexistent/k.pub.pem"]', "trusted_keys", "[0] no such file"),
    ('bundle = "/nonexistent/m.hmod"', "bundle", "no such file"),
    ('sysfs_root = "/nonexistent"', "sysfs_root", "no such directory"),
    ('log_level = "loud"', "log_level", "must be one of debug, info, warning, error"),
    ('[camera]\nsource = "webcam:0"', "camera.source", "unknown kind 'webcam'"),
    ('[camera]\nsource = "file:/nonexistent.mp4"', "camera.source", "no such file"),
    ('[camera]\nsource = 0', "camera.source", "must be a camera spec string"),
    ('[camera]\nfps = -5', "camera.fps", "must be >= 0"),
    ('[camera]\nloop = "yes"', "camera.loop", "must be true or false"),
])
def test_bad_values_are_refused_with_the_key_named(tmp_path, text, key, why):
    msg = refused(tmp_path, text)
    assert msg.startswith(f"{key}: "), msg
    assert why in msg, msg


def test_not_toml_and_missing_file(tmp_path):
    msg = refused(tmp_path, "device_id = \n")
    assert "not valid TOML" in msg and "line 1" in msg
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")


# --- run-time changes, redaction -----------------------------------------------------------------

def test_set_config_only_safe_keys_all_or_nothing(tmp_path):
    cfg = load_text(tmp_path, "top_k = 3\n")
    assert cfg.set_safe_many({"top_k": 7, "telemetry_period_s": 2}) == {"top_k": 7, "telemetry_period_s": 2.0}
    assert cfg["top_k"] == 7 and cfg["telemetry_period_s"] == 2.0
    with pytest.raises(ConfigError, match=r"^broker\.host: not changeable at run time"):
        cfg.set_safe_many({"top_k": 9, "broker.host": "evil"})
    with pytest.raises(ConfigError, match=r"^results_max_rate_hz: must be >= 0"):
        cfg.set_safe_many({"top_k": 9, "results_max_rate_hz": -1})
    with pytest.raises(ConfigError, match=r"^nope: unknown key"):
        cfg.set_safe_many({"nope": 1})
    assert cfg["top_k"] == 7 and cfg["broker.host"] == "localhost"  # nothing changed


def test_secrets_are_redacted(tmp_path):
    cfg = load_text(tmp_path, '[broker]\nusername = "dev"\npassword = "hunter2"\n')
    d = cfg.as_dict()
    assert d["broker"]["password"] == "***" and d["broker"]["username"] == "dev"
    assert "hunter2" not in json.dumps(d)
    assert cfg.as_dict(redact=False)["broker"]["password"] == "hunter2"


# --- the committed slot ----------------------------------------------------------------------------

def test_committed_slot_bundle(tmp_path):
    slots = tmp_path / "slots"
    (slots / "b").mkdir(parents=True)
    (slots / "state.json").write_text(json.dumps({"primary": "b", "slots": {"a": {"bundle": "a/model.hmod"},
                                                                           "b": {"bundle": "b/model.hmod"}}}))
    assert config.committed_bundle(slots) == (slots / "b" / "model.hmod", "b")
    cfg = load_text(tmp_path, f'slot_dir = "{slots}"\n')
    assert config.resolve_bundle(cfg) == (slots / "b" / "model.hmod", "b")
    (slots / "state.json").write_text('{"primary": "c", "slots": {}}')
    with pytest.raises(ConfigError, match=r"^slot_dir: .*state.json .*lacks primary"):
        config.committed_bundle(slots)
    (slots / "state.json").unlink()
    with pytest.raises(ConfigError, match=r"^slot_dir: .* has no state.json"):
        config.committed_bundle(slots)
    (slots / "current.hmod").write_bytes(b"x")
    assert config.committed_bundle(slots) == (slots / "current.hmod", None)


# --- the real command ------------------------------------------------------------------------------

def _agent(*args, env=None):
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=120, env=env)


def test_agent_refuses_a_bad_config_in_one_line_before_importing_anything_heavy(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('device_id = "cam-1"\n[broker]\nport = 99999\n')
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    for args in (["--config", str(bad)], ["serve", "--config", str(bad)]):
        res = _agent(*args, env=env)
        imported, other = stderr_imports(res.stderr)
        assert res.returncode == 2, res.stderr[-2000:]
        assert other == ["tandoor-agent: error: broker.port: must be in 1..65535, got 99999"], other
        assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
        assert res.stdout == ""


def test_agent_check_accepts_a_good_config(tmp_path):
    good = tmp_path / "agent.toml"
    good.write_text('device_id = "cam-1"\n[camera]\nsource = "synthetic:64x48@5"\n')
    res = _agent("serve", "--config", str(good), "--check")
    assert res.returncode == 0 and res.stdout.strip() == f"{good}: ok", res.stderr
    res = _agent("--config", str(tmp_path / "missing.toml"))
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_every_command_in_the_table_is_documented_and_dispatched():
    """commands.COMMANDS is the agent's command list: each has its row in docs/protocol.md's
    command table and its handler on the service; the table has no row the agent lacks."""
    import re

    from tandoor_agent.serve import commands
    from tandoor_agent.serve.service import Service

    doc = PROTOCOL.read_text()
    table = doc[doc.index("| cmd | args | result |"):].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `([a-z-]+)` \| ", table, re.M))
    assert documented == set(commands.COMMANDS), documented ^ set(commands.COMMANDS)
    for c in commands.COMMANDS.values():
        assert callable(getattr(Service, c.handler, None)), c
    assert commands.unknown("format-disk").startswith("unknown command 'format-disk'; commands: ping, ")
