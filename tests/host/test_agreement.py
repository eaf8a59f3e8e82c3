"""compiler/int8/agreement.py, the numbers verify, quantize --max-drop and bench --int8 report, on generated
class scores, against references written elsewhere: scipy's softmax, onnxruntime's SQNR
(qdq_loss_debug), and numpy's own argsort for the counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnxruntime.quantization.qdq_loss_debug import compute_signal_to_quantization_noice_ratio
from scipy.special import softmax

from tandoor_compiler.int8 import agreement
from tandoor_compiler.int8.agreement import CONFIDENT_P, MIN_CONFIDENT, OutputTally, probabilities, top1_verdict

RNG = np.random.default_rng(20261204)


def logits_like_a_camera(n: int, classes: int = 1000) -> np.ndarray:
    """n images of logits: some peaked (a sure top-1), most flat (a street scene judged by ImageNet)."""
    x = RNG.standard_normal((n, classes)) * 1.5
    sure = RNG.random(n) < 0.4
    x[sure, RNG.integers(0, classes, sure.sum())] += 12.0
    return x


def test_logits_are_softmaxed_and_probabilities_read_as_they_are():
    x = logits_like_a_camera(20)
    for row in x:
        assert np.allclose(probabilities(row), softmax(row))
        p = softmax(row)
        assert np.array_equal(probabilities(p), p.astype(np.float64))
    # an output that is not a distribution (negative, or not summing to 1) is logits
    assert np.allclose(probabilities(np.array([0.2, 0.3, 0.1])), softmax([0.2, 0.3, 0.1]))
    assert np.allclose(probabilities(np.array([-0.5, 1.5])), softmax([-0.5, 1.5]))
    # float32 probabilities (a model's Softmax output) sum to 1 only within float32's rounding
    p32 = softmax(x[0]).astype(np.float32)
    assert np.array_equal(probabilities(p32), p32.astype(np.float64))


@pytest.mark.parametrize("as_probabilities", [False, True])
def test_the_tally_counts_top1_on_confident_images_top5_on_all_and_sqnr_as_onnxruntime(as_probabilities):
    want = logits_like_a_camera(300)
    got = want + RNG.standard_normal(want.shape) * 0.8      # an INT8 model's error
    if as_probabilities:
        want, got = softmax(want, axis=1), softmax(got, axis=1)
    t = OutputTally("logits", classes=True)
    for g, w in zip(got, want):
        t.add(g[None], w[None])                              # outputs come as (1, N)
    row = t.summary()
    # the references: scipy's softmax, numpy's argmax/argsort, onnxruntime's SQNR
    conf = softmax(want, axis=1).max(axis=1) >= CONFIDENT_P if not as_probabilities else want.max(axis=1) >= CONFIDENT_P
    same = want.argmax(1) == got.argmax(1)
    in5 = np.array([w.argmax() in np.argsort(-g)[:5] for g, w in zip(got, want)])
    assert 50 < conf.sum() < 250                             # both kinds of image are there
    assert row["confident_images"] == conf.sum()
    assert row["top1_agreement"] == pytest.approx(same[conf].mean())
    assert row["top1_agreement_all"] == pytest.approx(same.mean())
    assert row["top5_agreement"] == pytest.approx(in5.mean())
    assert row["top1_agreement"] > row["top1_agreement_all"]  # the unsure images are where top-1 flips
    ref = compute_signal_to_quantization_noice_ratio(list(want.astype(np.float32)), list(got.astype(np.float32)))
    assert row["sqnr_db"] == pytest.approx(ref, abs=0.01)
    assert row["scores"] == ("probabilities" if as_probabilities else "logits") and row["classes"] == 1000
    cos = [np.dot(g, w) / np.linalg.norm(g) / np.linalg.norm(w) for g, w in zip(got, want)]
    assert row["cosine_min"] == pytest.approx(min(cos), abs=1e-6)


def test_top5_means_nothing_with_five_classes_or_fewer_and_other_outputs_get_sqnr_only():
    t = OutputTally("orientation", classes=True)
    for w in softmax(RNG.standard_normal((30, 4)) * 3, axis=1):
        t.add(w, w)
    row = t.summary()
    assert row["top5_agreement"] is None and row["classes"] == 4 and row["top1_agreement_all"] == 1.0
    assert "top-5 n/a (4 classes)" in agreement.describe(row)
    boxes = OutputTally("boxes", classes=False)
    boxes.add(np.ones(4), np.ones(4) * 1.01)
    assert set(boxes.summary()) == {"name", "sqnr_db", "cosine_mean", "cosine_min"}
    assert boxes.summary()["sqnr_db"] == pytest.approx(10 * np.log10(1.01 ** 2 / 0.01 ** 2), abs=0.01)


def test_a_budget_is_judged_on_confident_images_and_not_on_too_few():
    row = {"confident_images": MIN_CONFIDENT, "top1_agreement": 0.9}
    failure, note = top1_verdict(row, 125, max_drop=0.05)
    assert note is None and "90.0% on the 20 image(s) where fp32 is confident" in failure and "past --max-drop 5.0%" in failure
    assert top1_verdict(row, 125, max_drop=0.1) == (None, None)
    few = {"confident_images": MIN_CONFIDENT - 1, "top1_agreement": 0.0}
    failure, note = top1_verdict(few, 125, max_drop=0.0)
    assert failure is None and "top-1 not judged" in note and "19 of 125" in note
