"""A tiny CNN compiled once per session for the GPU targets (compiler/backends/cuda): conv -> relu
(ACL's, delegated with policy all) -> sin (TVM's: the GPU part has kernels) -> pool -> matmul ->
softmax; and a stand-in for NVIDIA's driver (the one piece that cannot exist on this host)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tandoor_compiler.pipeline import compile_model

_built: dict[tuple[str, ...], Path] = {}


def gpu_cnn(path: Path) -> Path:
    rng = np.random.default_rng(43)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "m")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Sin", ["r"], ["s"]),
             helper.make_node("GlobalAveragePool", ["s"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("MatMul", ["f", "m"], ["l"]), helper.make_node("Softmax", ["l"], ["y"])]
    g = helper.make_graph(nodes, "gpu_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def gpu_bundle(out_dir: Path, targets: tuple[str, ...] = ("jetson-orin", "cuda-sm90")) -> tuple[Path, Path]:
    """(the bundle, its source model) for ``targets``, compiled once per session."""
    if targets not in _built:
        model = gpu_cnn(out_dir / "gpu_cnn.onnx")
        out = out_dir / f"gpu_cnn.{'+'.join(targets)}.hmod"
        compile_model(model, out, targets=list(targets), policy="all", measure="off")
        _built[targets] = out
    return _built[targets], out_dir / "gpu_cnn.onnx"


_DRIVER_C = r"""
#define V(x) x
int cuInit(unsigned f) { return INIT_RESULT; }
int cuDriverGetVersion(int *v) { *v = DRIVER_VERSION; return 0; }
int cuDeviceGetCount(int *n) { *n = DEVICES; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int d) { *v = attr == 75 ? CC_MAJOR : CC_MINOR; return 0; }
int cuDeviceGetName(char *name, int len, int d) { const char *s = "Fake Orin"; int i = 0;
  for (; s[i] && i < len - 1; i++) name[i] = s[i]; name[i] = 0; return 0; }
"""


def fake_driver(out_dir: Path, name: str, cc: tuple[int, int] = (8, 7), version: int = 13000, devices: int = 1,
                init_result: int = 0) -> str:
    """A libcuda.so.1 stand-in answering the driver calls agent/run/gpu.py makes, as a device with
    compute capability ``cc`` and a driver serving CUDA ``version`` would."""
    src, lib = out_dir / f"{name}.c", out_dir / f"lib{name}.so"
    src.write_text(_DRIVER_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src), f"-DCC_MAJOR={cc[0]}", f"-DCC_MINOR={cc[1]}",
                    f"-DDRIVER_VERSION={version}", f"-DDEVICES={devices}", f"-DINIT_RESULT={init_result}"], check=True)
    return str(lib)
