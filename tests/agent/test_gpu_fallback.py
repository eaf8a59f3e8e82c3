"""A bundle with a GPU part on this host, which has no NVIDIA GPU: it runs its CPU library with
outputs within the bundle's promise against onnxruntime, and says why the GPU part did not run, in
run --json, verify and the agent's retained status (agent/run/gpu.py), as the NPU's orders do."""

from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import pytest

from support.agents import (START_TIMEOUT, AgentProcess, broker, running_sha, seed_slots, wd,  # noqa: F401
                            write_config)
from support.bundle_edit import rewrite, sha, version
from support.cli import run_cli
from support.gpu import fake_driver, gpu_bundle
from support.mosquitto import Recorder, available
from tandoor_agent.run import gpu as agent_gpu
from tandoor_contract import agreement, hmod

NO_DRIVER = "unavailable (no NVIDIA driver here: libcuda.so.1 not found)"


def _ran_within_promise(bundle, model, tmp_path, env=None) -> dict:
    x = np.random.default_rng(5).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    res = run_cli("tandoor-agent", "run", str(bundle), "--input", str(tmp_path / "x.npy"), "--json",
                  "--save-outputs", str(tmp_path / "out"), check=True, env=env)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = [np.load(tmp_path / "out" / "output_0.npy")]
    out = json.loads(res.stdout)
    with hmod.open_bundle(bundle) as b:
        verdict = agreement.compare(got, want, b.manifest, agreement.path_of(out["subgraphs"]))
    assert verdict.ok, verdict.reason
    return out


def test_a_jetson_orin_bundle_runs_here_on_the_cpu_within_promise_and_says_why(bundles_dir, tmp_path):
    bundle, model = gpu_bundle(bundles_dir, ("jetson-orin",))
    out = _ran_within_promise(bundle, model, tmp_path)
    assert out["gpu"] == "unavailable (the bundle's GPU part is for jetson-orin (aarch64), not this x86_64 machine)"
    assert {s["executor"] for s in out["subgraphs"]} == {"onnxruntime"}     # the delegated orders, as here without a GPU


def test_a_cuda_sm90_bundle_without_a_driver_runs_its_cpu_lib_and_verify_says_why(bundles_dir, tmp_path):
    bundle, model = gpu_bundle(bundles_dir)
    assert _ran_within_promise(bundle, model, tmp_path)["gpu"] == NO_DRIVER
    off = _ran_within_promise(bundle, model, tmp_path, env={**os.environ, "TANDOOR_GPU": "0"})
    assert off["gpu"] == "unavailable (turned off (TANDOOR_GPU=0))"
    res = run_cli("tandoor", "verify", str(bundle), "--reference", str(model), "--random", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"gpu: {NO_DRIVER}" in res.stdout and "PASS" in res.stdout


@pytest.mark.parametrize("kw, why", [
    ({"cc": (7, 2)}, "the GPU Fake Orin is sm_72; the bundle has cubins for sm_87"),
    ({"version": 12060}, "the driver serves CUDA 12.6; the bundle's GPU part needs CUDA 13 (JetPack 7.2 on a Jetson)"),
    ({"devices": 0}, "the NVIDIA driver sees no GPU"),
    ({"init_result": 100}, "the NVIDIA driver's cuInit failed (no GPU visible to this process?)"),
])
def test_the_probe_names_what_a_device_lacks(tmp_path, monkeypatch, kw, why):
    """NVIDIA's driver cannot exist here: a stand-in answers the calls the probe makes."""
    monkeypatch.setattr(agent_gpu, "driver_names", (fake_driver(tmp_path, "cuda", **kw),))
    entry = {"version": 1, "kind": "cuda", "libs": {"sm_87": "gpu/jetson-orin.sm_87.so.z"}}
    assert agent_gpu.probe(entry).why == why
    assert agent_gpu.probe({**entry, "version": 2}).why.endswith("this agent reads 1: update the agent")


def test_a_delegated_order_gives_the_same_outputs_when_its_tensors_cross_by_copy(bundles_dir):
    """With the VM on the GPU the orders' tensors are copied to host memory and back at each call;
    the same path on CPU tensors computes what the zero-copy one does."""
    from tandoor_agent.run.runtime import HybridModule

    bundle, _ = gpu_bundle(bundles_dir)
    with hmod.open_bundle(bundle) as b:
        module = HybridModule(b)
        try:
            ins = b.golden()[0][0]
            direct = module.run(ins)
            module._copy[0] = True
            copied = module.run(ins)
            assert module.describe()[0]["zero_copy"] is False and module.describe()[0]["calls"] == 2
        finally:
            module.close()
    np.testing.assert_array_equal(direct[0], copied[0])


@pytest.mark.skipif(not available(), reason="mosquitto is not installed (apt install mosquitto)")
def test_the_agents_retained_status_says_why_the_gpu_part_did_not_run(wd, broker, bundles_dir):
    bundle, _ = gpu_bundle(bundles_dir)
    hmod.generate_keypair(wd / "k.pem", wd / "k.pub.pem")
    signed = wd / "signed.hmod"
    rewrite(bundle, signed, version("1"), wd / "k.pem")
    slots = seed_slots(wd / "g1-slots", signed, wd / "k.pub.pem")
    cfg = write_config(wd / "g1.toml", device_id="g1", slot_dir=str(slots), trusted_keys=[str(wd / "k.pub.pem")],
                       telemetry_period_s=1.0, broker={"port": broker.port, "reconnect_min_s": 0.5,
                                                       "reconnect_max_s": 2.0},
                       camera={"source": "synthetic:32x32@10"})
    rec = Recorder(broker.port, "tandoor/#").start()
    agent = AgentProcess(["--config", str(cfg)], wd / "g1.log")
    try:
        assert running_sha(rec, "g1", sha(signed), START_TIMEOUT)["gpu"] == NO_DRIVER
    finally:
        agent.stop()
        rec.stop()
    assert (wd / "g1.log").read_text().count("gpu: unavailable") == 1
