"""The cost policy (compiler/stages/cost.py) on real models through the real pipeline: which subgraphs are
kept, and that every decision carries its numbers. The estimate tests compile with measure="off"
(estimates are deterministic); one test decides from times measured on this machine."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tandoor_compiler.stages import cost, frontend, importer, partition, passes  # noqa: E402
from tandoor_zoo import models as zoo
from tandoor_compiler.pipeline import Options, compile_model  # noqa: E402


def _crafted(path, c: int = 32, hw: int = 56):
    """conv-relu-conv-relu (ACL, conv-heavy) -> Erf (TVM) -> Add(const) (ACL, alone) -> Erf (TVM)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((c, 3, 3, 3)) * 0.1).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b2"),
        numpy_helper.from_array(rng.standard_normal((1, c, 1, 1)).astype(np.float32), "k"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Erf", ["r2"], ["e1"]),
        helper.make_node("Add", ["e1", "k"], ["a1"]),
        helper.make_node("Erf", ["a1"], ["y"]),
    ]
    g = helper.make_graph(nodes, "crafted", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, hw, hw])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, path)
    return path


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    return _crafted(tmp_path_factory.mktemp("cost") / "crafted.onnx")


@pytest.fixture(scope="module")
def crafted_manifest(crafted, tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "crafted.hmod"
    return compile_model(crafted, out, Options(policy="cost", measure="off"))


def _by_ops(manifest):
    conv = next(p for p in manifest["partitions"] if "nn.conv2d" in p["ops"])
    add = next(p for p in manifest["partitions"] if p["ops"] == ["add"])
    return conv, add


def test_conv_heavy_region_is_kept_with_its_numbers(crafted_manifest):
    conv, _ = _by_ops(crafted_manifest)
    assert conv["delegate"] is True
    est = conv["est"]
    assert est["source"] == "estimate" and est["arch"] == "x86_64"
    e = est["executor"]
    assert e in ("onnxruntime", "armnn")
    # gain beats the boundary, and the reason says so with the very numbers in est
    assert est["gain_us"] == pytest.approx(est["tvm_us"] - est["exec_us"][e], abs=0.02)
    assert est["gain_us"] > est["bridge_us"][e]
    assert est["p"] > est["p_min"]
    assert conv["reason"].startswith("cost (estimate): gain ")
    for number in (est["tvm_us"], est["exec_us"][e], est["bridge_us"][e]):
        assert f"{number:.1f} us" in conv["reason"]
    assert est["share"] > 0.9            # the convolutions are nearly all the work


def test_lone_add_between_two_erf_stays_in_tvm_with_a_reason_citing_numbers(crafted_manifest):
    _, add = _by_ops(crafted_manifest)
    assert add["delegate"] is False
    est = add["est"]
    e = est["executor"]
    # the executor's run plus its bridge costs more than TVM, which fuses the add with the Erfs
    assert est["exec_us"][e] + est["bridge_us"][e] > est["tvm_us"]
    assert re.search(r"TVM [0-9.]+ us vs \w+ [0-9.]+ us \+ bridge [0-9.]+ us", add["reason"]), add["reason"]
    assert f"{est['tvm_us']:.1f} us" in add["reason"] and f"{est['bridge_us'][e]:.1f} us" in add["reason"]
    assert ("add", add["reason"]) in [(o["op"], o["reason"]) for o in crafted_manifest["tvm_ops"]]
    assert crafted_manifest["ops_delegated"] == sum(len(p["ops"]) for p in crafted_manifest["partitions"] if p["delegate"])


def test_policies_all_and_none(crafted, tmp_path):
    man_all = compile_model(crafted, tmp_path / "all.hmod", Options(policy="all"))
    assert all(p["delegate"] for p in man_all["partitions"])
    _, add = _by_ops(man_all)
    assert add["reason"].startswith("policy all (cost (estimate):")   # the numbers are still shown
    man_none = compile_model(crafted, tmp_path / "none.hmod", Options(policy="none"))
    assert not any(p["delegate"] for p in man_none["partitions"])
    assert man_none["ops_delegated"] == 0 and man_none["predicted_speedup"] == 1.0


def test_decisions_for_a_board_use_the_board_table(crafted):
    m = frontend.load(crafted)
    mod, _ = passes.optimise(importer.to_relax(m))
    model_us = cost.model_tvm_us(mod["main"], "aarch64")
    seen = {}

    def keep(p):
        ok, reason, nums = cost.decide(cost.estimate(p.func, "aarch64"), model_us)
        seen[tuple(p.ops)] = nums
        return ok, reason

    r = partition.partition(mod, m.name, keep)
    kept = {tuple(p.ops): p.delegate for p in r.partitions}
    assert kept[("relax.add",)] is False
    assert any(d for ops, d in kept.items() if "relax.nn.conv2d" in ops)
    conv_nums = next(n for ops, n in seen.items() if "relax.nn.conv2d" in ops)
    assert set(conv_nums["exec_us"]) == {"armnn", "onnxruntime"}
    assert conv_nums["executor"] == "armnn"          # ACL is the assumed best on a Cortex-A76


def test_zoo_cnns_keep_their_single_region():
    for name in ("mobilenet_v2", "efficientnet_lite0"):
        m = frontend.load(zoo.ALL_CNNS[name]())
        mod, _ = passes.optimise(importer.to_relax(m))
        model_us = cost.model_tvm_us(mod["main"], "x86_64")
        r = partition.partition(mod, m.name, lambda p: cost.decide(cost.estimate(p.func, "x86_64"), model_us)[:2])
        assert [p.delegate for p in r.partitions] == [True], name


def test_gain_beats_bridge_is_p_above_p_min():
    """The policy's rule and the architecture's closed form are the same inequality."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        tvm_us, exec_us, bridge = rng.uniform(1, 1e4, 3)
        model_us = tvm_us + rng.uniform(0, 1e5)
        est = {"tvm_us": tvm_us, "exec_us": {"onnxruntime": exec_us}, "bridge_us": {"onnxruntime": bridge}}
        keep, _, n = cost.decide(est, model_us)
        p, s_e, c_o = tvm_us / model_us, tvm_us / exec_us, bridge / model_us
        closed = s_e > 1 and p > c_o * s_e / (s_e - 1)
        if abs((tvm_us - exec_us) - bridge) > 0.05:          # the manifest keeps 2 decimals
            assert keep == closed
        if keep:
            # the speedup of delegating it alone is > 1
            assert 1.0 / ((1 - p) + p / s_e + c_o) > 1.0


def test_measured_numbers_replace_estimates():
    est = {"tvm_us": 100.0, "exec_us": {"onnxruntime": 10.0, "armnn": 5.0},
           "bridge_us": {"onnxruntime": 20.0, "armnn": 20.0}}
    keep, reason, n = cost.decide(est, 1000.0)
    assert keep and n["executor"] == "armnn" and n["source"] == "estimate"
    # the board measured: armnn not runnable there, onnxruntime slower than estimated
    measured = {"tvm_us": 100.0, "exec_us": {"onnxruntime": 95.0}, "bridge_us": {"onnxruntime": 20.0}}
    keep, reason, n = cost.decide(est, 1000.0, measured)
    assert not keep and n["source"] == "profile" and n["executor"] == "onnxruntime"
    assert "armnn" not in n["exec_us"]
    assert reason.startswith("cost (profile): gain 5.0 us <= bridge 20.0 us")


def test_conv_flops_do_not_depend_on_kernel_layout(crafted):
    import tvm
    from tvm import relax

    m = frontend.load(crafted)
    mod, _ = passes.optimise(importer.to_relax(m))             # OHWI
    hwio = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"]})(mod)
    flops = []
    for mm in (mod, hwio):
        total = []
        relax.analysis.post_order_visit(mm["main"].body, lambda e: total.append(cost.op_flops(e)) if (
            isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.nn.conv2d") else None)
        flops.append(sum(total))
    hw = 56
    expect = 2 * hw * hw * 32 * (3 * 9 + 32 * 9)
    assert flops[0] == flops[1] == expect
    assert math.isclose(cost.speedup(0.0, 0), 1.0)


def test_host_only_compiles_decide_from_times_measured_here(crafted, tmp_path):
    """No board target: compile times every candidate subgraph here (tandoor-agent profile) and the
    cost policy decides from those times; each subgraph keeps the estimate beside the measurement."""
    man = compile_model(crafted, tmp_path / "measured.hmod", Options(policy="cost"))
    assert man["profile"] is not None and man["profile"]["arch"] == "x86_64"
    for p in man["partitions"]:
        est = p["est"]
        assert est["source"] == "measured here", est
        assert p["reason"].startswith("cost (measured here):")
        assert set(est["estimated"]["error"]) >= {"tvm", "onnxruntime"}
        assert est["estimated"]["tvm_us"] > 0
        best = est["executor"]
        gain = est["tvm_us"] - est["exec_us"][best]
        assert p["delegate"] == (round(gain, 2) > est["bridge_us"][best]), est
    off = compile_model(crafted, tmp_path / "estimated.hmod", Options(policy="cost", measure="off"))
    assert off["profile"] is None and all(p["est"]["source"] == "estimate" for p in off["partitions"])
