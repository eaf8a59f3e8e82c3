"""ONNX -> Relax with TVM's importer, and the converters Tandoor replaces while it runs.

TVM's ONNX frontend lowers some ops straight to TIR (``call_tir``), which op patterns cannot
see, or to forms ACL has no kernel for. While ``to_relax`` runs, these converters are swapped for
ones that emit plain Relax ops (and restored after, even on error):

    Clip (opset >= 11)   constant bounds -> relax.clip (two call_tir max/min otherwise)
    Pad (opset >= 11)    constant mode -> relax.nn.pad (topi's pad as call_tir otherwise)
    Max / Min / Sum / Mean  of non-constant tensors -> pairwise maximum / minimum / add (/ n)
                         (broadcast_to + stack + reduce otherwise)
    Resize               an empty roi/scales/sizes constant (opsets 11-12's "not given") as none
                         (TVM asserts that only one of scales and sizes is given)

and the escape hatch's placeholder nodes (compiler/backends/onnx/hatch.py) import as calls to external functions
(Codegen "onnxruntime") that RunCodegen later makes call_dps_packed to their orders' symbols.
"""

from __future__ import annotations

import contextlib
import functools
import io

import numpy as np

from ..errors import CompileError


def _const_value(e, default):
    import tvm

    if e is None:
        return default
    if isinstance(e, tvm.ir.GenericConst):
        v = e.value.numpy()
        return float(v) if v.size == 1 and not np.isnan(v) else None
    return None


def _clip(original):
    from tvm import relax

    def impl(cls, bb, inputs, attr, params):
        lo, hi = _const_value(inputs[1], -np.inf), _const_value(inputs[2], np.inf)
        if lo is None or hi is None:
            return original.__func__(cls, bb, inputs, attr, params)
        return relax.op.clip(inputs[0], lo, hi)

    return impl


def _pad(original):
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    def impl(cls, bb, inputs, attr, params):
        mode = attr.get("mode", b"constant")
        mode = mode.decode() if isinstance(mode, bytes) else str(mode)
        pads = get_constant(inputs[1], params)
        value = get_constant(inputs[2], params) if len(inputs) > 2 and inputs[2] is not None else None
        if (mode != "constant" or not isinstance(pads, tvm.ir.GenericConst) or (len(inputs) > 3 and inputs[3] is not None)
                or (value is not None and not isinstance(value, tvm.ir.GenericConst))):
            return original.__func__(cls, bb, inputs, attr, params)
        p = [int(v) for v in pads.value.numpy().reshape(-1)]
        rank = len(p) // 2
        if any(v < 0 for v in p):
            return original.__func__(cls, bb, inputs, attr, params)
        fill = float(value.value.numpy().reshape(-1)[0]) if value is not None else 0.0
        width = [v for i in range(rank) for v in (p[i], p[rank + i])]   # befores/afters -> pairs
        return relax.op.nn.pad(inputs[0], width, "constant", fill)

    return impl


def _pairwise(original):
    import tvm
    from tvm import relax

    def impl(cls, bb, inputs, attr, params):
        if all(isinstance(i, tvm.ir.GenericConst) for i in inputs) or cls.binary_op is None:
            return original.__func__(cls, bb, inputs, attr, params)
        if len(inputs) == 1:
            return inputs[0]
        out = functools.reduce(lambda a, b: bb.normalize(cls.binary_op(a, b)), inputs)
        if cls.__name__ == "Mean":
            out = relax.op.divide(out, relax.const(float(len(inputs)), str(inputs[0].ty.dtype)))
        return out

    return impl


def _resize(original):
    import tvm
    from tvm.relax.frontend.onnx.onnx_frontend import onnx_input

    def impl(cls, bb, inputs, attr, params):
        # opsets 11-12 write an absent roi/scales as an empty tensor (the input is required there)
        given = [None if k and isinstance(e, tvm.ir.GenericConst) and e.value.numpy().size == 0 else e
                 for k, e in enumerate(inputs)]
        return original.__func__(cls, bb, onnx_input(given), attr, params)

    return impl


def _overrides():
    """(converter class, method name, replacement factory) for every swapped converter."""
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    out = [(fe.Clip, "_impl_v13", _clip), (fe.Resize, "_impl_v18", _resize)]
    for v in ("_impl_v11", "_impl_v18", "_impl_v19", "_impl_v21", "_impl_v23"):
        if v in vars(fe.Pad):
            out.append((fe.Pad, v, _pad))
    for cls in (fe.Max, fe.Min, fe.Sum, fe.Mean):
        out.append((cls, "_impl_v1", _pairwise))
    return out


@contextlib.contextmanager
def _patched():
    saved = []
    try:
        for cls, name, factory in _overrides():
            original = vars(cls).get(name) or getattr(cls, name)
            saved.append((cls, name, vars(cls).get(name)))
            setattr(cls, name, classmethod(factory(getattr(cls, name))))
        yield
    finally:
        for cls, name, original in reversed(saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


@contextlib.contextmanager
def _placeholders(groups):
    """The escape hatch's placeholder nodes (compiler/backends/onnx/hatch.py) known to the importer while it runs."""
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    from ..backends.onnx import hatch

    if not groups:
        yield
        return
    original = fe._get_convert_map
    conv = hatch.converter(groups)
    fe._get_convert_map = lambda: {**original(), hatch.PLACEHOLDER: conv}
    try:
        yield
    finally:
        fe._get_convert_map = original


@contextlib.contextmanager
def _watched(seen: list):
    """The node TVM's importer is converting, kept in ``seen[0]`` (its loop names each node with
    ``_parse_value_proto`` just before converting it)."""
    import onnx
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    original = fe.ONNXGraphImporter._parse_value_proto

    def parse(self, value_proto):
        if isinstance(value_proto, onnx.NodeProto):
            seen[:] = [value_proto]
        return original(self, value_proto)

    fe.ONNXGraphImporter._parse_value_proto = parse
    try:
        yield
    finally:
        fe.ONNXGraphImporter._parse_value_proto = original


def to_relax(model):
    """Import a loaded model (compiler/stages/frontend.LoadedModel) with weights as constants (what
    `is_const()` patterns need)."""
    from tvm.relax.frontend.onnx import from_onnx

    shape_dict = {i.name: i.shape for i in model.inputs}
    problem, seen = None, []
    try:   # TVM prints its own "Error converting operator ..." to stdout: the error below says it
        with _patched(), _placeholders(model.hatch), _watched(seen), contextlib.redirect_stdout(io.StringIO()):
            return from_onnx(model.tvm_proto or model.proto, shape_dict=shape_dict, keep_params_in_input=False)
    except Exception as err:
        msg = [m for m in str(err).strip().splitlines() if m.strip()]
        problem = msg[-1][:300] if msg else type(err).__name__
    # raised outside the except block: TVM's half-built module goes with the original error now
    if model.overwritten:
        raise CompileError(f"{model.path.name}: the input shape given with --input does not fit the model "
                           f"(TVM: {problem}); give the shape the model was built for, or one its reshapes accept")
    node = seen[0] if seen else None
    at = f" at {node.op_type} {node.name or node.output[0]!r}" if node is not None else ""
    raise CompileError(f"TVM could not import {model.path.name}{at}: {problem}; export the model with standard "
                       "ONNX ops (opset 11-21) or report the op")
