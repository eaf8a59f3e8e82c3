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

import contextlib
import functools
import io
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandoor_contract import orders
from tandoor_contract.errors import TandoorError

from . import armnn_tflite

__all__ = ["UnsupportedOrder", "ArmnnExecutor", "available", "backends"]

DEFAULT_PREFERRED = ("CpuAcc", "GpuAcc", "CpuRef")
SCRATCH_BINDING = 1 << 20   # binding ids of the scratch outputs (Api.concat_by_copy), after the order's



@dataclass(frozen=True)
class Api:
    """What differs between the Arm NN Python APIs this executor speaks (one per libarmnn ABI)."""

    release: str
    # Convolution2d, DepthwiseConvolution2d and FullyConnected: weights and bias passed to the
    # Add*Layer call (20.08), or ConstantLayers connected to input slots 1 and 2 (22.x on: the
    # Add*Layer calls take only the descriptor and a name)
    weights_as_inputs: bool
    # DepthwiseConvolution2d's kernel from ours ([C*M, KH, KW, 1], out channel c*M + m):
    # "MCHW" = [M, C, KH, KW] (20.08), "1HWO" = [1, KH, KW, C*M] (22.x on)
    depthwise_kernel: str
    # a ConstTensor needs a TensorInfo marked constant (SetConstant, 22.x on; it throws otherwise)
    constant_infos: bool
    # ActivationFunction::HardSwish, which neither binding names (11 in both enums: after Elu = 10)
    hardswish: int
    # the binding has AddTransposeLayer (numpy's transpose, every permutation on CpuAcc, 23.08);
    # without it a transpose is a chain of Permutes NEPermute takes (PERMUTES_2008)
    transpose_layer: bool = False
    # Arm NN 20.08 on CpuAcc computes a layer wrongly when a 5x5 stride-2 depthwise convolution
    # reads the same tensor (a 1x1 conv beside it: off by 1.4-10 on random data from 8x8x16 up,
    # PicoDet's neck, PP-OCRv4 det's FPN; 3x3 or stride 1 measured right; each layer alone is
    # right): every depthwise whose input has another reader reads a copy of its own
    depthwise_own_input: bool = False
    # Arm NN 20.08 on CpuAcc computes a per-channel depthwise wrongly when it reads what another
    # layer of the network wrote (EfficientNet-Lite0's 1x1 conv -> 3x3 s2 depthwise: 75% of the
    # elements more than a step off, each layer alone within a step); a copy of its own (as above)
    # measured right: every per-channel depthwise reads one
    per_axis_depthwise_copy: bool = False
    # Arm NN 23.08 on CpuAcc computes wrongly after a channel concat whose inputs it writes in place
    # into the concat's output (sub-tensors; YOLOX from its first concat on, 88% wrong): a second
    # reader of one input (a scratch network output) makes it concatenate by copying instead
    concat_by_copy: bool = False
    # ActivationFunction::Gelu (erf form), an Arm NN layer since 23.11 (compiler/acl.py GELU_SINCE):
    # no release with a Python binding has it, so a "gelu" activation is refused and the order
    # falls back; "gelu_tanh" is built from Multiplication, Addition and TanH layers everywhere
    gelu: bool = False


APIS: dict[str, Api] = {
    "22": Api("20.08", weights_as_inputs=False, depthwise_kernel="MCHW", constant_infos=False, hardswish=11,
              depthwise_own_input=True, per_axis_depthwise_copy=True),
    "33": Api("23.08", weights_as_inputs=True, depthwise_kernel="1HWO", constant_infos=True, hardswish=11,
              transpose_layer=True, concat_by_copy=True),
}
# The numpy-style axes of the Permute layers Arm NN 20.08 places on CpuAcc, measured on the bookworm
# board for shapes without unit dims (leading 1s allow a few more): every other permutation falls to
# CpuRef ("PermutationVector not supported" / "Objects have different dimensions"), among them the
# rank-3 (0, 2, 1) of every detector head. Ranks 1-2 are lifted to rank 3 by a reshape.
PERMUTES_2008: dict[int, frozenset[tuple[int, ...]]] = {
    3: frozenset({(1, 2, 0), (2, 0, 1), (2, 1, 0)}),
    4: frozenset({(0, 2, 3, 1), (0, 3, 1, 2), (0, 3, 2, 1), (1, 0, 3, 2), (1, 2, 3, 0), (2, 3, 0, 1),
                  (2, 3, 1, 0), (3, 0, 1, 2), (3, 1, 2, 0), (3, 2, 0, 1), (3, 2, 1, 0)}),
}


@functools.lru_cache(maxsize=None)
def permute_plan(axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """The shortest chain of PERMUTES_2008 whose composition is transpose(axes) (None if there is
    none within three steps). transpose(transpose(x, a), b) == transpose(x, a[b])."""
    allowed = PERMUTES_2008.get(len(axes), frozenset())
    if axes in allowed:
        return (axes,)
    frontier = {p: (p,) for p in allowed}
    for _ in range(2):
        nxt = {}
        for done, chain in frontier.items():
            for b in allowed:
                c = tuple(done[i] for i in b)
                if c == axes:
                    return chain + (b,)
                nxt.setdefault(c, chain + (b,))
        frontier = nxt
    return None
# Same in both and so not in the table: the Addition/Subtraction/Multiplication/Division/Maximum/
# Minimum layers (23.08 deprecates them for ElementwiseBinary, but its binding does not export
# ElementwiseBinaryDescriptor), TransposeConvolution2d taking its weights in the call, Permute,
# Softmax's innermost-axis rule, the layer placement in SerializeToDot; DataType values differ
# (QSymmS8/QAsymmS8 moved) but are used by name only.

_FLT_MAX = float(np.finfo(np.float32).max)

# Order dtypes this executor takes: tensors (activations) and weights (int32: biases only)
TENSOR_DTYPES = ("float32", "int8", "uint8")
WEIGHT_DTYPES = ("float32", "int8", "int32")
QUANT_OPS = tuple(orders.QUANT_OPS)   # the op types whose quantized semantics the contract defines
_NP_OF_ARMNN = {"QAsymmS8": np.int8, "QAsymmU8": np.uint8, "QSymmS8": np.int8, "Signed32": np.int32}
_ARMNN_OF_ACT = {"int8": "QAsymmS8", "uint8": "QAsymmU8"}


@dataclass(frozen=True)
class QType:
    """A quantized Arm NN tensor type: the DataType (its pyarmnn name without ``DataType_``),
    one scale and one offset (real = (q - offset) * scale)."""

    armnn: str
    scale: float
    offset: int
    # per-axis: the tensor of the order's TFLite model whose TensorInfo this is (scale and offset
    # unused)
    per_axis: str | None = None

    @property
    def np_dtype(self) -> type:
        return _NP_OF_ARMNN[self.armnn]


@dataclass(frozen=True)
class QuantOp:
    """The quantized types of one conv2d/dense: input, output, kernel (in the input's type, see
    the module doc; ``kernel_shift`` is added to the int8 codes for uint8) and bias."""

    x: QType
    y: QType
    kernel: QType
    bias: QType | None
    kernel_shift: int = 0

    def kernel_codes(self, k: np.ndarray) -> np.ndarray:
        if not self.kernel_shift:
            return k
        return (k.astype(np.int16) + self.kernel_shift).astype(self.kernel.np_dtype)


# An integer output's defect rule: more than this fraction of its elements more than a step off,
# or any element more than this many steps (5% of a byte type's 256 codes).
WRONG_FRACTION, WRONG_STEPS = 1e-3, 0.05 * 256
# How far past the drift the compiler recorded for an INT8 output (tandoor_contract.probe.drift)
# a result may be before it counts as a defect: Arm NN's builder defects were 95% of an output
# wrong, rounding drift is what the compiler measured; the margin keeps another seed's worth.
DRIFT_MARGIN = 1.5


def differs(got: Sequence[np.ndarray], want: Sequence[np.ndarray],
            drift: Sequence[tuple[float, float] | None] | None = None) -> str | None:
    """Why ``got`` is not ``want`` computed another way (None if it is): more than 0.1% of an
    output's elements beyond 1e-3 + 1e-3 * |want|, or any beyond 5% of the output's range. Looser
    than the golden check on purpose: it looks for a defect, not for a summation order.

    An integer ``got`` (a quantized output; ``want`` may hold its codes as floats, as the probe
    member does) is compared in quantization steps: an element more than 1 step off is wrong
    (implementations round the requantization differently by one step), and more than 0.1% wrong
    or any more than 5% of the type's 256 codes off (12 steps) is a defect. Where the probe
    recorded the output's ``drift`` (a deep INT8 order: one-step roundings grow layer by layer),
    up to DRIFT_MARGIN times that fraction and those steps are rounding too."""
    for j, (g, w) in enumerate(zip(got, want)):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape or not np.all(np.isfinite(g64)) or not np.all(np.isfinite(w64)):
            return f"output {j}: shape {g64.shape} or non-finite values where onnxruntime gives {w64.shape}"
        if np.issubdtype(np.asarray(g).dtype, np.integer):
            steps = np.abs(g64 - w64)
            wrong = float(np.mean(steps > 1)) if steps.size else 0.0
            worst = float(steps.max()) if steps.size else 0.0
            d = (drift[j] if drift is not None and j < len(drift) else None) or (0.0, 0.0)
            max_wrong, max_steps = max(WRONG_FRACTION, DRIFT_MARGIN * d[0]), max(WRONG_STEPS, DRIFT_MARGIN * d[1])
            if wrong > max_wrong or worst > max_steps:
                allowed = f" (the order's rounding drift allows {max_wrong:.1%}, {max_steps:.0f} steps)" if any(d) else ""
                return (f"output {j}: {wrong:.1%} of its elements differ from onnxruntime's by more than 1 "
                        f"quantization step, at most {worst:.0f} steps{allowed}")
            continue
        diff = np.abs(g64 - w64)
        beyond = float(np.mean(diff > 1e-3 + 1e-3 * np.abs(w64))) if diff.size else 0.0
        scale = float(np.max(np.abs(w64))) if w64.size else 0.0
        if beyond > 1e-3 or (diff.size and float(diff.max()) > 0.05 * scale + 1e-3):
            return (f"output {j}: {beyond:.1%} of its elements differ from onnxruntime's, "
                    f"max abs err {float(diff.max()):.3g} (values up to {scale:.3g})")
    return None


class UnsupportedOrder(TandoorError):
    """The order (or this machine's Arm NN) cannot be run by this executor; the message says why."""

    exit_code = 3


# --- pyarmnn import and the shared runtime ----------------------------------------------------

_ann: Any = None
_raw: Any = None  # pyarmnn's SWIG classes: Tensor/ConstTensor over a caller's buffer (no copy)
_import_error: str | None = None
_runtime_obj: Any = None
_lock = threading.Lock()


def _pyarmnn():
    """Import pyarmnn once, quietly, or raise ImportError. Quietly: it logs a warning per missing
    parser, and 23.08's prints a deprecation notice on stdout (where `--json` output goes)."""
    global _ann, _raw, _import_error
    if _ann is not None:
        return _ann
    if _import_error is not None:
        raise ImportError(_import_error)
    log = logging.getLogger("pyarmnn")
    level = log.level
    log.setLevel(logging.ERROR)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            import pyarmnn as ann
    except Exception as e:  # ImportError, or OSError from a missing libarmnn
        _import_error = f"pyarmnn is not importable ({type(e).__name__}: {' '.join(str(e).split())})"
        raise ImportError(_import_error) from None
    finally:
        log.setLevel(level)
        if said.getvalue().strip():
            logging.getLogger("tandoor.armnn").debug("pyarmnn said on import: %s", said.getvalue().strip())
    try:
        from pyarmnn._generated import pyarmnn as raw
        _raw = raw if hasattr(raw, "Tensor") and hasattr(raw, "ConstTensor") else None
    except Exception:
        _raw = None
    _ann = ann
    return ann


def _runtime():
    """One IRuntime per process, kept alive here (GpuAcc makes one OpenCL context per runtime)."""
    global _runtime_obj
    with _lock:
        if _runtime_obj is None:
            ann = _pyarmnn()
            _runtime_obj = ann.IRuntime(ann.CreationOptions())
        return _runtime_obj


def _abi() -> str:
    return str(getattr(_pyarmnn(), "ARMNN_VERSION", "?")).split(".")[0]


def api() -> Api:
    """The API table entry for the libarmnn here (UnsupportedOrder for an ABI it does not know)."""
    abi = _abi()
    if abi not in APIS:
        known = ", ".join(f"{a.release} (ABI {k})" for k, a in APIS.items())
        raise UnsupportedOrder(f"Arm NN ABI {abi} is not one this executor speaks ({known}); "
                               "install one of those (scripts/board/install-on-board.sh)")
    return APIS[abi]


def available() -> tuple[bool, str]:
    """(True, version) when pyarmnn imports and has at least one backend, else (False, why)."""
    try:
        ann = _pyarmnn()
    except ImportError as e:
        return False, str(e)
    try:
        have = backends()
    except Exception as e:
        return False, f"Arm NN runtime failed to start ({type(e).__name__}: {e})"
    version = getattr(ann, "ARMNN_VERSION", "?")
    abi = str(version).split(".")[0]
    if not have:
        return False, f"pyarmnn (Arm NN ABI {version}) has no backends; install libarmnn-cpuref-backend{abi}"
    release = f"Arm NN {APIS[abi].release}, " if abi in APIS else ""
    return True, f"pyarmnn ({release}Arm NN ABI {version}), backends {', '.join(have)}"


def backends() -> list[str]:
    """Backends this machine's Arm NN runtime actually has, e.g. ['CpuAcc', 'CpuRef']."""
    try:
        rt = _runtime()
    except ImportError:
        return []
    return [str(b) for b in rt.GetDeviceSpec().GetSupportedBackends()]


# --- small helpers ----------------------------------------------------------------------------

def _ints(v: Any, n: int, what: str) -> list[int]:
    try:
        out = [int(x) for x in v]
    except (TypeError, ValueError):
        raise UnsupportedOrder(f"{what} must be a list of {n} integers, not {v!r}") from None
    if len(out) != n:
        raise UnsupportedOrder(f"{what} must have {n} entries, not {v!r}")
    return out


def _shape_of(spec: Any, what: str, dtypes: Sequence[str] = TENSOR_DTYPES, scalar: bool = False) -> tuple[int, ...]:
    """The spec's static shape; ``scalar``: a rank-0 weight (a Mul/Add constant) is one element of
    rank 1, which Arm NN broadcasts the same way (its tensors have rank 1..5)."""
    if not isinstance(spec, Mapping):
        raise UnsupportedOrder(f"{what}: expected {{shape, dtype}}, got {spec!r}")
    dtype = str(spec.get("dtype"))
    if dtype not in dtypes:
        raise UnsupportedOrder(f"{what} has dtype {dtype}: the Arm NN executor takes {', '.join(dtypes)}")
    try:
        shape = tuple(int(d) for d in spec.get("shape"))
    except (TypeError, ValueError):
        raise UnsupportedOrder(f"{what} has a non-static shape {spec.get('shape')!r}") from None
    if scalar and shape == ():
        return (1,)
    if not 1 <= len(shape) <= 5:
        raise UnsupportedOrder(f"{what} has rank {len(shape)}: Arm NN tensors have rank 1..5")
    if any(d <= 0 for d in shape):
        raise UnsupportedOrder(f"{what} has shape {list(shape)}: empty or negative dimensions")
    return shape


def _quant(spec: Mapping, what: str) -> orders.Quant | None:
    """The spec's quant (None for float32), malformed ones refused in one line."""
    try:
        return orders.quant_of(spec, what)
    except ValueError as e:
        raise UnsupportedOrder(f"{e}; the order is malformed") from None


def _per_tensor(q: orders.Quant, what: str, fix: str) -> tuple[float, int]:
    """(scale, zero point) of a quant that is one per tensor (a per-axis one whose scales and zero
    points are all equal is one too: the same reals); else UnsupportedOrder."""
    if q.varies:
        raise UnsupportedOrder(f"{what} has per-axis quantization ({len(q.scale)} scales on axis {q.axis}), which "
                               f"Arm NN takes for a kernel and its bias only: {fix}")
    return q.scale[0], q.zero_point[0]


# Resize: ONNX/TVM coordinate semantics vs Arm NN's, compared as 1-D index or weight maps.

def _onnx_coords(n_in: int, n_out: int, mode: str) -> np.ndarray | None:
    y = np.arange(n_out, dtype=np.float64)
    scale = n_out / n_in
    if mode in ("half_pixel", "half_pixel_symmetric"):  # identical when sizes (not scales) are given
        x = (y + 0.5) / scale - 0.5
    elif mode == "pytorch_half_pixel":
        x = (y + 0.5) / scale - 0.5 if n_out > 1 else np.zeros(n_out)
    elif mode == "align_corners":
        x = y * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_half_pixel_for_nn":
        x = (y + 0.5) / scale
    else:  # tf_crop_and_resize needs an roi, which the order does not carry
        return None
    return np.round(x, 9)  # make exact ties exact despite float64 noise


def _onnx_nearest(n_in: int, n_out: int, mode: str, rounding: str) -> np.ndarray | None:
    x = _onnx_coords(n_in, n_out, mode)
    if x is None:
        return None
    if rounding == "":  # TVM's default for nearest_neighbor
        rounding = "round" if mode == "align_corners" else "floor"
    if rounding == "round_prefer_floor":
        i = np.ceil(x - 0.5)
    elif rounding == "round_prefer_ceil":
        i = np.floor(x + 0.5)
    elif rounding == "floor":
        i = np.floor(x)
    elif rounding == "ceil":
        i = np.ceil(x)
    elif rounding == "round":  # half away from zero
        i = np.sign(x) * np.floor(np.abs(x) + 0.5)
    else:
        return None
    return np.clip(i, 0, n_in - 1).astype(np.int64)


def _onnx_linear(n_in: int, n_out: int, mode: str) -> np.ndarray | None:
    x = _onnx_coords(n_in, n_out, mode)
    if x is None:
        return None
    x = np.clip(x, 0, n_in - 1)
    x0 = np.floor(x).astype(np.int64)
    x1 = np.minimum(x0 + 1, n_in - 1)
    w = x - x0
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), x0), 1 - w)
    np.add.at(m, (np.arange(n_out), x1), w)
    return m


def _armnn_scale(n_in: int, n_out: int, align_corners: bool) -> np.float32:
    f = np.float32
    if align_corners and n_out > 1:
        return f(n_in - 1) / f(n_out - 1)
    return f(n_in) / f(n_out)


def _armnn_nearest(n_in: int, n_out: int, ac: bool, hp: bool) -> np.ndarray:
    s = _armnn_scale(n_in, n_out, ac)
    p = np.arange(n_out, dtype=np.float32)
    v = ((p + np.float32(0.5)) * s) if hp else (p * s)
    i = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)) if ac else np.floor(v)  # roundf / floorf
    return np.clip(i, 0, n_in - 1).astype(np.int64)


def _armnn_linear(n_in: int, n_out: int, ac: bool, hp: bool) -> np.ndarray:
    s = _armnn_scale(n_in, n_out, ac)
    p = np.arange(n_out, dtype=np.float32)
    v = ((p + np.float32(0.5)) * s - np.float32(0.5)) if hp else (p * s)
    fv = np.floor(v)
    x0 = np.maximum(fv, 0).astype(np.int64)
    w = (v - fv).astype(np.float64)
    if hp:
        x1 = np.minimum(np.maximum(np.ceil(v), 0).astype(np.int64), n_in - 1)
    else:
        x1 = np.minimum(x0 + 1, n_in - 1)
    m = np.zeros((n_out, n_in))
    np.add.at(m, (np.arange(n_out), np.minimum(x0, n_in - 1)), 1 - w)
    np.add.at(m, (np.arange(n_out), x1), w)
    return m


def resize_flags(method: str, mode: str, rounding: str, in_hw: Sequence[int],
                 out_hw: Sequence[int]) -> tuple[bool, bool] | None:
    """(align_corners, half_pixel_centers) that make Arm NN's resize equal to the ONNX/TVM one
    for these sizes, or None if no setting does."""
    first = {"align_corners": (True, False), "asymmetric": (False, False)}.get(mode, (False, True))
    candidates = [first] + [c for c in ((False, False), (False, True), (True, False)) if c != first]
    for ac, hp in candidates:
        ok = True
        for n_in, n_out in zip(in_hw, out_hw):
            if method == "nearest":
                want = _onnx_nearest(n_in, n_out, mode, rounding)
                ok = want is not None and np.array_equal(want, _armnn_nearest(n_in, n_out, ac, hp))
            else:
                want = _onnx_linear(n_in, n_out, mode)
                ok = want is not None and np.allclose(want, _armnn_linear(n_in, n_out, ac, hp), atol=1e-5)
            if not ok:
                break
        if ok:
            return ac, hp
    return None


# --- the executor -----------------------------------------------------------------------------

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
        ann, raw = self._ann, _raw
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
        handler = getattr(self, f"_op_{typ}")
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
        slot = handler(where, f"{k}:{typ}:{out}", ins, in_shapes, self._shapes[out], attrs, wts, **extra)
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

    # one method per op type: (where, name, input slots, input shapes, output shape, attrs, weights)

    def _op_conv2d(self, where, name, ins, in_shapes, out_shape, attrs, wts, q: QuantOp | None = None):
        ann = self._ann
        self._need_inputs(where, ins, 1)
        x_shape = in_shapes[0]
        if len(x_shape) != 4 or len(out_shape) != 4:
            raise UnsupportedOrder(f"{where}: conv2d needs NHWC rank-4 tensors, got {list(x_shape)}")
        cin = x_shape[3]
        if "kernel" not in wts:
            raise UnsupportedOrder(f"{where}: conv2d without a kernel weight")
        kernel = self._weight(wts["kernel"], where)
        if kernel.ndim != 4:
            raise UnsupportedOrder(f"{where}: conv2d kernel must be rank 4, is {list(kernel.shape)}")
        if q is not None:
            kernel = q.kernel_codes(kernel)
        bias = self._weight(wts["bias"], where) if wts.get("bias") else None
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
            w = (kernel.reshape(cin, m, kh, kw).transpose(1, 0, 2, 3) if self._api.depthwise_kernel == "MCHW"
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
        add = self._net.AddDepthwiseConvolution2dLayer if depthwise else self._net.AddConvolution2dLayer
        layer = self._weighted_layer(add, d, name, w, bias, q)
        ins[0].Connect(layer.GetInputSlot(0))
        yq = None if q is None else q.y
        slot = self._set(layer, shape=out_shape, q=yq)
        return self._activation(where, name, slot, out_shape, attrs.get("activation"), yq)

    def _op_dense(self, where, name, ins, in_shapes, out_shape, attrs, wts, q: QuantOp | None = None):
        ann = self._ann
        self._need_inputs(where, ins, 1)
        if "kernel" not in wts:
            raise UnsupportedOrder(f"{where}: dense without a kernel weight")
        kernel = self._weight(wts["kernel"], where)
        if kernel.ndim != 2:
            raise UnsupportedOrder(f"{where}: dense kernel must be [N, K], is {list(kernel.shape)}")
        if q is not None:
            kernel = q.kernel_codes(kernel)
        n, kdim = kernel.shape
        bias = self._weight(wts["bias"], where) if wts.get("bias") else None
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
            slot = self._reshape(f"{name}:rows", slot, (1, rows, 1, kdim), xq)
            d = ann.Convolution2dDescriptor()
            d.m_DataLayout = ann.DataLayout_NHWC
            d.m_StrideX = d.m_StrideY = 1
            d.m_BiasEnabled = bias is not None
            layer = self._weighted_layer(self._net.AddConvolution2dLayer, d, name, kernel.reshape(n, 1, 1, kdim),
                                         bias, q)
            slot.Connect(layer.GetInputSlot(0))
            slot = self._set(layer, shape=(1, rows, 1, n), q=yq)
            slot = self._activation(where, name, slot, (1, rows, 1, n), attrs.get("activation"), yq)
            return self._reshape(f"{name}:unflatten", slot, out_shape, yq)
        if tuple(x_shape) != (rows, kdim):
            slot = self._reshape(f"{name}:flatten", slot, (rows, kdim), xq)
        d = ann.FullyConnectedDescriptor()
        d.m_BiasEnabled = bias is not None
        d.m_TransposeWeightMatrix = True  # weights are [N, K]
        layer = self._weighted_layer(self._net.AddFullyConnectedLayer, d, name, kernel, bias, q)
        slot.Connect(layer.GetInputSlot(0))
        slot = self._set(layer, shape=(rows, n), q=yq)
        slot = self._activation(where, name, slot, (rows, n), attrs.get("activation"), yq)
        if tuple(out_shape) != (rows, n):
            slot = self._reshape(f"{name}:unflatten", slot, out_shape, yq)
        return slot

    def _op_activation(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        act = attrs.get("activation")
        if act is None:
            raise UnsupportedOrder(f"{where}: activation op without an activation object")
        if tuple(in_shapes[0]) != tuple(out_shape):
            raise UnsupportedOrder(f"{where}: activation changes shape {list(in_shapes[0])} -> {list(out_shape)}")
        return self._activation(where, name, ins[0], out_shape, act)

    def _pool(self, where, name, slot, x_shape, out_shape, kind, size, strides, pads, ceil_mode, include_pad):
        ann = self._ann
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
        layer = self._net.AddPooling2dLayer(d, name)
        slot.Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=out_shape)

    def _op_pool2d(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        size = _ints(attrs.get("pool_size"), 2, f"{where} pool_size")
        strides = _ints(attrs.get("strides", size), 2, f"{where} strides")
        pads = _ints(attrs.get("padding", [0, 0, 0, 0]), 4, f"{where} padding")
        if list(attrs.get("dilation") or [1, 1]) != [1, 1]:
            raise UnsupportedOrder(f"{where}: dilated pooling has no Arm NN layer")
        return self._pool(where, name, ins[0], in_shapes[0], out_shape, str(attrs.get("kind")), size, strides,
                          pads, bool(attrs.get("ceil_mode", False)), bool(attrs.get("count_include_pad", False)))

    def _op_global_pool2d(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        x = in_shapes[0]
        if len(x) != 4 or tuple(out_shape) != (x[0], 1, 1, x[3]):
            raise UnsupportedOrder(f"{where}: global pool {list(x)} -> {list(out_shape)} (N,1,1,C expected)")
        return self._pool(where, name, ins[0], x, out_shape, str(attrs.get("kind")), (x[1], x[2]), (1, 1),
                          (0, 0, 0, 0), False, False)

    def _op_layer_norm(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        """(x - mean) * rsqrt(mean((x - mean)^2) + eps) * gamma + beta over the last axis: Arm NN has
        no LayerNormalization layer, but Mean, Subtraction, Multiplication, Linear and Rsqrt
        (ElementwiseUnary) are in every release spoken here."""
        ann = self._ann
        self._need_inputs(where, ins, 1)
        x, shape = ins[0], tuple(in_shapes[0])
        if tuple(out_shape) != shape:
            raise UnsupportedOrder(f"{where}: output shape {list(out_shape)} is not the input's {list(shape)}")
        row = (1,) * (len(shape) - 1) + (shape[-1],)
        consts = {}
        for role in ("gamma", "beta"):
            w = self._weight(wts[role], where)
            if w.size != shape[-1]:
                raise UnsupportedOrder(f"{where}: {role} has {w.size} values for {shape[-1]} channels")
            consts[role] = self._constant_layer(np.asarray(w, np.float32).reshape(row), f"{name}:{role}")
        stat = [*shape[:-1], 1]
        d = self._elementwise("sub", f"{name}:centre", x, self._mean_last(f"{name}:mean", x, shape), shape)
        var = self._mean_last(f"{name}:var", self._elementwise("mul", f"{name}:sq", d, d, shape), shape)
        ve = self._linear(f"{name}:eps", var, stat, 1.0, float(attrs.get("epsilon", 0.0)))
        layer = self._net.AddElementwiseUnaryLayer(ann.ElementwiseUnaryDescriptor(ann.UnaryOperation_Rsqrt),
                                                  f"{name}:rsqrt")
        ve.Connect(layer.GetInputSlot(0))
        n = self._elementwise("mul", f"{name}:norm", d, self._set(layer, shape=stat), shape)
        g = self._elementwise("mul", f"{name}:gamma_mul", n, consts["gamma"], shape)
        return self._elementwise("add", f"{name}:beta_add", g, consts["beta"], shape)

    def _op_binary(self, where, name, ins, in_shapes, out_shape, attrs, wts, q: QType | None = None):
        if q is not None:   # a quantized add (_quant_add): two tensors of the output's shape
            if any(tuple(s) != tuple(out_shape) for s in in_shapes):
                raise UnsupportedOrder(f"{where}: a quantized add of shapes {[list(s) for s in in_shapes]} "
                                       f"into {list(out_shape)}; only equal shapes are built")
            layer = self._net.AddAdditionLayer(name)
            ins[0].Connect(layer.GetInputSlot(0))
            ins[1].Connect(layer.GetInputSlot(1))
            slot = self._set(layer, shape=out_shape, q=q)
            return self._activation(where, name, slot, out_shape, attrs.get("activation"), q)
        kind = str(attrs.get("kind"))
        adders = {"add": self._net.AddAdditionLayer, "sub": self._net.AddSubtractionLayer,
                  "mul": self._net.AddMultiplicationLayer, "div": self._net.AddDivisionLayer,
                  "max": self._net.AddMaximumLayer, "min": self._net.AddMinimumLayer}
        if kind not in adders:
            raise UnsupportedOrder(f"{where}: binary kind {kind!r} ({'/'.join(adders)} only)")
        # operands in order: a constant "lhs" goes before the op's input, a constant "rhs" after it
        operands: list[tuple[Any, Any]] = [(s, sh) for s, sh in zip(ins, in_shapes)]
        consts = {r: self._weight(n, where) for r, n in wts.items() if n}
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
                slot = self._constant_layer(np.asarray(val, np.float32).reshape(full), f"{name}:const{i}")
            elif full != shape:
                slot = self._reshape(f"{name}:rank{i}", slot, full)
            slots.append(slot)
            shapes.append(full)
        for a, b, o in zip(shapes[0], shapes[1], out_shape):
            if max(a, b) != o or min(a, b) not in (1, o):
                raise UnsupportedOrder(f"{where}: shapes {list(shapes[0])} and {list(shapes[1])} do not "
                                       f"broadcast to {list(out_shape)}")
        layer = adders[kind](name)
        slots[0].Connect(layer.GetInputSlot(0))
        slots[1].Connect(layer.GetInputSlot(1))
        slot = self._set(layer, shape=out_shape)
        return self._activation(where, name, slot, out_shape, attrs.get("activation"))

    def _op_conv2d_transpose(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
        self._need_inputs(where, ins, 1)
        x_shape = in_shapes[0]
        if len(x_shape) != 4 or len(out_shape) != 4:
            raise UnsupportedOrder(f"{where}: conv2d_transpose needs NHWC rank-4 tensors, got {list(x_shape)}")
        kernel = self._weight(wts["kernel"], where)
        if kernel.ndim != 4 or kernel.shape[3] != x_shape[3] or kernel.shape[0] != out_shape[3]:
            raise UnsupportedOrder(f"{where}: conv2d_transpose kernel {list(kernel.shape)} (OHWI) does not fit "
                                   f"{list(x_shape)} -> {list(out_shape)}")
        bias = self._weight(wts["bias"], where) if wts.get("bias") else None
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
        wt = self._const(kernel)
        layer = (self._net.AddTransposeConvolution2dLayer(d, wt, self._const(bias), name) if bias is not None
                 else self._net.AddTransposeConvolution2dLayer(d, wt, name=name))
        ins[0].Connect(layer.GetInputSlot(0))
        slot = self._set(layer, shape=out_shape)
        return self._activation(where, name, slot, out_shape, attrs.get("activation"))

    def _op_prelu(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        shape = tuple(in_shapes[0])
        slope = self._weight(wts["slope"], where)
        if slope.ndim > len(shape):
            raise UnsupportedOrder(f"{where}: prelu slope {list(slope.shape)} has a higher rank than {list(shape)}")
        full = (1,) * (len(shape) - slope.ndim) + tuple(slope.shape)
        if any(s not in (1, d) for s, d in zip(full, shape)):
            raise UnsupportedOrder(f"{where}: prelu slope {list(slope.shape)} does not broadcast to {list(shape)}")
        a_slot = self._constant_layer(slope.reshape(full), f"{name}:slope")
        layer = self._net.AddPreluLayer(name)
        ins[0].Connect(layer.GetInputSlot(0))
        a_slot.Connect(layer.GetInputSlot(1))
        return self._set(layer, shape=out_shape)

    def _op_strided_slice(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
        self._need_inputs(where, ins, 1)
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
        layer = self._net.AddStridedSliceLayer(d, name)
        ins[0].Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=out_shape)

    def _op_pad(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
        self._need_inputs(where, ins, 1)
        shape = in_shapes[0]
        rank = len(shape)
        pads = _ints(attrs.get("pads"), 2 * rank, f"{where} pads")
        pairs = [(pads[i], pads[rank + i]) for i in range(rank)]
        if any(p < 0 for p in pads) or [d + a + b for d, (a, b) in zip(shape, pairs)] != list(out_shape):
            raise UnsupportedOrder(f"{where}: pad {pads} of {list(shape)} is not {list(out_shape)}")
        d = ann.PadDescriptor(pairs, float(attrs.get("value", 0.0)))
        layer = self._net.AddPadLayer(d, name)
        ins[0].Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=out_shape)

    def _op_concat(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
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
        layer = self._net.AddConcatLayer(desc, name)
        for i, s in enumerate(ins):
            s.Connect(layer.GetInputSlot(i))
        return self._set(layer, shape=out_shape)

    def _op_reshape(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        if math.prod(in_shapes[0]) != math.prod(out_shape):
            raise UnsupportedOrder(f"{where}: reshape {list(in_shapes[0])} -> {list(out_shape)} changes the size")
        return self._reshape(name, ins[0], out_shape)  # the tensors table is the target shape

    def _op_softmax(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
        self._need_inputs(where, ins, 1)
        shape = tuple(in_shapes[0])
        rank = len(shape)
        axis = int(attrs.get("axis", -1))
        if not -rank <= axis < rank or shape != tuple(out_shape):
            raise UnsupportedOrder(f"{where}: softmax axis {axis} over {list(shape)} -> {list(out_shape)}")
        axis %= rank
        slot, cur = ins[0], shape
        if axis != rank - 1:  # ACL 20.08 only does the innermost axis: move it there and back
            axes = [a for a in range(rank) if a != axis] + [axis]
            slot = self._permute(f"{name}:to_last", slot, shape, axes)
            cur = tuple(shape[a] for a in axes)
        d = ann.SoftmaxDescriptor()
        d.m_Beta = 1.0
        d.m_Axis = -1
        layer = self._net.AddSoftmaxLayer(d, name)
        slot.Connect(layer.GetInputSlot(0))
        slot = self._set(layer, shape=cur)
        if axis != rank - 1:
            slot = self._permute(f"{name}:back", slot, cur, [int(a) for a in np.argsort(axes)])
        return slot

    def _op_resize2d(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        ann = self._ann
        self._need_inputs(where, ins, 1)
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
        layer = self._net.AddResizeLayer(d, name)
        ins[0].Connect(layer.GetInputSlot(0))
        return self._set(layer, shape=out_shape)

    def _op_transpose(self, where, name, ins, in_shapes, out_shape, attrs, wts):
        self._need_inputs(where, ins, 1)
        shape = in_shapes[0]
        rank = len(shape)
        axes = attrs.get("axes")
        axes = list(reversed(range(rank))) if axes is None else [int(a) % rank if rank else 0 for a in axes]
        if sorted(axes) != list(range(rank)):
            raise UnsupportedOrder(f"{where}: transpose axes {attrs.get('axes')} are not a permutation of rank {rank}")
        if [shape[a] for a in axes] != list(out_shape):
            raise UnsupportedOrder(f"{where}: transpose {list(shape)} by {axes} is not {list(out_shape)}")
        if axes == list(range(rank)):
            return self._reshape(name, ins[0], list(shape))
        return self._permute(name, ins[0], shape, axes)

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
