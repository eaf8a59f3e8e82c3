"""How far a quantized model's answers are from its fp32 model's: the numbers `tandoor verify
--images`, `tandoor quantize --max-drop` (and `compile --int8 --max-drop`) and `tandoor bench
--int8 --images` all report, computed here once. compiler/int8/accuracy.py runs the two models image by
image and hands each pair of outputs to an :class:`OutputTally`.

Per output:

* **SQNR** (dB): 10 log10 of the fp32 output's power over the error's, both summed over every
  image (onnxruntime's qdq_loss_debug formula); the cosine similarity, mean and worst image.

For class scores (the output the device decodes as a classifier's):

* **top-1 agreement on confident images**: the INT8 model's argmax equals fp32's, counted over the
  images where fp32's own top-1 probability is at least :data:`CONFIDENT_P` (0.5). On an image
  where fp32 is unsure (a street scene judged by ImageNet's classes: 17% on average on bikes.mp4)
  the top-1 is a coin toss that the smallest error flips; counting those mixes quantization error
  with the model's own doubt. The number of such images is reported beside it.
* **top-5 agreement on all images**: fp32's top-1 among the INT8 model's five best. None when the
  output has 5 classes or fewer (it would be 100% whatever the model did).
* top-1 agreement on all images, for comparison with earlier measurements.

Probabilities: an output that already is a distribution on an image (no value below 0, summing to
1 within :data:`SUMS_TO_ONE`) is read as it is; otherwise it is taken for logits and softmaxed.

A budget (`--max-drop`) judges the confident top-1 (:func:`top1_verdict`). With fewer than
:data:`MIN_CONFIDENT` confident images it is not judged: a percentage of a dozen images is noise.
"""

from __future__ import annotations

import numpy as np

CONFIDENT_P = 0.5       # fp32's top-1 probability from which an image's top-1 means something
MIN_CONFIDENT = 20      # confident images below which a top-1 agreement is not judged
SUMS_TO_ONE = 1e-3      # an output summing to 1 within this (and >= 0) is already probabilities
TOP_K = 5


def is_distribution(scores: np.ndarray) -> bool:
    """Whether one image's class scores already are probabilities (>= 0, summing to 1)."""
    s = np.asarray(scores, np.float64).reshape(-1)
    return bool(s.size) and s.min() >= 0.0 and abs(s.sum() - 1.0) <= SUMS_TO_ONE


def probabilities(scores: np.ndarray) -> np.ndarray:
    """``scores`` (one image's class scores) as probabilities, 1-D: as they are when they already
    are a distribution, else their softmax."""
    s = np.asarray(scores, np.float64).reshape(-1)
    if is_distribution(s):
        return s
    e = np.exp(s - s.max())
    return e / e.sum()


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise); +inf for no noise."""
    if noise_power == 0.0:
        return float("inf")
    return float(10.0 * np.log10(max(signal_power, 1e-30) / noise_power))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b) / (na * nb))


class OutputTally:
    """One output's numbers, image by image: :meth:`add` each (INT8, fp32) pair, then :meth:`summary`."""

    def __init__(self, name: str, classes: bool) -> None:
        self.name, self.classes = name, classes
        self.signal = self.noise = 0.0
        self.cosines: list[float] = []
        self.images = self.confident = self.top1_confident = self.top1_all = self.top5 = 0
        self.n_classes = 0
        self.softmaxed = 0          # images whose scores were logits (softmaxed), the rest probabilities

    def add(self, got, want) -> None:
        g = np.asarray(got, np.float64).reshape(-1)
        w = np.asarray(want, np.float64).reshape(-1)
        self.signal += float(np.sum(w * w))
        self.noise += float(np.sum((g - w) ** 2))
        self.cosines.append(_cosine(g, w))
        self.images += 1
        if not self.classes:
            return
        self.softmaxed += not is_distribution(w)
        p = probabilities(w)
        self.n_classes = w.size
        best = int(np.argmax(w))
        same = int(np.argmax(g)) == best
        self.top1_all += same
        if p[best] >= CONFIDENT_P:
            self.confident += 1
            self.top1_confident += same
        self.top5 += best in np.argsort(-g, kind="stable")[:TOP_K]

    def summary(self) -> dict:
        row = {"name": self.name, "sqnr_db": round(sqnr_db(self.signal, self.noise), 2),
               "cosine_mean": round(float(np.mean(self.cosines)), 6) if self.cosines else None,
               "cosine_min": round(float(np.min(self.cosines)), 6) if self.cosines else None}
        if self.classes and self.images:
            row.update(
                top1_agreement=self.top1_confident / self.confident if self.confident else None,
                confident_images=self.confident,
                top1_agreement_all=self.top1_all / self.images,
                top5_agreement=self.top5 / self.images if self.n_classes > TOP_K else None,
                classes=self.n_classes,
                scores="logits" if self.softmaxed else "probabilities")
        return row


def top1_verdict(row: dict, images: int, max_drop: float) -> tuple[str | None, str | None]:
    """(failure, note) for a class-score output's summary against ``max_drop``: a failure when the
    confident top-1 agreement drops by more; a note instead of a verdict when fewer than
    :data:`MIN_CONFIDENT` of the ``images`` are confident."""
    n = row["confident_images"]
    if n < MIN_CONFIDENT:
        return None, (f"top-1 not judged: fp32's top-1 probability is >= {CONFIDENT_P:g} on {n} of {images} "
                      f"image(s), fewer than the {MIN_CONFIDENT} a top-1 agreement needs to be more than noise; "
                      "give images the model is sure about (like the deployment's)")
    agree = row["top1_agreement"]
    if 1.0 - agree > max_drop + 1e-12:
        return (f"top-1 agreement {agree:.1%} on the {n} image(s) where fp32 is confident (top-1 probability >= "
                f"{CONFIDENT_P:g}) is a drop of {1 - agree:.1%}, past --max-drop {max_drop:.1%}"), None
    return None, None


def describe(row: dict) -> str:
    """One output's class-score numbers in words (verify, quantize, bench print the same)."""
    if row.get("confident_images") is None:
        return ""
    top1 = (f"top-1 agreement {row['top1_agreement']:.1%} on {row['confident_images']} confident image(s)"
            if row["top1_agreement"] is not None else "top-1: no confident image")
    top5 = (f"top-5 {row['top5_agreement']:.1%} on all" if row["top5_agreement"] is not None
            else f"top-5 n/a ({row['classes']} classes)")
    return f"{top1} (all: {row['top1_agreement_all']:.1%}), {top5}"
