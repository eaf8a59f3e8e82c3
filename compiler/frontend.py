"""Load an ONNX model, pin its shapes, fold ONNX-level shape arithmetic, import into Relax.

Models in the wild carry dynamic dims, Shape->Gather->Concat chains and dynamic Pads that TVM's
importer rejects. Once every input dim is pinned, onnxruntime's basic (EP-independent,
standard-ops-only) optimisation level folds all of that, plus BatchNorm into Conv, so we lean on
it rather than writing our own ONNX folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .errors import CompileError

ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 11: "float64"}


@dataclass
class TensorSpec:
    name: str
    shape: list[int]
    dtype: str

    def as_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass
class LoadedModel:
    path: Path
    sha256: str
    name: str
    proto: onnx.ModelProto            # pinned and folded: what TVM imports and golden runs on
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    notes: list[str] = field(default_factory=list)


def parse_input_specs(specs: list[str] | tuple[str, ...]) -> dict[str, list[int]]:
    """`NAME=1x3x224x224` (repeatable) -> {NAME: [1, 3, 224, 224]}."""
    out: dict[str, list[int]] = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([^=]+?)\s*=\s*(\d+(?:\s*[xX,]\s*\d+)*)\s*", spec)
        if not m:
            raise CompileError(f"bad --input '{spec}': expected NAME=DIMS such as data=1x3x224x224")
        out[m.group(1)] = [int(d) for d in re.split(r"\s*[xX,]\s*", m.group(2))]
    return out


def _read_model(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise CompileError(f"{path}: no such file; give the path of an .onnx model")
    data = path.read_bytes()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as err:  # protobuf DecodeError and friends
        raise CompileError(
            f"{path}: not a readable ONNX model ({type(err).__name__}); is the file truncated or of another format?"
        ) from None
    if not model.graph.node:
        raise CompileError(f"{path}: not a readable ONNX model (no graph nodes); is the file truncated or of another format?")
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CompileError(f"{path}: invalid ONNX model: {msg}") from None
    return model


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in vi.type.tensor_type.shape.dim]


def _pin_inputs(model: onnx.ModelProto, pins: dict[str, list[int]], path: Path) -> list[TensorSpec]:
    inputs = _graph_inputs(model)
    names = [i.name for i in inputs]
    for name in pins:
        if name not in names:
            raise CompileError(f"--input {name}: the model has no input named '{name}'; its inputs are: {', '.join(names)}")
    specs = []
    for vi in inputs:
        dims = _dims(vi)
        if vi.name in pins:
            want = pins[vi.name]
            if len(want) != len(dims):
                raise CompileError(f"--input {vi.name}: rank {len(want)} given but the model's input has rank {len(dims)} ({_fmt(dims)})")
            for have, w in zip(dims, want):
                if isinstance(have, int) and have > 0 and have != w:
                    raise CompileError(f"--input {vi.name}={_fmt(want)} conflicts with the model's static shape {_fmt(dims)}")
            dims = want
        bad = [i for i, d in enumerate(dims) if not isinstance(d, int) or d <= 0]
        if bad:
            raise CompileError(
                f"input '{vi.name}' has dynamic dims {_fmt(dims)}; pin them with --input {vi.name}="
                + "x".join(str(d) if isinstance(d, int) and d > 0 else ("1" if i == 0 else "N") for i, d in enumerate(dims))
            )
        tt = vi.type.tensor_type
        tt.shape.ClearField("dim")
        for d in dims:
            tt.shape.dim.add().dim_value = int(d)
        specs.append(TensorSpec(vi.name, [int(d) for d in dims], ONNX_DTYPES.get(tt.elem_type, str(tt.elem_type))))
    return specs


def _fmt(dims) -> str:
    return "x".join(str(d) for d in dims)


def _check_ops_importable(model: onnx.ModelProto, path: Path) -> None:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = _get_convert_map()
    unknown = sorted(
        {
            (n.domain or "ai.onnx") + "::" + n.op_type
            for n in model.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type not in known
        }
    )
    if unknown:
        raise CompileError(
            f"{path.name}: op(s) {', '.join(unknown)} can be run by neither TVM nor ACL; "
            "replace them in the exported model (or export with standard ONNX ops only)"
        )


def _fold_with_onnxruntime(model: onnx.ModelProto, notes: list[str]) -> onnx.ModelProto:
    import onnxruntime as ort
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "folded.onnx"
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = str(out)
        so.log_severity_level = 3
        try:
            ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
            folded = onnx.load(str(out))
        except Exception as err:
            notes.append(f"onnxruntime could not pre-fold the graph ({str(err).splitlines()[0][:120]}); importing it as is")
            return model
    # onnxruntime may stamp its own opset imports; keep the model's.
    return folded


def load(path: str | Path, input_specs: list[str] | tuple[str, ...] = ()) -> LoadedModel:
    path = Path(path)
    model = _read_model(path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    _check_ops_importable(model, path)
    inputs = _pin_inputs(model, parse_input_specs(input_specs), path)
    for vi in inputs:
        if vi.dtype != "float32":
            raise CompileError(f"input '{vi.name}' is {vi.dtype}; Tandoor compiles float32 models for now (export the model in fp32)")
    del model.graph.value_info[:]
    notes: list[str] = []
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as err:
        notes.append(f"ONNX shape inference failed: {str(err).splitlines()[0][:120]}")
    folded = _fold_with_onnxruntime(model, notes)
    outputs = []
    for vi in folded.graph.output:
        dims = _dims(vi)
        outputs.append(TensorSpec(vi.name, [d if isinstance(d, int) else -1 for d in dims],
                                  ONNX_DTYPES.get(vi.type.tensor_type.elem_type, "float32")))
    name = model.graph.name or path.stem
    if name in ("main_graph", "torch_jit", "torch-jit-export", ""):
        name = path.stem
    return LoadedModel(path, sha, re.sub(r"[^A-Za-z0-9_]", "_", name), folded, inputs, outputs, notes)


@contextlib.contextmanager
def _clip_as_clip_op():
    """ONNX Clip (opset >= 11) imports as two call_tir max/min that op patterns cannot see;
    with constant bounds emit relax.op.clip instead, which ACL maps to a bounded ReLU."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as fe

    original = fe.Clip._impl_v13

    def impl(cls, bb, inputs, attr, params):
        lo, hi = inputs[1], inputs[2]

        def const_value(e, default):
            if e is None:
                return default
            if isinstance(e, tvm.ir.GenericConst):
                v = e.value.numpy()
                return float(v) if v.size == 1 and not np.isnan(v) else None
            return None

        lo_v, hi_v = const_value(lo, -np.inf), const_value(hi, np.inf)
        if lo_v is None or hi_v is None:
            return original.__func__(cls, bb, inputs, attr, params)
        return relax.op.clip(inputs[0], lo_v, hi_v)

    fe.Clip._impl_v13 = classmethod(impl)
    try:
        yield
    finally:
        fe.Clip._impl_v13 = original


def to_relax(model: LoadedModel):
    """Import into Relax with weights as constants (what `is_const()` patterns need)."""
    from tvm.relax.frontend.onnx import from_onnx

    shape_dict = {i.name: i.shape for i in model.inputs}
    try:
        with _clip_as_clip_op():
            return from_onnx(model.proto, shape_dict=shape_dict, keep_params_in_input=False)
    except Exception as err:
        msg = str(err).strip().splitlines()
        raise CompileError(f"TVM could not import {model.path.name}: {msg[-1] if msg else type(err).__name__}") from None
