"""Real pretrained models from registry packages (zoo/wild.py), which Tandoor's own code never
exported: each compiles for host and aarch64 through the real CLI (whose self-check replays the
golden pairs with the auto and TVM-fallback executors), delegates like a classifier does (>= 90% of
its FLOPs in <= 4 subgraphs on the aarch64 cost model, <= 12 layout transposes), and `tandoor
verify`, running the bundle the same two ways, matches onnxruntime on fresh random inputs. The emulated board runs the same bundles on
CpuAcc (tests/board).
"""

from __future__ import annotations

import json

import pytest

from support.cli import compiled, manifest_of, run_cli
from tandoor_zoo import wild

MODELS = sorted(set(wild.MODELS) - set(wild.UNSEEN))  # those: tests/host/test_unseen_models.py


def wild_bundle(name: str, bundles_dir):
    m = wild.MODELS[name]
    pins = [a for pin in m.inputs for a in ("--input", pin)]
    return compiled(f"wild_{name}", wild.fetch(name), bundles_dir, *pins)


@pytest.mark.parametrize("name", MODELS)
def test_a_real_model_delegates_like_a_classifier(name, bundles_dir):
    man = manifest_of(wild_bundle(name, bundles_dir))
    kept = [p for p in man["partitions"] if p["delegate"]]
    share = man["flops_delegated"] / man["flops_total"]
    left = sorted({(t["op"], t["reason"]) for t in man["tvm_ops"]})
    assert share >= 0.90, f"{name}: {share:.1%} of the FLOPs delegated; TVM kept {left}"
    assert 1 <= len(kept) <= 4, f"{name}: {len(kept)} delegated subgraphs"
    assert man["layout_transposes"] <= 12, f"{name}: {man['layout_transposes']} layout transposes"
    assert set(man["targets"]) == {"host", "aarch64"}


@pytest.mark.parametrize("name", MODELS)
def test_a_real_model_matches_onnxruntime(name, bundles_dir):
    bundle = wild_bundle(name, bundles_dir)
    # as the compile's self-check ran it: the device's auto executors and the TVM fallback, each in a
    # runtime-only process, judged by the manifest's promise per output
    res = run_cli("tandoor", "verify", str(bundle), "--reference", str(wild.fetch(name)), "--random", "2", "--json")
    assert res.returncode == 0, f"{name}: {res.stdout[-2000:]} {res.stderr[-1000:]}"
    out = json.loads(res.stdout)
    assert out["ok"] and out["reference_matches_source"]
    assert sorted((c["delegate"], c["kind"]) for c in out["cases"] if c["kind"] == "random") == \
        [("auto", "random")] * 2 + [("tvm", "random")] * 2
