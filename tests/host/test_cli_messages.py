"""The host tools' one-line answers name the true cause, and say it before the slow imports:
a path that is not there, a reference model that is not the bundle's source."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from support.cli import compiled, run_cli
from tandoor_zoo import models as zoo


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandoor: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("cmd", [["compile", "{p}", "-o", "{d}/out.hmod"], ["bench", "{p}"], ["quantize", "{p}",
                                 "-o", "{d}/q.onnx", "--calibration", "{d}"], ["inspect", "{d}/none.hmod"]])
def test_a_missing_input_path_is_said_at_once(tmp_path, cmd):
    """Said before the slow imports: Python's own import log (PYTHONPROFILEIMPORTTIME) shows
    that neither TVM nor onnxruntime was imported on the way to the answer."""
    missing = tmp_path / "nowhere" / "model.onnx"
    r = run_cli("tandoor", *[a.format(p=missing, d=tmp_path) for a in cmd],
                env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    line = _one_line("\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("import time:")))
    if cmd[0] == "inspect":
        assert r.returncode == 10 and line.endswith(f"{tmp_path}/none.hmod does not exist; check the path, or "
                                                    f"copy/rebuild the bundle again (it may be truncated)"), line
    else:
        assert r.returncode == 2 and line == f"tandoor: error: {missing}: no such file; give the path of an .onnx model"
    assert "tandoor_host.cli" in imported, sorted(imported)[:20]   # the log is there to be read
    assert not imported & {"tvm", "onnxruntime", "tvm_ffi"}, sorted(imported & {"tvm", "onnxruntime", "tvm_ffi"})


def test_verify_against_another_model_says_it_is_not_the_bundles_source(bundles_dir, tmp_path):
    bundle = compiled("dynamic_batch", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32")
    other = tmp_path / "other.onnx"
    x = helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 32, 32])
    g = helper.make_graph([helper.make_node("Relu", ["input.1"], ["y"])], "other", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), other)
    missing = tmp_path / "missing.onnx"
    r = run_cli("tandoor", "verify", str(bundle), "--reference", str(missing))
    assert r.returncode == 2 and _one_line(r.stderr).endswith(f"{missing}: no such file; give the path of an .onnx model")
    r = run_cli("tandoor", "verify", str(bundle), "--reference", str(other))
    assert r.returncode == 2, r.stdout + r.stderr
    line = _one_line(r.stderr)
    assert "--input" not in line, line  # no --input was given
    assert "is not the model this bundle was compiled from" in line and "input.1" in line, line
    assert f"--reference {other}" in line, line
