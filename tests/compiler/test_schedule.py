"""The TVM side's schedule rules (compiler/stages/schedule.py) never change a number: tiny models of the
patterns real mobile models have, and real pretrained models, compiled TVM-only (every op in TVM,
as `--policy none`) and compared with onnxruntime on the source model; each pattern's kernels
must really be taken by the rule meant for them (a rule that fails is "not applicable", so a
silent fall-back to TVM's naive loops would pass a numbers-only test). Speed is measured by
`tandoor bench --kernels`, not here.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from support.cli import run_cli
from tandoor_compiler.stages import frontend, schedule
from tandoor_compiler.stages.passes import legalise_for_tvm
from tandoor_host.kernels import relax_module as _relax_module
from tandoor_host.kernels import tvm_pattern
from tandoor_zoo import wild

ATOL = RTOL = 1e-4
RNG = np.random.default_rng(20261201)
N = helper.make_node


def _w(*shape, scale=0.2) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


class Graph:
    """A small NCHW ONNX graph built op by op; weights are initializers."""

    def __init__(self, name: str, shape) -> None:
        self.name, self.nodes, self.inits, self.shape = name, [], {}, list(shape)
        self.k = 0

    def fresh(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def const(self, a, base: str = "c", dtype=np.float32) -> str:
        n = self.fresh(base)
        self.inits[n] = np.asarray(a, dtype)
        return n

    def ints(self, a, base: str = "i") -> str:
        return self.const(a, base, np.int64)

    def op(self, typ: str, ins: list[str], **attrs) -> str:
        out = self.fresh(typ.lower())
        self.nodes.append(N(typ, ins, [out], **attrs))
        return out

    def conv(self, x: str, cin: int, cout: int, k: int = 1, s: int = 1, g: int = 1, pad: int | None = None) -> str:
        p = k // 2 if pad is None else pad
        return self.op("Conv", [x, self.const(_w(cout, cin // g, k, k), "w"), self.const(_w(cout), "b")],
                       kernel_shape=[k, k], strides=[s, s], pads=[p] * 4, group=g)

    def hardswish_as_ops(self, x: str) -> str:     # x * clip(x + 3, 0, 6) / 6, as paddle2onnx writes it
        t = self.op("Add", [x, self.const(3.0)])
        t = self.op("Clip", [t, self.const(0.0), self.const(6.0)])
        return self.op("Div", [self.op("Mul", [x, t]), self.const(6.0)])

    def silu(self, x: str) -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x])])

    def save(self, path, out: str):
        vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
        inits = [numpy_helper.from_array(a, n) for n, a in self.inits.items()]
        g = helper.make_graph(self.nodes, self.name, [vi("x", self.shape)], [], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        shape = next(v for v in onnx.shape_inference.infer_shapes(m).graph.value_info if v.name == out)
        m.graph.output.append(shape)
        path.write_bytes(m.SerializeToString())
        return path


def squeeze_excite(g: Graph) -> str:
    x = g.hardswish_as_ops(g.conv("x", 16, 32, 3, 2))
    se = g.op("GlobalAveragePool", [x])
    se = g.op("Relu", [g.conv(se, 32, 8)])
    se = g.op("HardSigmoid", [g.conv(se, 8, 32)], alpha=1 / 6, beta=0.5)
    y = g.op("Mul", [x, se])
    return g.conv(y, 32, 24)


def depthwise_5x5_s2(g: Graph) -> str:
    x = g.conv("x", 16, 48)
    x = g.op("Relu", [g.conv(x, 48, 48, 5, 2, g=48)])
    return g.hardswish_as_ops(g.conv(x, 48, 40))


def silu_3x3(g: Graph) -> str:      # YOLO blocks: 3x3 conv + SiLU, rows of 13 (a partial tile)
    x = g.silu(g.conv("x", 16, 32, 3))
    return g.silu(g.conv(x, 32, 32, 3, 2))


def concat_neck(g: Graph) -> str:   # C2f / CSP necks: split, convs, concat of everything
    x = g.silu(g.conv("x", 16, 32))
    a, b = (g.fresh("split"), g.fresh("split"))
    g.nodes.append(N("Split", [x, g.ints([16, 16])], [a, b], axis=1))
    c = g.silu(g.conv(b, 16, 16, 3))
    d = g.silu(g.conv(c, 16, 16, 3))
    y = g.op("Concat", [a, b, c, d], axis=1)
    return g.silu(g.conv(y, 64, 32))


def resize_concat(g: Graph) -> str:  # FPN top-down: nearest x2, concat with the lateral
    hi = g.op("Relu", [g.conv("x", 16, 24)])
    lo = g.op("Relu", [g.conv(hi, 24, 24, 3, 2)])
    up = g.op("Resize", [lo, "", g.const([1, 1, 2, 2], "scales")], mode="nearest")
    return g.conv(g.op("Concat", [up, hi], axis=1), 48, 24, 3)


def shuffle_grouped(g: Graph) -> str:  # ShuffleNet: grouped 1x1, channel shuffle, grouped 3x3
    x = g.op("Relu", [g.conv("x", 16, 32, 1, g=4)])
    x = g.op("Reshape", [x, g.ints([1, 4, 8, 19, 25])])
    x = g.op("Transpose", [x], perm=[0, 2, 1, 3, 4])
    x = g.op("Reshape", [x, g.ints([1, 32, 19, 25])])
    return g.conv(x, 32, 32, 3, g=8)


def deconv(g: Graph) -> str:        # DBNet / CenterFace upsamplers: ConvTranspose 2x2 stride 2 (a 1x1
    x = g.op("Relu", [g.conv("x", 16, 24)])   # conv + pixel shuffle on the TVM side), and a 4x4 one
    up = g.op("ConvTranspose", [x, g.const(_w(24, 8, 2, 2), "w"), g.const(_w(8), "b")],
              kernel_shape=[2, 2], strides=[2, 2])
    up = g.op("Relu", [up])
    return g.op("ConvTranspose", [up, g.const(_w(8, 4, 4, 4), "w")], kernel_shape=[4, 4], strides=[2, 2],
                pads=[1, 1, 1, 1])


def stem(g: Graph) -> str:          # 3-channel input, stride 2, odd size
    return g.op("Relu", [g.conv("x", 3, 24, 3, 2)])


# name, builder, input shape, patterns that must be scheduled by ConvNHWC
CASES = [
    ("squeeze_excite", squeeze_excite, [1, 16, 28, 28], {"conv 3x3 s2", "conv 1x1"}),
    ("depthwise_5x5_s2", depthwise_5x5_s2, [1, 16, 28, 28], {"depthwise 5x5 s2", "conv 1x1"}),
    ("silu_3x3", silu_3x3, [1, 16, 13, 13], {"conv 3x3", "conv 3x3 s2"}),
    ("concat_neck", concat_neck, [1, 16, 20, 20], {"conv 1x1", "conv 3x3"}),
    ("resize_concat", resize_concat, [1, 16, 26, 26], {"conv 1x1", "conv 3x3 s2", "conv 3x3"}),
    ("shuffle_grouped", shuffle_grouped, [1, 16, 19, 25], {"grouped 1x1 g4", "grouped 3x3 g8"}),
    ("stem", stem, [1, 3, 65, 65], {"conv 3x3 s2"}),
    ("deconv", deconv, [1, 16, 20, 20], {"conv 1x1"}),
]


def _tvm_only(path):
    """The model as `--policy none` builds its host lib, run in a VM; and what scheduled what."""
    model = frontend.load(path, [])
    seen: dict = {}
    t = tvm.target.Target(schedule.host_target({"kind": "llvm"}))
    ex = tvm.compile(legalise_for_tvm(_relax_module(model, {})), target=t,
                     relax_pipeline=schedule.cpu_pipeline(t, observe=seen.update))
    return model, relax.VirtualMachine(ex, tvm.cpu()), seen


@pytest.mark.parametrize("name,build,shape,conv_patterns", CASES, ids=[c[0] for c in CASES])
def test_pattern_matches_onnxruntime_and_is_scheduled(name, build, shape, conv_patterns, tmp_path):
    g = Graph(name, shape)
    path = g.save(tmp_path / f"{name}.onnx", build(g))
    model, vm, seen = _tvm_only(path)
    x = RNG.standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = vm["main"](tvm.runtime.tensor(x))
    got = (got[0] if not hasattr(got, "numpy") else got).numpy()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)

    rules = {}
    for fname, (func, rule) in seen.items():
        pattern = tvm_pattern(fname, func)[0]
        rules.setdefault(pattern, set()).add(rule)
    for p in conv_patterns:
        assert rules.get(p) == {"ConvNHWC"}, f"{name}: {p} scheduled by {rules.get(p)} (all: {rules})"
    # nothing of these models is left to TVM's unscheduled loops
    assert all("none" not in r for r in rules.values()), rules
    if name == "deconv":    # the 2x2 stride-2 one became a 1x1 conv; the overlapping 4x4 one stays
        assert len([f for f in seen if f.startswith("conv2d_transpose")]) == 1, sorted(seen)


@pytest.mark.parametrize("width,channels", [(w, c) for w in (1, 7, 13, 14, 19, 20, 25, 28, 40, 52, 56, 112, 160)
                                            for c in (3, 16, 24, 32, 40, 64, 96, 256, 1000)])
@pytest.mark.parametrize("lanes,regs", [(16, 32), (8, 16), (4, 32)], ids=["avx512", "avx2", "neon"])
def test_conv_tile_fits_the_registers_and_prefers_whole_rows(width, channels, lanes, regs):
    ci, wi = schedule.conv_tile(width, channels, lanes, regs)
    assert channels % ci == 0 and 1 <= wi <= width
    assert wi * max(1, -(-ci // lanes)) <= regs - 4          # accumulators stay in registers
    if width % wi:   # a partial tile only where no whole-row tile of these channels is at least half as big
        whole = max((d for d in range(1, wi) if width % d == 0), default=1)
        assert whole * 2 < wi, (ci, wi, whole)


def test_host_target_names_an_x86_level_or_the_cpu():
    t = schedule.host_target({"kind": "llvm"})
    import platform

    if platform.machine() == "x86_64":
        assert t.get("mcpu") in ("x86-64-v4", "x86-64-v3", None)
        lanes, _ = schedule.vector_regs(tvm.target.Target(t))
        assert lanes == {"x86-64-v4": 16, "x86-64-v3": 8, None: 4}[t.get("mcpu")]
    assert schedule.host_target({"kind": "llvm", "mcpu": "cortex-a76"}) == {"kind": "llvm", "mcpu": "cortex-a76"}


# --- real models, TVM only ----------------------------------------------------------------------

REAL = ["pplcnet_orientation", "ppocr_cls", "yolov8n_320", "yolox_det", "ppocr_det"]


@pytest.mark.parametrize("name", REAL)
def test_a_real_model_tvm_only_matches_onnxruntime(name, tmp_path):
    m = wild.MODELS[name]
    pins = [a for pin in m.inputs for a in ("--input", pin)]
    out = tmp_path / f"{name}.hmod"
    run_cli("tandoor", "compile", str(wild.fetch(name)), "-o", str(out), "--policy", "none", "-q", *pins, check=True)
    res = run_cli("tandoor", "verify", str(out), "--reference", str(wild.fetch(name)), "--delegate", "tvm",
                  "--random", "1", "--json")
    assert res.returncode == 0, f"{name}: {res.stdout[-1500:]} {res.stderr[-800:]}"
