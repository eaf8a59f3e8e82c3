"""The facts the bundle's check is judged by (compiler/stages/check_facts.py, tandoor_contract.agreement),
on tiny generated models run in onnxruntime, against a second implementation written here in numpy
that orders ties the other way: tied TopK rows and ArgMax choices are free, everything else is still
compared (a wrong row or value is refused, naming the output and the path); the promised tolerance
follows the reduction length, the summed values and a squashing op; an old bundle's single pair
still reads."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from support import check_traits
from tandoor_compiler.stages import check_facts
from tandoor_contract import agreement, probe


def _runs(path, seeds=(1, 2)):
    model = onnx.load(path)
    ref = check_facts.Reference(model)
    spec = {"inputs": [{"shape": [d.dim_value for d in i.type.tensor_type.shape.dim]} for i in model.graph.input]}
    out = []
    for seed in seeds:
        x = probe.inputs(spec, seed=seed)
        outs = ref.run({i.name: a for i, a in zip(model.graph.input, x)})
        out.append((x, outs, dict(ref.last)))
    manifest = {"outputs": [{"name": n} for n in ref.facts.names],
                "tolerance": check_facts.promise(ref.facts, [r for _, _, r in out])}
    return ref.facts, out, manifest


def _topk_numpy(x: np.ndarray, k: int, ceiling: float) -> list[np.ndarray]:
    """The model's TopK with ties taken last index first (onnxruntime takes the lowest first)."""
    s = np.minimum(x[0], ceiling)
    order = np.lexsort((-np.arange(s.size), -s))[:k]
    return [s[order][None], order[None].astype(np.int64), x[0][order][None]]


@pytest.mark.parametrize("k", [16, 8])
def test_tied_topk_rows_are_free_and_the_rest_compared(tmp_path, k):
    facts, runs, manifest = _runs(check_traits.topk_ties(tmp_path / "t.onnx", k=k))
    assert [(t.output, t.kind) for t in facts.ties] == [("idx", "topk"), ("picked", "topk")]
    for x, want, seen in runs:
        got = _topk_numpy(x[0], k, 1.0)
        s = np.sort(np.minimum(x[0][0], 1.0))[::-1][: k + 1]
        tied = {j for j in range(k) if s[j] == s[j + 1] or (j and s[j] == s[j - 1])}
        assert len(tied) >= 2 and not np.array_equal(got[1], want[1])   # the premise: ties, ordered otherwise
        free = check_facts.ties(facts, seen)
        assert set(free) == {"idx", "picked"} and all(set(free[n].tolist()) == tied for n in free)
        ok = agreement.compare(got, want, manifest, "tvm", free)
        assert ok.ok and ok.free == 2 * len(tied), ok.reason
        strict = agreement.compare(got, want, manifest, "tvm")
        assert not strict.ok and strict.reason.startswith("output idx on the tvm path: max abs err ")
        wrong = [a.copy() for a in got]
        if len(tied) < k:      # untied rows are compared: two swapped are refused
            j = max(set(range(k)) - tied)
            wrong[2][0, j] += 0.5
            bad = agreement.compare(wrong, want, manifest, "onnxruntime", free)
            assert not bad.ok and bad.reason.startswith("output picked on the onnxruntime path: max abs err 0.5 ")
        wrong[0][0, 0] -= 0.1   # and the values themselves always are
        bad = agreement.compare(wrong, want, manifest, "tvm", free)
        assert not bad.ok and bad.reason.startswith("output vals on the tvm path")


def test_boxes_taken_by_tied_indices_through_squeeze_unsqueeze_expand_are_free_by_row(tmp_path):
    facts, runs, manifest = _runs(check_traits.detector_tail(tmp_path / "d.onnx"))
    assert sorted((t.output, t.out_axis) for t in facts.ties) == [("boxes", 0), ("boxes3", 1)]
    for x, want, seen in runs:
        vals, order, _ = _topk_numpy(x[0], 16, 1.0)
        b = x[1][0]
        got = [vals, b[order[0]], b[order[0]][None]]
        s = np.sort(np.minimum(x[0][0], 1.0))[::-1][:17]
        rows = [j for j in range(16) if s[j] == s[j + 1] or (j and s[j] == s[j - 1])]
        free = check_facts.ties(facts, seen)
        flat = sorted(4 * j + c for j in rows for c in range(4))
        assert free["boxes"].tolist() == flat and free["boxes3"].tolist() == flat
        assert agreement.compare(got, want, manifest, "tvm", free).ok
        assert agreement.compare(got, want, manifest, "tvm").reason.startswith("output boxes on the tvm path")


def test_an_argmax_between_equal_maxima_may_name_either(tmp_path):
    facts, runs, manifest = _runs(check_traits.argmax_ties(tmp_path / "a.onnx"))
    for x, want, seen in runs:
        s = np.minimum(x[0], 0.5)
        last = 3 - np.argmax(s[:, ::-1], axis=1)          # the last of equal maxima
        tied = (s == s.max(axis=1, keepdims=True)).sum(axis=1) > 1
        assert tied.sum() >= 5 and not np.array_equal(last, want[0])
        free = check_facts.ties(facts, seen)
        assert set(free["cls"].tolist()) == set(np.flatnonzero(tied).tolist())
        assert agreement.compare([last], want, manifest, "tvm", free).ok
        assert not agreement.compare([last], want, manifest, "tvm").ok
        wrong = last.copy()
        wrong.flat[np.flatnonzero(~tied)[0]] += 1
        assert not agreement.compare([wrong], want, manifest, "tvm", free).ok


def test_the_promise_follows_reduction_length_summed_values_and_squashing(tmp_path):
    facts, runs, manifest = _runs(check_traits.long_mean(tmp_path / "m.onnx"))
    entry = manifest["tolerance"]["outputs"]["y"]
    summed = max(float(np.abs(r["m"]).max()) for _, _, r in runs)      # the mean of x + 10, before the - 10
    assert facts.reduction == {"y": 65536} and 9.9 < summed < 10.1
    assert entry["atol"] == pytest.approx(check_facts.SAFETY * 2.0 ** -24 * 256 * summed)
    assert "longest reduction 65536 (GlobalAveragePool) making values up to 10" in entry["why"]

    facts, runs, manifest = _runs(check_traits.placeholder_softmax(tmp_path / "p.onnx"))
    entry = manifest["tolerance"]["outputs"]["prob"]
    logits = max(float(np.abs(r["logits"]).max()) for _, _, r in runs)
    assert logits > 1e7 and entry["atol"] == 1.0        # fp32 cannot resolve such logits: anything in [0, 1]
    assert "rounding alone decides this Softmax" in entry["why"]

    # a plain conv keeps the 0.001 every bundle promised (nothing looser where nothing calls for it)
    facts, runs, manifest = _runs(check_traits.placeholder_softmax(tmp_path / "s.onnx", layers=1, ch=4))
    assert manifest["tolerance"]["outputs"]["prob"]["atol"] == 1e-3 and manifest["tolerance"]["atol"] == 1e-3


def test_an_old_bundles_single_pair_and_a_paths_own_pair_are_read():
    old = {"atol": 0.02, "rtol": 0.01}
    assert agreement.tolerance(old, "any", "tvm") == agreement.Tolerance(0.02, 0.01)
    assert agreement.tolerance(None, "any", "tvm") == agreement.Tolerance(1e-3, 1e-3)
    new = {"atol": 0.5, "rtol": 1e-3, "outputs": {"a": {"atol": 0.004, "rtol": 1e-3, "why": "w",
                                                        "paths": {"armnn": {"atol": 0.5, "why": "fp16"}}}}}
    assert agreement.tolerance(new, "a", "tvm") == agreement.Tolerance(0.004, 1e-3, "w")
    assert agreement.tolerance(new, "a", "armnn") == agreement.Tolerance(0.5, 1e-3, "fp16")
    assert agreement.tolerance(new, "b", "tvm") == agreement.Tolerance(0.5, 1e-3)
    man = {"outputs": [{"name": "a"}], "tolerance": new}
    bad = agreement.compare([np.array([1.01])], [np.array([1.0])], man, "tvm")
    assert not bad.ok and bad.reason == ("output a on the tvm path: max abs err 0.01 exceeds its tolerance (atol 0.004, "
                                         "rtol 0.001: w; element 0: 1.01 vs 1)")
    assert agreement.compare([np.array([1.01])], [np.array([1.0])], man, "armnn").ok
    nan = agreement.compare([np.array([math.nan])], [np.array([1.0])], man, "armnn")
    assert not nan.ok and nan.reason == "output a has non-finite values on the armnn path"


def _deep_relu6_numpy(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """check_traits.deep_relu6 in float32 numpy, each conv one BLAS matmul over its im2col: the
    same sums in another order than onnxruntime's."""
    w = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    h = x[0]
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    for k, n in enumerate(convs):
        k_, b = w[n.input[1]], w[n.input[2]]
        cin, hh, ww = h.shape
        p = np.pad(h, ((0, 0), (1, 1), (1, 1)))
        cols = np.stack([p[:, i:i + hh, j:j + ww] for i in range(3) for j in range(3)], axis=1).reshape(cin * 9, hh * ww)
        h = (k_.reshape(k_.shape[0], -1) @ cols).reshape(-1, hh, ww) + b[:, None, None]
        if k < len(convs) - 1:
            h = np.clip(h, np.float32(0), np.float32(6))
    return h[None]


def test_a_deep_stacks_promise_measures_how_far_one_rounding_per_op_carries(tmp_path):
    """A 20-deep relu6 conv stack (M-LSD's trait): each conv alone agrees to a few ulps, yet two fp32
    programs end ~1e-2 apart, 10x the 0.001 the reduction's rule promises. The promise measured
    with one rounding per op (onnxruntime's noisy run) covers it, with room to spare."""
    path = check_traits.deep_relu6(tmp_path / "d.onnx")
    model = onnx.load(path)
    _, runs, old = _runs(path)
    assert old["tolerance"]["outputs"]["y"]["atol"] == 1e-3       # without the noisy run: the reduction's rule
    ref = check_facts.Reference(model, noisy=True)
    seen = []
    for seed in (1, 2):
        x = probe.inputs({"inputs": [{"shape": [1, 3, 16, 16]}]}, seed=seed)
        ref.run({"x": x[0]})
        seen.append((x[0], dict(ref.last)))
    entry = check_facts.promise(ref.facts, [r for _, r in seen])["outputs"]["y"]
    assert "one rounding per op moving it by" in entry["why"]
    for x, r in seen:
        other = _deep_relu6_numpy(model, x)
        apart = float(np.abs(other.astype(np.float64) - r["y"]).max())
        assert 2e-3 < apart < entry["atol"] / 2, (apart, entry)


def test_a_rounding_that_reorders_tied_rows_does_not_widen_the_promise(tmp_path):
    """The noisy run (one rounding per op) breaks the detector tail's exact score ties and TopK
    picks other rows, whose boxes differ by whole units: that is the ties' doing (those elements
    are free), not how far a value may move, so the promise for the boxes stays at the floor; a
    wrong untied box is still refused."""
    path = check_traits.detector_tail(tmp_path / "d.onnx", n=1000, k=300, gain=12.0)
    model = onnx.load(path)
    ref = check_facts.Reference(model, noisy=True)
    spec = {"inputs": [{"shape": [d.dim_value for d in i.type.tensor_type.shape.dim]} for i in model.graph.input]}
    runs = []
    for seed in (1, 2):
        ref.run({i.name: a for i, a in zip(model.graph.input, probe.inputs(spec, seed=seed))})
        runs.append(dict(ref.last))
    moved = max(float(np.abs(r["boxes3"] - r["boxes3" + check_facts.NOISY]).max()) for r in runs)
    assert moved > 0.1     # the premise: the noisy run picked other rows
    promise = check_facts.promise(ref.facts, runs)
    assert promise["outputs"]["boxes3"]["atol"] == agreement.DEFAULT["atol"], promise["outputs"]["boxes3"]
    assert promise["outputs"]["boxes"]["atol"] == agreement.DEFAULT["atol"], promise["outputs"]["boxes"]


def test_requant_flips_moves_one_activation_code_in_twenty_by_a_step_and_leaves_weights_alone():
    """check_facts.requant_flips (an INT8 order's probe drift): each QuantizeLinear of an activation
    rounds a step the other way on FLIP_RATE of its elements; a weight's QuantizeLinear is kept."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from tandoor_compiler.stages.check_facts import FLIP_RATE, requant_flips

    inits = [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "z"),
             numpy_helper.from_array(np.linspace(-3, 3, 64).astype(np.float32).reshape(1, 64), "w")]
    N = helper.make_node
    g = helper.make_graph([N("QuantizeLinear", ["x", "s", "z"], ["xq"]), N("QuantizeLinear", ["w", "s", "z"], ["wq"])],
                          "flips", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [200, 64])],
                          [helper.make_tensor_value_info("xq", TensorProto.INT8, None),
                           helper.make_tensor_value_info("wq", TensorProto.INT8, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    flipped = requant_flips(model, seed=3)
    assert sum(n.op_type == "RandomUniformLike" for n in flipped.graph.node) == 2    # the activation's only
    x = np.random.default_rng(0).uniform(-5, 5, (200, 64)).astype(np.float32)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    (a, wa), (b, wb) = run(model), run(flipped)
    moved = np.abs(a.astype(int) - b.astype(int))
    assert moved.max() == 1 and abs(float(np.mean(moved == 1)) - FLIP_RATE) < 0.015
    np.testing.assert_array_equal(wa, wb)
