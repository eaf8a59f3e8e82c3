"""Graph optimisation before partitioning: constants folded, conv in NHWC as ACL wants."""

from __future__ import annotations

import tvm
from tvm import relax

_LAYOUT_RULES_REGISTERED = False


def _register_layout_rules() -> None:
    """clip and leakyrelu have no layout-inference rule in TVM 0.27, so ConvertLayout puts a
    transpose pair around every ReLU6. They are elementwise: reuse relu's rule."""
    global _LAYOUT_RULES_REGISTERED
    if _LAYOUT_RULES_REGISTERED:
        return
    unary = tvm.ir.Op.get("relax.nn.relu").get_attr("FRelaxInferLayout")
    for name in ("relax.clip", "relax.nn.leakyrelu"):
        op = tvm.ir.Op.get(name)
        if op.get_attr("FRelaxInferLayout") is None:
            tvm.ir.register_op_attr(name, "FRelaxInferLayout", unary)
    _LAYOUT_RULES_REGISTERED = True


LAYOUT_PERMS = ([0, 2, 3, 1], [0, 3, 1, 2])


def count_layout_transposes(mod: tvm.IRModule) -> int:
    """NCHW<->NHWC transposes: what the layout change costs, to be kept at subgraph boundaries."""
    n = 0

    def visit(e):
        nonlocal n
        if (isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.permute_dims"
                and e.attrs.axes is not None and [int(a) for a in e.attrs.axes] in LAYOUT_PERMS):
            n += 1

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return n


def optimise(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict]:
    """Returns the module and facts for the manifest (transposes added by the layout change)."""
    _register_layout_rules()
    seq = tvm.transform.Sequential([
        relax.transform.FoldConstant(),
        relax.transform.FoldBatchnormToConv2D(),   # conv2d -> batch_norm (onnxruntime folds most already)
        relax.transform.FoldConstant(),
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}),
        relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(),
    ])
    mod = seq(mod)
    return mod, {"layout_transposes": count_layout_transposes(mod)}
