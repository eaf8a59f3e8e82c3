"""The ACL backend (order kind ``layers``): what the ARM Compute Library, through Arm NN, runs well.

The support table, as data. One :class:`Entry` per op family: the Relax dataflow patterns it
matches (fused composites, most specific first), a check per pattern that returns None when ACL can
take the match or a one-line reason when it cannot, the order op type it becomes (the contract's
vocabulary, ``tandoor_contract.orders.OPS``) and the function that writes that order op. Next to
it, ``RELAX_OPS`` says per Relax operator how an op left alone is explained (the same checks) and
what it costs (compiler/stages/cost.py). partition.py, codegen.py and cost.py dispatch on these tables and
know no op by name.

The constraints follow Arm NN 20.08 / ACL and TVM v0.19's ACL integration:
  - float32, or a QDQ-quantized conv2d/dense (int8/uint8 activations per tensor, int8 weights per
    tensor or per output channel) or residual add (the "q" entries), tensors of rank <= 4, static
    shapes;
  - conv2d in NHWC with a constant OHWI kernel; depthwise (groups == C_in) is ACL's
    NEDepthwiseConvolutionLayer; other grouped convolutions have no Arm NN 20.08 layer;
  - pools in NHWC with padding smaller than the window (ACL's pooling validation);
  - resize nearest/bilinear in NHWC, with the coordinate modes whose index maps equal ACL's.
Each entry names the first Arm NN release that builds it (``since``, default 20.08: a layer of its
own or layers 20.08 has); one that no release in ARMNN_RELEASES has matches nothing (GELU's erf
form, an Arm NN layer since 23.11), so its op stays in TVM as one fused kernel.

    entry.py       Rule, Match, Entry (what a table entry is); ARMNN_RELEASES and release_reason
    exprs.py       reading Relax expressions (shapes, dtypes, constants) and the float32 test
    checks.py      per-op constraint checks, each returning a reason
    patterns.py    the float patterns: activations as epilogues, bias + activation, written-out forms
    emit.py        writing order ops from a matched composite
    quantized.py   the QDQ (int8) composites: patterns, checks, the weights' int8 grid, writers
    table.py       ENTRIES (the table), rules(), entry_for()
    relax_ops.py   RELAX_OPS: per Relax operator its check and cost class; explain()
    order_onnx.py  an order rendered as ONNX, for the onnxruntime executor (orders/<symbol>.onnx)

"""

from .checks import GELU_SINCE, slice_spec
from .emit import BINARY_KINDS
from .entry import ARMNN_RELEASES, Check, Emit, Entry, Match, OpCheck, Rule, release_reason
from .patterns import EPILOGUES, Activation
from .quantized import INT8_ACTIVATIONS, QUANT_ACTS, bias_limit, int8_grid, weight_grid
from .relax_ops import RELAX_OPS, RelaxOp, explain, relax_op
from .table import ENTRIES, entry_for, rules

__all__ = [
    "ARMNN_RELEASES", "BINARY_KINDS", "ENTRIES", "EPILOGUES", "GELU_SINCE", "INT8_ACTIVATIONS", "QUANT_ACTS",
    "RELAX_OPS", "Activation", "Check", "Emit", "Entry", "Match", "OpCheck", "RelaxOp", "Rule", "bias_limit",
    "entry_for", "explain", "int8_grid", "relax_op", "release_reason", "rules", "slice_spec", "weight_grid",
]
