"""An NPU bundle (compile --npu, the real RKNN toolkit) deployed over MQTT to a host agent, which has
no RKNNLite and no librknnrt.so: the update commits through the health gate on the rknn order's ONNX
rendering, and the retained status names the NPU as unavailable and why (docs/npu.md)."""

from __future__ import annotations

import numpy as np
import pytest

from support.agents import (START_TIMEOUT, AgentProcess, acks, assert_committed_state, broker, deploy,  # noqa: F401
                            running_sha, seed_slots, wd, write_config)
from support.bundle_edit import rewrite, sha, version
from support.mosquitto import Recorder, available
from support.npu import npu_cnn, npu_frames
from tandoor_compiler.pipeline import compile_model
from tandoor_contract import hmod

pytestmark = pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")


def test_an_npu_bundle_commits_through_the_health_gate_on_its_fallback_and_status_says_why(wd, broker):
    hmod.generate_keypair(wd / "k.pem", wd / "k.pub.pem")
    base = wd / "npu.hmod"
    compile_model(npu_cnn(wd / "npu_cls.onnx"), base, targets=["rk3588"], npu=True, npu_dtype="int8",
                  npu_samples=npu_frames(), measure="off", key=wd / "k.pem")
    with hmod.open_bundle(base) as b:
        assert [g["inputs"] for g in b.manifest["golden"]] == [["golden/input_0_0.npy"], ["golden/input_1_0.npy"]]
    v1, v2 = (rewrite(base, wd / f"npu-v{i}.hmod", version(str(i)), wd / "k.pem") for i in (1, 2))
    slots = seed_slots(wd / "n1-slots", v1, wd / "k.pub.pem")
    cfg = write_config(wd / "n1.toml", device_id="n1", slot_dir=str(slots), trusted_keys=[str(wd / "k.pub.pem")],
                       delegate="auto", npu_cores=[0, 1, 2], telemetry_period_s=1.0, results_max_rate_hz=5.0,
                       broker={"port": broker.port, "reconnect_min_s": 0.5, "reconnect_max_s": 2.0},
                       camera={"source": "synthetic:64x48@20"})
    rec = Recorder(broker.port, "tandoor/#").start()
    agent = AgentProcess(["--config", str(cfg)], wd / "n1.log")
    try:
        st = running_sha(rec, "n1", sha(v1), START_TIMEOUT)
        assert st["npu"].startswith("unavailable (rknn-toolkit-lite2 not importable"), st
        assert [e["executor"] for e in st["executors"]] == ["onnxruntime"]
        res = deploy(broker.port, v2, ["n1"], job_id="npu-v2")
        assert res["devices"]["n1"]["state"] == "committed", res
        assert "health gate passed" in res["devices"]["n1"]["reason"]
        st = running_sha(rec, "n1", sha(v2))
        assert "\n" not in st["npu"]
        assert st["npu"].startswith("unavailable (rknn-toolkit-lite2 not importable")
        assert "committed" in [a["state"] for a in acks(rec, "n1", "npu-v2")]
        assert_committed_state(slots, sha(v2))
        assert agent.output().count("npu: unavailable") >= 1
    finally:
        agent.stop()
        rec.stop()
