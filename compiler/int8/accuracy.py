"""`tandoor verify INT8.hmod --reference FP32.onnx --images DIR`: how far a quantized bundle's
answers are from the fp32 model's on real images (not how close it is to its own source: that
is plain `verify`).

Each image is preprocessed as the device preprocesses a frame (the bundle's manifest), run
through the bundle's host lib and through the fp32 model in onnxruntime. Per output: the SQNR
and the cosine similarity; for a classifier (the first output, when the device decodes the bundle
as one: postprocess.resolve) top-1 agreement on the images where fp32 is confident (and how many
they were), top-5 agreement on all: compiler/int8/agreement.py holds those numbers and their verdict. For a detector (the manifest names a box decoder), both
sets of outputs go through the device's own decoder (agent/serve/pipeline.py ``decode``, NMS and
thresholds as the bundle records them) and each fp32 box is matched to one of the bundle's of the
same class at IoU >= 0.5, greedily by fp32 score: ``box_agreement`` = matched / fp32 boxes, and
``boxes_extra`` = the bundle's boxes fp32 did not have. ``ok`` when 1 - top1_agreement (on the
confident images; not judged, and said in ``notes``, when they are too few) and 1 - box_agreement
<= max_drop (the accuracy a user can lose without labels to measure it) and every output's SQNR >=
min_sqnr_db when given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tandoor_contract import hmod

from ..errors import CompileError

from . import calibration as calib
from .agreement import CONFIDENT_P, MIN_CONFIDENT, OutputTally, top1_verdict

DEFAULT_MAX_DROP = 0.05
# the class-score numbers of the first classifier output, at the report's top level
CLASS_KEYS = ("top1_agreement", "confident_images", "top1_agreement_all", "top5_agreement", "classes", "scores")


def _classifier_outputs(manifest: dict) -> list[bool]:
    """Which outputs are scored as a classifier's: the first, when the device decodes the bundle
    as a classifier (postprocess.resolve, the rule the agent publishes by); its decoder reads
    only that one. A model's other (1, N) outputs (MTCNN's box and landmark regressions) are not
    class scores."""
    from tandoor_agent.serve.postprocess import resolve

    is_cls = resolve(None, manifest) == "classifier"
    return [is_cls and j == 0 for j in range(len(manifest["outputs"]))]


MATCH_IOU = 0.5


def _is_detector(manifest: dict) -> bool:
    decoder = (manifest.get("postprocess") or {}).get("decoder")
    return decoder not in (None, "classifier", "raw")


def judged_by(manifest: dict) -> str | None:
    """What agreement a budget (--max-drop) can be judged by for outputs like the manifest's:
    "top-1" (class scores), "boxes" (a box decoder), or None (nothing: only SQNR can say)."""
    if _is_detector(manifest):
        return "boxes"
    return "top-1" if any(_classifier_outputs(manifest)) else None


def _iou(a: list[float], b: np.ndarray) -> np.ndarray:
    """IoU of box ``a`` with each row of ``b`` (x1, y1, x2, y2)."""
    w = np.clip(np.minimum(a[2], b[:, 2]) - np.maximum(a[0], b[:, 0]), 0, None)
    h = np.clip(np.minimum(a[3], b[:, 3]) - np.maximum(a[1], b[:, 1]), 0, None)
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    return inter / np.maximum(union, 1e-12)


def match_boxes(reference: list[dict], got: list[dict], iou: float = MATCH_IOU) -> int:
    """How many of ``reference``'s detections one of ``got``'s matches (same class, IoU >= ``iou``),
    each of ``got`` used once, the reference's highest scores first."""
    free = list(range(len(got)))
    matched = 0
    for r in sorted(reference, key=lambda d: -d["score"]):
        cands = [k for k in free if got[k]["class_id"] == r["class_id"]]
        if not cands:
            continue
        ious = _iou(r["box"], np.array([got[k]["box"] for k in cands], np.float64))
        best = int(np.argmax(ious))
        if ious[best] >= iou:
            matched += 1
            free.remove(cands[best])
    return matched


@contextlib.contextmanager
def simulated_npu(model: str | Path, inputs, samples: list[list[np.ndarray]] | None) -> Iterator[None]:
    """Within it, a bundle's rknn orders run in the RKNN toolkit's simulator (the agent's
    ``executors.rknn_runtime``), calibrated as `compile --npu` calibrated them on ``samples`` (the
    model inputs it made from --calibration), so the host judges what the NPU would give."""
    from tandoor_agent.run import executors
    from tandoor_compiler.stages import frontend
    from tandoor_compiler.backends.rknn import npu

    was = executors.rknn_runtime
    executors.rknn_runtime = npu.simulated_runtime(frontend.load(model, list(inputs)).proto, samples)
    try:
        yield
    finally:
        executors.rknn_runtime = was


def compare_on_images(bundle_path: str | Path, reference: str | Path, images: str | Path, *,
                      count: int | None = None, delegate: str = "onnxruntime", max_drop: float = DEFAULT_MAX_DROP,
                      min_sqnr_db: float | None = None, trusted_keys=(), preprocess: dict | None = None) -> dict:
    """The bundle against the fp32 ``reference`` on the images of ``images`` (a directory or a
    video; ``count`` of them spread evenly, default all). ``preprocess`` stands in for the
    manifest's (a bundle compiled without the flags). Returns the report (module doc)."""
    from tandoor_agent.run.runtime import HybridModule

    with hmod.open_bundle(bundle_path, trusted_keys=trusted_keys) as bundle:
        module = HybridModule(bundle, delegate=delegate)
        m = bundle.manifest if preprocess is None else {**bundle.manifest, "preprocess": preprocess}
        try:
            return compare(m, module.run, reference, images, count=count, max_drop=max_drop,
                           min_sqnr_db=min_sqnr_db, what=f"{delegate} executors")
        finally:
            module.close()


def compare_models(model: str | Path, reference: str | Path, images: str | Path, manifest: dict, *,
                   count: int | None = None, max_drop: float = DEFAULT_MAX_DROP,
                   min_sqnr_db: float | None = None) -> dict:
    """A QDQ ``model`` in onnxruntime against the fp32 ``reference``, the images preprocessed as
    ``manifest`` (inputs, outputs, preprocess, postprocess) says: `tandoor quantize --max-drop`."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return compare(manifest, lambda xs: sess.run(None, {name: xs[0]}), reference, images, count=count,
                   max_drop=max_drop, min_sqnr_db=min_sqnr_db, what="onnxruntime")


def compare(m: dict, run, reference: str | Path, images: str | Path, *, count: int | None = None,
            max_drop: float = DEFAULT_MAX_DROP, min_sqnr_db: float | None = None, what: str = "") -> dict:
    """``run`` (inputs -> outputs, a model as the manifest ``m`` describes it) against the fp32
    ``reference`` on the images (the module doc)."""
    import onnxruntime as ort

    from tandoor_agent.serve.pipeline import decode
    from tandoor_compiler.stages import frontend

    src = calib.open_source(images, "--images")
    if len(m["inputs"]) != 1:
        raise CompileError(f"the model has {len(m['inputs'])} inputs; --images feeds one image input")
    spec = m["inputs"][0]
    pins = [f"{spec['name']}=" + "x".join(str(d) for d in spec["shape"])]
    ref = frontend.load(reference, pins)
    theirs, ours = [o.shape for o in ref.outputs], [o["shape"] for o in m["outputs"]]
    if theirs != ours:
        raise CompileError(f"--reference {Path(reference).name} has output(s) of shape {theirs}, the bundle "
                           f"{ours}: give the fp32 model this bundle was quantized from")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(ref.proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = m["outputs"]
    tallies = [OutputTally(o["name"], cls) for o, cls in zip(outs, _classifier_outputs(m))]
    detector = _is_detector(m)
    boxes = {"fp32": 0, "bundle": 0, "matched": 0}
    n = 0
    for x in calib.tensors(src, calib.pick(src.size, count), spec, m.get("preprocess")):
        got = run([x])
        want = sess.run(None, {ref.inputs[0].name: x})
        for t, g, w in zip(tallies, got, want):
            t.add(g, w)
        if detector:
            ref_dets = decode(m, want)["detections"]
            our_dets = decode(m, got)["detections"]
            boxes["fp32"] += len(ref_dets)
            boxes["bundle"] += len(our_dets)
            boxes["matched"] += match_boxes(ref_dets, our_dets)
        n += 1
    per_output = [t.summary() for t in tallies]
    cls = [r for r in per_output if "top1_agreement" in r]
    box_agreement = boxes["matched"] / boxes["fp32"] if boxes["fp32"] else None
    failures, notes = [], []
    for r in cls:
        failure, note = top1_verdict(r, n, max_drop)
        failures += [failure] if failure else []
        notes += [note] if note else []
    if box_agreement is not None and 1.0 - box_agreement > max_drop + 1e-12:
        failures.append(f"box agreement {box_agreement:.1%} ({boxes['matched']} of fp32's {boxes['fp32']} boxes "
                        f"matched at IoU {MATCH_IOU:g}) is a drop of {1 - box_agreement:.1%}, past --max-drop "
                        f"{max_drop:.1%}")
    if min_sqnr_db is not None:
        failures += [f"output {r['name']}: SQNR {r['sqnr_db']:.1f} dB < --min-sqnr {min_sqnr_db:g} dB"
                     for r in per_output if r["sqnr_db"] < min_sqnr_db]
    first = cls[0] if cls else {}
    return {"images": n, "source": src.describe(), "delegate": what.split()[0] if what else "",
            **{k: first.get(k) for k in CLASS_KEYS}, "box_agreement": box_agreement,
            **({"boxes_fp32": boxes["fp32"], "boxes_bundle": boxes["bundle"], "boxes_matched": boxes["matched"],
                "boxes_extra": boxes["bundle"] - boxes["matched"]} if detector else {}),
            "sqnr_db": {r["name"]: r["sqnr_db"] for r in per_output},
            "outputs": per_output, "max_drop": max_drop, "min_sqnr_db": min_sqnr_db, "ok": not failures,
            "failures": failures, "notes": notes, "top1_judged": bool(cls) and not notes,
            "confident_p": CONFIDENT_P, "min_confident": MIN_CONFIDENT, "quantized": bool(m.get("quantized"))}


# --- the budget: --max-drop judged on --validation, before work and after it ---------------------

NOTHING_TO_JUDGE = ("--max-drop: these outputs have no class scores and no boxes to judge agreement by "
                    "(compile --int8 with --decoder for a detector); drop --max-drop and check with "
                    "tandoor verify --images --min-sqnr")
INT8_FIX = "Try --method percentile, more calibration images, or --keep-fp32 on the layers the report names"


def check_budget(validation, max_drop, *, model, inputs=(), decoder: str | None = None) -> None:
    """Refuse a budget that cannot be judged before any work: the two options apart, validation
    images that are not there, or outputs with nothing to agree on (no class scores, no boxes)."""
    if (validation is None) != (max_drop is None):
        raise CompileError("--max-drop and --validation go together: give the budget and the images calibration "
                           "did not see to judge it on, or neither")
    if validation is None:
        return
    from tandoor_compiler.stages import frontend

    from . import calibration as calib

    calib.open_source(validation, "--validation")      # refused now, not after minutes of work
    outputs = [o.as_dict() for o in frontend.load(model, list(inputs)).outputs]
    if judged_by({"outputs": outputs, "postprocess": {"decoder": decoder} if decoder else None}) is None:
        raise CompileError(NOTHING_TO_JUDGE)


def verdict(res: dict, max_drop: float, *, say=None, what: str = "INT8", fix: str = INT8_FIX) -> str:
    """What the held-out images said, as one line (given to ``say`` first); a CompileError (exit 2)
    past the budget or when the images cannot judge it."""
    from .agreement import describe

    said = [describe(res)] if res.get("confident_images") is not None else []
    if res.get("box_agreement") is not None:
        said.append(f"box agreement {res['box_agreement']:.1%} ({res['boxes_matched']}/{res['boxes_fp32']} boxes)")
    if not said:
        raise CompileError(NOTHING_TO_JUDGE)
    line = (f"on {res['images']} held-out image(s): " + ", ".join(said)
            + ", SQNR " + ", ".join(f"{k} {v:.1f} dB" for k, v in res["sqnr_db"].items()))
    if say is not None:
        say(line)
    if res["notes"] and res.get("box_agreement") is None:
        raise CompileError(f"--max-drop cannot be judged on --validation's {res['images']} image(s): "
                           f"{res['notes'][0]}; nothing written (or drop --max-drop and read tandoor verify --images)")
    if not res["ok"]:
        raise CompileError(f"{what} is past --max-drop {max_drop:.1%} on {res['images']} held-out image(s): "
                           f"{'; '.join(res['failures'])}; nothing written. {fix}")
    return line
