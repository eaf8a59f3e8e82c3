"""The compile's self-check and `tandoor verify` run a bundle the same way (the agent's executors
in a runtime-only process, the device's auto and the TVM fallback) and judge it by the same rule
(tandoor_contract.agreement), so they agree: on generated models with the traits that split them
(many equal scores into TopK, a long reduction, placeholder weights driving a Softmax's logits to
1e8), and on onnx's own placeholder-weights SqueezeNet, whose bundle the check accepted and verify
refused (max abs 0.003 on the onnxruntime path, where every class's reference value is 0.001)."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest

from support import check_traits
from support.bundle_edit import rewrite
from support.cli import manifest_of, run_cli

TRAITS = {"topk_ties": check_traits.topk_ties, "long_mean": check_traits.long_mean,
          "placeholder_softmax": check_traits.placeholder_softmax, "deep_relu6": check_traits.deep_relu6}


def _check_then_verify(model: Path, out: Path, *extra: str) -> tuple[object, dict, object]:
    """(the compile, verify's JSON, verify's process): compiled with its check; when the check
    refuses, compiled again without it so that verify can judge the same bundle."""
    check = run_cli("tandoor", "compile", str(model), "-o", str(out), "--measure", "off", "-q", *extra)
    if check.returncode != 0:
        assert check.returncode == 2 and "does not reproduce the model" in check.stderr, check.stderr
        run_cli("tandoor", "compile", str(model), "-o", str(out), "--measure", "off", "-q", "--no-check", *extra,
                check=True)
    v = run_cli("tandoor", "verify", str(out), "--reference", str(model), "--random", "2", "--json")
    assert v.returncode in (0, 1), v.stderr
    assert "Infinity" not in v.stdout and "NaN" not in v.stdout     # strict JSON, even when nothing ran
    return check, json.loads(v.stdout), v


@pytest.mark.parametrize("trait", sorted(TRAITS))
def test_the_compiles_check_and_verify_agree(trait, tmp_path):
    model = TRAITS[trait](tmp_path / f"{trait}.onnx")
    check, res, v = _check_then_verify(model, tmp_path / f"{trait}.hmod", "--policy", "all")
    assert (check.returncode == 0) == res["ok"] == (v.returncode == 0), (check.stderr, res["reason"])
    assert {(c["delegate"], c["kind"]) for c in res["cases"]} == {(d, k) for d in ("auto", "tvm")
                                                                   for k in ("golden", "random")}
    if check.returncode != 0:
        # the same cause, in both words: what the device's runtime lacks, or the output that missed
        said = re.search(r"self-check with \w+ executors: golden self-test failed: pair 0(?: raised)?: (.*)\); nothing",
                         check.stderr).group(1)
        assert said[:60] in res["reason"], (said, res["reason"])
        return
    man = manifest_of(tmp_path / f"{trait}.hmod")
    for c in res["cases"]:      # every case within what the manifest promises for its output
        assert c["ok"] and c["max_abs_err"] <= man["tolerance"]["atol"], c


def test_a_long_reductions_promise_covers_what_tvm_and_onnxruntime_differ_by(tmp_path):
    model = check_traits.long_mean(tmp_path / "m.onnx")
    check, res, _ = _check_then_verify(model, tmp_path / "m.hmod")
    entry = manifest_of(tmp_path / "m.hmod")["tolerance"]["outputs"]["y"]
    worst = max(c["max_abs_err"] for c in res["cases"])
    # measured here: TVM 1.5e-4 (= 0.9 sqrt(65536) 2^-24 x 10); the promise 1.2e-3, about 8x that
    assert check.returncode == 0 and res["ok"] and 2e-5 < worst < entry["atol"] / 3, (worst, entry)


def test_a_deep_stack_all_in_tvm_passes_its_check_though_tvm_and_onnxruntime_differ_by_ten_times_0_001(tmp_path):
    """M-LSD's trait, everything in TVM: each conv's rounding carried through 20 relu6 layers puts
    TVM ~1e-2 from onnxruntime (the check refused M-LSD for 7.5e-3 against 0.001); the promise
    measured by one rounding per op covers it, and verify agrees."""
    model = check_traits.deep_relu6(tmp_path / "d.onnx")
    check, res, _ = _check_then_verify(model, tmp_path / "d.hmod", "--policy", "none")
    entry = manifest_of(tmp_path / "d.hmod")["tolerance"]["outputs"]["y"]
    worst = max(c["max_abs_err"] for c in res["cases"] if c["delegate"] == "tvm")
    assert check.returncode == 0 and res["ok"], (check.stderr, res["reason"])
    assert 3e-3 < worst < entry["atol"] / 2 and "one rounding per op" in entry["why"], (worst, entry)


def test_tvms_own_topk_orders_near_ties_otherwise_and_the_recorded_ties_let_it_pass(tmp_path):
    """Everything in TVM (its full library in this process, where TopK is registered): TVM's sigmoid
    differs from onnxruntime's by an ulp near 1.0, so the near-tied scores come out in another order.
    Judged strictly, the indices miss by hundreds (the refusal of issue 29); with the ties the
    compiler recorded they pass, and a changed score is still refused."""
    import numpy as np
    import tvm  # noqa: F401  (the compiler library: TopK's sort is registered there, not in the runtime's)

    from tandoor_agent.run.runtime import HybridModule
    from tandoor_contract import agreement, hmod

    model = check_traits.topk_near_ties(tmp_path / "near.onnx")
    out = tmp_path / "near.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(out), "--policy", "none", "--measure", "off", "--no-check",
            "-q", check=True)
    with hmod.open_bundle(out) as b:
        module = HybridModule(b, delegate="tvm")
        try:
            for (ins, wants), ties in zip(b.golden(), agreement.golden_ties(b)):
                got = module.run(ins)
                assert 100 < len(ties["idx"]) < 300 and set(ties) == {"idx", "picked"}
                moved = np.flatnonzero(np.asarray(got[1]).reshape(-1) != wants[1].reshape(-1))
                assert len(moved) > 10 and set(moved.tolist()) <= set(ties["idx"].tolist())
                strict = agreement.compare(got, wants, b.manifest, "tvm")
                assert not strict.ok and strict.max_abs_err > 100 and strict.reason.startswith("output idx ")
                assert agreement.compare(got, wants, b.manifest, "tvm", ties).ok
                got[0] = np.asarray(got[0]).copy()
                got[0].flat[-1] -= 0.01
                assert agreement.compare(got, wants, b.manifest, "tvm", ties).reason.startswith("output vals ")
        finally:
            module.close()


@pytest.fixture(scope="module")
def squeezenet(tmp_path_factory) -> tuple[Path, Path]:
    dist = metadata.distribution("onnx")
    model = Path(dist.locate_file("onnx/backend/test/data/light/light_squeezenet.onnx"))
    out = tmp_path_factory.mktemp("squeezenet") / "sq.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(out), "--measure", "off", "-q", check=True)
    return model, out


def test_the_placeholder_squeezenet_is_accepted_by_both_and_says_why(squeezenet):
    model, out = squeezenet
    entry = manifest_of(out)["tolerance"]["outputs"]["softmaxout_1"]
    assert entry["atol"] == 1.0 and "rounding alone decides this Softmax" in entry["why"]
    logits = float(re.search(r"Softmax of values up to ([0-9.e+]+)", entry["why"]).group(1))
    assert logits > 1e9
    v = run_cli("tandoor", "verify", str(out), "--reference", str(model), "--random", "2")
    assert v.returncode == 0 and "PASS" in v.stdout, v.stdout
    assert "tolerance of softmaxout_1: atol 1, rtol 0.001 (fp32 upstream" in run_cli("tandoor", "inspect", str(out)).stdout


def test_the_squeezenet_judged_by_the_old_single_tolerance_fails_naming_output_and_path(squeezenet, tmp_path):
    """The disagreement explained: with the 0.001 every bundle used to promise, the onnxruntime
    order's rounding of 1e9-sized logits picks other classes (0.004 instead of 0.001) on random
    inputs; an old bundle is still read, and the miss names the output, the path and the tolerance."""
    model, out = squeezenet

    def old(man, members):
        man["tolerance"] = {"atol": 1e-3, "rtol": 1e-3}
    bundle = rewrite(out, tmp_path / "old.hmod", old)
    v = run_cli("tandoor", "verify", str(bundle), "--reference", str(model), "--random", "2", "--delegate", "auto",
                "--json")
    res = json.loads(v.stdout)
    assert v.returncode == 1 and not res["ok"]
    assert [c["ok"] for c in res["cases"] if c["kind"] == "golden"] == [True, True]
    assert re.match(r"random input, auto executors: output softmaxout_1 on the onnxruntime path: max abs err 0\.00\d+ "
                    r"exceeds its tolerance \(atol 0\.001, rtol 0\.001; element \d+: 0\.00\d+ vs 0\.001\)",
                    res["reason"]), res["reason"]


def test_an_int8_outputs_promise_excuses_a_few_elements_past_it_never_many():
    """``outliers`` (an INT8 output's entry): up to that fraction of the elements may be past the
    promise, as a flip upstream moves a handful by many steps; a wrong bundle, wrong on most, and a
    manifest excusing more than the probe check's 0.1%, are still refused. No entry: every element."""
    import numpy as np

    from tandoor_contract import agreement

    want = np.linspace(0.0, 1.0, 20000).astype(np.float32)
    got = want.copy()
    got[[5, 999, 17000]] += 0.25                                    # 3 of 20000 flipped, far past
    entry = {"atol": 0.02, "rtol": 0.001, "outliers": 1e-3}
    man = {"outputs": [{"name": "maps"}], "tolerance": {"atol": 0.02, "rtol": 0.001, "outputs": {"maps": entry}}}
    a = agreement.compare([got], [want], man, "tvm")
    assert a.ok and a.max_abs_err == pytest.approx(0.25) and a.past == 3
    got[:100] += 0.25                                               # 102 of 20000 (5 twice): past 0.1% (20)
    a = agreement.compare([got], [want], man, "tvm")
    assert not a.ok and "102 of 20000 elements past it" in a.reason and "up to 0.10% of elements" in a.reason
    got = want.copy()
    got[[5, 999, 17000]] += 0.25
    strict = {**man, "tolerance": {"atol": 0.02, "rtol": 0.001, "outputs": {"maps": {"atol": 0.02, "rtol": 0.001}}}}
    assert not agreement.compare([got], [want], strict, "tvm").ok
    greedy = {**man, "tolerance": {"atol": 0.02, "rtol": 0.001, "outputs": {"maps": {**entry, "outliers": 0.5}}}}
    got[:100] += 0.25
    assert agreement.tolerance(greedy["tolerance"], "maps", "tvm").outliers == agreement.MAX_OUTLIERS
    assert not agreement.compare([got], [want], greedy, "tvm").ok
    assert agreement.tolerance({"outputs": {"maps": {**entry, "outliers": float("nan")}}}, "maps", "tvm").outliers == 0
    got[0] = np.nan                                                 # never excused: not finite
    assert "non-finite" in agreement.compare([got], [want], man, "tvm").reason
