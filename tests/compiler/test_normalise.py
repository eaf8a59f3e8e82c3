"""The normaliser (compiler/stages/normalise.py): every step, on a tiny generated model that makes it act,
leaves a model valid for the model's own opset (onnx's full check) that onnxruntime runs to the
same numbers as the original; a step that breaks a file onnxruntime runs is blamed by name; and
the traits it exists for (unsorted graphs, fp16 islands, opset-11 Resize with sizes) compile and
verify end to end against onnxruntime on the file as shipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from support.cli import manifest_of, run_cli
from tandoor_compiler.stages import normalise
from tandoor_compiler.errors import CompileError

N = helper.make_node
RNG = np.random.default_rng(20261204)
OPSETS = (9, 11, 13, 17)


def _w(*shape, scale=0.3) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs: dict, outputs: dict, inits: dict | None = None, *, opset: int, ir: int | None = None,
           inits_as_inputs: bool = False, value_info=()) -> onnx.ModelProto:
    inits = inits or {}
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()]
    if inits_as_inputs:
        vi += [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
               for n, a in inits.items()]
    g = helper.make_graph(nodes, "m", vi, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                           for n, s in outputs.items()],
                          [numpy_helper.from_array(np.asarray(a), n) for n, a in inits.items()],
                          value_info=list(value_info))
    kw = {"ir_version": ir} if ir else {}
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], **kw)


def _conv_relu(opset: int, **kw) -> onnx.ModelProto:
    return _model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), N("Relu", ["c"], ["y"])],
                  {"x": [1, 3, 8, 8]}, {"y": [1, 4, 8, 8]}, {"w": _w(4, 3, 3, 3), "b": _w(4)}, opset=opset, **kw)


# --- one model per step that makes the step act, for the opsets where its trait exists ---------------

def _unsorted(opset):
    m = _conv_relu(opset)
    nodes = list(m.graph.node)[::-1]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    return m


def _opset6(opset):
    """onnxruntime runs no BatchNormalization-6: the reference is the same model at opset 9."""
    inits = {"g": np.abs(_w(3)) + 0.5, "be": _w(3), "mu": _w(3), "var": np.abs(_w(3)) + 0.5}

    def at(v, **bn):
        return _model([N("BatchNormalization", ["x", "g", "be", "mu", "var"], ["bn"], **bn),
                       N("AveragePool", ["bn"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
                      {"x": [1, 3, 8, 8]}, {"y": [1, 3, 4, 4]}, inits, opset=v, ir=3 if v < 7 else None,
                      inits_as_inputs=v < 7)
    return at(6, is_test=1), at(9)


def _old_forms(opset):
    """The attribute forms TVM's importer misreads (normalise.ATTRIBUTE_FORMS), at the oldest opset
    onnxruntime runs them in: Slice-1, Pad-2, Clip-6, Upsample (scales an attribute before 9),
    ReduceX axes, Split-2, Squeeze-1/Unsqueeze-1."""
    up = ([N("Upsample", ["c"], ["u"], scales=[1.0, 1.0, 2.0, 2.0])] if opset < 9 else
          [N("Upsample", ["c", "sc"], ["u"], mode="linear")] if opset < 10 else [N("Resize", ["c", "sc"], ["u"])])
    sl = (N("Slice", ["x"], ["s"], starts=[1, 2], ends=[7, 1000], axes=[2, 3]) if opset < 10 else
          N("Slice", ["x", "st", "en", "ax"], ["s"]))       # Slice-10 takes inputs; Pad, Clip still attributes
    nodes = [sl,
             N("Pad", ["s"], ["p"], pads=[0, 0, 1, 2, 0, 0, 2, 1], value=0.5),
             N("Clip", ["p"], ["c"], min=-0.5, max=0.8), *up,
             N("ReduceMean", ["u"], ["r"], axes=[3]), N("Split", ["r"], ["a", "b"], axis=1, split=[1, 3]),
             N("Squeeze", ["a"], ["sq"], axes=[1]), N("Unsqueeze", ["sq"], ["us"], axes=[1]),
             N("ReduceSum", ["b"], ["rs"], axes=[1]), N("Concat", ["us", "rs"], ["y"], axis=1)]
    return _model(nodes, {"x": [1, 4, 8, 8]}, {"y": [1, 2, 18, 1]},
                  {"sc": np.array([1, 1, 2, 2], np.float32), "st": np.array([1, 2]), "en": np.array([7, 1000]),
                   "ax": np.array([2, 3])} if opset >= 9 else {}, opset=opset)


def _resize10(opset):
    """Resize-10 (no roi: its second input is scales), which TVM's importer reads as roi."""
    return _model([N("Resize", ["x", "sc"], ["y"], mode="linear")], {"x": [1, 3, 4, 4]}, {"y": [1, 3, 8, 8]},
                  {"sc": np.array([1, 1, 2, 2], np.float32)}, opset=opset)


def _empty_optional(opset):
    """Optional inputs left empty: a Clip without its min, a Squeeze with an empty axes (which
    onnxruntime's kernel refuses: the reference leaves it out)."""
    def at(axes):
        return _model([N("Clip", ["x", "", "hi"], ["c"]), N("ReduceMean", ["c"], ["r"], axes=[1]),
                       N("Squeeze", ["r", *axes], ["y"])],
                      {"x": [1, 3, 4, 4]}, {"y": [4, 4]}, {"hi": np.array(0.3, np.float32)}, opset=opset)
    return at([""]), at([])


def _constants(opset):
    m = _conv_relu(opset)
    w = m.graph.initializer[0]
    m.graph.node.insert(0, N("Constant", [], [w.name], value=w))
    del m.graph.initializer[0]
    return m


def _identity_dropout(opset):
    drop = N("Dropout", ["c"], ["d"], ratio=0.5) if opset < 12 else N("Dropout", ["c"], ["d"])
    return _model([N("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), drop, N("Identity", ["d"], ["i"]),
                   N("Relu", ["i"], ["r"]), N("Identity", ["r"], ["y"])],
                  {"x": [1, 3, 8, 8]}, {"y": [1, 4, 8, 8]}, {"w": _w(4, 3, 3, 3)}, opset=opset)


def _resize(empty: str):
    """tf2onnx / keras: scales and sizes both given, one an empty tensor. onnxruntime runs the empty
    sizes form only without it: its reference is that."""
    def make(opset):
        inits = {"roi": np.zeros(0, np.float32)}
        if empty == "scales":
            inits.update(scales=np.zeros(0, np.float32), sizes=np.array([1, 3, 16, 16], np.int64))
        else:
            inits.update(scales=np.array([1, 1, 2, 2], np.float32), sizes=np.zeros(0, np.int64))
        m = _model([N("Resize", ["x", "roi", "scales", "sizes"], ["y"], mode="nearest")],
                   {"x": [1, 3, 8, 8]}, {"y": [1, 3, 16, 16]}, inits, opset=opset)
        if empty == "scales":
            return m
        ref = onnx.ModelProto()
        ref.CopyFrom(m)
        del ref.graph.node[0].input[3]
        return m, ref
    return make


def _dynamic(opset):
    return _model([N("Relu", ["x"], ["y"])], {"x": ["N", 3, "H", "W"]}, {"y": ["N", 3, "H", "W"]}, opset=opset)


def _stale(opset):
    return _conv_relu(opset, value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 99, 99])])


def _depth_to_space(opset):
    mode = {"mode": "CRD"} if opset >= 11 else {}
    return _model([N("DepthToSpace", ["x"], ["d"], blocksize=2, **mode), N("SpaceToDepth", ["d"], ["y"], blocksize=2)],
                  {"x": [1, 8, 4, 4]}, {"y": [1, 8, 4, 4]}, opset=opset)


def _conv_transpose(opset):
    return _model([N("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[2, 2], strides=[2, 2], output_shape=[17, 17])],
                  {"x": [1, 3, 8, 8]}, {"y": [1, 4, 17, 17]}, {"w": _w(3, 4, 2, 2)}, opset=opset)


def _shape_chain(opset):
    idx = {"i": np.array(1, np.int64), "minus1": np.array([-1], np.int64), "zero": np.array([0], np.int64)}
    return _model([N("Shape", ["x"], ["s"]), N("Gather", ["s", "i"], ["c"], axis=0),
                   N("Unsqueeze", ["c"], ["cu"], axes=[0]) if opset < 13 else N("Unsqueeze", ["c", "zero"], ["cu"]),
                   N("Concat", ["minus1", "cu"], ["shape"], axis=0), N("Reshape", ["x", "shape"], ["y"])],
                  {"x": [1, 3, 4, 4]}, {"y": [16, 3]}, idx, opset=opset)


def _fp16(opset):
    """onnxconverter-common's float16 converter with keep_io_types, by hand: Casts at the inputs and
    outputs, fp16 weights, an fp32 island (a blocked op between Casts), the input Cast appended last."""
    inits = {"w": _w(4, 3, 3, 3).astype(np.float16), "b": _w(4).astype(np.float16)}
    nodes = [N("Conv", ["x16", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             N("Cast", ["c"], ["c32"], to=TensorProto.FLOAT), N("Sigmoid", ["c32"], ["s32"]),
             N("Cast", ["s32"], ["s"], to=TensorProto.FLOAT16), N("Mul", ["c", "s"], ["y16"]),
             N("Cast", ["y16"], ["y"], to=TensorProto.FLOAT), N("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16)]
    return _model(nodes, {"x": [1, 3, 8, 8]}, {"y": [1, 4, 8, 8]}, inits, opset=opset)


TRIGGERS = {   # step -> [(trait, model(opset), opsets, --input pins)]
    "sort_nodes": [("unsorted", _unsorted, OPSETS, {})],
    "ir3_weights_not_inputs": [("ir3 weights not inputs", lambda o: _conv_relu(o, ir=3), (7, 8), {})],
    "drop_trailing_empty_inputs": [("empty optional inputs", _empty_optional, (13, 17), {})],
    "upgrade_old_opset": [("opset6", _opset6, (6,), {}), ("old attribute forms", _old_forms, (7, 9, 10), {}),
                          ("resize-10", _resize10, (10,), {})],
    "initializers_out_of_inputs": [("ir4", lambda o: _conv_relu(o, ir=4, inits_as_inputs=True), (9, 11), {})],
    "constants_to_initializers": [("constant weights", _constants, OPSETS, {})],
    "refuse_training_only_ops": [],         # it refuses or leaves the model alone: test below
    "drop_identity": [("identity+dropout", _identity_dropout, OPSETS, {})],
    # opset 11 requires roi and scales: an empty scales beside sizes stays (TVM's importer copes)
    "tidy_resize_inputs": [("empty scales", _resize("scales"), (13, 17), {}),
                           ("empty sizes", _resize("sizes"), (11, 13, 17), {})],
    "pin_inputs": [("dynamic dims", _dynamic, OPSETS, {"x": [1, 3, 6, 5]})],
    "drop_stale_value_info": [("stale value_info", _stale, OPSETS, {})],
    "decompose_depth_space": [("depth/space", _depth_to_space, OPSETS, {})],
    "conv_transpose_output_shape": [("output_shape", _conv_transpose, OPSETS, {})],
    "fold_with_onnxruntime": [("shape chain", _shape_chain, OPSETS, {})],
    "fp16_to_fp32": [("fp16 islands", _fp16, OPSETS, {})],
}
CASES = [pytest.param(step.name, trait, make, opset, pins, id=f"{step.name}-{trait}-opset{opset}")
         for step in normalise.STEPS for trait, make, opsets, pins in TRIGGERS[step.name] for opset in opsets]


def test_every_step_has_a_model_that_makes_it_act():
    assert set(TRIGGERS) == {s.name for s in normalise.STEPS}


def _session(m: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name,trait,make,opset,pins", CASES)
def test_each_step_keeps_the_model_valid_for_its_opset_and_its_numbers(tmp_path, name, trait, make, opset, pins):
    original = made = make(opset)
    reference = original
    if isinstance(made, tuple):
        original, reference = made
    path = tmp_path / "m.onnx"
    path.write_bytes(original.SerializeToString())
    ctx = normalise.Context(path, pins)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    before = normalise.STEPS[[s.name for s in normalise.STEPS].index(name) - 1].name if name != "sort_nodes" else None
    if before:
        normalise.normalise(model, ctx, until=before)
    was = model.SerializeToString()
    normalise.normalise(model, ctx, until=name) if not before else \
        next(s for s in normalise.STEPS if s.name == name).run(model, ctx)
    assert model.SerializeToString() != was, f"{name} did nothing to the {trait} model"
    onnx.checker.check_model(model, full_check=True)
    names = [s.name for s in normalise.STEPS]
    upgraded = opset < 7 or (names.index(name) >= names.index("upgrade_old_opset") and normalise.old_forms(original))
    assert normalise.opset(model) == (13 if upgraded else opset)

    ins = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    feeds = {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in ins}
    want = _session(reference).run(None, feeds)
    got = _session(model).run(None, feeds)
    tol = 2e-2 if name == "fp16_to_fp32" else 1e-5     # fp16's rounding is gone: fp32 is nearer the truth
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.astype(np.float32), atol=tol, rtol=tol)


def test_a_training_mode_batchnorm_is_refused_and_an_inference_one_left_alone(tmp_path):
    inits = {"g": np.ones(3, np.float32), "be": np.zeros(3, np.float32), "mu": np.zeros(3, np.float32),
             "var": np.ones(3, np.float32)}
    for training, opset in ((1, 15), (0, 15), (0, 9)):
        kw = {"training_mode": training} if opset >= 14 else {}
        m = _model([N("BatchNormalization", ["x", "g", "be", "mu", "var"], ["y"], **kw)],
                   {"x": [1, 3, 4, 4]}, {"y": [1, 3, 4, 4]}, inits, opset=opset)
        was = m.SerializeToString()
        ctx = normalise.Context(tmp_path / "bn.onnx", {})
        if training:
            with pytest.raises(CompileError, match="training mode"):
                normalise.refuse_training_only_ops(m, ctx)
        else:
            normalise.refuse_training_only_ops(m, ctx)
            assert m.SerializeToString() == was


# --- unsorted graphs and onnx's checker -------------------------------------------------------------

def test_an_unsorted_graph_is_sorted_stably_before_the_checker_sees_it(tmp_path):
    m = _fp16(13)
    ctx = normalise.Context(tmp_path / "m.onnx", {})
    normalise.sort_nodes(m, ctx)
    order = [n.output[0] for n in m.graph.node]
    assert order == ["x16", "c", "c32", "s32", "s", "y16", "y"]    # the Cast first, the rest as they were
    assert ctx.notes == ["1 node(s) read a tensor made later in the file (fp16 converters append their input "
                         "Casts last); nodes sorted topologically"]
    normalise.sort_nodes(m, ctx)                                      # sorted: left as it is, no second note
    assert [n.output[0] for n in m.graph.node] == order and len(ctx.notes) == 1


def test_the_checkers_refusal_is_quoted_whole_on_one_line(tmp_path):
    m = _conv_relu(13)
    m.graph.node[1].input[0] = "ghost"         # made by no node: onnx's message spans three lines
    src = tmp_path / "ghost.onnx"
    src.write_bytes(m.SerializeToString())
    res = run_cli("tandoor", "compile", str(src), "-o", str(tmp_path / "ghost.hmod"), "-q")
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "invalid ONNX model" in lines[0], res.stderr
    assert "input 'ghost' of node" in lines[0] and "OpType: Relu" in lines[0] and "is not output of any previous" \
        in lines[0], lines[0]


# --- a step that breaks a file onnxruntime runs is Tandoor's bug, named -------------------------------

def test_a_step_that_breaks_a_valid_file_is_named_not_the_exporter(tmp_path):
    src = tmp_path / "ok.onnx"
    src.write_bytes(_conv_relu(13).SerializeToString())
    env = {**os.environ, "TANDOOR_FAILPOINT": "normalise:drop_identity"}
    args = ("tandoor", "compile", str(src), "-o", str(tmp_path / "ok.hmod"), "-q", "--no-cache")
    res = run_cli(*args, env=env)
    assert res.returncode == 3, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "internal error in stage load" in lines[0] and "normalisation step drop_identity" in lines[0] \
        and "runs as shipped" in lines[0] and "--debug" in lines[0] and "export the model" not in lines[0], lines[0]
    res = run_cli(*args, "--debug", env=env)
    assert res.returncode == 3 and "Traceback" in res.stderr and "StepBrokeModel" in res.stderr
    assert not (tmp_path / "ok.hmod").exists()


# --- end to end: compile, the bundle's self-check, tandoor verify, and onnxruntime on the file as shipped

def _compile_and_verify(tmp: Path, name: str, m: onnx.ModelProto, *args: str) -> tuple[Path, Path, dict]:
    src, out = tmp / f"{name}.onnx", tmp / f"{name}.hmod"
    src.write_bytes(m.SerializeToString())
    res = run_cli("tandoor", "compile", str(src), "-o", str(out), "-q", *args)
    assert res.returncode == 0, f"{name}: exit {res.returncode}: {res.stderr[-2000:]}"
    for delegate in ("onnxruntime", "tvm"):
        v = run_cli("tandoor", "verify", str(out), "--reference", str(src), "--delegate", delegate, "--json")
        assert v.returncode == 0 and json.loads(v.stdout)["ok"], f"{name} via {delegate}: {v.stdout[-1500:]}"
    return src, out, manifest_of(out)


def _bundle_vs_file(out: Path, src: Path, delegate: str) -> float:
    """Max abs difference of the bundle's outputs from onnxruntime's on the file as shipped, on the
    first golden pair's inputs."""
    from tandoor_agent.run.runtime import HybridModule
    from tandoor_contract import hmod, probe

    with hmod.open_bundle(out) as b:
        ins = probe.inputs({"inputs": b.manifest["inputs"]}, seed=1)
        module = HybridModule(b, delegate=delegate)
        try:
            got = module.run(ins)
        finally:
            module.close()
        want = _session(onnx.load(str(src))).run(None, {i["name"]: a for i, a in zip(b.manifest["inputs"], ins)})
    return max(float(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max()) for g, w in zip(got, want))


@pytest.mark.parametrize("opset", [11, 13])
def test_a_resize_with_sizes_and_an_empty_scales_compiles_at_its_own_opset(tmp_path, opset):
    """opset 11 requires roi and scales: the empty scales stays in the file, and TVM's importer reads
    it as none (before, it became "", which onnxruntime refuses at opset 11)."""
    m = _model([N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                N("Resize", ["c", "roi", "scales", "sizes"], ["y"], mode="nearest",
                  coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
               {"x": [1, 3, 8, 8]}, {"y": [1, 4, 16, 16]},
               {"w": _w(4, 3, 3, 3), "b": _w(4), "roi": np.zeros(0, np.float32), "scales": np.zeros(0, np.float32),
                "sizes": np.array([1, 4, 16, 16], np.int64)}, opset=opset)
    src, out, man = _compile_and_verify(tmp_path, f"resize{opset}", m, "--policy", "all")
    assert "acl.resize2d" in [c for p in man["partitions"] if p["delegate"] for c in p["composites"]]
    assert _bundle_vs_file(out, src, "auto") < 1e-4


def _converted_fp16(keep_io_types: bool = True) -> onnx.ModelProto:
    """A small CNN through onnxruntime's copy of onnxconverter-common's float16 converter, as a user
    converts a model: inputs and outputs kept fp32 (or fp16 too), Sigmoid blocked (an fp32 island
    between Casts)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    m = _model([N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]), N("Relu", ["c1"], ["r1"]),
                N("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]), N("Sigmoid", ["c2"], ["s"]),
                N("Mul", ["c2", "s"], ["y"])],
               {"x": [1, 3, 16, 16]}, {"y": [1, 8, 16, 16]},
               {"w1": _w(8, 3, 3, 3), "b1": _w(8), "w2": _w(8, 8, 3, 3, scale=0.1), "b2": _w(8)}, opset=13)
    return convert_float_to_float16(m, keep_io_types=keep_io_types, op_block_list=["Sigmoid"])


def test_an_fp16_converted_unsorted_model_compiles_in_fp32_and_matches_the_file_as_shipped(tmp_path):
    m = _converted_fp16()
    made = {o for n in m.graph.node for o in n.output}
    assert any(i in made and i not in {o for p in m.graph.node[:k] for o in p.output}
               for k, n in enumerate(m.graph.node) for i in n.input), "the converter's output was sorted"
    weights = sum(t.data_type == TensorProto.FLOAT16 for t in m.graph.initializer)
    casts = sum(n.op_type == "Cast" for n in m.graph.node)
    src, out, man = _compile_and_verify(tmp_path, "fp16", m, "--policy", "all")
    fp16 = man["fp16"]
    assert (fp16["weights"], fp16["casts"], fp16["computed_in"], fp16["fp16_io"]) == (weights, casts, "float32", [])
    assert 0 <= fp16["max_abs_vs_fp16"] < 1e-2     # onnxruntime's CPU kernels compute fp16 Convs in fp32 too
    assert any("fp16 parts computed in fp32" in n for n in man["notes"])
    assert any("sorted topologically" in n for n in man["notes"])
    assert any(p["delegate"] for p in man["partitions"])           # the fp32 convolutions went to ACL
    for delegate in ("auto", "tvm"):
        # the drift recorded is the bundle's distance from the fp16 file on the golden inputs
        assert _bundle_vs_file(out, src, delegate) <= fp16["max_abs_vs_fp16"] + 1e-4


def test_an_fp16_model_with_fp16_inputs_and_outputs_is_an_fp32_bundle(tmp_path):
    m = _converted_fp16(keep_io_types=False)
    assert m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    src, out, man = _compile_and_verify(tmp_path, "io16", m)
    assert man["fp16"]["fp16_io"] == ["x", "y"] and man["fp16"]["max_abs_vs_fp16"] < 1e-2
    assert [i["dtype"] for i in man["inputs"] + man["outputs"]] == ["float32", "float32"]
    assert any("fp16 inputs/outputs x, y are fp32 in the bundle" in n for n in man["notes"])


def test_a_uint8_camera_input_cast_through_fp16_keeps_its_cast(tmp_path):
    """uint8 HWC pixels -> Cast(fp16) -> Cast(fp32) -> scale -> NCHW (a real pre-processing graph,
    trtutils' yolo_preproc_base.onnx, and what the fp16 converter makes of a uint8-input model):
    the Cast from uint8 becomes a Cast to fp32, not an Identity that fed uint8 to a Mul."""
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["h"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "scale"], ["s"]),
             helper.make_node("Transpose", ["s"], ["t"], perm=[0, 3, 1, 2]),
             helper.make_node("Conv", ["t", "w"], ["y"], pads=[1, 1, 1, 1])]
    g = helper.make_graph(nodes, "u8fp16", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 16, 16, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                          [numpy_helper.from_array(np.float32(1 / 255), "scale"),
                           numpy_helper.from_array(_w(4, 3, 3, 3), "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    src, out, man = _compile_and_verify(tmp_path, "u8fp16", m)
    assert man["inputs"][0]["dtype"] == "uint8" and man["fp16"]["casts"] == 2, man.get("fp16")
    assert _bundle_vs_file(out, src, "tvm") < 1e-4
