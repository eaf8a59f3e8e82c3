"""The RK3588's NPU as a delegate (compiler/backends/rknn/npu.py, compiler/backends/rknn/toolkit.py, agent/run/executors/rknn.py),
with the real RKNN toolkit in .venv-rknn (scripts/setup.sh) and its real simulator: compile --npu
against onnxruntime, refusals, the rknn executor driven by the simulator, and the fallback where
the host has no librknnrt.so (the agent runs the order's ONNX rendering and says why).

No skips: without .venv-rknn these tests fail saying so (setup installs it on x86_64)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from support.cli import manifest_of, run_cli
from tandoor_compiler.backends.rknn import npu
from tandoor_compiler.backends.rknn import toolkit as rknn
from tandoor_compiler.errors import CompileError
from tandoor_compiler.pipeline import compile_model

RNG = np.random.default_rng(20261204)


@pytest.fixture(scope="module", autouse=True)
def toolkit():
    try:
        rknn.python()
    except CompileError as err:
        pytest.fail(f"{err} (.venv-rknn is missing: scripts/setup.sh installs it on x86_64)")


def _model(path: Path, nodes, inits, x=(1, 3, 32, 32), y=(1, 10)) -> Path:
    g = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", T.FLOAT, list(x))],
                          [helper.make_tensor_value_info("y", T.FLOAT, list(y))], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def cnn(tmp: Path) -> Path:
    """conv-relu x2, pool, classifier, then an Erf the NPU's table lacks (it stays on the CPU)."""
    w = lambda *s: nh.from_array((RNG.standard_normal(s) * 0.3).astype(np.float32))  # noqa: E731
    inits = [w(8, 3, 3, 3), w(16, 8, 3, 3), w(10, 16)]
    for t, n in zip(inits, ("w1", "w2", "fc")):
        t.name = n
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["z"], transB=1), helper.make_node("Erf", ["z"], ["y"])]
    return _model(tmp / "cnn.onnx", nodes, inits)


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("calib")
    for k in range(10):
        img = cv2.GaussianBlur((RNG.random((48, 64, 3)) * 255).astype(np.uint8), (7, 7), 0)
        cv2.imwrite(str(d / f"{k:02d}.png"), img)
    return d


def test_compile_npu_int8_puts_the_cnn_on_the_npu_and_the_simulator_agrees_with_onnxruntime(tmp_path, calib):
    out = tmp_path / "cnn.hmod"
    res = run_cli("tandoor", "compile", str(cnn(tmp_path)), "-o", str(out), "--target", "rk3588", "--npu",
                  "--calibration", str(calib), "--mean", "0.5", "--std", "0.25")
    assert res.returncode == 0, res.stderr
    m = manifest_of(out)
    n = m["npu"]
    assert n["share"] > 0.99 and len(n["orders"]) == 1
    o = n["orders"][0]
    assert o["dtype"] == "int8" and o["toolkit_version"] == "2.5.0" and o["calibration_frames"] == 8
    assert o["check"]["source"] == "2 held-out calibration frame(s)"
    assert min(o["check"]["cosine"]) >= rknn.TOLERANCE["int8"]["cosine"]
    assert o["check"]["top1"] == [1.0]              # the order's output is the classifier's [1, 10] scores
    [part] = [p for p in m["partitions"] if p.get("kind") == "rknn"]
    assert part["executor"] == "rknn" and part["rknn"].endswith(".rknn")
    assert "Erf" not in " ".join(part["ops"])                          # the NPU's table lacks it: TVM runs it
    assert any(r["why"].startswith("Erf: not in the NPU's op table") for r in n["cpu"])
    inspect = run_cli("tandoor", "inspect", str(out), check=True).stdout
    assert "NPU (rk3588): 100.0% of the FLOPs in 1 rknn order(s)" in inspect
    # verify runs it here (no NPU: the ONNX rendering, exactly fp32) and shows the NPU part
    ver = run_cli("tandoor", "verify", str(out), "--reference", str(tmp_path / "cnn.onnx"), check=True).stdout
    assert "npu: 100.0% of the FLOPs in 1 rknn order(s); at compile the simulator gave" in ver
    assert "[npu: unavailable (rknn-toolkit-lite2 not importable" in ver and "PASS" in ver


def test_the_agent_runs_an_rknn_bundle_on_its_onnx_rendering_where_the_npu_runtime_is_missing(tmp_path):
    """The host has no librknnrt.so (nor RKNNLite): the order falls back to onnxruntime, exactly fp32,
    and says why."""
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_contract import hmod

    model, out = cnn(tmp_path), tmp_path / "cnn16.hmod"
    compile_model(model, out, targets=["rk3588"], npu=True, npu_dtype="fp16", measure="off")
    x = RNG.standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(str(model)).run(None, {"x": x})[0]
    with hmod.open_bundle(out) as b:
        hm = HybridModule(b)
        try:
            got = hm.run([x])[0]
            [sg] = [d for d in hm.describe() if "rknn" in d["symbol"]]
            npu_status = hm.npu()
        finally:
            hm.close()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert sg["executor"] == "onnxruntime"
    assert sg["npu_unavailable"].startswith("rknn-toolkit-lite2 not importable")
    assert npu_status == f"unavailable ({sg['npu_unavailable']})"


def test_the_rknn_executor_runs_on_the_toolkits_simulator_and_refuses_another_runtime_version(tmp_path):
    from tandoor_agent.run.executors import Unavailable
    from tandoor_agent.run.executors.rknn import RknnExecutor

    model = cnn(tmp_path)
    m = onnx.load(model)
    del m.graph.node[-1]                      # up to the Gemm: what the NPU takes
    m.graph.output[0].name = "z"
    data = m.SerializeToString()
    order = {"symbol": "cnn_rknn_0", "inputs": [{"name": "x", "shape": [1, 3, 32, 32], "dtype": "float32"}],
             "outputs": [{"name": "z", "shape": [1, 10], "dtype": "float32"}],
             "rknn": {"toolkit_version": "2.5.0", "dtype": "fp16"}}
    sim = rknn.Simulator(data, "fp16")
    ex = RknnExecutor(order, b"(the board's .rknn)", tmp_path, cores=(0, 1, 2), runtime=sim)
    try:
        assert sim.core_mask == 7 and ex.backend.startswith("NPU cores 0,1,2 (librknnrt 2.5.0")
        x = RNG.standard_normal((1, 3, 32, 32)).astype(np.float32)
        out = np.zeros((1, 10), np.float32)
        ex.run_into([x], [out])
        want = ort.InferenceSession(data).run(None, {"x": x})[0]
        assert rknn.past(rknn.agreement([[out]], [[want]]), rknn.TOLERANCE["fp16"]) == []
    finally:
        ex.close()
    old = {**order, "rknn": {"toolkit_version": "1.6.0", "dtype": "fp16"}}
    with pytest.raises(Unavailable, match=r"librknnrt 2\.5\.0 does not match the order's toolkit 1\.6\.0"):
        RknnExecutor(old, b"", tmp_path, runtime=rknn.Simulator(data, "fp16"))


def test_the_npu_table_refuses_what_the_npu_cannot_take_with_reasons(tmp_path):
    a = nh.from_array(np.ones((1, 4, 3, 3, 3), np.float32) * 0.1, "w3")
    nodes = [helper.make_node("MatMul", ["x", "x"], ["mm"]),                         # two activations
             helper.make_node("Unsqueeze", ["mm", "ax"], ["u"]),
             helper.make_node("Conv", ["u", "w3"], ["y"])]                           # 3-D convolution
    ax = nh.from_array(np.array([1], np.int64), "ax")
    model = onnx.load(_model(tmp_path / "no.onnx", nodes, [a, ax], x=(1, 1, 4, 4), y=(1, 4, 2, 2, 2)))
    picked = npu.pick(model)
    assert picked.groups == []
    assert picked.refused[0] == "both operands are activations; the NPU's matmul takes a constant weight here"
    assert picked.refused[1] == "not in the NPU's op table (compiler/backends/rknn/npu.py)"
    assert picked.refused[2].startswith("u has rank 5")


def test_past_the_orders_tolerance_the_compile_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(rknn.TOLERANCE, "fp16", {"cosine": 1.0, "max_err": 0.0})
    out = tmp_path / "cnn.hmod"
    with pytest.raises(CompileError, match=r"on the NPU \(fp16\) does not agree with onnxruntime fp32 on 2 probe "
                                           r"input\(s\): output 0: cosine .*nothing was written"):
        compile_model(cnn(tmp_path), out, targets=["rk3588"], npu=True, npu_dtype="fp16", measure="off")
    assert not out.exists() and list(tmp_path.glob("*.hmod*")) == []
    # with --max-drop the answers decide (the CLI judges them next): the order is kept, and said to be past
    compile_model(cnn(tmp_path), out, targets=["rk3588"], npu=True, npu_dtype="fp16", measure="off", npu_judged=True)
    [o] = manifest_of(out)["npu"]["orders"]
    assert o["past"] and o["past"][0].startswith("output 0: cosine ")
    said = " ".join(run_cli("tandoor", "inspect", str(out), check=True).stdout.split())
    assert f"{o['symbol']} is past its own bound (output 0: cosine" in said and "judged with --max-drop" in said


def test_without_the_toolkit_venv_npu_says_how_to_get_it_in_one_line(tmp_path, calib):
    out = tmp_path / "cnn.hmod"
    res = run_cli("tandoor", "compile", str(cnn(tmp_path)), "-o", str(out), "--target", "rk3588", "--npu",
                  "--calibration", str(calib), env={**os.environ, "TANDOOR_RKNN_PYTHON": str(tmp_path / "nope" / "python")})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"tandoor: error: {rknn.MISSING}"]
    assert not out.exists()
    res = run_cli("tandoor", "compile", str(cnn(tmp_path)), "-o", str(out), "--npu")
    assert res.returncode == 2 and "--npu is the RK3588's NPU: give --target rk3588" in res.stderr
    assert "Traceback" not in res.stderr


def _text_lines(d: Path, n: int, seed: int) -> Path:
    """``n`` rendered lines of text, half of them upside down: what PP-OCR's direction classifier
    is for (fp32 gets 99% of such lines right, confidently)."""
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog board camera model frame update fleet 2026 rk3588".split()
    d.mkdir()
    for k in range(n):
        img = np.full((48, 240, 3), int(rng.integers(180, 255)), np.uint8)
        cv2.putText(img, " ".join(rng.choice(words, 3)), (4, 34), int(rng.choice([0, 2, 3, 4])), 0.8,
                    tuple(int(v) for v in rng.integers(0, 80, 3)), 2, cv2.LINE_AA)
        cv2.imwrite(str(d / f"{k:03d}.png"), img[::-1, ::-1] if k % 2 else img)
    return d


def test_a_real_classifier_from_the_wild_goes_to_the_npu_in_int8_and_keeps_its_top1_on_unseen_frames(tmp_path):
    """PP-OCR's direction classifier (zoo/wild.py ppocr_cls: paddle2onnx, Constant-node weights,
    HardSigmoid) calibrated on 24 lines of text, checked on the 4 of them held out, and judged with
    --max-drop on 40 other lines through the agent's runtime with the simulator as its NPU."""
    from tandoor_zoo import wild

    calib, val = _text_lines(tmp_path / "calib", 24, 1), _text_lines(tmp_path / "val", 40, 2)
    out = tmp_path / "cls.hmod"
    res = run_cli("tandoor", "compile", str(wild.fetch("ppocr_cls")), "--input", "x=1x3x48x192", "-o", str(out),
                  "--target", "rk3588", "--npu", "--calibration", str(calib), "--mean", "0.5,0.5,0.5",
                  "--std", "0.5,0.5,0.5", "--max-drop", "0.05", "--validation", str(val))
    assert res.returncode == 0, res.stderr
    judged = re.search(r"on (\d+) held-out image\(s\): top-1 agreement ([\d.]+)% on (\d+)", " ".join(res.stderr.split()))
    assert judged, res.stderr
    assert int(judged[1]) == 40 and int(judged[3]) >= 20 and float(judged[2]) >= 95.0
    n = manifest_of(out)["npu"]
    assert n["share"] >= 0.99, n["cpu"]
    [o] = n["orders"]
    assert o["calibration_frames"] == 20 and o["check"]["source"] == "4 held-out calibration frame(s)"
    assert min(o["check"]["cosine"]) >= 0.98 and o["check"]["top1"] == [1.0]


def _frames(n: int) -> list[list[np.ndarray]]:
    """Smooth images as the cnn's inputs (the bundle's preprocessing applied): what calibration feeds."""
    out = []
    for _ in range(n):
        img = cv2.GaussianBlur((RNG.random((32, 32, 3)) * 255).astype(np.uint8), (7, 7), 0)
        out.append([((img.astype(np.float32) / 255 - 0.5) / 0.25).transpose(2, 0, 1)[None].copy()])
    return out


def test_the_health_gate_passes_an_int8_npu_bundle_on_the_npu_within_what_the_simulator_showed(tmp_path, monkeypatch):
    """On a board with the NPU the golden pairs run in INT8: fp32's promise would roll the bundle
    back. The compiler records the rknn path's promise from the simulator on held-out frames, which
    are the golden pairs; the agent's gate, with the simulator as its NPU, passes within it."""
    from tandoor_agent.run import executors
    from tandoor_agent.update.health import health_check
    from tandoor_contract import agreement, hmod

    model, out, samples = cnn(tmp_path), tmp_path / "cnn.hmod", _frames(10)
    compile_model(model, out, targets=["rk3588"], npu=True, npu_dtype="int8", npu_samples=samples, measure="off")
    with hmod.open_bundle(out) as b:
        m, golden = b.manifest, b.golden()
    assert [g["inputs"] for g in m["golden"]] == [["golden/input_0_0.npy"], ["golden/input_1_0.npy"]]
    np.testing.assert_array_equal(golden[1][0][0], samples[9][0])           # held out: every fifth frame
    rknn_path = agreement.tolerance(m["tolerance"], "y", "rknn")
    fp32 = agreement.tolerance(m["tolerance"], "y", "tvm")
    assert "simulator on 2 held-out calibration frame(s)" in rknn_path.why

    monkeypatch.setattr(executors, "rknn_runtime", npu.simulated_runtime(onnx.load(model), samples))
    rep = health_check(out, frames=2)
    assert rep.ok, rep.reason
    assert rep.path == "rknn"
    assert fp32.atol < rep.golden_max_abs_err <= rknn_path.atol      # the old promise would have failed it


def test_a_region_the_toolkit_cannot_convert_stays_on_the_cpu(tmp_path, monkeypatch):
    """The toolkit refuses one region (a worker answering ok: false): the compile goes on with that
    region on ACL/TVM, says why in the NPU's report, and the bundle matches onnxruntime."""
    def refuses(onnx_bytes, **kw):
        raise rknn.ConvertFailed("RuntimeError: simulated refusal")

    monkeypatch.setattr(rknn, "convert", refuses)
    out = tmp_path / "cnn.hmod"
    compile_model(cnn(tmp_path), out, targets=["rk3588"], npu=True, npu_dtype="fp16", measure="off")
    m = manifest_of(out)
    assert m["npu"]["orders"] == [] and m["npu"]["share"] == 0.0
    assert not [p for p in m["partitions"] if p.get("kind") == "rknn"]
    assert any("the RKNN toolkit could not convert its region (RuntimeError: simulated refusal)" in c["why"]
               for c in m["npu"]["cpu"])
    assert any(p["delegate"] and p.get("kind") not in ("onnx", "rknn") for p in m["partitions"])   # ACL took it


def test_an_npu_compile_is_cached_under_its_calibration_frames(tmp_path, monkeypatch):
    """The second compile of the same model with the same frames comes from the cache; other frames
    compile anew (their .rknn is calibrated on them)."""
    monkeypatch.setenv("TANDOOR_COMPILE_CACHE", str(tmp_path / "cache"))
    model, samples = cnn(tmp_path), _frames(5)
    first = compile_model(model, tmp_path / "a.hmod", targets=["rk3588"], npu=True, npu_samples=samples, measure="off")
    again = compile_model(model, tmp_path / "b.hmod", targets=["rk3588"], npu=True, npu_samples=samples, measure="off")
    other = compile_model(model, tmp_path / "c.hmod", targets=["rk3588"], npu=True, npu_samples=_frames(5),
                          measure="off")
    assert first["cache"]["hit"] is False and again["cache"]["hit"] is True and other["cache"]["hit"] is False
    assert again["npu"] == first["npu"]


def test_a_boards_profile_decides_the_npu_and_a_region_slower_there_stays_on_the_cpu(tmp_path, monkeypatch):
    """`tandoor-agent profile` measures an rknn order on the NPU (here the toolkit's simulator, far
    slower than onnxruntime on the same region: a real measurement of that NPU); compiling again
    with that profile leaves the region on the CPU, and the manifest says it was measured."""
    from tandoor_agent.run import executors
    from tandoor_agent.run import profile as agent_profile

    model, samples = cnn(tmp_path), _frames(5)
    first = tmp_path / "first.hmod"
    compile_model(model, first, targets=["rk3588"], npu=True, npu_dtype="fp16", policy="all", measure="off")
    monkeypatch.setattr(executors, "rknn_runtime", npu.simulated_runtime(onnx.load(model), samples))
    prof = agent_profile.measure(first, runs=3, warmup=1, executors=("rknn", "onnxruntime"))
    agent_profile.write(prof, tmp_path / "board.json")
    [sub] = [s for name, s in prof["subgraphs"].items() if name.endswith("_rknn_0")]
    assert sub["backend"]["rknn"].startswith("NPU cores 0,1,2") and sub["exec_us"]["rknn"] > sub["exec_us"]["onnxruntime"]

    again = compile_model(model, tmp_path / "again.hmod", targets=["rk3588"], npu=True, npu_dtype="fp16",
                          profile=tmp_path / "board.json", measure="off")
    n = again["npu"]
    assert n["source"].startswith("measured (profile of ") and n["orders"] == [] and n["share"] == 0.0
    assert any(re.match(r"Conv: measured on .+: \d+ us on the NPU, \d+ us on onnxruntime$", c["why"]) for c in n["cpu"])


def test_int8_leaves_a_concat_of_far_apart_ranges_on_the_cpu_so_the_npu_keeps_them_apart(tmp_path):
    """YOLOv8's head joins box coordinates (to 320) and class scores (0..1) in its last Concat: one
    INT8 scale for both crushes the scores. With INT8 ranges from calibration the table leaves that
    Concat on the CPU (the NPU region gives both tensors apart); fp16 (no ranges) takes it."""
    w = nh.from_array((RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    big = nh.from_array(np.array(300.0, np.float32), "big")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["scores"]),
             helper.make_node("Mul", ["scores", "big"], ["boxes"]),
             helper.make_node("Concat", ["boxes", "scores"], ["y"], axis=1)]
    model = onnx.load(_model(tmp_path / "head.onnx", nodes, [w, big], x=(1, 3, 8, 8), y=(1, 8, 8, 8)))
    [concat] = [k for k, n in enumerate(model.graph.node) if n.op_type == "Concat"]
    ranges = npu.ranges(model, [[RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)] for _ in range(5)])
    assert 0.5 < ranges["scores"] <= 1.0 and 150 < ranges["boxes"] <= 300
    picked = npu.pick(model, ranges=ranges)
    assert picked.refused[concat].startswith("INT8 would give it one scale for inputs up to ")
    assert [sorted(g) for g in picked.groups] == [[0, 1, 2]]
    assert concat in {k for g in npu.pick(model).groups for k in g}          # fp16: no ranges, one region


def test_on_held_out_frames_the_answers_decide_and_a_refusal_names_max_drop(tmp_path, monkeypatch):
    """--calibration given (fp16 too): past the order's own bound, the model's answers on the
    held-out frames decide (top-1 of its score vector kept: compiled, recorded); when they move,
    the refusal names --max-drop --validation, which judges boxes on the user's frames."""
    monkeypatch.setitem(rknn.TOLERANCE, "fp16", {"cosine": 1.0, "max_err": 0.0})     # no order keeps this
    frames = [[RNG.standard_normal((1, 3, 32, 32)).astype(np.float32)] for _ in range(5)]
    out = tmp_path / "cnn.hmod"
    compile_model(cnn(tmp_path), out, targets=["rk3588"], npu=True, npu_dtype="fp16", npu_samples=frames,
                  measure="off")
    [o] = manifest_of(out)["npu"]["orders"]
    assert o["past"] and o["answers_agree"] and o["check"]["source"] == "1 held-out calibration frame(s)"
    monkeypatch.setitem(rknn.ANSWERS_COSINE, "fp16", 1.01)
    monkeypatch.setattr(rknn, "agreement", lambda got, want: {"cosine": [0.5] * len(want[0]), "max_err": [1.0] *
                                                              len(want[0]), "top1": [0.0] * len(want[0])})
    with pytest.raises(CompileError, match=r"model output 0: top-1 kept on 0% of the frames.*nothing was written.*"
                                           r"--max-drop PCT --validation DIR"):
        compile_model(cnn(tmp_path), tmp_path / "moved.hmod", targets=["rk3588"], npu=True, npu_dtype="fp16",
                      npu_samples=frames, measure="off", cache=False)
