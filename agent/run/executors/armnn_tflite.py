"""An order's per-axis quantization as a TFLite model, for the Arm NN executor's per-channel weights.

pyarmnn (20.08 and 23.08) cannot put per-axis scales on a TensorInfo (it has SetQuantizationScale,
no SetQuantizationScales), so a per-channel int8 order could not reach ACL. Arm NN's TfLite parser,
present in both bindings, does make per-axis TensorInfos: from a TFLite tensor's quantization
(scale, zero_point, quantized_dimension). So the Arm NN executor makes, from the order alone, a
TFLite model of tensors alone (no ops, no weight data: a few hundred bytes per weight), every
tensor a subgraph input, named as ``TFLITE_1HWO`` says; it parses it, takes each weight's
TensorInfo (GetNetworkInputBindingInfo), sets its shape to Arm NN's layout and builds the order
layer by layer as for per-tensor weights (agent/run/executors/armnn.py). The weights' own tensors
rather than a TFLite rendering of the ops: the layer builder already does what a TFLite graph
cannot say (explicit asymmetric padding, clip bounds) and what the boards' Arm NN need (its
depthwise and concat work-arounds); the parser only supplies the types.

Made at load, not stored: everything in it is in the order (its scales are in the order's blob
once), and a bundle of EfficientNet-Lite0 carried 188 KB of such members (3% of its INT8 bytes).
Bundles written on 2026-12-05 also hold it as the partition's ``tflite`` member: the same bytes,
no longer read. The writer is ``flatbuffers``' Builder (onnxruntime's dependency, so on every
board) with the schema's field slots below, checked against the ``tflite`` package's own reader
(tests/agent/test_armnn_tflite.py); the model is a pure function of the order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tandoor_contract import orders

# TFLite's schema (tensorflow/lite/schema/schema.fbs, version 3): the enum values and, per table,
# its field count and the slot of each field this writer sets.
# a depthwise kernel's second tensor, in TFLite's [1, KH, KW, C*M] layout (quantized_dimension 3),
# is named the kernel's name + this: Arm NN 23.08 reads its scales there, 20.08 on [M, C, KH, KW]'s dim 0
TFLITE_1HWO = ":1HWO"


def is_depthwise(op: Mapping, kshape, cin: int) -> bool:
    """A conv2d that is depthwise: said so, or one group per input channel with our [C*M, KH, KW, 1]
    kernel. The writer and the executor's layer builder both ask this."""
    attrs = op.get("attrs") or {}
    groups = int(attrs.get("groups", 1))
    return op.get("type") == "conv2d" and (bool(attrs.get("depthwise")) or (
        groups > 1 and groups == cin and int(kshape[-1]) == 1))


_TYPES = {"int8": 9, "int32": 2}          # TensorType.INT8, TensorType.INT32
SCHEMA_VERSION = 3
MODEL = (8, {"version": 0, "operator_codes": 1, "subgraphs": 2, "description": 3, "buffers": 4})
SUBGRAPH = (6, {"tensors": 0, "inputs": 1, "outputs": 2, "operators": 3, "name": 4})
TENSOR = (10, {"shape": 0, "type": 1, "buffer": 2, "name": 3, "quantization": 4})
QUANT = (7, {"scale": 2, "zero_point": 3, "quantized_dimension": 6})
BUFFER = (3, {})


def per_axis_tensors(order: Mapping) -> list[dict]:
    """The tensors of the order's TFLite model: {name, shape, dtype, scale, zero_point, dim} per
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
        x = tensors.get((op.get("inputs") or [""])[0]) or {}
        if is_depthwise(op, shape, int(x.get("shape", [0])[-1] or 0)):
            o, kh, kw, _ = shape     # ours [C*M, KH, KW, 1], output channel c*M + m: TFLite's last axis
            out.append(_tensor(kname + TFLITE_1HWO, [1, kh, kw, o], kspec["dtype"], kq.scale,
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
    """The order's per-axis quantization as TFLite bytes (module doc), or None when no weight's
    quant varies along its axis (per-tensor orders are built without it)."""
    import flatbuffers      # here: only per-channel orders on Arm NN need it

    tensors = per_axis_tensors(order)
    if not tensors:
        return None
    b = flatbuffers.Builder(1024)
    empty = _table(b, BUFFER, [])       # buffer 0: the empty one every non-constant tensor names
    scales: dict[tuple[float, ...], int] = {}
    made = [_write_tensor(b, t, scales) for t in tensors]
    every = list(range(len(made)))
    tensor_vec, ins, outs = _offsets(b, made), _ints(b, every), _ints(b, every)
    ops, name = _offsets(b, []), b.CreateString(str(order.get("symbol") or "order"))
    sub = _table(b, SUBGRAPH, [("tensors", "off", tensor_vec), ("inputs", "off", ins), ("outputs", "off", outs),
                               ("operators", "off", ops), ("name", "off", name)])
    subs, bufs, codes = _offsets(b, [sub]), _offsets(b, [empty]), _offsets(b, [])
    desc = b.CreateString("tandoor: per-axis quantization of an order's weights, for Arm NN's TfLite parser")
    model = _table(b, MODEL, [("version", "u32", SCHEMA_VERSION), ("operator_codes", "off", codes),
                              ("subgraphs", "off", subs), ("description", "off", desc), ("buffers", "off", bufs)])
    b.Finish(model, file_identifier=b"TFL3")
    return bytes(b.Output())


def _table(b, schema: tuple[int, dict[str, int]], fields: list[tuple[str, str, object]]) -> int:
    """One table of ``schema`` (field count, slots) with ``fields`` (name, kind, value) in order."""
    count, slots = schema
    b.StartObject(count)
    for field, kind, value in fields:
        slot = slots[field]
        if kind == "off":
            b.PrependUOffsetTRelativeSlot(slot, value, 0)
        elif kind == "u32":
            b.PrependUint32Slot(slot, value, 0)
        elif kind == "i32":
            b.PrependInt32Slot(slot, value, 0)
        elif kind == "i8":
            b.PrependInt8Slot(slot, value, 0)
        else:
            raise ValueError(kind)
    return b.EndObject()


def _offsets(b, tables: list[int]) -> int:
    b.StartVector(4, len(tables), 4)
    for t in reversed(tables):
        b.PrependUOffsetTRelative(t)
    return b.EndVector()


def _ints(b, xs: list[int]) -> int:
    b.StartVector(4, len(xs), 4)
    for x in reversed(xs):
        b.PrependInt32(int(x))
    return b.EndVector()


def _write_tensor(b, t: dict, scales: dict[tuple[float, ...], int]) -> int:
    """One tensor; its scale vector shared with an earlier tensor's equal one (a depthwise kernel's
    two layouts). Zero points all 0 are left out: Arm NN reads an INT8 tensor with other than one
    zero point as QSymmS8 (what ACL's per-channel kernels take), and they are 8 of a channel's 12
    bytes."""
    name = b.CreateString(t["name"])
    shape = _ints(b, t["shape"])
    key = tuple(t["scale"])
    if key not in scales:
        b.StartVector(4, len(key), 4)
        for s in reversed(key):
            b.PrependFloat32(s)
        scales[key] = b.EndVector()
    quant = [("scale", "off", scales[key])]
    if any(t["zero_point"]):
        b.StartVector(8, len(t["zero_point"]), 8)
        for z in reversed(t["zero_point"]):
            b.PrependInt64(z)
        quant.append(("zero_point", "off", b.EndVector()))
    quant.append(("quantized_dimension", "i32", t["dim"]))
    q = _table(b, QUANT, quant)
    return _table(b, TENSOR, [("shape", "off", shape), ("type", "i8", _TYPES[t["dtype"]]), ("buffer", "u32", 0),
                              ("name", "off", name), ("quantization", "off", q)])
