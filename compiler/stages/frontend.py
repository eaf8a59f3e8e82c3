"""Load an ONNX model: read and check it, then normalise it (compiler/stages/normalise.py).

Models in the wild carry dynamic dims, Shape->Gather->Concat chains, stale shapes and old
opsets that TVM's importer rejects; the normalisation steps deal with each. The import into
Relax is compiler/stages/importer.py.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from tandoor_contract import hmod, media

from . import normalise
from ..errors import CompileError

ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 11: "float64"}


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
    overwritten: bool = False         # --input replaced a static dim of the model's input
    fp16: dict | None = None          # fp16 parts computed in fp32 (normalise.fp16_to_fp32)
    # the escape hatch (compiler/backends/onnx/hatch.py): what TVM imports when some nodes go to onnxruntime
    tvm_proto: onnx.ModelProto | None = None
    hatch: list = field(default_factory=list)


def parse_input_specs(specs: list[str] | tuple[str, ...]) -> dict[str, list[int]]:
    """`NAME=1x3x224x224` (repeatable) -> {NAME: [1, 3, 224, 224]}."""
    out: dict[str, list[int]] = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([^=]+?)\s*=\s*(\d+(?:\s*[xX,]\s*\d+)*)\s*", spec)
        if not m:
            raise CompileError(f"bad --input '{spec}': expected NAME=DIMS such as data=1x3x224x224")
        out[m.group(1)] = [int(d) for d in re.split(r"\s*[xX,]\s*", m.group(2))]
    return out


def read_model(path: Path, ctx: normalise.Context | None = None) -> onnx.ModelProto:
    """The model read, its nodes sorted and IR-3 weights that are not inputs accepted
    (normalise.BEFORE_CHECK: the checker refuses both), and checked; a refusal quotes onnx's
    whole message. A file the checker refuses for any other reason but onnxruntime runs is
    compiled as onnxruntime reads it, with a note (the golden pairs are onnxruntime's)."""
    if not path.is_file():
        raise CompileError(f"{path}: no such file; give the path of an .onnx model")
    if hmod.is_bundle(path):
        raise CompileError(f"{path}: a Tandoor bundle, not an ONNX model; give the .onnx it was compiled from "
                           "(tandoor-agent run and tandoor inspect take the bundle)")
    try:
        model = onnx.load(str(path))      # external data, if any, from beside the file
    except Exception as err:  # protobuf DecodeError and friends
        raise CompileError(
            f"{path}: not a readable ONNX model ({type(err).__name__}); is the file truncated or of another format?"
        ) from None
    if not model.graph.node:
        raise CompileError(f"{path}: not a readable ONNX model (no graph nodes); is the file truncated or of another format?")
    ctx = ctx or normalise.Context(path, {})
    for step in normalise.BEFORE_CHECK:
        step(model, ctx)
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        if normalise.loads(path) is not None:    # onnxruntime refuses it too: the file is broken
            raise CompileError(f"{path}: invalid ONNX model: {normalise.one_line(err)}") from None
        ctx.notes.append(f"onnx's checker refuses the file ({normalise.one_line(err)[:300]}) but onnxruntime runs "
                         "it: compiled as onnxruntime reads it")
    return model


# Model inputs are images (contract/media.INPUT_DTYPES: float32, or uint8 pixels the graph
# normalises); why each other dtype is refused, for the one-line refusal.
_IDS = ("integer ids (tokens, indices) are not images; Tandoor compiles models whose inputs are images, "
        "float32 or uint8 pixels")
REFUSED_INPUT_DTYPES = {
    "int8": "an int8 input is a quantized tensor, not camera pixels; export the model with a float32 or uint8 input "
            "(quantization inside the graph, as tandoor quantize writes it)",
    "int32": _IDS, "int64": _IDS,
}
_OTHER_DTYPE = "Tandoor compiles float32 or uint8 (camera pixel) inputs; export the model with a float32 input"


def load(path: str | Path, input_specs: list[str] | tuple[str, ...] = ()) -> LoadedModel:
    """Read, check and normalise (compiler/stages/normalise.py STEPS) an ONNX model with its inputs
    pinned: what TVM imports and the golden pairs run on."""
    path = Path(path)
    ctx = normalise.Context(path, parse_input_specs(input_specs))
    model = read_model(path, ctx)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    folded = normalise.normalise(model, ctx)
    inits = {i.name for i in folded.graph.initializer}
    inputs = []
    for vi in folded.graph.input:
        if vi.name in inits:
            continue
        elem = vi.type.tensor_type.elem_type
        dt = ONNX_DTYPES.get(elem) or onnx.TensorProto.DataType.Name(elem).lower()
        if dt not in media.INPUT_DTYPES:
            raise CompileError(f"input '{vi.name}' is {dt}: {REFUSED_INPUT_DTYPES.get(dt, _OTHER_DTYPE)}")
        inputs.append(TensorSpec(vi.name, [int(d) for d in normalise.dims_of(vi)], dt))
    outputs = []
    for vi in folded.graph.output:
        outputs.append(TensorSpec(vi.name, [d if isinstance(d, int) else -1 for d in normalise.dims_of(vi)],
                                  ONNX_DTYPES.get(vi.type.tensor_type.elem_type, "float32")))
    name = model.graph.name or path.stem
    if name in ("main_graph", "torch_jit", "torch-jit-export", ""):
        name = path.stem
    return LoadedModel(path, sha, re.sub(r"[^A-Za-z0-9_]", "_", name), folded, inputs, outputs, ctx.notes,
                       ctx.overwritten, ctx.fp16)
