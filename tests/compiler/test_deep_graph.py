"""A graph deeper than Python's recursion limit (issue 40: a dynamically quantized segmentation
net died in stage golden with a RecursionError in quantize.output_steps): every graph walk the
compiler does in Python is a loop with a stack, so a generated 10,000-node chain passes the load
(every normalisation step), the escape hatch's scan, the check facts, TVM's import, and the
golden stage's quantization steps and tolerance. (The whole compile of it takes ~6 minutes in
TVM's own passes and build: too slow for the suite; done by hand, it compiles and self-checks.)
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tandoor_compiler.stages import check_facts, frontend, importer
from tandoor_compiler.backends.onnx import hatch
from tandoor_compiler.int8 import quantize

DEPTH = 10_000
SCALE = 0.02


def _chain(n: int) -> onnx.ModelProto:
    """Quantize -> Dequantize -> (Relu, Neg) x (n - 2)/2: one output whose step is the dequantize's
    scale, n nodes away."""
    N = helper.make_node
    nodes = [N("QuantizeLinear", ["x", "s", "z"], ["q"]), N("DequantizeLinear", ["q", "s", "z"], ["t0"])]
    for i in range(n - 2):
        nodes.append(N("Relu" if i % 2 == 0 else "Neg", [f"t{i}"], [f"t{i + 1}" if i < n - 3 else "y"]))
    g = helper.make_graph(nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
                          [numpy_helper.from_array(np.array(SCALE, np.float32), "s"),
                           numpy_helper.from_array(np.array(0, np.uint8), "z")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_a_10000_node_chain_passes_every_graph_walk_without_hitting_the_recursion_limit(tmp_path):
    assert sys.getrecursionlimit() < DEPTH      # a recursive walk would fail here
    src = tmp_path / "deep.onnx"
    src.write_bytes(_chain(DEPTH).SerializeToString())
    loaded = frontend.load(src)
    assert len(loaded.proto.graph.node) >= DEPTH - 2      # nothing folded away: the chain is still deep
    assert quantize.output_steps(loaded.proto) == {"y": pytest.approx(SCALE)}
    assert hatch.reasons(loaded.proto) == {}
    check_facts.analyse(loaded.proto)
    mod = importer.to_relax(loaded)
    assert len(mod["main"].body.blocks[0].bindings) >= DEPTH - 2
    entries = quantize.manifest_entries(loaded)
    assert entries is not None and entries["quantized"]["steps"]["y"] == pytest.approx(SCALE)
