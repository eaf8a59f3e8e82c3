"""Arm NN's per-op builders: one function per order op type, found in ``BUILDERS`` (as
compiler/backends/acl/order_onnx.py's are), each ``builder(ex, where, name, input slots, input shapes, output
shape, attrs, weights[, q])`` adding the op's layers to the executor ``ex``'s network and returning
its output slot. The executor (armnn.py) owns the network, the tensor table and the shared layer
helpers these call."""

from __future__ import annotations

import math
from typing import Any

import numpy as np



from .armnn_api import (
    QType, QuantOp, UnsupportedOrder, _ints, resize_flags
)


def conv2d(ex, where, name, ins, in_shapes, out_shape, attrs, wts, q: QuantOp | None = None):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    x_shape = in_shapes[0]
    if len(x_shape) != 4 or len(out_shape) != 4:
        raise UnsupportedOrder(f"{where}: conv2d needs NHWC rank-4 tensors, got {list(x_shape)}")
    cin = x_shape[3]
    if "kernel" not in wts:
        raise UnsupportedOrder(f"{where}: conv2d without a kernel weight")
    kernel = ex._weight(wts["kernel"], where)
    if kernel.ndim != 4:
        raise UnsupportedOrder(f"{where}: conv2d kernel must be rank 4, is {list(kernel.shape)}")
    if q is not None:
        kernel = q.kernel_codes(kernel)
    bias = ex._weight(wts["bias"], where) if wts.get("bias") else None
    sh, sw = _ints(attrs.get("strides", [1, 1]), 2, f"{where} strides")
    pt, pl, pb, pr = _ints(attrs.get("padding", [0, 0, 0, 0]), 4, f"{where} padding")
    dh, dw = _ints(attrs.get("dilation", [1, 1]), 2, f"{where} dilation")
    groups = int(attrs.get("groups", 1))
    o, kh, kw, ki = kernel.shape
    depthwise = bool(attrs.get("depthwise")) or (groups > 1 and groups == cin and ki == 1)
    if depthwise:
        if ki != 1 or o % cin or (groups not in (1, cin)):
            raise UnsupportedOrder(f"{where}: depthwise conv2d kernel {list(kernel.shape)} with groups "
                                   f"{groups} does not fit {cin} input channels ([C*M, KH, KW, 1] expected)")
        m = o // cin
        # ours: [C*M, KH, KW, 1], out channel c*M + m  ->  [M, C, KH, KW] or [1, KH, KW, C*M]
        w = (kernel.reshape(cin, m, kh, kw).transpose(1, 0, 2, 3) if ex._api.depthwise_kernel == "MCHW"
             else kernel.transpose(3, 1, 2, 0))
        d = ann.DepthwiseConvolution2dDescriptor()
    elif groups != 1:
        raise UnsupportedOrder(f"{where}: grouped conv2d (groups={groups}, {cin} input channels) is neither "
                               "ordinary nor depthwise; Arm NN 20.08 has no grouped convolution")
    else:
        if ki != cin:
            raise UnsupportedOrder(f"{where}: conv2d kernel {list(kernel.shape)} (OHWI) does not match "
                                   f"{cin} input channels")
        w = kernel  # OHWI is what Arm NN wants for NHWC
        d = ann.Convolution2dDescriptor()
    if bias is not None and bias.shape != (o,):
        raise UnsupportedOrder(f"{where}: conv2d bias shape {list(bias.shape)} is not [{o}]")
    d.m_DataLayout = ann.DataLayout_NHWC
    d.m_PadTop, d.m_PadLeft, d.m_PadBottom, d.m_PadRight = pt, pl, pb, pr
    d.m_StrideY, d.m_StrideX = sh, sw
    d.m_DilationY, d.m_DilationX = dh, dw
    d.m_BiasEnabled = bias is not None
    add = ex._net.AddDepthwiseConvolution2dLayer if depthwise else ex._net.AddConvolution2dLayer
    layer = ex._weighted_layer(add, d, name, w, bias, q)
    ins[0].Connect(layer.GetInputSlot(0))
    yq = None if q is None else q.y
    slot = ex._set(layer, shape=out_shape, q=yq)
    return ex._activation(where, name, slot, out_shape, attrs.get("activation"), yq)


def dense(ex, where, name, ins, in_shapes, out_shape, attrs, wts, q: QuantOp | None = None):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    if "kernel" not in wts:
        raise UnsupportedOrder(f"{where}: dense without a kernel weight")
    kernel = ex._weight(wts["kernel"], where)
    if kernel.ndim != 2:
        raise UnsupportedOrder(f"{where}: dense kernel must be [N, K], is {list(kernel.shape)}")
    if q is not None:
        kernel = q.kernel_codes(kernel)
    n, kdim = kernel.shape
    bias = ex._weight(wts["bias"], where) if wts.get("bias") else None
    if bias is not None and bias.shape != (n,):
        raise UnsupportedOrder(f"{where}: dense bias shape {list(bias.shape)} is not [{n}]")
    x_shape = in_shapes[0]
    slot = ins[0]
    if x_shape[-1] == kdim:  # y = x @ kernel.T over the last axis
        rows = math.prod(x_shape[:-1])
    elif math.prod(x_shape[1:]) == kdim:  # flatten everything but the batch
        rows = x_shape[0]
    else:
        raise UnsupportedOrder(f"{where}: dense kernel {list(kernel.shape)} does not fit input {list(x_shape)}")
    if math.prod(out_shape) != rows * n:
        raise UnsupportedOrder(f"{where}: dense output {list(out_shape)} is not {rows} x {n}")
    xq, yq = (None, None) if q is None else (q.x, q.y)
    if q is not None and q.kernel.per_axis is not None:
        # ACL's fully connected takes no per-channel kernel (module doc): the same [N, K] bytes as an
        # OHWI 1x1 convolution over [1, rows, 1, K]
        slot = ex._reshape(f"{name}:rows", slot, (1, rows, 1, kdim), xq)
        d = ann.Convolution2dDescriptor()
        d.m_DataLayout = ann.DataLayout_NHWC
        d.m_StrideX = d.m_StrideY = 1
        d.m_BiasEnabled = bias is not None
        layer = ex._weighted_layer(ex._net.AddConvolution2dLayer, d, name, kernel.reshape(n, 1, 1, kdim),
                                     bias, q)
        slot.Connect(layer.GetInputSlot(0))
        slot = ex._set(layer, shape=(1, rows, 1, n), q=yq)
        slot = ex._activation(where, name, slot, (1, rows, 1, n), attrs.get("activation"), yq)
        return ex._reshape(f"{name}:unflatten", slot, out_shape, yq)
    if tuple(x_shape) != (rows, kdim):
        slot = ex._reshape(f"{name}:flatten", slot, (rows, kdim), xq)
    d = ann.FullyConnectedDescriptor()
    d.m_BiasEnabled = bias is not None
    d.m_TransposeWeightMatrix = True  # weights are [N, K]
    layer = ex._weighted_layer(ex._net.AddFullyConnectedLayer, d, name, kernel, bias, q)
    slot.Connect(layer.GetInputSlot(0))
    slot = ex._set(layer, shape=(rows, n), q=yq)
    slot = ex._activation(where, name, slot, (rows, n), attrs.get("activation"), yq)
    if tuple(out_shape) != (rows, n):
        slot = ex._reshape(f"{name}:unflatten", slot, out_shape, yq)
    return slot


def activation(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    act = attrs.get("activation")
    if act is None:
        raise UnsupportedOrder(f"{where}: activation op without an activation object")
    if tuple(in_shapes[0]) != tuple(out_shape):
        raise UnsupportedOrder(f"{where}: activation changes shape {list(in_shapes[0])} -> {list(out_shape)}")
    return ex._activation(where, name, ins[0], out_shape, act)


def _pool(ex, where, name, slot, x_shape, out_shape, kind, size, strides, pads, ceil_mode, include_pad):
    ann = ex._ann
    if len(x_shape) != 4 or len(out_shape) != 4:
        raise UnsupportedOrder(f"{where}: pooling needs NHWC rank-4 tensors, got {list(x_shape)}")
    if kind not in ("max", "avg"):
        raise UnsupportedOrder(f"{where}: pool kind {kind!r} (max/avg only)")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = size, strides, pads
    rnd = math.ceil if ceil_mode else math.floor
    want = [rnd((x_shape[1] + pt + pb - kh) / sh) + 1, rnd((x_shape[2] + pl + pr - kw) / sw) + 1]
    if want != list(out_shape[1:3]):
        raise UnsupportedOrder(
            f"{where}: pool output {list(out_shape[1:3])} differs from Arm NN's "
            f"{'ceiling' if ceil_mode else 'floor'}-rounded {want} (ceil_mode whose last window would start "
            "in the bottom/right padding is not expressible)")
    d = ann.Pooling2dDescriptor()
    d.m_PoolType = ann.PoolingAlgorithm_Max if kind == "max" else ann.PoolingAlgorithm_Average
    d.m_PoolHeight, d.m_PoolWidth = kh, kw
    d.m_StrideY, d.m_StrideX = sh, sw
    d.m_PadTop, d.m_PadLeft, d.m_PadBottom, d.m_PadRight = pt, pl, pb, pr
    d.m_OutputShapeRounding = ann.OutputShapeRounding_Ceiling if ceil_mode else ann.OutputShapeRounding_Floor
    d.m_PaddingMethod = ann.PaddingMethod_IgnoreValue if (include_pad and kind == "avg") else ann.PaddingMethod_Exclude
    d.m_DataLayout = ann.DataLayout_NHWC
    layer = ex._net.AddPooling2dLayer(d, name)
    slot.Connect(layer.GetInputSlot(0))
    return ex._set(layer, shape=out_shape)


def pool2d(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    size = _ints(attrs.get("pool_size"), 2, f"{where} pool_size")
    strides = _ints(attrs.get("strides", size), 2, f"{where} strides")
    pads = _ints(attrs.get("padding", [0, 0, 0, 0]), 4, f"{where} padding")
    if list(attrs.get("dilation") or [1, 1]) != [1, 1]:
        raise UnsupportedOrder(f"{where}: dilated pooling has no Arm NN layer")
    return _pool(ex, where, name, ins[0], in_shapes[0], out_shape, str(attrs.get("kind")), size, strides,
                      pads, bool(attrs.get("ceil_mode", False)), bool(attrs.get("count_include_pad", False)))


def global_pool2d(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    x = in_shapes[0]
    if len(x) != 4 or tuple(out_shape) != (x[0], 1, 1, x[3]):
        raise UnsupportedOrder(f"{where}: global pool {list(x)} -> {list(out_shape)} (N,1,1,C expected)")
    return _pool(ex, where, name, ins[0], x, out_shape, str(attrs.get("kind")), (x[1], x[2]), (1, 1),
                      (0, 0, 0, 0), False, False)


def layer_norm(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    """(x - mean) * rsqrt(mean((x - mean)^2) + eps) * gamma + beta over the last axis: Arm NN has
    no LayerNormalization layer, but Mean, Subtraction, Multiplication, Linear and Rsqrt
    (ElementwiseUnary) are in every release spoken here."""
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    x, shape = ins[0], tuple(in_shapes[0])
    if tuple(out_shape) != shape:
        raise UnsupportedOrder(f"{where}: output shape {list(out_shape)} is not the input's {list(shape)}")
    row = (1,) * (len(shape) - 1) + (shape[-1],)
    consts = {}
    for role in ("gamma", "beta"):
        w = ex._weight(wts[role], where)
        if w.size != shape[-1]:
            raise UnsupportedOrder(f"{where}: {role} has {w.size} values for {shape[-1]} channels")
        consts[role] = ex._constant_layer(np.asarray(w, np.float32).reshape(row), f"{name}:{role}")
    stat = [*shape[:-1], 1]
    d = ex._elementwise("sub", f"{name}:centre", x, ex._mean_last(f"{name}:mean", x, shape), shape)
    var = ex._mean_last(f"{name}:var", ex._elementwise("mul", f"{name}:sq", d, d, shape), shape)
    ve = ex._linear(f"{name}:eps", var, stat, 1.0, float(attrs.get("epsilon", 0.0)))
    layer = ex._net.AddElementwiseUnaryLayer(ann.ElementwiseUnaryDescriptor(ann.UnaryOperation_Rsqrt),
                                              f"{name}:rsqrt")
    ve.Connect(layer.GetInputSlot(0))
    n = ex._elementwise("mul", f"{name}:norm", d, ex._set(layer, shape=stat), shape)
    g = ex._elementwise("mul", f"{name}:gamma_mul", n, consts["gamma"], shape)
    return ex._elementwise("add", f"{name}:beta_add", g, consts["beta"], shape)


def binary(ex, where, name, ins, in_shapes, out_shape, attrs, wts, q: QType | None = None):
    if q is not None:   # a quantized add (_quant_add): two tensors of the output's shape
        if any(tuple(s) != tuple(out_shape) for s in in_shapes):
            raise UnsupportedOrder(f"{where}: a quantized add of shapes {[list(s) for s in in_shapes]} "
                                   f"into {list(out_shape)}; only equal shapes are built")
        layer = ex._net.AddAdditionLayer(name)
        ins[0].Connect(layer.GetInputSlot(0))
        ins[1].Connect(layer.GetInputSlot(1))
        slot = ex._set(layer, shape=out_shape, q=q)
        return ex._activation(where, name, slot, out_shape, attrs.get("activation"), q)
    kind = str(attrs.get("kind"))
    adders = {"add": ex._net.AddAdditionLayer, "sub": ex._net.AddSubtractionLayer,
              "mul": ex._net.AddMultiplicationLayer, "div": ex._net.AddDivisionLayer,
              "max": ex._net.AddMaximumLayer, "min": ex._net.AddMinimumLayer}
    if kind not in adders:
        raise UnsupportedOrder(f"{where}: binary kind {kind!r} ({'/'.join(adders)} only)")
    # operands in order: a constant "lhs" goes before the op's input, a constant "rhs" after it
    operands: list[tuple[Any, Any]] = [(s, sh) for s, sh in zip(ins, in_shapes)]
    consts = {r: ex._weight(n, where) for r, n in wts.items() if n}
    if "lhs" in consts:
        operands.insert(0, (None, consts["lhs"]))
    if "rhs" in consts:
        operands.append((None, consts["rhs"]))
    if len(operands) != 2:
        raise UnsupportedOrder(f"{where}: binary needs exactly two operands, got {len(operands)}")
    rank = len(out_shape)
    slots, shapes = [], []
    for i, (slot, val) in enumerate(operands):
        shape = tuple(val.shape) if slot is None else tuple(val)
        if len(shape) > rank:
            raise UnsupportedOrder(f"{where}: operand {i} rank {len(shape)} exceeds the output rank {rank}")
        full = (1,) * (rank - len(shape)) + shape
        if slot is None:
            slot = ex._constant_layer(np.asarray(val, np.float32).reshape(full), f"{name}:const{i}")
        elif full != shape:
            slot = ex._reshape(f"{name}:rank{i}", slot, full)
        slots.append(slot)
        shapes.append(full)
    for a, b, o in zip(shapes[0], shapes[1], out_shape):
        if max(a, b) != o or min(a, b) not in (1, o):
            raise UnsupportedOrder(f"{where}: shapes {list(shapes[0])} and {list(shapes[1])} do not "
                                   f"broadcast to {list(out_shape)}")
    layer = adders[kind](name)
    slots[0].Connect(layer.GetInputSlot(0))
    slots[1].Connect(layer.GetInputSlot(1))
    slot = ex._set(layer, shape=out_shape)
    return ex._activation(where, name, slot, out_shape, attrs.get("activation"))


def conv2d_transpose(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    x_shape = in_shapes[0]
    if len(x_shape) != 4 or len(out_shape) != 4:
        raise UnsupportedOrder(f"{where}: conv2d_transpose needs NHWC rank-4 tensors, got {list(x_shape)}")
    kernel = ex._weight(wts["kernel"], where)
    if kernel.ndim != 4 or kernel.shape[3] != x_shape[3] or kernel.shape[0] != out_shape[3]:
        raise UnsupportedOrder(f"{where}: conv2d_transpose kernel {list(kernel.shape)} (OHWI) does not fit "
                               f"{list(x_shape)} -> {list(out_shape)}")
    bias = ex._weight(wts["bias"], where) if wts.get("bias") else None
    sh, sw = _ints(attrs.get("strides", [1, 1]), 2, f"{where} strides")
    pt, pl, pb, pr = _ints(attrs.get("padding", [0, 0, 0, 0]), 4, f"{where} padding")
    oph, opw = _ints(attrs.get("output_padding", [0, 0]), 2, f"{where} output_padding")
    # output_padding grows the output at the bottom/right: the same as cropping less there
    if oph > pb or opw > pr:
        raise UnsupportedOrder(f"{where}: conv2d_transpose output_padding {[oph, opw]} exceeds the bottom/right "
                               f"padding {[pb, pr]}; Arm NN cannot grow the output")
    pb, pr = pb - oph, pr - opw
    o, kh, kw, _ = kernel.shape
    want = [(x_shape[1] - 1) * sh + kh - pt - pb, (x_shape[2] - 1) * sw + kw - pl - pr]
    if want != list(out_shape[1:3]):
        raise UnsupportedOrder(f"{where}: conv2d_transpose output {list(out_shape[1:3])} is not Arm NN's {want}")
    d = ann.TransposeConvolution2dDescriptor()
    d.m_PadTop, d.m_PadLeft, d.m_PadBottom, d.m_PadRight = pt, pl, pb, pr
    d.m_StrideY, d.m_StrideX = sh, sw
    d.m_BiasEnabled = bias is not None
    d.m_DataLayout = ann.DataLayout_NHWC
    wt = ex._const(kernel)
    layer = (ex._net.AddTransposeConvolution2dLayer(d, wt, ex._const(bias), name) if bias is not None
             else ex._net.AddTransposeConvolution2dLayer(d, wt, name=name))
    ins[0].Connect(layer.GetInputSlot(0))
    slot = ex._set(layer, shape=out_shape)
    return ex._activation(where, name, slot, out_shape, attrs.get("activation"))


def prelu(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    shape = tuple(in_shapes[0])
    slope = ex._weight(wts["slope"], where)
    if slope.ndim > len(shape):
        raise UnsupportedOrder(f"{where}: prelu slope {list(slope.shape)} has a higher rank than {list(shape)}")
    full = (1,) * (len(shape) - slope.ndim) + tuple(slope.shape)
    if any(s not in (1, d) for s, d in zip(full, shape)):
        raise UnsupportedOrder(f"{where}: prelu slope {list(slope.shape)} does not broadcast to {list(shape)}")
    a_slot = ex._constant_layer(slope.reshape(full), f"{name}:slope")
    layer = ex._net.AddPreluLayer(name)
    ins[0].Connect(layer.GetInputSlot(0))
    a_slot.Connect(layer.GetInputSlot(1))
    return ex._set(layer, shape=out_shape)


def strided_slice(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    shape = in_shapes[0]
    rank = len(shape)
    begin = _ints(attrs.get("begin"), rank, f"{where} begin")
    end = _ints(attrs.get("end"), rank, f"{where} end")
    strides = _ints(attrs.get("strides"), rank, f"{where} strides")
    if any(s <= 0 for s in strides) or any(not 0 <= b <= e <= d for b, e, d in zip(begin, end, shape)):
        raise UnsupportedOrder(f"{where}: strided_slice {begin}:{end}:{strides} is not normalised for {list(shape)}")
    want = [-(-(e - b) // s) for b, e, s in zip(begin, end, strides)]
    if want != list(out_shape):
        raise UnsupportedOrder(f"{where}: strided_slice gives {want}, the order says {list(out_shape)}")
    d = ann.StridedSliceDescriptor()
    d.m_Begin, d.m_End, d.m_Stride = begin, end, strides
    d.m_DataLayout = ann.DataLayout_NHWC
    layer = ex._net.AddStridedSliceLayer(d, name)
    ins[0].Connect(layer.GetInputSlot(0))
    return ex._set(layer, shape=out_shape)


def pad(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    shape = in_shapes[0]
    rank = len(shape)
    pads = _ints(attrs.get("pads"), 2 * rank, f"{where} pads")
    pairs = [(pads[i], pads[rank + i]) for i in range(rank)]
    if any(p < 0 for p in pads) or [d + a + b for d, (a, b) in zip(shape, pairs)] != list(out_shape):
        raise UnsupportedOrder(f"{where}: pad {pads} of {list(shape)} is not {list(out_shape)}")
    d = ann.PadDescriptor(pairs, float(attrs.get("value", 0.0)))
    layer = ex._net.AddPadLayer(d, name)
    ins[0].Connect(layer.GetInputSlot(0))
    return ex._set(layer, shape=out_shape)


def concat(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    if not ins:
        raise UnsupportedOrder(f"{where}: concat without inputs")
    rank = len(out_shape)
    axis = int(attrs.get("axis", 0))
    if not -rank <= axis < rank:
        raise UnsupportedOrder(f"{where}: concat axis {axis} out of range for rank {rank}")
    axis %= rank
    for s in in_shapes:
        if len(s) != rank or any(s[i] != out_shape[i] for i in range(rank) if i != axis):
            raise UnsupportedOrder(f"{where}: concat input {list(s)} does not fit {list(out_shape)} on axis {axis}")
    if sum(s[axis] for s in in_shapes) != out_shape[axis]:
        raise UnsupportedOrder(f"{where}: concat inputs do not add up to {list(out_shape)} on axis {axis}")
    if len(ins) == 1:
        return ins[0]
    desc = ann.CreateDescriptorForConcatenation([ann.TensorShape(tuple(s)) for s in in_shapes], axis)
    layer = ex._net.AddConcatLayer(desc, name)
    for i, s in enumerate(ins):
        s.Connect(layer.GetInputSlot(i))
    return ex._set(layer, shape=out_shape)


def reshape(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    if math.prod(in_shapes[0]) != math.prod(out_shape):
        raise UnsupportedOrder(f"{where}: reshape {list(in_shapes[0])} -> {list(out_shape)} changes the size")
    return ex._reshape(name, ins[0], out_shape)  # the tensors table is the target shape


def softmax(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    shape = tuple(in_shapes[0])
    rank = len(shape)
    axis = int(attrs.get("axis", -1))
    if not -rank <= axis < rank or shape != tuple(out_shape):
        raise UnsupportedOrder(f"{where}: softmax axis {axis} over {list(shape)} -> {list(out_shape)}")
    axis %= rank
    slot, cur = ins[0], shape
    if axis != rank - 1:  # ACL 20.08 only does the innermost axis: move it there and back
        axes = [a for a in range(rank) if a != axis] + [axis]
        slot = ex._permute(f"{name}:to_last", slot, shape, axes)
        cur = tuple(shape[a] for a in axes)
    d = ann.SoftmaxDescriptor()
    d.m_Beta = 1.0
    d.m_Axis = -1
    layer = ex._net.AddSoftmaxLayer(d, name)
    slot.Connect(layer.GetInputSlot(0))
    slot = ex._set(layer, shape=cur)
    if axis != rank - 1:
        slot = ex._permute(f"{name}:back", slot, cur, [int(a) for a in np.argsort(axes)])
    return slot


def resize2d(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ann = ex._ann
    ex._need_inputs(where, ins, 1)
    x = in_shapes[0]
    if len(x) != 4 or len(out_shape) != 4 or (x[0], x[3]) != (out_shape[0], out_shape[3]):
        raise UnsupportedOrder(f"{where}: resize2d {list(x)} -> {list(out_shape)} is not an NHWC spatial resize")
    size = attrs.get("size")
    if size is not None and [int(s) for s in size] != list(out_shape[1:3]):
        raise UnsupportedOrder(f"{where}: resize2d size {size} disagrees with the output {list(out_shape)}")
    method = str(attrs.get("method"))
    mode = str(attrs.get("coordinate_transformation_mode", "half_pixel"))
    rounding = str(attrs.get("rounding_method", "") or "")
    if method not in ("nearest", "linear"):
        raise UnsupportedOrder(f"{where}: resize2d method {method!r} (Arm NN has nearest and bilinear)")
    flags = resize_flags(method, mode, rounding, x[1:3], out_shape[1:3])
    if flags is None:
        what = f"{method}/{mode}" + (f"/{rounding or 'default'}" if method == "nearest" else "")
        raise UnsupportedOrder(f"{where}: resize2d {what} {list(x[1:3])} -> {list(out_shape[1:3])} differs from "
                               "every Arm NN resize (align_corners / half_pixel_centers / neither)")
    d = ann.ResizeDescriptor()
    d.m_Method = ann.ResizeMethod_NearestNeighbor if method == "nearest" else ann.ResizeMethod_Bilinear
    d.m_TargetHeight, d.m_TargetWidth = int(out_shape[1]), int(out_shape[2])
    d.m_DataLayout = ann.DataLayout_NHWC
    d.m_AlignCorners, d.m_HalfPixelCenters = flags
    layer = ex._net.AddResizeLayer(d, name)
    ins[0].Connect(layer.GetInputSlot(0))
    return ex._set(layer, shape=out_shape)


def transpose(ex, where, name, ins, in_shapes, out_shape, attrs, wts):
    ex._need_inputs(where, ins, 1)
    shape = in_shapes[0]
    rank = len(shape)
    axes = attrs.get("axes")
    axes = list(reversed(range(rank))) if axes is None else [int(a) % rank if rank else 0 for a in axes]
    if sorted(axes) != list(range(rank)):
        raise UnsupportedOrder(f"{where}: transpose axes {attrs.get('axes')} are not a permutation of rank {rank}")
    if [shape[a] for a in axes] != list(out_shape):
        raise UnsupportedOrder(f"{where}: transpose {list(shape)} by {axes} is not {list(out_shape)}")
    if axes == list(range(rank)):
        return ex._reshape(name, ins[0], list(shape))
    return ex._permute(name, ins[0], shape, axes)


#: order op type -> its builder (contract/orders.py names the types)
BUILDERS = {
    'conv2d': conv2d,
    'dense': dense,
    'activation': activation,
    'pool2d': pool2d,
    'global_pool2d': global_pool2d,
    'layer_norm': layer_norm,
    'binary': binary,
    'conv2d_transpose': conv2d_transpose,
    'prelu': prelu,
    'strided_slice': strided_slice,
    'pad': pad,
    'concat': concat,
    'reshape': reshape,
    'softmax': softmax,
    'resize2d': resize2d,
    'transpose': transpose,
}
