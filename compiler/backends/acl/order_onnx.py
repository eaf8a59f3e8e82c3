"""An order (docs/bundle-format.md) rendered as an ONNX graph, for the onnxruntime executor.

The device cannot import ``onnx``, so the compiler renders every order here and stores the result
as ``orders/<symbol>.onnx``. The rendering is a pure function of (order, weights): equal inputs
give byte-identical models.

Layout: rank-4 order tensors are NHWC and every order tensor keeps its own name and layout in the
graph. ONNX Conv/MaxPool/AveragePool are NCHW, so they run on a Transpose(0,3,1,2) copy of their
input and their result is turned back with Transpose(0,2,3,1). Both copies are made lazily and at
most once per tensor: an NHWC tensor feeding several NCHW ops is transposed once, and an NCHW
result that only feeds NCHW ops (conv -> conv) is never turned back at all. onnxruntime's
transpose optimiser removes most of what remains.

Semantics follow the order, i.e. TVM's relax ops that codegen read the attributes from; where an
ONNX op differs (nearest resize with rounding "round"), the difference is handled below.
"""

from __future__ import annotations

import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tandoor_contract import hmod
from tandoor_contract import backends, orders

OPSET = 17
# The IR version that came with opset 17 (onnx 1.12). Every onnxruntime that runs opset 17
# (>= 1.13, the agent requires >= 1.20) loads it; onnx's own default may be newer than the
# board's onnxruntime accepts.
IR_VERSION = 8

TO_NCHW = [0, 3, 1, 2]
TO_NHWC = [0, 2, 3, 1]

_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min"}
_GLOBAL_POOL = {"avg": "ReduceMean", "max": "ReduceMax"}
_POOL = {"avg": "AveragePool", "max": "MaxPool"}
# TVM's coordinate_transformation_mode values that mean the same in ONNX Resize-13
_COORD_MODES = ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel", "tf_half_pixel_for_nn")

# resize2d rounding_method (TVM's names) -> ONNX nearest_mode. TVM's "" means "round" under
# align_corners and "floor" otherwise (topi.image.resize2d). TVM's "round" rounds half to even,
# which no ONNX nearest_mode does: it is rendered as round_prefer_ceil when no sampling
# coordinate is exactly halfway for these sizes (then the two agree), else as two Gathers with
# TVM's index table (_nearest_indices).
_NEAREST_MODE = {
    "round_prefer_floor": "round_prefer_floor",
    "round_prefer_ceil": "round_prefer_ceil",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round_prefer_ceil",
}


def order_to_onnx(order: dict, weights: bytes, external: str | None = None) -> onnx.ModelProto:
    """Render ``order`` with its weights blob as an opset-17 ONNX model.

    Graph inputs and outputs carry the order's names, shapes and dtypes in call order; the
    weights an op uses become initializers. With ``external`` (a file name, e.g. "<symbol>.bin"),
    the order's weights are not copied into the model: they are ONNX external data at their
    offsets in that file, which is the weights blob itself, and a layout change (OHWI -> OIHW) is
    a Transpose node onnxruntime folds when the session starts. The bundle then carries the
    weights once instead of twice. Raises ValueError for anything the format does not define
    (unknown op type, activation, pool kind, resize mode, weights outside the blob ...).
    The result has passed ``onnx.checker.check_model(full_check=True)``.
    """
    ver = order.get("order_version")
    if ver not in hmod.ORDER_VERSIONS:
        raise ValueError(f"order_version {ver!r} is not supported (expected one of {hmod.ORDER_VERSIONS})")
    if orders.kind_of(order) != backends.LAYERS:   # an onnx order (compiler/backends/onnx/hatch.py) is its own ONNX already
        raise ValueError(f"order {order.get('symbol')!r} is of kind {orders.kind_of(order)!r}: only a layer list is rendered")
    if external is not None and (not external or "/" in external or "\\" in external or external.startswith(".")):
        raise ValueError(f"external data file name {external!r} must be a plain file name")
    # order_version 5's scale references: read as lists, and (with external) rendered as external
    # data at the same bytes, so the blob holds a per-channel scale list once for every reader
    blob = bytes(weights)
    scale_at = {blob[o:o + n]: o for o, n in orders.scale_refs(order)}
    order = orders.resolve_scales(order, blob)
    r = _Renderer(order, blob, external, scale_at)
    for i, op in enumerate(order["ops"]):
        if reason := orders.check_op(op):
            raise ValueError(f"order {order.get('symbol')!r}: op {i}: {reason}")
        getattr(r, f"_op_{op['type']}")(op)     # every op type has one (tests/test_order_onnx.py)
    for o in order["outputs"]:
        r.nhwc(o["name"])

    graph = helper.make_graph(
        r.nodes, str(order.get("symbol") or "order"),
        [_value_info(t) for t in order["inputs"]],
        [_value_info(t) for t in order["outputs"]],
        initializer=r.inits,
        value_info=[_value_info({"name": n, **t}) for n, t in order["tensors"].items()
                    if n in r.materialized and n not in r.io_names],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              ir_version=IR_VERSION, producer_name="tandoor",
                              doc_string=f"tandoor order {order.get('symbol')}")
    if external is None:
        onnx.checker.check_model(model, full_check=True)
    else:  # the checker reads external data from files beside the model
        with tempfile.TemporaryDirectory(prefix="tandoor-onnx-") as tmp:
            (Path(tmp) / external).write_bytes(r.blob)
            (Path(tmp) / "order.onnx").write_bytes(model.SerializeToString())
            onnx.checker.check_model(str(Path(tmp) / "order.onnx"), full_check=True)
    return model


def _value_info(t: dict) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(t["dtype"]))
    return helper.make_tensor_value_info(t["name"], elem, [int(d) for d in t["shape"]])


def _pads(p, what: str) -> list[int]:
    """[top, left, bottom, right] (TVM also allows [all] and [h, w]) -> ONNX pads, same order."""
    p = [int(x) for x in p]
    if len(p) == 1:
        p = p * 4
    elif len(p) == 2:
        p = p * 2
    if len(p) != 4:
        raise ValueError(f"{what}: padding {p} is not [top, left, bottom, right]")
    return p


def zero_run(blob: bytes, nbytes: int) -> int | None:
    """The offset of ``nbytes`` zeros the blob ends with (64-aligned end: pipeline appends them for
    a quantized order's per-channel zero points), or None."""
    at = len(blob) - nbytes
    return at if nbytes and at >= 0 and len(blob) % 64 == 0 and blob[at:] == bytes(nbytes) else None


def with_zero_run(order: dict, blob: bytes) -> bytes:
    """``blob`` ending in as many zeros as the order's longest all-zero per-channel zero_point list
    takes (64-byte aligned), so that the ONNX rendering and the TVM fallback read such zero points
    there instead of each carrying copies (EfficientNet-Lite0 INT8: 2 x 22 KB)."""
    need = 0
    for table in ("tensors", "weights"):
        for spec in (order.get(table) or {}).values():
            q = orders.quant_of(spec) if isinstance(spec, dict) and spec.get("quant") else None
            # int8/uint8 kernels': an int32 bias's zero points are read by nobody (ONNX needs none)
            if q is not None and q.axis is not None and not any(q.zero_point) and spec["dtype"] in ("int8", "uint8"):
                need = max(need, len(q.zero_point))
    if not need:
        return blob
    need += -need % 64
    pad = -len(blob) % 64
    return blob if zero_run(blob, need) is not None else blob + bytes(pad + need)


class _Renderer:
    def __init__(self, order: dict, blob: bytes, external: str | None = None,
                 scale_at: dict[bytes, int] | None = None) -> None:
        self.order, self.blob, self.external = order, blob, external
        self.scale_at = scale_at or {}      # float32 bytes of a scale list -> its blob offset
        self.tensors: dict[str, dict] = order["tensors"]
        self.wtable: dict[str, dict] = order.get("weights") or {}
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.io_names = {t["name"] for t in order["inputs"]} | {t["name"] for t in order["outputs"]}
        self.taken = set(self.tensors) | set(self.wtable) | self.io_names
        self.materialized = {t["name"] for t in order["inputs"]}  # NHWC value under its own name
        self.nchw: dict[str, str] = {}      # order tensor -> its NCHW copy
        self.cache: dict[tuple, str] = {}   # (weight, transform) -> initializer name
        self.ext_done: set[str] = set()     # order weights already declared as external data

    # --- names, initializers, nodes ---------------------------------------------------------

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def const(self, array: np.ndarray, base: str) -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.array(array, order="C"), name))  # rank 0 stays rank 0
        return name

    def weight(self, op: dict, role: str, transform=None, tag: str = "", perm: list[int] | None = None) -> str | None:
        """Initializer name of the op's weight ``role`` (None if absent), optionally transformed.
        ``perm``: the transform is that transpose (an in-graph Transpose over external data)."""
        name = (op.get("weights") or {}).get(role)
        if name is None:
            return None
        key = (name, tag)
        if key not in self.cache:
            a = self.array(name)
            raw = a
            if transform is not None:
                a = transform(a)
            if self.external and tag and perm is not None:
                self.cache[key] = self.node("Transpose", [self.external_weight(name)], self.fresh(f"{name}__{tag}"),
                                            perm=perm)
            elif self.external and not tag and a.shape == raw.shape:
                self.cache[key] = self.external_weight(name)
            elif tag:
                self.cache[key] = self.const(a, f"{name}__{tag}")
            else:
                self.taken.add(name)
                self.inits.append(numpy_helper.from_array(np.array(a, order="C"), name))
                self.cache[key] = name
        return self.cache[key]

    def external_weight(self, name: str) -> str:
        """The order weight ``name`` as an initializer whose bytes stay in the external file."""
        if name not in self.ext_done:
            self.array(name)  # checks that it lies inside the blob
            w = self.wtable[name]
            self.taken.add(name)
            self.external_init(name, w["dtype"], w["shape"], int(w["offset"]), int(w["nbytes"]))
            self.ext_done.add(name)
        return name

    def external_init(self, name: str, dtype: str, shape, offset: int, nbytes: int) -> None:
        t = onnx.TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        t.dims.extend(int(d) for d in shape)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", self.external), ("offset", str(offset)), ("length", str(nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)

    def array(self, name: str) -> np.ndarray:
        w = self.wtable.get(name)
        if w is None:
            raise ValueError(f"weight {name!r} is not in the order's weights table")
        try:
            a = hmod.blob_array(self.blob, w)
        except ValueError as err:
            raise ValueError(f"weight {name!r}: {err}") from None
        return a.astype(a.dtype.newbyteorder("="))

    def node(self, op_type: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attrs))
        return output

    def shape(self, t: str) -> list[int]:
        return [int(d) for d in self.tensors[t]["shape"]]

    # --- layouts ----------------------------------------------------------------------------

    def nhwc(self, t: str) -> str:
        """The order tensor ``t`` in the order's layout, under its own name."""
        if t not in self.materialized:
            if t not in self.nchw:
                raise ValueError(f"tensor {t!r} is used before any op produces it")
            self.node("Transpose", [self.nchw[t]], t, perm=TO_NHWC)
            self.materialized.add(t)
        return t

    def to_nchw(self, t: str) -> str:
        if len(self.shape(t)) != 4:
            raise ValueError(f"tensor {t!r} of shape {self.shape(t)} is not NHWC")
        if t not in self.nchw:
            self.nchw[t] = self.node("Transpose", [self.nhwc(t)], self.fresh(f"{t}__nchw"), perm=TO_NCHW)
        return self.nchw[t]

    def produce_nchw(self, op: dict, value: str, act: dict | None) -> None:
        out = op["output"]
        if out in self.materialized or out in self.nchw:
            raise ValueError(f"tensor {out!r} is produced twice")
        self.nchw[out] = self.activation(act, value, self.fresh(f"{out}__nchw")) if act else value

    # --- activations ------------------------------------------------------------------------

    def activation(self, act: dict, x: str, y: str) -> str:
        kind = act.get("kind")
        if kind == "relu":
            return self.node("Relu", [x], y)
        if kind == "clip":
            lo = self.const(np.array(act["min"], np.float32), f"{y}__min") if act.get("min") is not None else ""
            hi = self.const(np.array(act["max"], np.float32), f"{y}__max") if act.get("max") is not None else ""
            return self.node("Clip", [x, lo, hi], y)
        if kind == "sigmoid":
            return self.node("Sigmoid", [x], y)
        if kind == "tanh":
            return self.node("Tanh", [x], y)
        if kind == "hardswish":
            return self.node("HardSwish", [x], y)
        if kind == "leaky_relu":
            return self.node("LeakyRelu", [x], y, alpha=float(act.get("alpha", 0.01)))
        if kind == "hardsigmoid":
            return self.node("HardSigmoid", [x], y, alpha=float(act["alpha"]), beta=float(act["beta"]))
        if kind == "silu":
            s = self.node("Sigmoid", [x], self.fresh(f"{y}__sigmoid"))
            return self.node("Mul", [x, s], y)
        if kind in ("gelu", "gelu_tanh"):    # ONNX Gelu is opset 20: written out at opset 17
            return self.gelu(x, y, kind == "gelu_tanh")
        raise ValueError(f"activation kind {kind!r} has no ONNX rendering")

    def gelu(self, x: str, y: str, tanh: bool) -> str:
        """x * (1 + erf(x / sqrt 2)) / 2, or with tanh(sqrt(2/pi) * (x + 0.044715 x^3)) inside."""
        def c(v: float, tag: str) -> str:
            return self.const(np.array(v, np.float32), f"{y}__{tag}")

        def step(op: str, ins: list[str], tag: str) -> str:
            return self.node(op, ins, self.fresh(f"{y}__{tag}"))

        if tanh:
            cube = step("Mul", [step("Mul", [x, x], "sq"), x], "cube")
            inner = step("Add", [x, step("Mul", [cube, c(0.044715, "a")], "acube")], "inner")
            phi = step("Tanh", [step("Mul", [inner, c(np.sqrt(2 / np.pi), "k")], "scaled")], "tanh")
        else:
            phi = step("Erf", [step("Div", [x, c(np.sqrt(2.0), "sqrt2")], "scaled")], "erf")
        half = step("Mul", [x, c(0.5, "half")], "xhalf")
        return self.node("Mul", [half, step("Add", [phi, c(1.0, "one")], "phi")], y)

    def target(self, op: dict, act: dict | None, tag: str) -> str:
        """Where an op writes its value: the output itself, or a temporary if an activation follows."""
        return self.fresh(f"{op['output']}__{tag}") if act else self.output(op)

    def output(self, op: dict) -> str:
        out = op["output"]
        if out in self.materialized or out in self.nchw:
            raise ValueError(f"tensor {out!r} is produced twice")
        self.materialized.add(out)
        return out

    def finish(self, op: dict, value: str, act: dict | None) -> None:
        if act:
            self.activation(act, value, self.output(op))

    # --- quantized tensors (order_version 2) ---------------------------------------------------
    #
    # A quantized op is rendered as onnxruntime's QDQ form: DequantizeLinear of its int8 input and
    # of its int8/int32 weights, the float op, QuantizeLinear of the result. onnxruntime fuses each
    # such group into its integer kernels (QLinearConv, QGemm); layout transposes act on the int8
    # tensors, outside the group.

    def qparams(self, q: orders.Quant, dtype: str, base: str, zero_point: bool = True) -> list[str]:
        per_axis = q.axis is not None
        scale = np.array(q.scale if per_axis else q.scale[0], np.float32)
        at = self.scale_at.get(scale.astype("<f4").tobytes()) if self.external and per_axis else None
        if at is not None:   # the blob holds these bytes (order_version 5): refer to them
            names = [self.fresh(f"{base}__scale")]
            self.external_init(names[0], "float32", scale.shape, at, scale.nbytes)
        else:
            names = [self.const(scale, f"{base}__scale")]
        if zero_point:
            zp = np.array(q.zero_point if per_axis else q.zero_point[0], dtype)
            at = zero_run(self.blob, zp.nbytes) if self.external and per_axis and not zp.any() else None
            if at is not None:   # symmetric per-channel zero points: the zeros the blob ends with
                names.append(self.fresh(f"{base}__zp"))
                self.external_init(names[-1], dtype, zp.shape, at, zp.nbytes)
            else:
                names.append(self.const(zp, f"{base}__zp"))
        return names

    def dequantize(self, x: str, q: orders.Quant, dtype: str, base: str, axis: int | None = None) -> str:
        attrs = {"axis": axis} if q.axis is not None and axis is not None else {}
        return self.node("DequantizeLinear", [x, *self.qparams(q, dtype, base, dtype != "int32")],
                         self.fresh(f"{base}__dq"), **attrs)

    def qweight(self, op: dict, role: str, transform=None, tag: str = "", perm=None, axis: int = 0) -> str | None:
        """A quantized weight, dequantized in the graph (None if the op has no such weight)."""
        name = (op.get("weights") or {}).get(role)
        if name is None:
            return None
        spec = self.wtable[name]
        q = orders.quant_of(spec, f"weight {name}")
        if q is None:
            raise ValueError(f"{op['type']} -> {op['output']}: a quantized op with a float32 {role}")
        w = self.weight(op, role, transform, tag, perm)
        return self.dequantize(w, q, spec["dtype"], name, axis)

    def op_quant(self, op: dict) -> tuple[orders.Quant, orders.Quant] | None:
        """(input quant, output quant) of a quantized conv2d/dense; None for a float op."""
        x, y = op["inputs"][0], op["output"]
        qx, qy = orders.quant_of(self.tensors[x], x), orders.quant_of(self.tensors[y], y)
        if qx is None and qy is None:
            return None
        if qx is None or qy is None or self.tensors[x]["dtype"] != self.tensors[y]["dtype"]:
            raise ValueError(f"{op['type']} -> {y}: quantized ops take and give one int8/uint8 type")
        return qx, qy

    def requantize(self, op: dict, value: str, act: dict | None, qy: orders.Quant, out: str | None = None) -> str:
        y = op["output"]
        if act:
            value = self.activation(act, value, self.fresh(f"{y}__act"))
        return self.node("QuantizeLinear", [value, *self.qparams(qy, self.tensors[y]["dtype"], y)],
                         out or self.fresh(f"{y}__q"))

    # --- ops --------------------------------------------------------------------------------

    def _op_conv2d(self, op: dict) -> None:
        a = op["attrs"]
        x = op["inputs"][0]
        if (qs := self.op_quant(op)) is not None:
            return self._qconv2d(op, *qs)
        cin = self.shape(x)[3]
        groups = int(a.get("groups", 1))
        kernel = self.array(op["weights"]["kernel"])  # OHWI; depthwise [C*M, KH, KW, 1] is OHWI too
        if kernel.ndim != 4 or kernel.shape[3] * groups != cin or kernel.shape[0] % groups:
            raise ValueError(f"conv2d -> {op['output']}: kernel {list(kernel.shape)} with groups={groups} "
                             f"does not fit {cin} input channels")
        if a.get("depthwise") and groups != cin:
            raise ValueError(f"conv2d -> {op['output']}: depthwise with groups={groups} != {cin} channels")
        w = self.weight(op, "kernel", lambda k: k.transpose(0, 3, 1, 2), "oihw", perm=[0, 3, 1, 2])
        ins = [self.to_nchw(x), w]
        b = self.weight(op, "bias", lambda v: v.reshape(-1))
        if b is not None:
            ins.append(b)
        y = self.conv_node(op, ins, kernel, groups)
        self.produce_nchw(op, y, a.get("activation"))

    def _op_conv2d_transpose(self, op: dict) -> None:
        a = op["attrs"]
        x = op["inputs"][0]
        kernel = self.array(op["weights"]["kernel"])  # OHWI
        if kernel.ndim != 4 or kernel.shape[3] != self.shape(x)[3]:
            raise ValueError(f"conv2d_transpose -> {op['output']}: kernel {list(kernel.shape)} does not fit "
                             f"{self.shape(x)[3]} input channels")
        w = self.weight(op, "kernel", lambda k: k.transpose(3, 0, 1, 2), "iohw", perm=[3, 0, 1, 2])
        ins = [self.to_nchw(x), w]
        b = self.weight(op, "bias", lambda v: v.reshape(-1))
        if b is not None:
            ins.append(b)
        y = self.node("ConvTranspose", ins, self.fresh(f"{op['output']}__deconv"),
                      kernel_shape=list(kernel.shape[1:3]),
                      strides=[int(s) for s in a.get("strides", [1, 1])],
                      pads=_pads(a.get("padding", [0]), f"conv2d_transpose -> {op['output']}"),
                      output_padding=[int(p) for p in a.get("output_padding", [0, 0])])
        self.produce_nchw(op, y, a.get("activation"))

    def _op_prelu(self, op: dict) -> None:
        slope = self.weight(op, "slope")
        self.node("PRelu", [self.nhwc(op["inputs"][0]), slope], self.output(op))

    def _op_strided_slice(self, op: dict) -> None:
        a, x = op["attrs"], op["inputs"][0]
        rank = len(self.shape(x))
        parts = [np.array([int(v) for v in a[k]], np.int64) for k in ("begin", "end", "strides")]
        if any(len(p) != rank for p in parts) or (parts[2] <= 0).any():
            raise ValueError(f"strided_slice -> {op['output']}: begin/end/strides must have {rank} entries, strides > 0")
        names = [self.const(p, f"{op['output']}__{k}") for p, k in zip(parts, ("starts", "ends", "steps"))]
        axes = self.const(np.arange(rank, dtype=np.int64), f"{op['output']}__axes")
        self.node("Slice", [self.nhwc(x), names[0], names[1], axes, names[2]], self.output(op))

    def _op_pad(self, op: dict) -> None:
        a, x = op["attrs"], op["inputs"][0]
        pads = np.array([int(p) for p in a["pads"]], np.int64)
        if len(pads) != 2 * len(self.shape(x)) or (pads < 0).any():
            raise ValueError(f"pad -> {op['output']}: pads {pads.tolist()} do not fit rank {len(self.shape(x))}")
        value = self.const(np.array(float(a.get("value", 0.0)), np.float32), f"{op['output']}__value")
        self.node("Pad", [self.nhwc(x), self.const(pads, f"{op['output']}__pads"), value], self.output(op),
                  mode="constant")

    def conv_node(self, op: dict, ins: list[str], kernel: np.ndarray, groups: int) -> str:
        a = op["attrs"]
        return self.node("Conv", ins, self.fresh(f"{op['output']}__conv"), kernel_shape=list(kernel.shape[1:3]),
                         strides=[int(s) for s in a.get("strides", [1, 1])],
                         pads=_pads(a.get("padding", [0]), f"conv2d -> {op['output']}"),
                         dilations=[int(d) for d in a.get("dilation", [1, 1])], group=groups)

    def _qconv2d(self, op: dict, qx: orders.Quant, qy: orders.Quant) -> None:
        a = op["attrs"]
        x = op["inputs"][0]
        cin, groups = self.shape(x)[3], int(a.get("groups", 1))
        kernel = self.array(op["weights"]["kernel"])
        if kernel.ndim != 4 or kernel.shape[3] * groups != cin or kernel.shape[0] % groups:
            raise ValueError(f"conv2d -> {op['output']}: kernel {list(kernel.shape)} with groups={groups} "
                             f"does not fit {cin} input channels")
        xf = self.dequantize(self.to_nchw(x), qx, self.tensors[x]["dtype"], f"{x}__in")
        ins = [xf, self.qweight(op, "kernel", lambda k: k.transpose(0, 3, 1, 2), "oihw", [0, 3, 1, 2], axis=0)]
        if (b := self.qweight(op, "bias", axis=0)) is not None:
            ins.append(b)
        y = self.conv_node(op, ins, kernel, groups)
        self.produce_nchw(op, self.requantize(op, y, a.get("activation"), qy), None)

    def _qdense(self, op: dict, qx: orders.Quant, qy: orders.Quant) -> None:
        x = op["inputs"][0]
        if len(self.shape(x)) != 2:
            raise ValueError(f"dense -> {op['output']}: a quantized dense takes a 2-D input, has {self.shape(x)}")
        xf = self.dequantize(self.nhwc(x), qx, self.tensors[x]["dtype"], f"{x}__in")
        ins = [xf, self.qweight(op, "kernel", axis=0)]
        if (b := self.qweight(op, "bias", axis=0)) is not None:
            ins.append(b)
        y = self.node("Gemm", ins, self.fresh(f"{op['output']}__gemm"), transB=1)
        self.requantize(op, y, op["attrs"].get("activation"), qy, self.output(op))

    def _op_dense(self, op: dict) -> None:
        x = op["inputs"][0]
        if (qs := self.op_quant(op)) is not None:
            return self._qdense(op, *qs)
        act = op["attrs"].get("activation")
        b = self.weight(op, "bias", lambda v: v.reshape(-1))
        out = op["output"]
        if len(self.shape(x)) == 2:
            w = self.weight(op, "kernel")
            y = self.node("Gemm", [self.nhwc(x), w] + ([b] if b else []), self.target(op, act, "gemm"), transB=1)
        else:
            w = self.weight(op, "kernel", lambda k: k.T, "t", perm=[1, 0])
            if b is None:
                y = self.node("MatMul", [self.nhwc(x), w], self.target(op, act, "matmul"))
            else:
                y = self.node("MatMul", [self.nhwc(x), w], self.fresh(f"{out}__matmul"))
                y = self.node("Add", [y, b], self.target(op, act, "bias"))
        self.finish(op, y, act)

    def _op_activation(self, op: dict) -> None:
        act = op["attrs"].get("activation")
        if not act:
            raise ValueError(f"activation -> {op['output']}: no activation given")
        self.activation(act, self.nhwc(op["inputs"][0]), self.output(op))

    def _op_pool2d(self, op: dict) -> None:
        a = op["attrs"]
        kind = a.get("kind")
        if kind not in _POOL:
            raise ValueError(f"pool2d kind {kind!r} has no ONNX rendering")
        attrs = dict(kernel_shape=[int(k) for k in a["pool_size"]],
                     strides=[int(s) for s in a.get("strides", [1, 1])],
                     pads=_pads(a.get("padding", [0]), f"pool2d -> {op['output']}"),
                     ceil_mode=int(bool(a.get("ceil_mode", False))))
        if kind == "avg":
            attrs["count_include_pad"] = int(bool(a.get("count_include_pad", False)))
        y = self.node(_POOL[kind], [self.to_nchw(op["inputs"][0])], self.fresh(f"{op['output']}__pool"), **attrs)
        self.produce_nchw(op, y, None)

    def _op_global_pool2d(self, op: dict) -> None:
        kind = op["attrs"].get("kind")
        if kind not in _GLOBAL_POOL:
            raise ValueError(f"global_pool2d kind {kind!r} has no ONNX rendering")
        self.node(_GLOBAL_POOL[kind], [self.nhwc(op["inputs"][0])], self.output(op), axes=[1, 2], keepdims=1)

    def _op_binary(self, op: dict) -> None:
        kind = op["attrs"].get("kind")
        if kind not in _BINARY:
            raise ValueError(f"binary kind {kind!r} has no ONNX rendering")
        if any(self.tensors[t].get("quant") for t in [*op["inputs"], op["output"]]):
            return self._qadd(op)
        it = iter(op["inputs"])
        operands = []
        for role in ("lhs", "rhs"):
            w = self.weight(op, role)
            if w is None:
                t = next(it, None)
                if t is None:
                    raise ValueError(f"binary -> {op['output']}: no {role} operand")
                w = self.nhwc(t)
            operands.append(w)
        if next(it, None) is not None:
            raise ValueError(f"binary -> {op['output']}: more inputs than operands")
        self.node(_BINARY[kind], operands, self.output(op))

    def _qadd(self, op: dict) -> None:
        """A quantized add (orders.QUANT_OPS): each input dequantized with its own quant, the sum
        requantized; onnxruntime fuses the group into QLinearAdd."""
        y = op["output"]
        ins = op["inputs"]
        qs = [orders.quant_of(self.tensors[t], t) for t in [*ins, y]]
        dtypes = {self.tensors[t]["dtype"] for t in [*ins, y]}
        if op["attrs"].get("kind") != "add" or op.get("weights") or len(ins) != 2 or None in qs or len(dtypes) != 1:
            raise ValueError(f"binary -> {y}: a quantized binary is an add of two tensors of its output's "
                             "int8/uint8 type")
        xs = [self.dequantize(self.nhwc(t), q, self.tensors[t]["dtype"], f"{t}__in{i}")
              for i, (t, q) in enumerate(zip(ins, qs))]
        s = self.node("Add", xs, self.fresh(f"{y}__sum"))
        self.requantize(op, s, op["attrs"].get("activation"), qs[2], self.output(op))

    def _op_concat(self, op: dict) -> None:
        self.node("Concat", [self.nhwc(t) for t in op["inputs"]], self.output(op), axis=int(op["attrs"]["axis"]))

    def _op_reshape(self, op: dict) -> None:
        shape = np.array([int(d) for d in op["attrs"]["shape"]], np.int64)
        s = self.const(shape, f"{op['output']}__shape")
        # allowzero: a 0 in the order's shape is a real 0, not ONNX's "copy this dim"
        self.node("Reshape", [self.nhwc(op["inputs"][0]), s], self.output(op), allowzero=int(bool((shape == 0).any())))

    def _op_softmax(self, op: dict) -> None:
        self.node("Softmax", [self.nhwc(op["inputs"][0])], self.output(op), axis=int(op["attrs"]["axis"]))

    def _op_layer_norm(self, op: dict) -> None:
        x = op["inputs"][0]
        c = self.shape(x)[-1]
        gamma, beta = self.weight(op, "gamma"), self.weight(op, "beta")
        for role in ("gamma", "beta"):
            if list(self.array(op["weights"][role]).shape) != [c]:
                raise ValueError(f"layer_norm -> {op['output']}: {role} is not one value per channel ({c})")
        self.node("LayerNormalization", [self.nhwc(x), gamma, beta], self.output(op), axis=-1,
                  epsilon=float(op["attrs"]["epsilon"]))

    def _op_transpose(self, op: dict) -> None:
        self.node("Transpose", [self.nhwc(op["inputs"][0])], self.output(op), perm=[int(p) for p in op["attrs"]["axes"]])

    def _op_resize2d(self, op: dict) -> None:
        a = op["attrs"]
        x, out = op["inputs"][0], op["output"]
        n, h, w, c = self.shape(x)
        oh, ow = (int(s) for s in a["size"])
        ctm = a.get("coordinate_transformation_mode", "half_pixel")
        if ctm not in _COORD_MODES:
            raise ValueError(f"resize2d coordinate_transformation_mode {ctm!r} has no ONNX rendering")
        method = a.get("method")
        attrs = {"coordinate_transformation_mode": ctm}
        if method == "linear":
            attrs["mode"] = "linear"
        elif method == "nearest":
            rounding = a.get("rounding_method", "")
            if rounding == "":
                rounding = "round" if ctm == "align_corners" else "floor"
            if rounding not in _NEAREST_MODE:
                raise ValueError(f"resize2d rounding_method {rounding!r} has no ONNX rendering")
            if rounding == "round" and (_has_tie(h, oh, ctm) or _has_tie(w, ow, ctm)):
                # half-to-even at a tie: gather with TVM's exact indices instead
                ih = self.const(_nearest_indices(h, oh, ctm), f"{out}__rows")
                iw = self.const(_nearest_indices(w, ow, ctm), f"{out}__cols")
                y = self.node("Gather", [self.nhwc(x), ih], self.fresh(f"{out}__gather"), axis=1)
                self.node("Gather", [y, iw], self.output(op), axis=2)
                return
            attrs.update(mode="nearest", nearest_mode=_NEAREST_MODE[rounding])
        else:
            raise ValueError(f"resize2d method {method!r} has no ONNX rendering")
        sizes = self.const(np.array([n, oh, ow, c], np.int64), f"{out}__sizes")
        self.node("Resize", [self.nhwc(x), "", "", sizes], self.output(op), **attrs)


def _coords(size: int, out: int, ctm: str) -> list[Fraction]:
    """Exact source coordinates of output positions 0..out-1 (TVM's and ONNX's formulas)."""
    if ctm == "align_corners":
        return [Fraction(x * (size - 1), out - 1) if out > 1 else Fraction(0) for x in range(out)]
    if ctm == "asymmetric":
        return [Fraction(x * size, out) for x in range(out)]
    if ctm == "tf_half_pixel_for_nn":
        return [(x + Fraction(1, 2)) * Fraction(size, out) for x in range(out)]
    if ctm == "pytorch_half_pixel" and out == 1:
        return [Fraction(0)]
    return [(x + Fraction(1, 2)) * Fraction(size, out) - Fraction(1, 2) for x in range(out)]  # half_pixel


def _has_tie(size: int, out: int, ctm: str) -> bool:
    return any(c - (c.numerator // c.denominator) == Fraction(1, 2) for c in _coords(size, out, ctm))


def _nearest_indices(size: int, out: int, ctm: str) -> np.ndarray:
    """TVM's rounding "round" (half to even), clamped into the input."""
    return np.array([min(max(round(c), 0), size - 1) for c in _coords(size, out, ctm)], np.int64)
