"""The escape hatch (compiler/backends/onnx/hatch.py): ONNX nodes that neither ACL nor the device's TVM runtime can
run become onnxruntime orders, and no bundle calls a function the runtime-only TVM lacks.

Tiny generated models (onnx.helper) for each trait: an LSTM (no TVM converter), a Loop whose
outputs onnx's shape inference cannot size, a detector tail with TopK + GatherElements (TopK lowers
to tvm.contrib.sort.topk), each compiled by the real `tandoor compile` (its self-check runs the
bundle in a runtime-only process), checked by `tandoor verify`, and run by `tandoor-agent run`
(runtime-only) against onnxruntime on the source model. The tables are checked against the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import manifest_of, run_cli
# the small onnx.helper builders are tails.py's: one set for the hatch's models and the tail's
from support.tails import F, N, _i64, _save, _vi, _w, e2e_detector, loop_of_data, nonzero_tail


def lstm(d: Path) -> Path:
    """Conv -> [seq, batch, feat] -> LSTM -> Relu: a CRNN recogniser's shape in miniature."""
    h = 8
    return _save(d / "lstm.onnx", [
        N("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1]), N("Reshape", ["c", "shp"], ["r"]),
        N("Transpose", ["r"], ["seq"], perm=[2, 0, 1]),
        N("LSTM", ["seq", "W", "R", "B"], ["Y", "Yh"], hidden_size=h), N("Relu", ["Y"], ["y"])],
        [_vi("x", [1, 3, 1, 6])], [_vi("y", [6, 1, 1, h])],
        {"cw": _w(4, 3, 3, 3), "shp": _i64(1, 4, 6), "W": _w(1, 4 * h, 4), "R": _w(1, 4 * h, h), "B": _w(1, 8 * h)})


def loop(d: Path) -> Path:
    """A Loop (3 trips) reading an outer tensor in its body, with a scan output onnx's shape
    inference leaves unsized."""
    body = helper.make_graph(
        [N("Mul", ["acc_in", "half"], ["m"]), N("Add", ["m", "xr"], ["acc_out"]),
         N("Identity", ["cond_in"], ["cond_out"]), N("Identity", ["acc_out"], ["scan"])], "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("acc_in", [1, 4])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out", [1, 4]), _vi("scan", [1, 4])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    return _save(d / "loop.onnx", [
        N("Relu", ["x"], ["xr"]), N("Loop", ["M", "cond", "zero"], ["acc", "scans"], body=body),
        N("Sigmoid", ["acc"], ["y"]), N("Reshape", ["scans", "s2"], ["z"])],
        [_vi("x", [1, 4])], [_vi("y", [1, 4]), _vi("z", [3, 4])],
        {"M": np.array(3, np.int64), "cond": np.array(True), "zero": np.zeros((1, 4), np.float32), "s2": _i64(3, 4)})


def topk(d: Path) -> Path:
    """An end-to-end detector's tail: scores -> TopK -> GatherElements of the boxes by the indices."""
    return _save(d / "topk.onnx", [
        N("Conv", ["x", "cw"], ["c"]), N("Reshape", ["c", "shp"], ["r"]),
        N("Slice", ["r", "s0", "s1", "ax"], ["scores"]), N("Reshape", ["scores", "s16"], ["sc"]),
        N("TopK", ["sc", "k"], ["top", "idx"]), N("Slice", ["r", "b0", "b1", "ax"], ["boxes"]),
        N("Unsqueeze", ["idx", "one"], ["idx3"]), N("Expand", ["idx3", "eshp"], ["idx4"]),
        N("GatherElements", ["boxes", "idx4"], ["sel"], axis=2), N("Sigmoid", ["top"], ["y"])],
        [_vi("x", [1, 3, 4, 4])], [_vi("y", [1, 5]), _vi("sel", [1, 4, 5])],
        {"cw": _w(5, 3, 1, 1), "shp": _i64(1, 5, 16), "s0": _i64(0), "s1": _i64(1), "ax": _i64(1),
         "s16": _i64(1, 16), "k": _i64(5), "b0": _i64(1), "b1": _i64(5), "one": _i64(1), "eshp": _i64(1, 4, 5)})


MODELS = {"lstm": (lstm, ["LSTM"]), "loop": (loop, ["Loop"]), "topk": (topk, ["TopK"])}


def _agent_outputs(bundle: Path, x: np.ndarray, d: Path, *extra: str) -> tuple[list[np.ndarray], dict]:
    np.save(d / "x.npy", x)
    out = d / "out"
    res = run_cli("tandoor-agent", "run", str(bundle), "--input", str(d / "x.npy"), "--save-outputs", str(out),
                  "--json", *extra, check=True)
    report = json.loads(res.stdout)
    return [np.load(out / f"output_{j}.npy") for j in range(len(report["outputs"]))], report


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_node_neither_acl_nor_the_runtime_runs_becomes_an_onnxruntime_order(name, tmp_path):
    make, ops = MODELS[name]
    model = make(tmp_path)
    bundle = tmp_path / f"{name}.hmod"
    # host + aarch64: the check runs the host lib in a runtime-only process, as the agent does
    res = run_cli("tandoor", "compile", str(model), "-o", str(bundle), "--target", "aarch64", "--measure", "off",
                  check=True)
    assert f"ONNX node(s) to onnxruntime ({ops[0]} x1)" in " ".join((res.stdout + res.stderr).split())
    man = manifest_of(bundle)
    hatch = [p for p in man["partitions"] if p.get("kind") == "onnx"]
    assert [p["ops"] for p in hatch] == [[f"onnx.{o}" for o in ops]] and hatch[0]["delegate"]
    assert set(hatch[0]["why"]) == set(ops) and hatch[0]["executor"] == "onnxruntime"
    with zipfile.ZipFile(bundle) as z:
        order = json.loads(z.read(hatch[0]["order"]))
        rendering = onnx.load_from_string(z.read(hatch[0]["onnx"]))
    assert order["order_version"] == 3 and order["kind"] == "onnx" and order["ops"] == []
    assert [n.op_type for n in rendering.graph.node] == ops
    assert all(d.HasField("dim_value") for o in rendering.graph.output for d in o.type.tensor_type.shape.dim)

    verify = run_cli("tandoor", "verify", str(bundle), "--reference", str(model))
    assert verify.returncode == 0 and "PASS" in verify.stdout, verify.stdout + verify.stderr

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    spec = sess.get_inputs()[0]
    x = np.random.default_rng(7).standard_normal([int(v) for v in spec.shape]).astype(np.float32)
    want = sess.run(None, {spec.name: x})
    for delegate in ("auto", "tvm"):    # tvm (and armnn) refuse the onnx order: it falls back to onnxruntime
        got, report = _agent_outputs(bundle, x, tmp_path, "--delegate", delegate)
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
        sg = next(s for s in report["subgraphs"] if s["symbol"] == hatch[0]["symbol"])
        assert sg["executor"] == "onnxruntime"
        if delegate == "tvm":
            assert "runs on onnxruntime only" in sg["fallback_reason"]


def test_inspect_says_which_nodes_went_to_onnxruntime_and_why(tmp_path):
    bundle = tmp_path / "lstm.hmod"
    run_cli("tandoor", "compile", str(lstm(tmp_path)), "-o", str(bundle), "--measure", "off", check=True)
    info = json.loads(run_cli("tandoor", "inspect", str(bundle), "--json", check=True).stdout)
    [row] = info["onnxruntime_ops"]
    assert row["op"] == "LSTM" and row["count"] == 1 and "importer has no converter" in row["reason"]
    text = run_cli("tandoor", "inspect", str(bundle), env={**os.environ, "COLUMNS": "200"}).stdout
    assert "ONNX nodes run by onnxruntime" in text and "onnxruntime" in text


@pytest.mark.parametrize("make, first", [(e2e_detector, "NonMaxSuppression"), (nonzero_tail, "NonZero"),
                                         (loop_of_data, "Loop")], ids=["NonMaxSuppression", "NonZero", "Loop"])
def test_an_op_whose_output_size_depends_on_the_data_ends_the_model_in_onnxruntime(make, first, tmp_path):
    """NMS's count of boxes kept, NonZero's count of hits, a Loop's rows (a trip count the data
    decides; the probes may agree on it, real inputs need not): that op and everything after it run
    in onnxruntime after the VM (the manifest's tail, bundle format 3); the compile's check,
    `tandoor verify` and the runtime-only agent give onnxruntime's outputs, of whatever size each
    input makes, with ACL orders (--policy all: Arm NN's CpuRef here) before the tail."""
    model = make(tmp_path)
    bundle = tmp_path / "tail.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(bundle), "--target", "aarch64", "--measure", "off",
            "--policy", "all", check=True)
    man = manifest_of(bundle)
    # a tail is format 3; its ACL orders' one fallback library per target makes it 4
    assert man["format_version"] == (4 if any(p["delegate"] for p in man["partitions"]) else 3)
    assert man["tail"]["kind"] == "onnx"
    assert man["tail"]["ops"][0] == f"onnx.{first}" and not any(p.get("kind") == "onnx" for p in man["partitions"])
    info = json.loads(run_cli("tandoor", "inspect", str(bundle), "--json", check=True).stdout)
    assert any(r["op"] == first and "depends on the data" in r["reason"] for r in info["onnxruntime_ops"])

    verify = run_cli("tandoor", "verify", str(bundle), "--reference", str(model))
    assert verify.returncode == 0 and "PASS" in verify.stdout, verify.stdout + verify.stderr

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    spec = sess.get_inputs()[0]
    sizes = set()
    for seed in (7, 10, 11):
        x = np.random.default_rng(seed).standard_normal([int(v) for v in spec.shape]).astype(np.float32)
        want = sess.run(None, {spec.name: x})
        sizes.add(want[0].shape)
        for delegate in ("auto", "armnn") if seed == 7 else ("auto",):
            got, report = _agent_outputs(bundle, x, tmp_path, "--delegate", delegate)
            assert [g.shape for g in got] == [w.shape for w in want]
            for a, b in zip(want, got):
                np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
    assert len(sizes) > 1, "the inputs should make outputs of different sizes"


# --- the tables against the wheel ----------------------------------------------------------------

_REGISTRY = ("import json, sys\n"
             "if sys.argv[1] == 'runtime':\n"
             "    from tandoor_agent.run import lean\n"
             "    assert lean.runtime_only()\n"
             "import tvm_ffi, tvm\n"
             "print(json.dumps(sorted(tvm_ffi.registry.list_global_func_names())))\n")


def _registry(which: str) -> set[str]:
    res = subprocess.run([sys.executable, "-c", _REGISTRY, which], capture_output=True, text=True, check=True)
    return set(json.loads(res.stdout.strip().splitlines()[-1]))


def test_the_runtime_only_library_lacks_what_the_table_routes_away_and_has_what_the_compiler_assumes():
    from tandoor_compiler.backends.onnx import hatch

    runtime, full = _registry("runtime"), _registry("full")
    for lack in hatch.RUNTIME_LACKS.values():
        assert lack.function in full, f"{lack.op}: TVM's compiler library no longer registers {lack.function}"
        assert lack.function not in runtime, f"{lack.op}: the runtime library registers {lack.function} now"
    assumed = {n for n in full if n.startswith(hatch.RUNTIME_PREFIXES)} - hatch.RUNTIME_ABSENT
    assert assumed <= runtime, f"assumed in the runtime library but absent: {sorted(assumed - runtime)}"
    assert not hatch.RUNTIME_ABSENT & runtime, "RUNTIME_ABSENT lists functions the runtime library has"
    assert len(assumed) > 50     # the VM's builtins: not an empty prefix match


def _lacking_op_model(op: str) -> onnx.ModelProto:
    f, i64 = F, TensorProto.INT64
    cases = {
        "TopK": ([N("TopK", ["x", "k"], ["v", "i"])], [_vi("x", [1, 10])], [_vi("v", [1, 3]), _vi("i", [1, 3], i64)],
                 {"k": _i64(3)}),
        "NonMaxSuppression": ([N("NonMaxSuppression", ["b", "s", "m", "iou", "st"], ["o"])],
                              [_vi("b", [1, 10, 4]), _vi("s", [1, 1, 10])], [_vi("o", [10, 3], i64)],
                              {"m": _i64(5), "iou": np.array([0.5], np.float32), "st": np.array([0.1], np.float32)}),
        "NonZero": ([N("NonZero", ["x"], ["o"])], [_vi("x", [10])], [_vi("o", [1, None], i64)], {}),
        "Unique": ([N("Unique", ["x"], ["o"])], [_vi("x", [10])], [_vi("o", [None], f)], {}),
    }
    nodes, ins, outs, inits = cases[op]
    g = helper.make_graph(nodes, op, ins, outs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("op", sorted(__import__("tandoor_compiler.backends.onnx.hatch", fromlist=["x"]).RUNTIME_LACKS))
def test_tvm_lowers_each_routed_op_to_the_function_the_table_names_and_the_backstop_refuses_it(op):
    """Without the hatch, TVM's build pipeline makes each RUNTIME_LACKS op call its function: the
    table is what the wheel does, and check_runtime (run after every build) refuses it by op name."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    from tandoor_compiler.backends.onnx import hatch
    from tandoor_compiler.stages import schedule
    from tandoor_compiler.errors import CompileError

    mod = from_onnx(_lacking_op_model(op), keep_params_in_input=False)
    t = tvm.target.Target(schedule.host_target({"kind": "llvm"}))
    calls: set[str] = set()
    tvm.compile(mod, target=t, relax_pipeline=tvm.transform.Sequential([schedule.cpu_pipeline(t), hatch.observer(calls)]))
    lack = hatch.RUNTIME_LACKS[op]
    assert lack.function in calls, f"{op} now lowers to {sorted(calls)}"
    with pytest.raises(CompileError, match=rf"{lack.function} \(from {op}\)"):
        hatch.check_runtime(calls, frozenset())
    hatch.check_runtime(calls - {lack.function}, frozenset())   # the VM's own builtins pass


def test_connected_nodes_share_one_order_unless_that_would_make_a_cycle():
    """LSTM -> LSTM is one order; LSTM -> (Relu in TVM) -> LSTM, with the first also feeding the
    second directly, cannot be one order (it would wait for TVM, which waits for it): two."""
    from tandoor_compiler.backends.onnx import hatch

    h = 4

    def lstm_node(x, y, k):
        return N("LSTM", [x, f"W{k}", f"R{k}"], [y], hidden_size=h)

    def lstm_weights(k, feat):
        return {f"W{k}": _w(1, 4 * h, feat), f"R{k}": _w(1, 4 * h, h)}

    def model(nodes, inits):
        g = helper.make_graph(nodes, "g", [_vi("x", [3, 1, h])], [_vi("y", None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    sq = {"ax": _i64(1)}
    chain = model([lstm_node("x", "a4", 0), N("Squeeze", ["a4", "ax"], ["a"]), lstm_node("a", "b4", 1),
                   N("Squeeze", ["b4", "ax"], ["y"])], {**lstm_weights(0, h), **lstm_weights(1, h), **sq})
    chain = onnx.shape_inference.infer_shapes(chain)
    inputs = [{"name": "x", "shape": [3, 1, h], "dtype": "float32"}]
    _, groups = hatch.cut(chain, "m", inputs)
    assert [g.op_types for g in groups] == [["LSTM"], ["LSTM"]]   # Squeeze (TVM) sits between them

    # two LSTMs fed by one another directly: one order of two nodes
    direct = model([N("LSTM", ["x", "W0", "R0"], ["", "yh"], hidden_size=h),
                    N("LSTM", ["yh", "W1", "R1"], ["y4"], hidden_size=h), N("Squeeze", ["y4", "ax"], ["y"])],
                   {**lstm_weights(0, h), **lstm_weights(1, h), **sq})
    tvm_proto, groups = hatch.cut(direct, "m", inputs)
    assert [g.op_types for g in groups] == [["LSTM", "LSTM"]] and groups[0].inputs == ["x"]
    assert [n.op_type for n in tvm_proto.graph.node] == [hatch.PLACEHOLDER, "Squeeze"]

    # the second LSTM reads the first directly and through a Relu TVM runs: merging them would cycle
    cyc = model([N("LSTM", ["x", "W0", "R0"], ["", "yh"], hidden_size=h), N("Relu", ["yh"], ["r"]),
                 N("Add", ["yh", "r"], ["s"]), N("LSTM", ["s", "W1", "R1", "", "", "yh"], ["y4"], hidden_size=h),
                 N("Squeeze", ["y4", "ax"], ["y"])], {**lstm_weights(0, h), **lstm_weights(1, h), **sq})
    tvm_proto, groups = hatch.cut(cyc, "m", inputs)
    assert [g.op_types for g in groups] == [["LSTM"], ["LSTM"]]
    sess = ort.InferenceSession(groups[1].onnx_bytes, providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["s", "yh"]      # initial_h from the first order


def test_an_onnxruntime_order_with_an_int_input_made_in_tvm_runs_and_profiles(tmp_path):
    """LSTM's sequence_lens (int32) computed by the TVM side from the input: the order's int32
    tensor is bound as int32 by the onnxruntime executor, and `tandoor-agent profile` feeds it
    valid values (zeros), not quantized codes."""
    h = 4
    nodes = [N("ReduceMax", ["x"], ["m"], keepdims=0, axes=[0, 1, 2]), N("Mul", ["m", "zero"], ["z"]),
             N("Add", ["z", "three"], ["t"]), N("Reshape", ["t", "one"], ["t1"]), N("Cast", ["t1"], ["sl"], to=TensorProto.INT32),
             N("LSTM", ["x", "W", "R", "", "sl"], ["y"], hidden_size=h)]
    model = _save(tmp_path / "seqlen.onnx", nodes, [_vi("x", [3, 1, 4])], [_vi("y", [3, 1, 1, h])],
                  {"W": _w(1, 4 * h, 4), "R": _w(1, 4 * h, h), "zero": np.array(0, np.float32),
                   "three": np.array(3, np.float32), "one": _i64(1)}, opset=17)
    bundle = tmp_path / "seqlen.hmod"
    run_cli("tandoor", "compile", str(model), "-o", str(bundle), "--measure", "off", check=True)
    [part] = [p for p in manifest_of(bundle)["partitions"] if p.get("kind") == "onnx"]
    with zipfile.ZipFile(bundle) as z:
        order = json.loads(z.read(part["order"]))
    assert {i["name"]: i["dtype"] for i in order["inputs"]} == {"x": "float32", "sl": "int32"}
    x = np.random.default_rng(3).standard_normal((3, 1, 4)).astype(np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got, _ = _agent_outputs(bundle, x, tmp_path)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    prof = tmp_path / "prof.json"
    run_cli("tandoor-agent", "profile", str(bundle), "-o", str(prof), "--runs", "2", "--warmup", "0", check=True)
    entry = json.loads(prof.read_text())["subgraphs"][part["symbol"]]
    assert entry["exec_us"]["onnxruntime"] > 0
    assert "runs on onnxruntime only" in entry["unavailable"]["tvm"]


def test_a_loop_counted_by_a_static_shape_is_not_a_tail():
    """A tf2onnx map over the batch: count INT64_MAX, going on while i < Shape(x)[0]. With the
    input's shape pinned the Shape is a constant, so the trip count is too and the Loop stays an
    ordinary onnxruntime order; the same loop counting x's positive values is the tail."""
    from tandoor_compiler.backends.onnx import hatch

    i64, b = TensorProto.INT64, TensorProto.BOOL

    def model(count_from: str) -> onnx.ModelProto:
        body = helper.make_graph(
            [N("Add", ["i", "one"], ["i1"]), N("Less", ["i1", "n"], ["cond_out"]), N("Identity", ["v"], ["scan"])],
            "body", [_vi("i", [], i64), _vi("cond_in", [], b)], [_vi("cond_out", [], b), _vi("scan", [1])],
            [numpy_helper.from_array(np.array(1, np.int64), "one"), numpy_helper.from_array(np.array([1.0], np.float32), "v")])
        count = ([N("Shape", ["x"], ["shp"]), N("Gather", ["shp", "z"], ["n"], axis=0)] if count_from == "shape" else
                 [N("Greater", ["x", "zf"], ["pos"]), N("Cast", ["pos"], ["pf"], to=F),
                  N("ReduceSum", ["pf"], ["nf"], keepdims=0), N("Cast", ["nf"], ["n"], to=i64)])
        g = helper.make_graph(count + [N("Loop", ["M", "c"], ["scans"], body=body), N("Relu", ["scans"], ["y"])],
                              "m", [_vi("x", [4, 3])], [_vi("y", [None, 1])],
                              [numpy_helper.from_array(np.array(2**62, np.int64), "M"),
                               numpy_helper.from_array(np.array(True), "c"),
                               numpy_helper.from_array(np.array(0, np.int64), "z"),
                               numpy_helper.from_array(np.array(0.0, np.float32), "zf")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    assert hatch._tail(model("shape")) == {}
    tail = hatch._tail(model("values"))
    assert [model("values").graph.node[k].op_type for k in sorted(tail)] == ["Loop", "Relu"]
