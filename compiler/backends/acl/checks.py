"""Per-op constraint checks: None when ACL (through Arm NN) can take the call, else a one-line
reason. The table's patterns call them, and so does ``explain`` for an op that stayed in TVM."""

from __future__ import annotations

from tvm import relax

from .entry import release_reason
from .exprs import _fp32, _ints, _is_const, _num, _numel, _shape, _tensor_args


def check_conv2d(call: relax.Call) -> str | None:
    data, kernel = call.args[0], call.args[1]
    if r := _fp32(data, kernel):
        return r
    if not _is_const(kernel):
        return "conv2d kernel is not a constant: Arm NN needs weights at network build time"
    if call.attrs.data_layout != "NHWC" or call.attrs.kernel_layout != "OHWI":
        return f"conv2d in {call.attrs.data_layout}/{call.attrs.kernel_layout}: ACL's fast kernels are NHWC/OHWI"
    if str(call.attrs.out_dtype) not in ("", "float32", "None"):
        return f"conv2d out_dtype {call.attrs.out_dtype}"
    groups = int(call.attrs.groups)
    cin = _shape(data)[3]
    cout = _shape(kernel)[0]
    if groups != 1 and not (groups == cin and cout % cin == 0):
        return f"grouped convolution (groups={groups}, {cin} channels): Arm NN 20.08 has only ordinary and depthwise convolution"
    return None


def check_conv2d_transpose(call: relax.Call) -> str | None:
    data, kernel = call.args[0], call.args[1]
    if r := _fp32(data, kernel):
        return r
    if not _is_const(kernel):
        return "conv2d_transpose kernel is not a constant"
    a = call.attrs
    if a.data_layout != "NHWC" or a.kernel_layout != "IOHW":
        return f"conv2d_transpose in {a.data_layout}/{a.kernel_layout}: ACL's kernels are NHWC"
    if int(a.groups) != 1:
        return f"grouped conv2d_transpose (groups={int(a.groups)}) has no Arm NN layer"
    if any(int(d) != 1 for d in a.dilation):
        return "dilated conv2d_transpose has no Arm NN layer"
    return None


def check_dense(call: relax.Call) -> str | None:
    x, w = call.args[0], call.args[1]
    if r := _fp32(x, w):
        return r
    if not _is_const(w):
        return "matmul with a non-constant right operand: ACL's fully-connected layer needs constant weights"
    if len(_shape(w)) != 2:
        return f"matmul with a rank-{len(_shape(w))} weight: only 2-D weights map to a fully-connected layer"
    return None


def check_pool2d(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if call.attrs.layout != "NHWC":
        return f"pooling in {call.attrs.layout}: ACL pools run in NHWC"
    if any(int(d) != 1 for d in call.attrs.dilation):
        return "dilated pooling has no ACL kernel"
    size = _ints(call.attrs.pool_size)
    pad = _ints(call.attrs.padding)
    if pad[0] >= size[0] or pad[2] >= size[0] or pad[1] >= size[1] or pad[3] >= size[1]:
        return f"pool padding {pad} not smaller than the window {size} (ACL refuses it)"
    if bool(call.attrs.ceil_mode):
        # ONNX drops a last window that starts inside the bottom/right padding; ACL does not.
        shape = _shape(call.args[0])
        strides = _ints(call.attrs.strides)
        for ax, (lo, hi) in ((1, (pad[0], pad[2])), (2, (pad[1], pad[3]))):
            n, k, st = shape[ax], size[ax - 1], strides[ax - 1]
            out = -(-(n + lo + hi - k) // st) + 1
            if (out - 1) * st >= n + lo:
                return "ceil_mode pooling whose last window starts in the padding: ACL and ONNX disagree on its size"
    return None


def check_global_pool(call: relax.Call) -> str | None:
    x = call.args[0]
    if r := _fp32(x):
        return r
    shape = _shape(x)
    if len(shape) != 4:
        return f"reduction over a rank-{len(shape)} tensor: only NHWC spatial reductions map to ACL's global pool"
    axes = sorted(int(a) % 4 for a in call.attrs.axis) if call.attrs.axis is not None else []
    if axes != [1, 2]:
        return f"reduction over axes {axes}: only the H,W axes of NHWC map to ACL's global pool"
    return None


def check_adaptive_pool(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if call.attrs.layout != "NHWC":
        return f"adaptive pooling in {call.attrs.layout}"
    out = call.attrs.output_size
    if out is None or _ints(out) != [1, 1]:
        return "adaptive pooling to a size other than 1x1 has no ACL kernel"
    return None


def check_elementwise(call: relax.Call) -> str | None:
    return _fp32(*_tensor_args(call), call)


def check_unary(call: relax.Call) -> str | None:
    return _fp32(call.args[0])


def check_prelu(call: relax.Call) -> str | None:
    x, alpha = call.args[0], call.args[1]
    if r := _fp32(x, alpha):
        return r
    if not _is_const(alpha):
        return "prelu slope is not a constant"
    if _numel(_shape(alpha)) not in (1, _shape(x)[int(call.attrs.axis) % len(_shape(x))]):
        return "prelu slope is neither a scalar nor one per channel"
    return None


def check_concat(call: relax.Call) -> str | None:
    fields = call.args[0].fields if isinstance(call.args[0], relax.Tuple) else None
    if fields is None:
        return "concat of a non-literal tuple"
    if r := _fp32(*fields):
        return r
    if any(_is_const(f) for f in fields):
        return "concat with a constant operand: orders concatenate tensors only"
    return None


def check_reshape(call: relax.Call) -> str | None:
    return _fp32(call.args[0], call)


def check_softmax(call: relax.Call) -> str | None:
    return _fp32(call.args[0])


def check_resize(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    a = call.attrs
    if a.layout != "NHWC":
        return f"resize in {a.layout}"
    if a.method not in ("nearest_neighbor", "linear"):
        return f"resize method {a.method}: ACL has nearest and bilinear only"
    mode, rounding = str(a.coordinate_transformation_mode), str(a.rounding_method)
    if a.method == "linear" and mode not in ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"):
        return f"bilinear resize with coordinate mode {mode} has no ACL equivalent"
    # Nearest: only the (mode, rounding) pairs whose index maps match ACL's for every size.
    if a.method == "nearest_neighbor" and (mode, rounding) not in NEAREST_OK:
        return f"nearest resize with {mode}/{rounding or 'default'} rounding picks other pixels than ACL"
    return None


NEAREST_OK = {("asymmetric", "floor"), ("half_pixel", "round_prefer_ceil"), ("align_corners", "round_prefer_ceil"),
              ("tf_half_pixel_for_nn", "floor")}


def check_gelu(call: relax.Call) -> str | None:
    return release_reason("GELU (erf)", GELU_SINCE) or _fp32(call.args[0])


GELU_SINCE = "23.11"      # ActivationFunction::Gelu (Arm NN 23.11 release notes)


def check_layer_norm(call: relax.Call) -> str | None:
    x, gamma, beta = call.args[0], call.args[1], call.args[2]
    if r := _fp32(x, gamma, beta):
        return r
    rank = len(_shape(x))
    if sorted(int(a) % rank for a in call.attrs.axes) != [rank - 1]:
        return "layer norm over axes other than the last: orders normalise the last axis only"
    if not (_is_const(gamma) and _is_const(beta)):
        return "layer norm with a non-constant gamma or beta"
    return None


def check_transpose(call: relax.Call) -> str | None:
    shape = _shape(call.args[0])
    if shape is not None and len(shape) < 2:    # a rank-0/1 "transpose" moves nothing; ONNX has no empty perm
        return f"transpose of a rank-{len(shape)} tensor moves nothing"
    return _fp32(call.args[0])


def slice_spec(call: relax.Call) -> tuple[list[int], list[int], list[int]] | str:
    """A strided_slice as full-rank (begin, end, strides), normalised like numpy; or a reason."""
    shape = _shape(call.args[0])
    vals = []
    for arg in call.args[1:5]:
        if arg is None:
            vals.append(None)
            continue
        items = arg.fields if isinstance(arg, relax.Tuple) else getattr(arg, "values", None)
        if items is None:
            return "strided_slice with non-constant bounds"
        try:
            vals.append([int(_num(v)) for v in items])
        except (TypeError, ValueError):
            return "strided_slice with non-constant bounds"
    axes, begin, end = vals[0], vals[1], vals[2]
    strides = vals[3] if len(vals) > 3 and vals[3] is not None else [1] * len(axes)
    rank = len(shape)
    b, e, s = [0] * rank, list(shape), [1] * rank
    for ax, lo, hi, st in zip(axes, begin, end, strides):
        ax %= rank
        if st <= 0:
            return f"strided_slice with step {st}: ACL slices forwards only"
        n = shape[ax]
        lo = max(0, min(n, lo + n if lo < 0 else lo))
        hi = max(0, min(n, hi + n if hi < 0 else hi))
        b[ax], e[ax], s[ax] = lo, max(hi, lo), st
    return b, e, s


def check_strided_slice(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0], call):
        return r
    spec = slice_spec(call)
    if isinstance(spec, str):
        return spec
    if any(d == 0 for d in _shape(call)):
        return "strided_slice to an empty tensor"
    return None


def check_pad(call: relax.Call) -> str | None:
    if r := _fp32(call.args[0]):
        return r
    if str(call.attrs.pad_mode) != "constant":
        return f"pad mode {call.attrs.pad_mode}: Arm NN pads with a constant only"
    if any(int(p) < 0 for p in call.attrs.pad_width):
        return "negative padding (a crop) is not a pad"
    return None
