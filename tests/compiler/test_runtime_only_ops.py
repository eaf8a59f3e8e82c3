"""No compile writes a bundle the device cannot run: every op the op table accepts goes through a
compile and then the runtime-only agent, compared with onnxruntime.

The ops are the ACL table's (each case of tests/compiler/test_ops.py) and the ONNX ops the TVM side
takes that ACL does not (TVM_CASES below), side by side in one model (each case converted to one
opset by onnx's version converter), compiled twice by the real `tandoor compile`: policy all (every
ACL region an order, run by the executors and by its TVM fallback) and policy none (every op in
the TVM lib). The compile's own check is the device's run: `tandoor-agent`'s health check in a
process that loads TVM's runtime library only, golden pairs from onnxruntime on the source model,
with auto's executors and with the TVM fallbacks; a packed function the runtime lacks fails there
(and, earlier, hatch.check_runtime refuses the build). Then `tandoor-agent run` on one more input.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, version_converter

from support.cli import manifest_of, run_cli

import test_ops  # noqa: E402  (tests/compiler/test_ops.py: the ACL table's cases)

N = helper.make_node
X = {"x": [1, 4, 6, 6]}
RNG = np.random.default_rng(20261204)


def _w(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def _i64(*v) -> np.ndarray:
    return np.array(v, np.int64)


def C(name, nodes, outputs: dict, inits: dict | None = None, inputs: dict | None = None, opset: int = 17):
    return test_ops.Case(f"tvm_{name}", nodes, inputs or X, outputs, inits or {}, (), opset=opset)


Y = {"y": [1, 4, 6, 6]}
# ONNX ops the TVM side runs (no ACL entry takes them, or not in this form); tiny, float in and out.
TVM_CASES = [
    *[C(op.lower(), [N(op, ["x"], ["y"])], Y) for op in
      ("Exp", "Abs", "Neg", "Floor", "Ceil", "Erf", "Sin", "Cos", "Sign", "Round", "Softplus", "Softsign",
       "Elu", "Selu", "Tanh", "Sigmoid", "Relu", "HardSigmoid")],
    C("log_sqrt_reciprocal", [N("Abs", ["x"], ["a"]), N("Add", ["a", "one"], ["p"]), N("Log", ["p"], ["l"]),
                              N("Sqrt", ["p"], ["s"]), N("Reciprocal", ["p"], ["r"]), N("Sum", ["l", "s", "r"], ["y"])],
      Y, {"one": np.array(1, np.float32)}),
    C("gelu_erf", [N("Div", ["x", "sq2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["a"]),
                   N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])], Y,
      {"sq2": np.array(1.4142135, np.float32), "one": np.array(1, np.float32), "half": np.array(0.5, np.float32)}),
    C("layernorm_op", [N("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], Y, {"g": _w(6), "b": _w(6)}),
    C("layernorm_elementwise", [N("ReduceMean", ["x"], ["mu"], axes=[-1]), N("Sub", ["x", "mu"], ["c"]),
                                N("Pow", ["c", "two"], ["sq"]), N("ReduceMean", ["sq"], ["var"], axes=[-1]),
                                N("Add", ["var", "eps"], ["ve"]), N("Sqrt", ["ve"], ["sd"]), N("Div", ["c", "sd"], ["y"])],
      Y, {"two": np.array(2, np.float32), "eps": np.array(1e-5, np.float32)}),
    C("instance_norm", [N("InstanceNormalization", ["x", "g", "b"], ["y"])], Y, {"g": _w(4), "b": _w(4)}),
    C("lrn", [N("LRN", ["x"], ["y"], size=3)], Y),
    C("reductions", [N("ReduceMax", ["x"], ["a"], axes=[1]), N("ReduceMin", ["x"], ["b"], axes=[1]),
                     N("ReduceSum", ["x", "ax"], ["c"]), N("ReduceL2", ["x"], ["d"], axes=[1]),
                     N("ReduceProd", ["x"], ["e"], axes=[1]), N("Sum", ["a", "b", "c", "d", "e"], ["y"])],
      {"y": [1, 1, 6, 6]}, {"ax": _i64(1)}),
    C("arg_max_min", [N("ArgMax", ["x"], ["i"], axis=1), N("ArgMin", ["x"], ["j"], axis=1),
                      N("Add", ["i", "j"], ["k"]), N("Cast", ["k"], ["y"], to=TensorProto.FLOAT)], {"y": [1, 1, 6, 6]}),
    C("compare_where", [N("Greater", ["x", "zero"], ["g"]), N("Less", ["x", "zero"], ["l"]), N("Or", ["g", "l"], ["o"]),
                        N("Not", ["o"], ["n"]), N("Equal", ["x", "x"], ["e"]), N("And", ["n", "e"], ["a"]),
                        N("Where", ["a", "x", "neg"], ["w"]), N("Where", ["g", "x", "w"], ["y"])],
      Y, {"zero": np.array(0, np.float32), "neg": np.array(-1, np.float32)}),
    C("max_min_mod_pow", [N("Max", ["x", "k"], ["a"]), N("Min", ["a", "k2"], ["b"]), N("Abs", ["b"], ["c"]),
                          N("Pow", ["c", "k"], ["d"]), N("Mod", ["x", "m"], ["e"], fmod=1), N("Add", ["d", "e"], ["y"])],
      Y, {"k": np.array(0.5, np.float32), "k2": np.array(1.5, np.float32), "m": np.array(0.7, np.float32)}),
    C("gather_family", [N("Gather", ["x", "gi"], ["g"], axis=1), N("GatherElements", ["x", "ge"], ["e"], axis=3),
                        N("ReduceSum", ["g", "ax1"], ["gs"]), N("ReduceSum", ["e", "ax1"], ["es"]),
                        N("Add", ["gs", "es"], ["y"])],
      {"y": [1, 1, 6, 6]}, {"gi": _i64(3, 0), "ge": np.tile(_i64(5, 4, 3, 2, 1, 0), (1, 4, 6, 1)), "ax1": _i64(1)}),
    C("gather_nd_scatter", [N("GatherND", ["x", "gn"], ["g"]), N("ScatterND", ["x", "si", "g"], ["s"]),
                            N("ScatterElements", ["s", "se", "x"], ["y"], axis=1)],
      Y, {"gn": _i64(0, 1).reshape(1, 2), "si": _i64(0, 2).reshape(1, 2), "se": np.tile(_i64(3, 2, 1, 0).reshape(1, 4, 1, 1), (1, 1, 6, 6))}),
    C("shape_ops", [N("Tile", ["x", "reps"], ["t"]), N("Slice", ["t", "st", "en", "axs"], ["s"]),
                    N("Expand", ["s", "eshape"], ["e"]), N("Flatten", ["e"], ["f"], axis=2),
                    N("Reshape", ["f", "back"], ["y"])],
      Y, {"reps": _i64(1, 2, 1, 1), "st": _i64(2), "en": _i64(6), "axs": _i64(1), "eshape": _i64(1, 4, 6, 6),
          "back": _i64(1, 4, 6, 6)}),
    C("cumsum", [N("CumSum", ["x", "cax"], ["y"])], Y, {"cax": np.array(3, np.int64)}),
    C("trilu_einsum", [N("Trilu", ["x"], ["t"]), N("Einsum", ["t", "x"], ["y"], equation="bcij,bcjk->bcik")], Y),
    C("batched_matmul", [N("MatMul", ["x", "w"], ["y"])], {"y": [1, 4, 6, 3]}, {"w": _w(1, 4, 6, 3)}),
    C("resize_nearest_linear", [N("Resize", ["x", "", "sc"], ["a"], mode="nearest"),
                                N("Resize", ["a", "", "sc2"], ["y"], mode="linear")],
      {"y": [1, 4, 6, 6]}, {"sc": np.array([1, 1, 2, 2], np.float32), "sc2": np.array([1, 1, 0.5, 0.5], np.float32)}),
    C("depth_space_grid", [N("SpaceToDepth", ["x"], ["s"], blocksize=2), N("DepthToSpace", ["s"], ["y"], blocksize=2)], Y),
    C("onehot_range", [N("Shape", ["x"], ["sh"]), N("Cast", ["sh"], ["shf"], to=TensorProto.FLOAT),
                       N("ReduceSum", ["shf", "ax0"], ["n"], keepdims=0), N("Add", ["x", "n"], ["y"])],
      Y, {"ax0": _i64(0)}),
    C("conv_3d_in_1d", [N("Conv", ["x", "w1"], ["y"], pads=[1, 1])], {"y": [1, 2, 6]}, {"w1": _w(2, 4, 3)},
      inputs={"x": [1, 4, 6]}),
    C("avgpool_1d_reduce_l1", [N("AveragePool", ["x"], ["a"], kernel_shape=[2]), N("ReduceL1", ["a"], ["y"], axes=[1])],
      {"y": [1, 1, 5]}, inputs={"x": [1, 4, 6]}),
    C("mish", [N("Mish", ["x"], ["y"])], Y, opset=18),
    C("gelu_op", [N("Gelu", ["x"], ["y"])], Y, opset=20),
]


OPSET = 20   # every case converted to it (onnx's version converter): one model for all of them


def _at_opset(c) -> tuple[list, list]:
    """A case's nodes and initializers as of OPSET (reductions take axes as an input from 18 on)."""
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    g = helper.make_graph(c.nodes, c.name, [vi(n, s) for n, s in c.inputs.items()],
                          [vi(n, s) for n, s in c.outputs.items()],
                          [numpy_helper.from_array(np.asarray(a), n) for n, a in c.inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", c.opset)], ir_version=8)
    if c.opset != OPSET:
        m = version_converter.convert_version(m, OPSET)
    return list(m.graph.node), list(m.graph.initializer)


def merged(cases: list, name: str) -> onnx.ModelProto:
    """The cases side by side in one graph at OPSET: every tensor and node renamed <case>__<name>."""
    nodes, inputs, outputs, inits = [], [], [], []
    for c in cases:
        p = f"{c.name}__"
        ren = lambda n: p + n if n else n  # noqa: E731
        c_nodes, c_inits = _at_opset(c)
        for n in c_nodes:
            m = onnx.NodeProto()
            m.CopyFrom(n)
            m.input[:] = [ren(i) for i in n.input]
            m.output[:] = [ren(o) for o in n.output]
            m.name = p + (n.name or n.output[0])
            nodes.append(m)
        vi = lambda n, s: helper.make_tensor_value_info(p + n, TensorProto.FLOAT, s)  # noqa: E731
        inputs += [vi(n, s) for n, s in c.inputs.items()]
        outputs += [vi(n, s) for n, s in c.outputs.items()]
        for t in c_inits:
            t.name = p + t.name
            inits.append(t)
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("policy", ["all", "none"])
def test_every_op_the_table_accepts_runs_in_the_runtime_only_agent(policy, tmp_path):
    """policy all: each ACL case's region an order (executors + TVM fallbacks); none: all in TVM."""
    model = tmp_path / "every_op.onnx"
    onnx.save(merged(test_ops.CASES + TVM_CASES, "every_op"), str(model))
    bundle = tmp_path / f"every_op_{policy}.hmod"
    # the compile's check is the runtime-only agent's health check against onnxruntime's golden pairs
    res = run_cli("tandoor", "compile", str(model), "-o", str(bundle), "--policy", policy, "--measure", "off")
    assert res.returncode == 0, f"policy {policy}: {res.stderr.strip().splitlines()[-1:]}"
    man = manifest_of(bundle)
    assert not [p for p in man["partitions"] if p.get("kind") == "onnx"], "an op of the table went to onnxruntime"
    if policy == "none":
        assert not [p for p in man["partitions"] if p["delegate"]]

    # and one more input through `tandoor-agent run` (a runtime-only process), against onnxruntime
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    args, feeds = [], {}
    for i in sess.get_inputs():
        feeds[i.name] = rng.standard_normal([int(d) for d in i.shape]).astype(np.float32)
        np.save(tmp_path / f"{i.name}.npy", feeds[i.name])
        args += ["--input", f"{i.name}={tmp_path / f'{i.name}.npy'}"]
    want = sess.run(None, feeds)
    out = tmp_path / "out"
    run = run_cli("tandoor-agent", "run", str(bundle), *args, "--save-outputs", str(out), "--json", check=True)
    assert json.loads(run.stdout)["outputs"]
    for j, (o, a) in enumerate(zip(sess.get_outputs(), want)):
        np.testing.assert_allclose(np.load(out / f"output_{j}.npy"), a, atol=1e-3, rtol=1e-3, err_msg=o.name)
