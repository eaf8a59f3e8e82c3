"""The health gate on real bundles: a good bundle passes; tampered golden outputs (re-signed, so
only the self-test can catch them) fail with the error and the tolerance; a latency budget too
small fails with the p95; inference errors and non-finite outputs are counted; the check in a
child process reports crashes and hangs; gate() judges a SlotStore trial and the job's settle() commits or rolls it back."""

from __future__ import annotations

import io
import json
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support.bundle_edit import rewrite, npy
from support.cli import compiled
from tandoor_contract import hmod
from tandoor_agent.update.health import HealthReport, gate, health_check, health_check_isolated
from tandoor_agent.run.runtime import HybridModule
from tandoor_agent.update.jobs import settle
from tandoor_agent.update.slots import SlotStore, TransitionError
from tandoor_zoo import models as zoo

DELEGATE = "onnxruntime"  # the fastest to build here; the gate's logic does not depend on it


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("healthkeys")
    for k in ("k1", "k2"):
        hmod.generate_keypair(d / f"{k}.pem", d / f"{k}.pub.pem")
    return {"k1": d / "k1.pem", "k1.pub": d / "k1.pub.pem", "k2.pub": d / "k2.pub.pem"}


@pytest.fixture(scope="module")
def B(bundles_dir, keys, tmp_path_factory) -> dict[str, Path]:
    # --policy all: the cost model keeps a model this small in TVM, and the gate's report of the
    # executor that ran the delegated subgraph is part of what is checked
    base = compiled("dynamic_batch", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32",
                    "--policy", "all")
    d = tmp_path_factory.mktemp("healthbundles")

    def version(v):
        def edit(man, members):
            man["model"]["version"] = v
        return edit

    def tamper_golden(man, members):
        name = man["golden"][0]["outputs"][0]
        out = np.load(io.BytesIO(members[name]), allow_pickle=False)
        out = out.copy()
        out.flat[3] += 0.31
        members[name] = npy(out)
        man["model"]["version"] = "bad-golden"

    return {
        "good": rewrite(base, d / "good.hmod", version("1"), keys["k1"]),
        "good2": rewrite(base, d / "good2.hmod", version("2"), keys["k1"]),
        "bad_golden": rewrite(base, d / "bad_golden.hmod", tamper_golden, keys["k1"]),
    }


# --- in process ------------------------------------------------------------------------------

def test_a_good_bundle_passes(B, keys):
    rep = health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, frames=12)
    assert rep.ok and rep.reason is None, rep
    assert rep.golden_ok and rep.golden_pairs == 2
    assert rep.golden_max_abs_err is not None and rep.golden_max_abs_err <= rep.atol == 1e-3
    assert rep.frames == 12 and rep.errors == 0
    assert rep.p95_ms is not None and 0 < rep.median_ms <= rep.p95_ms
    assert rep.model == {"name": "dynamic_batch", "version": "1"}
    assert rep.executors and rep.executors[0]["executor"] == DELEGATE
    assert rep.summary().startswith("healthy: golden max abs err")
    json.dumps(rep.to_dict(), allow_nan=False)
    assert HealthReport.from_dict(rep.to_dict()) == rep


def test_tampered_golden_outputs_fail_the_self_test(B, keys):
    # the bundle is signed and every hash matches: only running it shows the outputs are wrong
    with hmod.open_bundle(B["bad_golden"], [keys["k1.pub"]]) as b:
        assert b.verified
    rep = health_check(B["bad_golden"], [keys["k1.pub"]], delegate=DELEGATE, frames=4)
    assert not rep.ok and rep.golden_ok is False
    # the contract's rule (tandoor_contract.agreement): the output, the path, its tolerance and why
    assert re.match(r"golden self-test failed: pair 0: output \S+ on the onnxruntime path: max abs err 0\.31\d* "
                    r"exceeds its tolerance \(atol 0\.001, rtol 0\.001: fp32 upstream, .*element 3: ", rep.reason), rep.reason
    assert rep.path == "onnxruntime"
    assert rep.golden_max_abs_err == pytest.approx(0.31, abs=1e-3)
    assert rep.frames == 0  # no point timing a model that answers wrong


def test_a_golden_output_of_another_shape_fails_in_one_line_with_a_json_report(B, keys, tmp_path):
    def longer(man, members):
        name = man["golden"][1]["outputs"][0]
        out = np.load(io.BytesIO(members[name]), allow_pickle=False)
        members[name] = npy(np.concatenate([out.reshape(-1), [0.5]]).astype(out.dtype))
    bundle = rewrite(B["good"], tmp_path / "longer.hmod", longer, keys["k1"])
    rep = health_check(bundle, [keys["k1.pub"]], delegate=DELEGATE, frames=0)
    assert not rep.ok and re.fullmatch(r"golden self-test failed: pair 1: output \S+ has shape \[.*\], the reference "
                                       r"\[\d+\]", rep.reason), rep.reason
    assert rep.golden_max_abs_err is not None and rep.golden_max_abs_err < 1e-3   # pair 0's, a number
    json.dumps(rep.to_dict(), allow_nan=False)


def test_latency_over_budget_fails(B, keys):
    rep = health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, latency_budget_ms=0.001, frames=5)
    assert not rep.ok and rep.golden_ok
    assert re.fullmatch(r"p95 latency [0-9.]+ ms over budget 0\.001 ms", rep.reason), rep.reason
    assert rep.p95_ms > 0.001 and rep.latency_budget_ms == 0.001
    assert health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, latency_budget_ms=60_000, frames=5).ok


class Stalls:
    """The real module with one frame stalled by ``stall_s`` (a runtime whose threads collide now
    and then): the median and p95 stay the model's, the p99 is the stall's."""

    def __init__(self, bundle, delegate="auto", stall_s=0.2, at=12):
        self.m, self.stall_s, self.at, self.calls = HybridModule(bundle, delegate=delegate), stall_s, at, 0

    def run(self, inputs):
        self.calls += 1
        if self.calls == self.at:
            import time

            time.sleep(self.stall_s)
        return self.m.run(inputs)

    def describe(self):
        return self.m.describe()

    def close(self):
        self.m.close()


def test_p99_over_its_budget_fails_with_the_p95_within_its_own(B, keys):
    """One stalled frame in 20: np.percentile puts p95 at 5% of the way to it, p99 at 81%; a p95
    budget of 100 ms passes and the same p99 budget names the p99."""
    rep = health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, latency_budget_ms=100, p99_budget_ms=100,
                       frames=20, make_module=lambda b, delegate: Stalls(b, delegate))
    assert not rep.ok and rep.golden_ok and rep.frames == 20, rep.reason
    assert re.fullmatch(r"p99 latency [0-9.]+ ms over budget 100 ms", rep.reason), rep.reason
    assert rep.p95_ms < 100 < 0.81 * 200 <= rep.p99_ms, (rep.p95_ms, rep.p99_ms)
    assert rep.p99_budget_ms == 100 and rep.latency_budget_ms == 100
    # without a p99 budget the same stall passes: the p99 is reported, not judged
    rep = health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, latency_budget_ms=100, frames=20,
                       make_module=lambda b, delegate: Stalls(b, delegate))
    assert rep.ok and rep.p99_ms >= 0.81 * 200 and "p99" in rep.summary(), rep.reason


def test_p99_budget_reaches_the_isolated_check(B, keys):
    """The child process gets --p99-budget-ms (the gate runs the check there)."""
    rep = health_check_isolated(B["good"], [keys["k1.pub"]], delegate=DELEGATE, p99_budget_ms=0.001, frames=5)
    assert not rep.ok and re.fullmatch(r"p99 latency [0-9.]+ ms over budget 0\.001 ms", rep.reason), rep.reason
    assert rep.p99_ms >= rep.p95_ms >= rep.median_ms > 0 and rep.p99_budget_ms == 0.001


class Flaky:
    """The real module, made to fail some frames after the golden self-test (a runtime that
    crashes on some inputs, or a model that overflows on them)."""

    def __init__(self, bundle, delegate="auto", mode="raise"):
        self.m = HybridModule(bundle, delegate=delegate)
        self.mode, self.calls = mode, 0

    def run(self, inputs):
        self.calls += 1
        out = self.m.run(inputs)
        if self.calls > 2 and self.calls % 3 == 0:
            if self.mode == "raise":
                raise RuntimeError("executor returned status 7")
            out = [np.full_like(o, np.nan) for o in out]
        return out

    def describe(self):
        return self.m.describe()

    def close(self):
        self.m.close()


@pytest.mark.parametrize("mode,what", [("raise", "executor returned status 7"), ("nan", "non-finite output")])
def test_inference_errors_are_counted(B, keys, mode, what):
    rep = health_check(B["good"], [keys["k1.pub"]], delegate=DELEGATE, frames=9,
                       make_module=lambda b, delegate: Flaky(b, delegate, mode))
    assert not rep.ok and rep.golden_ok and rep.frames == 9 and rep.errors == 3
    assert rep.reason.startswith("3 of 9 inference(s) failed (first: frame ") and what in rep.reason


def test_refused_and_unloadable_bundles(B, keys, tmp_path):
    rep = health_check(B["good"], [keys["k2.pub"]], delegate=DELEGATE)
    assert not rep.ok and rep.reason.startswith("bundle refused: ") and "does not verify" in rep.reason

    def boom(bundle, delegate):
        raise RuntimeError("no executor can run dynamic_batch_acl_0: armnn: missing")
    rep = health_check(B["good"], [keys["k1.pub"]], make_module=boom)
    assert not rep.ok and rep.reason == "cannot load the model: no executor can run dynamic_batch_acl_0: armnn: missing"


# --- in a child process ----------------------------------------------------------------------

def test_isolated_check_agrees_with_the_in_process_one(B, keys):
    rep = health_check_isolated(B["good"], [keys["k1.pub"]], delegate=DELEGATE, frames=5, timeout_s=300)
    assert rep.ok and rep.golden_ok and rep.frames == 5, rep
    pub = hmod.load_public_key(keys["k1.pub"])  # a key object is handed to the child as a PEM file
    rep = health_check_isolated(B["bad_golden"], [pub], delegate=DELEGATE, frames=2, timeout_s=300)
    assert not rep.ok and rep.reason.startswith("golden self-test failed: pair 0: output ") and "max abs err 0.31" in rep.reason


def test_the_cli(B, keys):
    res = subprocess.run([sys.executable, "-m", "tandoor_agent.update.health", str(B["good"]), "--trusted-key",
                          str(keys["k1.pub"]), "--delegate", DELEGATE, "--frames", "3",
                          "--latency-budget-ms", "0.001", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 4, res.stderr
    rep = json.loads(res.stdout)
    assert rep["ok"] is False and rep["reason"].startswith("p95 latency ")


def _fake_python(tmp_path: Path, body: str) -> str:
    p = tmp_path / "python"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def test_a_crashing_or_hanging_check_is_a_failed_check(B, keys, tmp_path):
    rep = health_check_isolated(B["good"], [keys["k1.pub"]], python=_fake_python(tmp_path, "kill -SEGV $$"))
    assert not rep.ok and rep.reason == "health check process was killed by SIGSEGV"
    rep = health_check_isolated(B["good"], [keys["k1.pub"]], python=_fake_python(tmp_path, "exec sleep 60"),
                                timeout_s=1)
    # killed at its 1 s timeout, not waited for: the child would have run 60 s
    assert not rep.ok and rep.reason == "health check timed out after 1 s" and rep.seconds < 60
    rep = health_check_isolated(B["good"], [keys["k1.pub"]],
                                python=_fake_python(tmp_path, "echo 'Traceback: boom' >&2; exit 1"))
    assert not rep.ok and rep.reason == "health check process exited 1 without a report: Traceback: boom"


# --- the gate on a slot store ----------------------------------------------------------------

def test_gate_judges_a_trial_and_settle_commits_a_healthy_one_and_rolls_back_a_sick_one(B, keys, tmp_path):
    pub = keys["k1.pub"]
    store = SlotStore(tmp_path / "slots")
    with pytest.raises(TransitionError, match="nothing to health-check"):
        gate(store, [pub])
    store.install(B["good"], "j1", [pub])
    rep = gate(store, [pub], delegate=DELEGATE, frames=4, isolated=False)
    # the gate only judges: the trial is still on trial until the job settles it
    assert rep.ok and store.trial()["job_id"] == "j1" and store.job("j1")["outcome"] == "trial"
    assert settle(store, rep) is True
    assert store.primary() == "a" and store.job("j1")["outcome"] == "committed"
    assert store.job("j1")["reason"].startswith("health gate passed (healthy: golden max abs err")

    store.install(B["bad_golden"], "j2", [pub])
    rep = gate(store, [pub], delegate=DELEGATE, frames=4, isolated=False)
    assert not rep.ok and store.trial()["job_id"] == "j2"
    assert settle(store, rep) is False
    st = store.load()
    assert st["primary"] == "a" and st["trial"] is None and st["slots"]["b"]["state"] == "bad"
    job = store.job("j2")
    assert job["outcome"] == "rolled_back" and job["reason"].startswith("health gate failed: golden self-test failed")

    # the latency budget of the job, through the isolated check (the default)
    store.install(B["good2"], "j3", [pub])
    rep = gate(store, [pub], delegate=DELEGATE, frames=3, latency_budget_ms=0.001, timeout_s=300)
    assert not settle(store, rep) and store.job("j3")["outcome"] == "rolled_back"
    assert re.fullmatch(r"health gate failed: p95 latency [0-9.]+ ms over budget 0\.001 ms", store.job("j3")["reason"])
    assert store.primary_bundle() == store.dir / "a" / "model.hmod"
