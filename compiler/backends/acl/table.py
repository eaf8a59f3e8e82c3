"""The ACL table: every entry, quantized first, most specific pattern first; entries newer than
every board's Arm NN gated off; and the lookups partition.py and codegen.py call."""

from __future__ import annotations

from dataclasses import replace

from tvm.relax.dpl import is_const, is_op, wildcard

from tandoor_contract import orders

from .checks import (GELU_SINCE, check_adaptive_pool, check_concat, check_conv2d, check_conv2d_transpose,
                     check_dense, check_elementwise, check_gelu, check_global_pool, check_layer_norm, check_pad,
                     check_pool2d, check_prelu, check_reshape, check_resize, check_softmax, check_strided_slice,
                     check_transpose, check_unary)
from .emit import (emit_activation, emit_binary, emit_concat, emit_conv2d, emit_conv2d_transpose, emit_dense,
                   emit_global_pool2d, emit_layer_norm, emit_pad, emit_pool2d, emit_prelu, emit_reshape,
                   emit_resize2d, emit_softmax, emit_strided_slice, emit_transpose)
from .entry import Entry, Rule, release_reason
from .patterns import _hardsigmoid_rule, _hardswish_rules, _silu_rule, _single, _with_epilogue
from .quantized import _conv_kernel, _dense_kernel, _qadd_rules, _quantized_rules, emit_qadd, emit_qconv2d, emit_qdense


def _entries() -> list[Entry]:
    conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
    deconv = is_op("relax.nn.conv2d_transpose")(wildcard(), is_const())
    dense = is_op("relax.matmul")(wildcard(), is_const())
    return [
        # quantized first: their patterns contain the float ones
        Entry("qconv2d", "conv2d", tuple(_quantized_rules(
            "conv2d", lambda x: is_op("relax.nn.conv2d")(x, is_const()), check_conv2d, _conv_kernel)), emit_qconv2d,
              "QDQ convolution: int8/uint8 in and out, int8 kernel (per tensor or channel), int32 bias, relu/clip"),
        Entry("qdense", "dense", tuple(_quantized_rules(
            "dense", lambda x: is_op("relax.matmul")(x, is_const()), check_dense, _dense_kernel)), emit_qdense,
              "QDQ fully connected: int8/uint8 in and out, int8 kernel, int32 bias"),
        Entry("qadd", "binary", tuple(_qadd_rules()), emit_qadd,
              "QDQ add of two int8/uint8 tensors of one shape (residual adds), relu/clip"),
        Entry("conv2d", "conv2d", tuple(_with_epilogue("conv2d", conv, check_conv2d)), emit_conv2d,
              "convolution (ordinary, depthwise, dilated) + per-channel bias + activation"),
        Entry("conv2d_transpose", "conv2d_transpose",
              tuple(_with_epilogue("conv2d_transpose", deconv, check_conv2d_transpose)), emit_conv2d_transpose,
              "transposed convolution + bias + activation (FPN/U-Net decoders)"),
        Entry("dense", "dense", tuple(_with_epilogue("dense", dense, check_dense)), emit_dense,
              "fully connected + bias + activation"),
        Entry("hardswish", "activation", tuple(_hardswish_rules()), emit_activation,
              "hard-swish written out as ops"),
        Entry("hardsigmoid", "activation", (_hardsigmoid_rule(),), emit_activation, "clip(a*x + b, 0, 1)"),
        Entry("silu", "activation", (_silu_rule(),), emit_activation, "x * sigmoid(x) written out"),
        Entry("gelu", "activation", (_single("gelu", "relax.nn.gelu", check_gelu),), emit_activation,
              "GELU, erf form (ONNX Gelu, or written out: compiler/stages/written_out.py)", since=GELU_SINCE),
        Entry("gelu_tanh", "activation", (_single("gelu_tanh", "relax.nn.gelu_tanh", check_unary),), emit_activation,
              "GELU, tanh form (built from multiply, add and tanh layers)"),
        Entry("layer_norm", "layer_norm", (_single("layer_norm", "relax.nn.layer_norm", check_layer_norm, 3),),
              emit_layer_norm, "LayerNormalization over the last axis (built from mean, subtract, rsqrt layers)"),
        Entry("activation", "activation", (
            _single("relu", "relax.nn.relu", check_unary),
            _single("clip", "relax.clip", check_unary, 3),
            _single("sigmoid", "relax.sigmoid", check_unary),
            _single("tanh", "relax.tanh", check_unary),
            _single("leaky_relu", "relax.nn.leakyrelu", check_unary)), emit_activation, "activations alone"),
        Entry("prelu", "prelu", (_single("prelu", "relax.nn.prelu", check_prelu, 2),), emit_prelu,
              "PRelu with a constant scalar or per-channel slope"),
        Entry("pool2d", "pool2d", (
            _single("max_pool2d", "relax.nn.max_pool2d", check_pool2d),
            _single("avg_pool2d", "relax.nn.avg_pool2d", check_pool2d)), emit_pool2d, "max/average pooling"),
        Entry("global_pool2d", "global_pool2d", (
            _single("global_avg_pool2d", "relax.nn.adaptive_avg_pool2d", check_adaptive_pool),
            _single("global_avg_pool2d_mean", "relax.mean", check_global_pool),
            _single("global_max_pool2d", "relax.max", check_global_pool)), emit_global_pool2d,
              "mean/max over H and W"),
        Entry("binary", "binary", tuple(_single(n, op, check_elementwise, 2) for op, n in (
            ("relax.add", "add"), ("relax.subtract", "subtract"), ("relax.multiply", "multiply"),
            ("relax.divide", "divide"), ("relax.maximum", "maximum"), ("relax.minimum", "minimum"))),
              emit_binary, "elementwise arithmetic with broadcasting"),
        Entry("concat", "concat", (_single("concat", "relax.concat", check_concat),), emit_concat, "concatenation"),
        Entry("reshape", "reshape", tuple(_single(n, op, check_reshape, ar) for op, n, ar in (
            ("relax.reshape", "reshape", 2), ("relax.squeeze", "squeeze", 1), ("relax.expand_dims", "expand_dims", 1),
            ("relax.flatten", "flatten", 1))), emit_reshape, "reshape, squeeze, unsqueeze, flatten"),
        Entry("transpose", "transpose", (_single("transpose", "relax.permute_dims", check_transpose),), emit_transpose,
              "axis permutation"),
        Entry("strided_slice", "strided_slice", (_single("strided_slice", "relax.strided_slice", check_strided_slice),),
              emit_strided_slice, "Slice, Split outputs, the Focus space-to-depth stem"),
        Entry("pad", "pad", (_single("pad", "relax.nn.pad", check_pad),), emit_pad, "constant padding"),
        Entry("softmax", "softmax", (_single("softmax", "relax.nn.softmax", check_softmax),), emit_softmax,
              "softmax on any axis"),
        Entry("resize2d", "resize2d", (_single("resize2d", "relax.image.resize2d", check_resize, 2),), emit_resize2d,
              "nearest/bilinear resize"),
    ]


def _gated(e: Entry) -> Entry:
    """An entry no board's Arm NN can build yet matches nothing: its ops stay in TVM, and a board
    release that has the layer (ARMNN_RELEASES) delegates them with no other change."""
    reason = release_reason(e.name, e.since)
    if reason is None:
        return e
    return replace(e, rules=tuple(replace(r, check=lambda ann, reason=reason: reason) for r in e.rules))


ENTRIES: list[Entry] = [_gated(e) for e in _entries()]
_BY_RULE: dict[str, Entry] = {r.name: e for e in ENTRIES for r in e.rules}
assert all(e.order_type in orders.OPS for e in ENTRIES), "an ACL entry names an op type the contract lacks"


def rules() -> list[Rule]:
    """Every pattern, most specific first (entries are listed in that order)."""
    return [r for e in ENTRIES for r in e.rules]


def entry_for(composite: str) -> Entry:
    try:
        return _BY_RULE[composite]
    except KeyError:
        raise KeyError(f"no ACL entry has the composite {composite}") from None
