"""An order's per-axis quantization as a TFLite model, for the Arm NN executor's per-channel weights.

pyarmnn (20.08 and 23.08) cannot put per-axis scales on a TensorInfo (it has SetQuantizationScale,
no SetQuantizationScales), so a per-channel int8 order could not reach ACL. Arm NN's TfLite parser,
present in both bindings, does make per-axis TensorInfos: from a TFLite tensor's quantization
(scale, zero_point, quantized_dimension). So for an order with per-axis weights the compiler writes
the partition's ``tflite`` member: a TFLite model of tensors alone (no ops, no weight data: a few
hundred bytes per weight, the kernels stay in the order's blob once), every tensor a subgraph input,
named as ``tandoor_contract.orders.TFLITE_1HWO`` says. The executor parses it, takes each weight's
TensorInfo (GetNetworkInputBindingInfo), sets its shape to Arm NN's layout and builds the order
layer by layer as for per-tensor weights (agent/run/executors/armnn.py). The weights' own tensors
rather than a TFLite rendering of the ops: the layer builder already does what a TFLite graph
cannot say (explicit asymmetric padding, clip bounds) and what the boards' Arm NN need (its
depthwise and concat work-arounds); the parser only supplies the types.

The writer is the ``tflite`` package's flatbuffer builders (tflite==2.18.0, the schema's generated
Python classes); the model is a pure function of the order: equal orders give equal bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import flatbuffers
import numpy as np
import tflite

from tandoor_contract import orders

_TYPES = {"int8": tflite.TensorType.INT8, "int32": tflite.TensorType.INT32}
SCHEMA_VERSION = 3


def per_axis_tensors(order: Mapping) -> list[dict]:
    """The tensors of the order's ``tflite`` member: {name, shape, dtype, scale, zero_point, dim} per
    per-axis weight of a quantized conv2d/dense (its quant varies along its axis), plus a depthwise
    kernel in TFLite's [1, KH, KW, C*M] layout, in op order; [] when no weight varies."""
    weights, tensors = order.get("weights") or {}, order.get("tensors") or {}
    out: list[dict] = []
    seen: set[str] = set()
    for op in order.get("ops") or []:
        if op.get("type") not in ("conv2d", "dense"):
            continue
        wts = op.get("weights") or {}
        kname = wts.get("kernel")
        kspec = weights.get(kname) if kname else None
        kq = orders.quant_of(kspec, kname) if kspec else None
        if kq is None or kq.axis is None or not kq.varies or kname in seen or kspec["dtype"] not in _TYPES:
            continue
        seen.add(kname)
        shape = [int(d) for d in kspec["shape"]]
        out.append(_tensor(kname, shape, kspec["dtype"], kq.scale, kq.zero_point, kq.axis))
        attrs = op.get("attrs") or {}
        x = tensors.get((op.get("inputs") or [""])[0]) or {}
        cin = int(x.get("shape", [0])[-1] or 0)
        if op["type"] == "conv2d" and (attrs.get("depthwise") or (int(attrs.get("groups", 1)) > 1 and
                                                                   int(attrs.get("groups", 1)) == cin)):
            o, kh, kw, _ = shape     # ours [C*M, KH, KW, 1], output channel c*M + m: TFLite's last axis
            out.append(_tensor(kname + orders.TFLITE_1HWO, [1, kh, kw, o], kspec["dtype"], kq.scale,
                               kq.zero_point, 3))
        bname = wts.get("bias")
        bspec = weights.get(bname) if bname else None
        xq = orders.quant_of(x, "input") if x else None
        if bspec and bspec.get("dtype") in _TYPES and xq is not None and bname not in seen:
            seen.add(bname)
            # what Arm NN checks a bias's scales against: the float32 products, per channel
            sb = [float(np.float32(xq.scale[0]) * np.float32(s)) for s in kq.scale]
            out.append(_tensor(bname, [int(d) for d in bspec["shape"]], bspec["dtype"], sb, [0] * len(sb), 0))
    return out


def _tensor(name: str, shape: list[int], dtype: str, scale, zero_point, dim: int) -> dict:
    return {"name": name, "shape": shape, "dtype": dtype, "scale": [float(s) for s in scale],
            "zero_point": [int(z) for z in zero_point], "dim": int(dim)}


def quant_model(order: Mapping) -> bytes | None:
    """The order's ``tflite`` member (module doc), or None when no weight's quant varies along
    its axis (per-tensor orders are built without it)."""
    tensors = per_axis_tensors(order)
    if not tensors:
        return None
    b = flatbuffers.Builder(1024)
    tflite.BufferStart(b)           # buffer 0: the empty one every non-constant tensor names
    empty = tflite.BufferEnd(b)
    scales: dict[tuple[float, ...], int] = {}
    made = [_write_tensor(b, t, scales) for t in tensors]
    every = list(range(len(made)))
    tensor_vec = _offsets(b, tflite.SubGraphStartTensorsVector, made)
    ins, outs = _ints(b, tflite.SubGraphStartInputsVector, every), _ints(b, tflite.SubGraphStartOutputsVector, every)
    ops = _offsets(b, tflite.SubGraphStartOperatorsVector, [])
    name = b.CreateString(str(order.get("symbol") or "order"))
    tflite.SubGraphStart(b)
    tflite.SubGraphAddTensors(b, tensor_vec)
    tflite.SubGraphAddInputs(b, ins)
    tflite.SubGraphAddOutputs(b, outs)
    tflite.SubGraphAddOperators(b, ops)
    tflite.SubGraphAddName(b, name)
    subs = _offsets(b, tflite.ModelStartSubgraphsVector, [tflite.SubGraphEnd(b)])
    bufs = _offsets(b, tflite.ModelStartBuffersVector, [empty])
    codes = _offsets(b, tflite.ModelStartOperatorCodesVector, [])
    desc = b.CreateString("tandoor: per-axis quantization of an order's weights, for Arm NN's TfLite parser")
    tflite.ModelStart(b)
    tflite.ModelAddVersion(b, SCHEMA_VERSION)
    tflite.ModelAddOperatorCodes(b, codes)
    tflite.ModelAddSubgraphs(b, subs)
    tflite.ModelAddDescription(b, desc)
    tflite.ModelAddBuffers(b, bufs)
    b.Finish(tflite.ModelEnd(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _offsets(b: flatbuffers.Builder, start, tables: list[int]) -> int:
    start(b, len(tables))
    for t in reversed(tables):
        b.PrependUOffsetTRelative(t)
    return b.EndVector()


def _ints(b: flatbuffers.Builder, start, xs: list[int]) -> int:
    start(b, len(xs))
    for x in reversed(xs):
        b.PrependInt32(int(x))
    return b.EndVector()


def _write_tensor(b: flatbuffers.Builder, t: dict, scales: dict[tuple[float, ...], int]) -> int:
    """One tensor; its scale vector shared with an earlier tensor's equal one (a depthwise kernel's
    two layouts). Zero points all 0 are left out: Arm NN reads an INT8 tensor with other than one
    zero point as QSymmS8 (what ACL's per-channel kernels take), and they are 8 of a channel's 12
    bytes (EfficientNet-Lite0's members: 649 KB with them and a vector per tensor, 188 KB without)."""
    name = b.CreateString(t["name"])
    shape = _ints(b, tflite.TensorStartShapeVector, t["shape"])
    key = tuple(t["scale"])
    if key not in scales:
        tflite.QuantizationParametersStartScaleVector(b, len(key))
        for s in reversed(key):
            b.PrependFloat32(s)
        scales[key] = b.EndVector()
    zp = None
    if any(t["zero_point"]):
        tflite.QuantizationParametersStartZeroPointVector(b, len(t["zero_point"]))
        for z in reversed(t["zero_point"]):
            b.PrependInt64(z)
        zp = b.EndVector()
    tflite.QuantizationParametersStart(b)
    tflite.QuantizationParametersAddScale(b, scales[key])
    if zp is not None:
        tflite.QuantizationParametersAddZeroPoint(b, zp)
    tflite.QuantizationParametersAddQuantizedDimension(b, t["dim"])
    quant = tflite.QuantizationParametersEnd(b)
    tflite.TensorStart(b)
    tflite.TensorAddShape(b, shape)
    tflite.TensorAddType(b, _TYPES[t["dtype"]])
    tflite.TensorAddBuffer(b, 0)
    tflite.TensorAddName(b, name)
    tflite.TensorAddQuantization(b, quant)
    return tflite.TensorEnd(b)
