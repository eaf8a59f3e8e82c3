"""Run one order (docs/bundle-format.md) through Arm NN (pyarmnn 20.08 or 23.08).

The order is built layer by layer into an ``INetwork`` (no parser), optimised for the preferred
backends that this machine actually has (CpuAcc = ACL NEON, GpuAcc = ACL OpenCL, CpuRef =
reference), and loaded once into an ``IRuntime``. Anything that cannot be built exactly raises
:class:`UnsupportedOrder` with a one-line reason, so that the caller can fall back to another
executor.

Two Arm NN Python APIs are spoken, chosen by the ABI of the libarmnn found (``APIS``, the one table
of what differs): 20.08 (ABI 22; Debian 12, Ubuntu 22.04) and 23.08 (ABI 33; Debian 13, Ubuntu
24.04; the last Arm NN with a Python binding). tests/board runs every op type on CpuAcc with each.

Arm NN facts this module depends on (all checked numerically by tests/agent/test_armnn_executor.py
on CpuRef, and by tests/board on CpuAcc with both APIs):

* NHWC ``Convolution2d`` takes its kernel as OHWI (our layout, used as is).
* ``DepthwiseConvolution2d`` takes its kernel as [M, C, KH, KW] in 20.08 and [1, KH, KW, C*M] in
  23.08, whatever the data layout; ours is [C*M, KH, KW, 1] with output channel ``c*M + m``.
* ``Permute``'s ``m_DimMappings[i]`` is where *source* axis i goes, the inverse of numpy's
  ``transpose(axes)`` (``axes[i]`` is the source of destination axis i): we pass argsort(axes).
  This pyarmnn has no Transpose layer.
* ``ActivationFunction_TanH`` computes ``m_A * tanh(m_B * x)`` (both default to 0!).
* Neither pyarmnn names ``ActivationFunction_HardSwish``, but both libarmnn (ABI 22 and 33)
  implement it as enum value 11 (after Elu = 10); it is used only for those ABIs.
* ``Pooling2d`` with ``OutputShapeRounding_Ceiling`` has no "last window must start inside the
  input or the left padding" rule (ONNX/PyTorch ceil_mode); such orders are refused.
* ``Resize`` follows TensorFlow: nearest with half-pixel centres is ``floor((y + 0.5) * in/out)``
  and align-corners nearest rounds half away from zero. Each resize is checked by computing both
  index/weight maps, so only the coordinate modes that really coincide are accepted.
* Softmax is built over the last axis (``m_Axis = -1``, the only axis ACL 20.08 honours); other
  axes are permuted to the end and back.
* Quantized conv2d/dense (order_version 2): activations are QAsymmS8/QAsymmU8 with the order's
  scale and zero point, the bias Signed32 with scale input x kernel scale, and the kernel is given
  the *activation's* type (int8 codes as QAsymmS8 offset 0; uint8 activations: codes + 128 as
  QAsymmU8 offset 128, the same reals), as Arm NN's TfLite parser does: ACL's convolution,
  depthwise and fully connected kernels take per-tensor weights only of the input's type (or
  per-channel QSymmS8), so a per-tensor QSymmS8 kernel would leave the layer to CpuRef. A fused
  relu/clip is an ActivationLayer on the output's quantization (equal to requantizing the
  activated accumulator within a step).
* Per-channel kernels (a quant that varies along axis 0) are QSymmS8 with per-axis scales, the
  bias Signed32 with per-axis scales, for int8 and uint8 activations alike. Neither binding's
  TensorInfo has a per-axis setter (no SetQuantizationScales), but both TfLite parsers make such
  TensorInfos from a TFLite tensor's quantization: a TFLite model made from the order at load
  (armnn_tflite.py; bundles of 2026-12-05 also carry it as the partition's
  ``tflite`` member, which is the same bytes and no longer read) holds each per-axis weight as a tensor, and the builder takes its
  TensorInfo from ITfLiteParser.GetNetworkInputBindingInfo (only CreateNetworkFromBinaryFile
  exists in either binding: the model goes through a temporary file), with Arm NN's shape. The
  quantized dimension must be Arm NN's: 20.08 refuses a depthwise kernel's unless it is 0 (its
  [M, C, KH, KW]), 23.08's CpuRef reads [1, KH, KW, C*M] scales along dim 3 (measured wrong along
  0), hence the member's second, 1HWO tensor per depthwise kernel. ACL's fully connected takes no
  per-channel weights (23.08: no backend for the layer; 20.08's CpuRef aborts the process on an
  assertion asking), so a per-channel dense is built as the same kernel's 1x1 convolution. Never
  call GetQuantizationScale on a per-axis TensorInfo: Debian's libarmnn asserts, and aborts.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tandoor_contract import orders

from . import armnn_tflite

__all__ = ["UnsupportedOrder", "ArmnnExecutor", "available", "backends"]

from . import armnn_api, armnn_ops
from .armnn_api import (  # noqa: F401  (re-exported: the executor module's public names)
    Api, DEFAULT_PREFERRED, PERMUTES_2008, QType, QUANT_OPS, QuantOp, SCRATCH_BINDING,
    UnsupportedOrder, WEIGHT_DTYPES, _ARMNN_OF_ACT, _FLT_MAX, _abi, _per_tensor, _pyarmnn, _quant,
    _runtime, _shape_of, api, available, backends, differs, permute_plan, resize_flags
)


class ArmnnExecutor:
    """One order built into an Arm NN network and loaded into the (shared) runtime.

    ``backend`` is the backend that runs most of the order's layers on this machine (asking for
    CpuAcc where only CpuRef exists silently falls back; this reports what really runs),
    ``layer_backends`` lists (layer name, layer type, backend) for every layer.
    """

    def __init__(self, order: Mapping[str, Any], weights: bytes | bytearray | memoryview,
                 preferred: Sequence[str] | str = DEFAULT_PREFERRED):
        try:
            self._ann = ann = _pyarmnn()
        except ImportError as e:
            raise UnsupportedOrder(str(e)) from None
        if isinstance(preferred, str):
            preferred = (preferred,)
        self.symbol = str(order.get("symbol", "?"))
        self._api = api()
        self.last_run_ns = 0  # time inside EnqueueWorkload during the last run_into
        self.last_zero_copy = False  # whether Arm NN wrote every output into the caller's buffer
        self._net_id: int | None = None
        self._keep: list[Any] = []  # numpy arrays behind every ConstTensor
        self._slots: dict[str, Any] = {}
        self._blob = weights if weights is not None else b""
        self._weights_table = order.get("weights") or {}
        self._weights_cache: dict[str, np.ndarray] = {}
        # how many ops (and order outputs) read each tensor (Api.depthwise_own_input)
        self._readers = Counter(str(n) for op in order.get("ops") or [] for n in op.get("inputs") or [])
        self._readers.update(str(o.get("name")) for o in order.get("outputs") or [])
        self._scratch_ids: list[int] = []   # extra network outputs only Arm NN writes (Api.concat_by_copy)
        self._scratch: list[tuple[int, Any]] = []
        self._tflite: bytes | None = None   # the order's per-axis TFLite model, made when first needed
        self._order = order
        self._parser: Any = None    # the TfLite parser holding the model's per-axis TensorInfos

        tensors = order.get("tensors")
        if not isinstance(tensors, Mapping):
            raise UnsupportedOrder(f"order {self.symbol} has no 'tensors' table")
        self._order_tensors = tensors
        self._shapes = {str(n): _shape_of(spec, f"tensor {n!r}") for n, spec in tensors.items()}
        self._qtypes = {str(n): self._tensor_qtype(spec, f"tensor {n!r}") for n, spec in tensors.items()}
        ins, outs = order.get("inputs") or [], order.get("outputs") or []
        if not ins or not outs:
            raise UnsupportedOrder(f"order {self.symbol} has no inputs or no outputs")
        self.input_names = [str(s["name"]) for s in ins]
        self.output_names = [str(s["name"]) for s in outs]
        for kind, specs in (("input", ins), ("output", outs)):
            for s in specs:
                shape = _shape_of(s, f"{kind} {s.get('name')!r}")
                if self._shapes.get(str(s["name"])) != shape:
                    raise UnsupportedOrder(f"{kind} {s['name']!r} shape {list(shape)} disagrees with the tensors table")
                if str(s.get("dtype")) != str(tensors[str(s["name"])].get("dtype")):
                    raise UnsupportedOrder(f"{kind} {s['name']!r} dtype {s.get('dtype')} disagrees with the "
                                           "tensors table")
        for name, spec in self._weights_table.items():
            _shape_of(spec, f"weight {name!r}", WEIGHT_DTYPES, scalar=True)
        if orders.is_quantized(order) and order.get("order_version") == 1:   # (dtypes are known ones here)
            raise UnsupportedOrder(f"order {self.symbol} is order_version 1 (float32 only) but has quantized "
                                   "tensors; a quantized order is order_version 2")
        self.input_shapes = [self._shapes[n] for n in self.input_names]
        self.output_shapes = [self._shapes[n] for n in self.output_names]
        # numpy dtypes run/run_into take and give: the order's (int8 codes stay int8)
        self.input_dtypes = [np.dtype(str(tensors[n].get("dtype"))) for n in self.input_names]
        self.output_dtypes = [np.dtype(str(tensors[n].get("dtype"))) for n in self.output_names]

        # build
        self._net = net = ann.INetwork()
        for i, name in enumerate(self.input_names):
            layer = net.AddInputLayer(i, f"input:{name}")
            self._set(layer, name)
            self._slots[name] = layer.GetOutputSlot(0)
        for k, op in enumerate(order.get("ops") or []):
            self._add_op(k, op)
        for j, name in enumerate(self.output_names):
            layer = net.AddOutputLayer(j, f"output:{name}")
            self._slot(name, "the outputs").Connect(layer.GetInputSlot(0))

        # optimise for what exists, load
        rt = self._runtime = _runtime()
        have = [str(b) for b in rt.GetDeviceSpec().GetSupportedBackends()]
        self.requested_backends = [b for b in preferred if b in have]
        if not self.requested_backends:
            raise UnsupportedOrder(f"none of the preferred Arm NN backends {list(preferred)} exists here "
                                   f"(this Arm NN has {have})")
        try:
            opt, msgs = ann.Optimize(net, [ann.BackendId(b) for b in self.requested_backends],
                                     rt.GetDeviceSpec(), ann.OptimizerOptions())
        except Exception as e:
            raise UnsupportedOrder(f"Arm NN cannot optimise order {self.symbol} for "
                                   f"{self.requested_backends}: {e}") from None
        self.messages = [str(m) for m in (msgs or ())]
        self.layer_backends = self._layer_backends(opt)
        try:
            net_id, load_msgs = rt.LoadNetwork(opt)
        except Exception as e:
            raise UnsupportedOrder(f"Arm NN cannot load order {self.symbol}: {e}") from None
        self._net_id = net_id
        # The runtime owns a deep copy of the optimised graph (weights included) from here on;
        # the INetwork and its weight copies are no longer needed. The numpy arrays behind the
        # ConstTensors (mostly views of the caller's blob) are kept, as pyarmnn's docs ask.
        self._net = self._parser = None
        if load_msgs:
            self.messages.append(str(load_msgs))
        compute = [b for _, t, b in self.layer_backends if t not in ("Input", "Output")]
        counts = Counter(compute or [b for _, _, b in self.layer_backends])
        self.layer_counts = dict(counts)
        self.backend = counts.most_common(1)[0][0] if counts else self.requested_backends[0]
        self._scratch = [(b, ann.Tensor(rt.GetOutputTensorInfo(net_id, b))) for b in self._scratch_ids]
        self._in_infos = [self._constant(rt.GetInputTensorInfo(net_id, i)) for i in range(len(self.input_names))]
        self._out_infos = [rt.GetOutputTensorInfo(net_id, j) for j in range(len(self.output_names))]
        self._in_sizes = [int(np.prod(s)) for s in self.input_shapes]
        self._out_sizes = [int(np.prod(s)) for s in self.output_shapes]

    # --- running --------------------------------------------------------------------------

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        outputs = [np.empty(s, d) for s, d in zip(self.output_shapes, self.output_dtypes)]
        self.run_into(inputs, outputs)
        return outputs

    def run_into(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        """Run with caller-owned output buffers (DPS). C-contiguous buffers of the order's dtype
        (float32; int8/uint8 codes for quantized tensors) are written by Arm NN directly; anything
        else goes through a temporary and np.copyto. A quantized input takes codes of its own
        dtype only: casting floats to codes would drop the quantization silently."""
        if self._net_id is None:
            raise RuntimeError(f"Arm NN executor for {self.symbol} is closed")
        if len(inputs) != len(self._in_infos) or len(outputs) != len(self._out_infos):
            raise ValueError(f"{self.symbol} takes {len(self._in_infos)} inputs and {len(self._out_infos)} "
                             f"outputs, got {len(inputs)} and {len(outputs)}")
        ann, raw = self._ann, armnn_api._raw   # set by _pyarmnn() at the first build: read it now
        in_tensors = []
        for i, x in enumerate(inputs):
            a = np.asarray(x)
            if a.size != self._in_sizes[i]:
                raise ValueError(f"{self.symbol} input {i} ({self.input_names[i]}): expected shape "
                                 f"{list(self.input_shapes[i])}, got {list(a.shape)}")
            want = self.input_dtypes[i]
            if a.dtype != want and want.kind in "iu":
                raise TypeError(f"{self.symbol} input {i} ({self.input_names[i]}) takes {want} codes, got {a.dtype}")
            if a.dtype != want or not a.flags.c_contiguous:
                a = np.ascontiguousarray(a, dtype=want)
            if raw is not None:
                t = raw.ConstTensor(self._in_infos[i], a)  # reads the caller's buffer in place
            else:
                t = ann.ConstTensor(self._in_infos[i], a.view())  # (it marks its array read-only)
            in_tensors.append((i, t))
        out_tensors, copies = [], []
        for j, out in enumerate(outputs):
            if not isinstance(out, np.ndarray):
                raise TypeError(f"{self.symbol} output {j}: expected a numpy array, got {type(out).__name__}")
            if out.size != self._out_sizes[j]:
                raise ValueError(f"{self.symbol} output {j} ({self.output_names[j]}): expected shape "
                                 f"{list(self.output_shapes[j])}, got {list(out.shape)}")
            direct = (raw is not None and out.dtype == self.output_dtypes[j] and out.flags.c_contiguous
                      and out.flags.writeable)
            if direct:
                t = raw.Tensor(self._out_infos[j], out)  # Arm NN writes into the caller's buffer
            else:
                t = ann.Tensor(self._out_infos[j])
                copies.append((out, t))
            out_tensors.append((j, t))
        out_tensors += self._scratch
        t0 = time.perf_counter_ns()
        self._runtime.EnqueueWorkload(self._net_id, in_tensors, out_tensors)
        self.last_run_ns = time.perf_counter_ns() - t0
        self.last_zero_copy = not copies
        for out, t in copies:
            np.copyto(out, t.get_memory_area().reshape(out.shape), casting="same_kind")

    def close(self) -> None:
        net_id, self._net_id = self._net_id, None
        if net_id is not None:
            try:
                self._runtime.UnloadNetwork(net_id)
            except Exception:
                pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> ArmnnExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ArmnnExecutor {self.symbol} on {getattr(self, 'backend', '?')}>"

    # --- building -------------------------------------------------------------------------

    def _info(self, shape: Sequence[int], q: QType | None = None):
        ann = self._ann
        if q is None:
            return ann.TensorInfo(ann.TensorShape(tuple(int(d) for d in shape)), ann.DataType_Float32)
        if q.per_axis is not None:
            info = self._per_axis_info(q.per_axis)
            if info.GetNumElements() != math.prod(shape):   # (its scales cannot be read: module doc)
                raise UnsupportedOrder(f"the order's per-axis TFLite model's tensor {q.per_axis!r} has "
                                       f"{info.GetNumElements()} elements, the order's {math.prod(shape)}")
            info.SetShape(ann.TensorShape(tuple(int(d) for d in shape)))
            return info
        info = ann.TensorInfo(ann.TensorShape(tuple(int(d) for d in shape)), getattr(ann, f"DataType_{q.armnn}"))
        info.SetQuantizationScale(float(q.scale))
        info.SetQuantizationOffset(int(q.offset))
        return info

    def _per_axis_info(self, name: str):
        """A fresh TensorInfo of the order's TFLite model's tensor ``name`` (per-axis scales that only
        Arm NN's TfLite parser can make), parsed once per order."""
        ann = self._ann
        if self._parser is None and not hasattr(ann, "ITfLiteParser"):
            raise UnsupportedOrder("this pyarmnn has no TfLite parser, which per-channel kernels need for their "
                                   f"per-axis scales; install libarmnntfliteparser{_abi()}")
        if self._parser is None:
            fd, path = tempfile.mkstemp(prefix="tandoor-armnn-", suffix=".tflite")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(self._tflite or b"")
                parser = ann.ITfLiteParser()
                net = parser.CreateNetworkFromBinaryFile(path)   # (read whole: the file can go)
            except Exception as e:
                raise UnsupportedOrder(f"Arm NN's TfLite parser cannot read the order's per-axis quantization "
                                       f"(its TFLite model): {' '.join(str(e).split())[:300]}") from None
            finally:
                os.unlink(path)
            self._parser = (parser, net)
        try:
            return self._parser[0].GetNetworkInputBindingInfo(0, name)[1]
        except Exception:
            raise UnsupportedOrder(f"the order's TFLite model has no tensor {name!r}; the order's per-axis "
                                   "quantization is not all there") from None

    @staticmethod
    def _tensor_qtype(spec: Mapping, what: str) -> QType | None:
        """The Arm NN type of an int8/uint8 tensor (None for float32): one scale and zero point."""
        q = _quant(spec, what)
        if q is None:
            return None
        scale, zp = _per_tensor(q, what, "Arm NN quantizes an activation per tensor")
        return QType(_ARMNN_OF_ACT[str(spec.get("dtype"))], scale, zp)

    def _constant(self, info):
        """The info as a ConstTensor wants it (marked constant where the API asks for that)."""
        if self._api.constant_infos:
            info.SetConstant(True)
        return info

    def _set(self, layer, tensor: str | None = None, shape: Sequence[int] | None = None, q: QType | None = None):
        """The layer's output info: the tensor's (shape and type), or ``shape`` of type ``q``."""
        if tensor is not None:
            shape, q = self._shapes[tensor], self._qtypes[tensor]
        layer.GetOutputSlot(0).SetTensorInfo(self._info(shape, q))
        return layer.GetOutputSlot(0)

    def _constant_layer(self, a: np.ndarray, name: str, q: QType | None = None):
        """A ConstantLayer holding ``a``; its output slot, whose info is constant where the API says."""
        layer = self._net.AddConstantLayer(self._const(a, q), name)
        layer.GetOutputSlot(0).SetTensorInfo(self._constant(self._info(a.shape, q)))
        return layer.GetOutputSlot(0)

    def _slot(self, name: str, where: str):
        try:
            return self._slots[name]
        except KeyError:
            raise UnsupportedOrder(f"{where} use tensor {name!r}, which no earlier op produces") from None

    def _const(self, arr: np.ndarray, q: QType | None = None):
        arr = np.ascontiguousarray(arr, dtype=np.float32 if q is None else q.np_dtype)
        self._keep.append(arr)
        return self._ann.ConstTensor(self._constant(self._info(arr.shape, q)), arr)

    def _weighted_layer(self, add, desc, name: str, weights: np.ndarray, bias: np.ndarray | None,
                        q: QuantOp | None = None):
        """A Convolution2d / DepthwiseConvolution2d / FullyConnected layer with its weights the
        way this API takes them: in the call (20.08) or as ConstantLayers on slots 1, 2 (23.08)."""
        wq, bq = (None, None) if q is None else (q.kernel, q.bias)
        if not self._api.weights_as_inputs:
            wt = self._const(weights, wq)
            return add(desc, wt, self._const(bias, bq), name) if bias is not None else add(desc, wt, name=name)
        layer = add(desc, name)
        for slot, (role, a, aq) in enumerate((("weights", weights, wq), ("bias", bias, bq)), start=1):
            if a is None:
                continue
            self._constant_layer(a, f"{name}:{role}", aq).Connect(layer.GetInputSlot(slot))
        return layer

    def _weight(self, name: str, where: str) -> np.ndarray:
        if name in self._weights_cache:
            return self._weights_cache[name]
        spec = self._weights_table.get(name)
        if spec is None:
            raise UnsupportedOrder(f"{where}: weight {name!r} is not in the order's weights table")
        shape = _shape_of(spec, f"weight {name!r}", WEIGHT_DTYPES, scalar=True)
        dt = np.dtype(str(spec.get("dtype"))).newbyteorder("<")   # the blob is little-endian
        offset, nbytes = int(spec.get("offset", -1)), int(spec.get("nbytes", -1))
        count = math.prod(shape)
        if nbytes != dt.itemsize * count or offset < 0 or offset + nbytes > len(self._blob):
            raise UnsupportedOrder(f"{where}: weight {name!r} (offset {offset}, {nbytes} bytes, shape "
                                   f"{list(shape)}) does not fit the {len(self._blob)}-byte blob")
        a = np.frombuffer(self._blob, dtype=dt, count=count, offset=offset).reshape(shape)
        if not a.flags.aligned:
            a = a.copy()
        self._weights_cache[name] = a
        return a

    def _add_op(self, k: int, op: Mapping[str, Any]) -> None:
        typ = str(op.get("type"))
        out = str(op.get("output"))
        where = f"op {k} ({typ} -> {out!r})"
        if out not in self._shapes:
            raise UnsupportedOrder(f"{where}: output tensor is not in the tensors table")
        if reason := orders.check_op(op):
            raise UnsupportedOrder(f"op {k}: {reason}")
        handler = armnn_ops.BUILDERS[typ]
        ins = [self._slot(str(n), where) for n in (op.get("inputs") or [])]
        in_shapes = [self._shapes[str(n)] for n in (op.get("inputs") or [])]
        attrs = op.get("attrs") or {}
        wts = op.get("weights") or {}
        q = self._quant_op(where, typ, op, attrs, wts)
        extra = {} if q is None else {"q": q}   # only the QUANT_OPS handlers take one
        if (typ == "conv2d" and attrs.get("depthwise") and self._api.depthwise_own_input and ins
                and (self._readers[str(op["inputs"][0])] > 1 or (
                    q is not None and q.kernel.per_axis is not None and self._api.per_axis_depthwise_copy))):
            ins[0] = self._copy(f"{k}:copy", ins[0], in_shapes[0], None if q is None else q.x)
        if typ == "concat" and self._api.concat_by_copy and len(ins) > 1:
            # Arm NN writes a concat's inputs in place only when each has no other reader
            j = min(range(len(ins)), key=lambda i: math.prod(in_shapes[i]))
            bid = SCRATCH_BINDING + len(self._scratch_ids)
            ins[j].Connect(self._net.AddOutputLayer(bid, f"{k}:scratch").GetInputSlot(0))
            self._scratch_ids.append(bid)
        slot = handler(self, where, f"{k}:{typ}:{out}", ins, in_shapes, self._shapes[out], attrs, wts, **extra)
        self._slots[out] = slot

    def _quant_op(self, where: str, typ: str, op: Mapping[str, Any], attrs: Mapping[str, Any],
                  wts: Mapping[str, str]) -> QuantOp | QType | None:
        """None for an op of float32 tensors and weights; the types of a quantized conv2d/dense
        (order_version 2's semantics: x int8/uint8, kernel int8, bias int32, y of x's dtype, a
        fused relu/clip) or the output type of a quantized add; UnsupportedOrder for anything
        else quantized (orders.QUANT_OPS)."""
        names = [str(n) for n in op.get("inputs") or []] + [str(op.get("output"))]
        tq = [self._qtypes[n] for n in names]
        wspecs = {r: self._weights_table.get(n) for r, n in wts.items() if n}
        wdtype = {r: str(sp.get("dtype")) for r, sp in wspecs.items() if isinstance(sp, Mapping)}
        if all(t is None for t in tq) and all(d == "float32" for d in wdtype.values()):
            return None
        if typ not in QUANT_OPS:
            raise UnsupportedOrder(f"{where}: a quantized {typ} is not supported yet (order_version 2 quantizes "
                                   f"{', '.join(QUANT_OPS)} only; leave it float32)")
        if typ == "binary":
            return self._quant_add(where, attrs, wts, names, tq)
        if len(tq) != 2 or any(t is None for t in tq):
            raise UnsupportedOrder(f"{where}: mixes float32 and quantized tensors; a quantized {typ} has an "
                                   "int8/uint8 input and output")
        x, y = tq
        if x.armnn != y.armnn:
            raise UnsupportedOrder(f"{where}: {self._tensor_dtype(names[0])} input, {self._tensor_dtype(names[1])} "
                                   f"output; a quantized {typ}'s output has its input's dtype")
        if missing := sorted(str(wts[r]) for r, sp in wspecs.items() if sp is None):
            raise UnsupportedOrder(f"{where}: weight(s) {missing} are not in the order's weights table")
        if wdtype.get("kernel") != "int8" or wdtype.get("bias", "int32") != "int32":
            raise UnsupportedOrder(f"{where}: a quantized {typ} takes an int8 kernel and an int32 bias, not "
                                   f"{wdtype.get('kernel')} and {wdtype.get('bias', 'none')}")
        self._quant_activation(where, typ, attrs)
        fix = "quantize the kernel per tensor, or run this order on onnxruntime"
        kq = _quant(wspecs["kernel"], f"{where} kernel")
        if kq.varies:
            return self._per_axis_op(where, typ, op, attrs, wts, kq, x, y)
        sw, zw = _per_tensor(kq, f"{where}: the kernel", fix)
        if zw != 0:
            raise UnsupportedOrder(f"{where}: kernel zero point {zw}; order_version 2 kernels are symmetric (0)")
        # the kernel in the activation's type (module doc: what ACL takes); uint8: codes + 128
        shift = 128 if x.armnn == "QAsymmU8" else 0
        kernel = QType(x.armnn, sw, shift)
        bias = None
        if "bias" in wspecs:
            bq = _quant(wspecs["bias"], f"{where} bias")
            sb, zb = _per_tensor(bq, f"{where}: the bias", fix)
            if zb != 0 or abs(sb - x.scale * sw) > 1e-5 * x.scale * sw:
                raise UnsupportedOrder(f"{where}: bias scale {sb:.6g} / zero point {zb} is not input scale x kernel "
                                       f"scale {x.scale * sw:.6g} / 0; the order is malformed")
            # the float32 product Arm NN checks the bias scale against (within 1e-6)
            bias = QType("Signed32", float(np.float32(x.scale) * np.float32(sw)), 0)
        return QuantOp(x, y, kernel, bias, shift)

    def _quant_add(self, where: str, attrs: Mapping[str, Any], wts: Mapping[str, str], names: list[str],
                   tq: list[QType | None]) -> QType:
        """The output type of a quantized add (orders.QUANT_OPS): two inputs and the output of one
        quantized dtype, each with its own scale and offset, which ACL's addition takes as they are."""
        if str(attrs.get("kind")) != "add" or wts or len(tq) != 3:
            raise UnsupportedOrder(f"{where}: a quantized binary is an add of two tensors (kind "
                                   f"{attrs.get('kind')!r}, {len(tq) - 1} input(s), weights {sorted(wts)})")
        if any(t is None for t in tq) or len({t.armnn for t in tq}) != 1:
            raise UnsupportedOrder(f"{where}: a quantized add takes and gives one int8/uint8 type, not "
                                   f"{', '.join(self._tensor_dtype(n) for n in names)}")
        self._quant_activation(where, "add", attrs)
        return tq[2]

    @staticmethod
    def _quant_activation(where: str, what: str, attrs: Mapping[str, Any]) -> None:
        """A quantized op fuses relu or clip (an ActivationLayer on its output's quantization) or nothing."""
        act = attrs.get("activation")
        if act is not None and str(act.get("kind")) not in ("relu", "clip"):
            raise UnsupportedOrder(f"{where}: {act.get('kind')} fused into a quantized {what}; only relu and clip are "
                                   "(the others have no quantized semantics in order_version 2)")

    def _per_axis_op(self, where: str, typ: str, op: Mapping[str, Any], attrs: Mapping[str, Any],
                     wts: Mapping[str, str], kq: orders.Quant, x: QType, y: QType) -> QuantOp:
        """The types of a conv2d/dense whose kernel scales vary per output channel: QSymmS8 and
        Signed32 per axis, their TensorInfos from the order's TFLite model (module doc)."""
        if self._tflite is None:
            try:
                self._tflite = armnn_tflite.quant_model(self._order)
            except ImportError as e:    # flatbuffers: onnxruntime's dependency, so normally there
                raise UnsupportedOrder(f"{where}: per-axis quantization needs the flatbuffers package "
                                       f"({e}); pip install flatbuffers") from None
        if self._tflite is None:
            raise UnsupportedOrder(
                f"{where}: the kernel has per-axis quantization ({len(kq.scale)} scales on axis {kq.axis}) that "
                "no TFLite tensor says (only int8 conv2d/dense kernels and int32 biases do; pyarmnn has no "
                "SetQuantizationScales): run this order on onnxruntime")
        if kq.axis != 0 or any(kq.zero_point):
            raise UnsupportedOrder(f"{where}: per-axis kernel on axis {kq.axis} with zero points "
                                   f"{sorted(set(kq.zero_point))[:3]}; order_version 2 kernels are symmetric, "
                                   "per output channel (axis 0)")
        kname = str(wts["kernel"])
        kshape = self._weights_table[kname].get("shape") or [0]
        depthwise = armnn_tflite.is_depthwise(op, kshape, self._shapes[str((op.get("inputs") or [""])[0])][-1])
        # Arm NN's depthwise layout decides which of the model's tensors has the quantized dim it reads
        kernel = QType("QSymmS8", 0.0, 0, kname + (armnn_tflite.TFLITE_1HWO if depthwise and
                                                    self._api.depthwise_kernel == "1HWO" else ""))
        bias = None
        if wts.get("bias"):
            bq = _quant(self._weights_table[str(wts["bias"])], f"{where} bias")
            want = [x.scale * s for s in kq.scale]
            if (bq.axis is None and len(kq.scale) > 1) or len(bq.scale) != len(want) or any(bq.zero_point) or any(
                    abs(b - w) > 1e-5 * w for b, w in zip(bq.scale, want)):
                raise UnsupportedOrder(f"{where}: bias scales / zero points are not input scale x kernel scales / 0 "
                                       "per output channel; the order is malformed")
            bias = QType("Signed32", 0.0, 0, str(wts["bias"]))
        return QuantOp(x, y, kernel, bias, 0)

    def _tensor_dtype(self, name: str) -> str:
        return str(self._order_tensors[name].get("dtype"))

    def _need_inputs(self, where: str, ins: list, n: int) -> None:
        if len(ins) != n:
            raise UnsupportedOrder(f"{where}: expected {n} input(s), got {len(ins)}")

    def _activation(self, where: str, name: str, slot, shape, act: Mapping[str, Any] | None,
                    q: QType | None = None):
        """Append an ActivationLayer for the order's activation object (None: nothing); ``q``: the
        quantized type it computes in (relu/clip on a quantized op's output)."""
        if act is None:
            return slot
        ann = self._ann
        kind = str(act.get("kind"))
        if kind == "silu":  # x * sigmoid(x): Arm NN has no Swish activation
            sig = self._activation(where, f"{name}:sig", slot, shape, {"kind": "sigmoid"})
            layer = self._net.AddMultiplicationLayer(f"{name}:silu")
            slot.Connect(layer.GetInputSlot(0))
            sig.Connect(layer.GetInputSlot(1))
            return self._set(layer, shape=shape)
        if kind == "gelu" and not self._api.gelu:
            raise UnsupportedOrder(f"{where}: activation gelu: Arm NN has a GELU layer only since 23.11, "
                                   f"this is {self._api.release}")
        if kind == "gelu_tanh":  # x * (0.5 + 0.5 tanh(k * (x + a x^3))): no such Arm NN activation
            cube = self._elementwise("mul", f"{name}:cube", self._elementwise("mul", f"{name}:sq", slot, slot, shape),
                                     slot, shape)
            inner = self._elementwise("add", f"{name}:inner", slot, self._linear(f"{name}:a", cube, shape, 0.044715),
                                      shape)
            d = ann.ActivationDescriptor()
            d.m_Function, d.m_A, d.m_B = ann.ActivationFunction_TanH, 1.0, math.sqrt(2 / math.pi)  # m_A tanh(m_B x)
            layer = self._net.AddActivationLayer(d, f"{name}:tanh")
            inner.Connect(layer.GetInputSlot(0))
            phi = self._linear(f"{name}:phi", self._set(layer, shape=shape), shape, 0.5, 0.5)
            return self._elementwise("mul", f"{name}:gelu", slot, phi, shape)
        if kind == "hardsigmoid":  # clip(alpha * x + beta, 0, 1): Linear then BoundedReLu
            d = ann.ActivationDescriptor()
            d.m_Function = ann.ActivationFunction_Linear
            d.m_A, d.m_B = float(act.get("alpha", 0.2)), float(act.get("beta", 0.5))
            layer = self._net.AddActivationLayer(d, f"{name}:linear")
            slot.Connect(layer.GetInputSlot(0))
            lin = self._set(layer, shape=shape)
            return self._activation(where, f"{name}:hsig", lin, shape, {"kind": "clip", "min": 0.0, "max": 1.0})
        d = ann.ActivationDescriptor()
        if kind == "relu":
            d.m_Function = ann.ActivationFunction_ReLu
        elif kind == "clip":
            lo = act.get("min")
            hi = act.get("max")
            lo = -_FLT_MAX if lo is None else max(float(lo), -_FLT_MAX)
            hi = _FLT_MAX if hi is None else min(float(hi), _FLT_MAX)
            if lo > hi:
                raise UnsupportedOrder(f"{where}: clip with min {lo} > max {hi}")
            if lo == 0.0 and hi == _FLT_MAX:
                d.m_Function = ann.ActivationFunction_ReLu
            else:  # BoundedReLu: min(m_A, max(m_B, x))
                d.m_Function = ann.ActivationFunction_BoundedReLu
                d.m_A, d.m_B = hi, lo
        elif kind == "sigmoid":
            d.m_Function = ann.ActivationFunction_Sigmoid
        elif kind == "tanh":  # m_A * tanh(m_B * x)
            d.m_Function = ann.ActivationFunction_TanH
            d.m_A, d.m_B = 1.0, 1.0
        elif kind == "leaky_relu":
            d.m_Function = ann.ActivationFunction_LeakyReLu
            d.m_A = float(act.get("alpha", 0.01))
        elif kind == "hardswish":
            d.m_Function = getattr(ann, "ActivationFunction_HardSwish", self._api.hardswish)
        else:
            raise UnsupportedOrder(f"{where}: activation kind {kind!r} has no Arm NN equivalent")
        layer = self._net.AddActivationLayer(d, f"{name}:{kind}")
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=shape, q=q)

    def _linear(self, name: str, slot, shape, a: float, b: float = 0.0):
        """a * x + b, an ActivationLayer (Linear)."""
        ann = self._ann
        d = ann.ActivationDescriptor()
        d.m_Function, d.m_A, d.m_B = ann.ActivationFunction_Linear, float(a), float(b)
        layer = self._net.AddActivationLayer(d, name)
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=shape)

    def _elementwise(self, kind: str, name: str, a, b, shape):
        """a (kind) b for two slots of one rank (Arm NN broadcasts dims of size 1)."""
        add = {"add": self._net.AddAdditionLayer, "sub": self._net.AddSubtractionLayer,
               "mul": self._net.AddMultiplicationLayer}[kind]
        layer = add(name)
        a.Connect(layer.GetInputSlot(0))
        b.Connect(layer.GetInputSlot(1))
        return self._set(layer, shape=shape)

    def _mean_last(self, name: str, slot, shape):
        """The mean over the last axis, kept as a size-1 axis."""
        ann = self._ann
        layer = self._net.AddMeanLayer(ann.MeanDescriptor([len(shape) - 1], True), name)
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=[*shape[:-1], 1])

    def _copy(self, name: str, slot, shape, q: QType | None = None):
        """The tensor copied by an identity activation (a layer with an input of its own). A
        quantized one is a BoundedReLu over every code's real value: ACL has no quantized Linear."""
        ann = self._ann
        d = ann.ActivationDescriptor()
        if q is None:
            d.m_Function, d.m_A, d.m_B = ann.ActivationFunction_Linear, 1.0, 0.0
        else:
            lo, hi = orders.QUANT_DTYPES["int8" if q.np_dtype is np.int8 else "uint8"]
            d.m_Function = ann.ActivationFunction_BoundedReLu   # min(m_A, max(m_B, x))
            d.m_A, d.m_B = (hi - q.offset) * q.scale, (lo - q.offset) * q.scale
        layer = self._net.AddActivationLayer(d, name)
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=shape, q=q)

    def _reshape(self, name: str, slot, shape, q: QType | None = None):
        ann = self._ann
        layer = self._net.AddReshapeLayer(ann.ReshapeDescriptor(ann.TensorShape(tuple(shape))), name)
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=shape, q=q)

    def _permute(self, name: str, slot, in_shape, axes):
        """numpy-style transpose(axes): a Transpose layer where the binding has one; else Permutes
        (whose mapping is the inverse of axes) that NEPermute takes, chained (PERMUTES_2008)."""
        ann = self._ann
        axes, rank = [int(a) for a in axes], len(in_shape)
        out_shape = [in_shape[a] for a in axes]
        if self._api.transpose_layer:
            layer = self._net.AddTransposeLayer(ann.TransposeDescriptor(ann.PermutationVector(tuple(axes))), name)
            slot.Connect(layer.GetInputSlot(0))
            return self._set(layer, shape=out_shape)
        cur = list(in_shape)
        if rank < 3:  # lift to rank 3 with leading 1s, where NEPermute has permutations
            lift = 3 - rank
            cur, axes = [1] * lift + cur, list(range(lift)) + [a + lift for a in axes]
            slot = self._reshape(f"{name}:lift", slot, cur)
        plan = permute_plan(tuple(axes))
        if plan is None:
            raise UnsupportedOrder(f"{name}: a transpose by {axes} has no chain of Permutes Arm NN "
                                   f"{self._api.release} runs on CpuAcc")
        for k, step in enumerate(plan):
            mapping = tuple(int(i) for i in np.argsort(step))  # PermutationVector wants a tuple
            last = k == len(plan) - 1 and rank >= 3
            layer = self._net.AddPermuteLayer(ann.PermuteDescriptor(ann.PermutationVector(mapping)),
                                              name if last else f"{name}:{k}")
            slot.Connect(layer.GetInputSlot(0))
            cur = [cur[a] for a in step]
            slot = self._set(layer, shape=cur)
        return self._reshape(name, slot, out_shape) if rank < 3 else slot

    # --- which backend runs what --------------------------------------------------------------

    @staticmethod
    def _layer_backends(opt) -> list[tuple[str, str, str]]:
        """(layer name, layer type, backend) of every layer, read from the optimised network's dot
        dump (IOptimizedNetwork has no other introspection in pyarmnn 20.08)."""
        fd, path = tempfile.mkstemp(prefix="tandoor-armnn-", suffix=".dot")
        os.close(fd)
        try:
            opt.SerializeToDot(path)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except Exception:
            return []
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        out = []
        for label in re.findall(r'label="\{([^"]*)\}"', text):
            fields = dict(re.findall(r"(\w+) : ([^\\|]*)\\l", label))
            if "BackendID" in fields:
                out.append((fields.get("LayerName", "?"), fields.get("LayerType", "?"), fields["BackendID"]))
        return out
