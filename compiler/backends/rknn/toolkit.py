"""The compiler's side of the RKNN toolkit: it lives in its own venv (``.venv-rknn``, made by
scripts/setup.sh on x86_64 hosts) and is driven as a subprocess through compiler/backends/rknn/worker.py's
versioned JSON request/response. Nothing here imports the toolkit.

``convert`` turns one rknn group's ONNX rendering into a ``.rknn`` for rk3588 (INT8 calibrated on
the group's own inputs as the model computes them from the calibration frames, or fp16) and runs
the toolkit's simulator on check inputs; ``agreement`` compares the simulator with onnxruntime
against the order's tolerance (``TOLERANCE``), which the compile refuses past.

``Simulator`` is an RKNNLite-shaped runtime backed by the worker's ``--serve`` mode: the agent's
rknn executor (agent/run/executors/rknn.py) takes it in place of RKNNLite on the host, so the
executor's own code runs against the toolkit's simulator in tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ...errors import CompileError

PROTOCOL = 1
WORKER = Path(__file__).with_name("worker.py")
TARGET_PLATFORM = "rk3588"
DTYPES = ("int8", "fp16")
MISSING = "--npu needs the RKNN toolkit: run scripts/setup.sh on an x86_64 host"

# What an rknn order promises against onnxruntime fp32 on the check inputs, per output:
# the cosine similarity at least ``cosine``, and the largest error at most ``max_err`` of the
# reference's largest magnitude. INT8's is its quantization step's worth; fp16's is fp16's.
TOLERANCE = {"int8": {"cosine": 0.98, "max_err": 0.25}, "fp16": {"cosine": 0.9999, "max_err": 0.01}}
# On held-out real frames (--calibration given) the model's answers decide instead: a score
# vector keeps its top-1 on every frame, any other output (boxes, maps) its direction, cosine
# at least this. A 1% max error is more than fp16 keeps through a deep net (a face detector's
# fp16 order: 0.137-0.155 of the largest value at cosine 0.9994-0.9995, the same boxes).
ANSWERS_COSINE = {"int8": 0.98, "fp16": 0.999}
# What a refusal offers: the bundle's answers judged on the user's own frames by the host
JUDGE_HINT = ("or give --max-drop PCT --validation DIR to judge the bundle's answers (top-1, boxes) on your own "
              "frames instead")


class ConvertFailed(CompileError):
    """The toolkit answered, and cannot convert this model: the caller may leave it on the CPU."""

    def __init__(self, why: str):
        super().__init__(f"the RKNN toolkit cannot convert this part of the model: {why}")
        self.why = why


def python() -> Path:
    """The toolkit venv's interpreter: $TANDOOR_RKNN_PYTHON, else .venv-rknn beside the running venv
    (scripts/setup.sh makes both in the repository's root), else CompileError with the fix."""
    env = os.environ.get("TANDOOR_RKNN_PYTHON")
    candidates = [Path(env)] if env else [Path(sys.prefix).parent / ".venv-rknn" / "bin" / "python",
                                          Path(__file__).resolve().parents[3] / ".venv-rknn" / "bin" / "python"]
    for p in candidates:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise CompileError(MISSING)


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return " ".join(lines[-1:])[:300]


def _save(arrays: list[np.ndarray], d: Path, stem: str) -> list[str]:
    out = []
    for j, a in enumerate(arrays):
        p = d / f"{stem}_{j}.npy"
        np.save(p, np.ascontiguousarray(a, dtype=np.float32))
        out.append(str(p))
    return out


def convert(onnx_bytes: bytes, *, dtype: str, calibration: list[list[np.ndarray]], check: list[list[np.ndarray]],
            analysis: bool = False, timeout: float = 1800) -> dict:
    """One ONNX model -> {"blob": .rknn bytes, "toolkit_version", "outputs": simulator outputs per
    check input, "report": per-layer rows or None, "seconds"}. CompileError on a toolkit failure."""
    if dtype not in DTYPES:
        raise CompileError(f"unknown --npu-dtype {dtype}; choose {', '.join(DTYPES)}")
    py = python()
    with tempfile.TemporaryDirectory(prefix="tandoor-rknn-") as tmp:
        d = Path(tmp)
        (d / "model.onnx").write_bytes(onnx_bytes)
        dataset = None
        if dtype == "int8":
            if not calibration:
                raise CompileError("--npu with INT8 needs --calibration (a directory of images or a video); "
                                   "or give --npu-dtype fp16")
            lines = [" ".join(_save(xs, d, f"calib_{k}")) for k, xs in enumerate(calibration)]
            dataset = d / "dataset.txt"
            dataset.write_text("\n".join(lines) + "\n")
        req = {"protocol": PROTOCOL, "action": "convert", "onnx": str(d / "model.onnx"),
               "target_platform": TARGET_PLATFORM, "quantize": dtype, "dataset": str(dataset) if dataset else None,
               "mean": None, "std": None, "probe_inputs": [_save(xs, d, f"check_{k}") for k, xs in enumerate(check)],
               "out_dir": str(d / "out"), "analysis": analysis}
        (d / "request.json").write_text(json.dumps(req))
        res = subprocess.run([str(py), str(WORKER), str(d / "request.json"), str(d / "response.json")],
                             capture_output=True, text=True, timeout=timeout)
        try:
            ans = json.loads((d / "response.json").read_text())
        except (OSError, ValueError):
            raise CompileError(f"the RKNN toolkit's worker failed before answering ({_tail(res.stderr or res.stdout)}); "
                               "rerun scripts/setup.sh") from None
        if ans.get("protocol") != PROTOCOL:
            raise CompileError(f"the RKNN worker speaks protocol {ans.get('protocol')}, the compiler {PROTOCOL}; "
                               "rerun scripts/setup.sh")
        if not ans.get("ok"):
            raise ConvertFailed(str(ans.get("error") or "no reason given"))
        return {"blob": Path(ans["rknn"]).read_bytes(), "toolkit_version": ans["toolkit_version"],
                "outputs": [[np.load(p) for p in outs] for outs in ans["outputs"]], "report": ans.get("report"),
                "seconds": ans.get("seconds", {})}


def agreement(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> dict:
    """Per output, the worst over the check inputs: cosine similarity and max error relative to
    the reference's largest magnitude; for a score vector (shape [1, N]) also the share of check
    inputs whose top-1 is the reference's (None for other outputs)."""
    cos, err, top1 = [], [], []
    for j in range(len(want[0]) if want else 0):
        scores = np.shape(want[0][j])[:1] == (1,) and np.ndim(want[0][j]) == 2 and np.shape(want[0][j])[1] > 1
        top1.append(float(np.mean([np.argmax(g[j]) == np.argmax(w[j]) for g, w in zip(got, want)])) if scores else None)
        cs, es = [], []
        for g, w in zip(got, want):
            a = np.asarray(g[j], np.float64).ravel()
            b = np.asarray(w[j], np.float64).ravel()
            if a.size != b.size:
                raise CompileError(f"the simulator's output {j} has {a.size} elements, onnxruntime's {b.size}")
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            cs.append(1.0 if na == nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0)
            es.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12)))
        cos.append(min(cs))
        err.append(max(es))
    return {"cosine": cos, "max_err": err, "top1": top1}


def past(agree: dict, tolerance: dict) -> list[str]:
    """Outputs past the tolerance, described; empty when the order keeps its promise."""
    bad = []
    for j, (c, e) in enumerate(zip(agree["cosine"], agree["max_err"])):
        if c < tolerance["cosine"] or e > tolerance["max_err"]:
            bad.append(f"output {j}: cosine {c:.4f} (>= {tolerance['cosine']}), max error {e:.3f} of the largest "
                       f"value (<= {tolerance['max_err']})")
    return bad


def answers_disagree(agree: dict, dtype: str) -> list[str]:
    """The model outputs whose answers moved (``agree``: :func:`agreement` of the model's outputs):
    a score vector whose top-1 changed on a frame, another output below ANSWERS_COSINE."""
    bad = []
    for j, (c, t) in enumerate(zip(agree["cosine"], agree["top1"])):
        if t is not None and t < 1.0:
            bad.append(f"model output {j}: top-1 kept on {t:.0%} of the frames")
        elif t is None and c < ANSWERS_COSINE[dtype]:
            bad.append(f"model output {j}: cosine {c:.4f} (>= {ANSWERS_COSINE[dtype]})")
    return bad


class Simulator:
    """An RKNNLite-shaped runtime over the toolkit's simulator (worker --serve): ``load_rknn`` takes
    the order's ONNX rendering (the simulator cannot run a .rknn file: it builds the model itself)
    with the same quantization, ``init_runtime``, ``inference``, ``get_sdk_version``, ``release``."""

    NPU_CORE_0_1_2 = 7

    def __init__(self, onnx_bytes: bytes, dtype: str = "fp16", calibration: list[list[np.ndarray]] | None = None):
        self._onnx, self._dtype, self._calibration = onnx_bytes, dtype, calibration or []
        self._tmp = tempfile.TemporaryDirectory(prefix="tandoor-rknn-sim-")
        self._proc = None
        self.toolkit_version = None
        self.core_mask = None

    def _ask(self, req: dict) -> dict:
        self._proc.stdin.write(json.dumps({"protocol": PROTOCOL, **req}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the RKNN simulator worker exited")
        ans = json.loads(line)
        if not ans.get("ok"):
            raise RuntimeError(ans.get("error"))
        return ans

    def load_rknn(self, path: str) -> int:      # the .rknn itself is the board's; the simulator rebuilds
        return 0

    def init_runtime(self, core_mask: int = 7) -> int:
        d = Path(self._tmp.name)
        (d / "model.onnx").write_bytes(self._onnx)
        dataset = None
        if self._dtype == "int8":
            dataset = d / "dataset.txt"
            dataset.write_text("\n".join(" ".join(_save(xs, d, f"calib_{k}"))
                                         for k, xs in enumerate(self._calibration)) + "\n")
        self._proc = subprocess.Popen([str(python()), str(WORKER), "--serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ans = self._ask({"action": "build", "onnx": str(d / "model.onnx"), "target_platform": TARGET_PLATFORM,
                         "quantize": self._dtype, "dataset": str(dataset) if dataset else None})
        self.toolkit_version = ans["toolkit_version"]
        self.core_mask = core_mask
        return 0

    def get_sdk_version(self) -> str:
        return f"librknnrt version: {self.toolkit_version} (simulator)"

    def inference(self, inputs: list[np.ndarray], data_format=None) -> list[np.ndarray]:
        d = Path(self._tmp.name)
        ans = self._ask({"action": "infer", "inputs": _save(inputs, d, "in"), "out_dir": str(d)})
        return [np.load(p) for p in ans["outputs"]]

    def release(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.write(json.dumps({"action": "release"}) + "\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except Exception:
                self._proc.kill()
            self._proc = None
        self._tmp.cleanup()
