"""Arm NN's two Python bindings behind one face (``Api``), and what the executor and its op
builders share: quantization records, the permutes Arm NN needs, resize's coordinate rules, the
pyarmnn loader and its availability. The executor is armnn.py, its per-op builders armnn_ops.py."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandoor_contract import orders
from tandoor_contract.errors import TandoorError



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
    # ActivationFunction::Gelu (erf form), an Arm NN layer since 23.11 (compiler/backends/acl/ GELU_SINCE):
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
