"""What the bundle's check needs to know about each model output, from the ONNX graph and
onnxruntime's run of it: the tolerance the compiler promises (the manifest's ``tolerance``) and
which elements a tie makes arbitrary (each golden pair's ``ties``). The rule that applies both is
tandoor_contract.agreement; `tandoor verify` calls :func:`ties` on its random inputs too.

Tolerance. Two correct fp32 programs differ by rounding, and how much depends on the model:
- the summation order of a reduction of length L (a conv's Cin*kh*kw, a MatMul's K, a global pool's
  H*W, a Softmax's axis): rounding errors of a sum wander like sqrt(L) * u (u = 2^-24) times the
  values summed. Measured on a 65536-long mean of values near 10 (tests/compiler/test_check_facts.py):
  TVM's loops 1.5e-4 = 0.9 sqrt(L) u 10, onnxruntime's blocked sums less; TVM does not sum in a way
  that grows like L u, so every path gets the same promise;
- fp16 anywhere upstream: u = 2^-11 there;
- the scale: the largest |value| on the golden pairs of the output, or of what its longest reduction
  made (a later subtraction may cancel it); through a squashing op (Sigmoid, Softmax, Tanh,
  HardSigmoid) the error of its input times the op's steepest slope, at most the op's range. A
  Softmax over logits of 7e9 (onnx's own placeholder-weights SqueezeNet: every weight 0.02, every
  logit equal) is decided by rounding alone: fp32 resolves such logits to 512, and the onnxruntime
  order gives 250 of the 1000 classes 0.004 where onnxruntime's whole-model run gives each 0.001.
  Its outputs may be anything in [0, 1] and are promised as such.
- depth: a rounding error made early is carried, and amplified, by every layer after it. In M-LSD
  tiny (tf2onnx, 41 convs with folded BatchNorm, relu6) TVM and onnxruntime differ by 7.5e-3 to
  2.1e-2 on outputs up to 81 (1e-4 of the scale, 2000 u) though no single op departs from fp32:
  against a float64 run (onnx.reference) onnxruntime is 8.2e-3 off and TVM 4.4e-3, every
  intermediate of both within a few u of the truth at the first conv and growing together through
  the net. No formula over the graph predicts that gain, so it is measured: onnxruntime runs the
  model again with every rounding op's output (:data:`EXACT` ops do not round) multiplied by
  1 + r, r uniform in [-u, u] (one rounding each, :func:`rounding_noise`), and the ``spread`` is the largest
  change of the output over the golden pairs. Measured TVM/onnxruntime difference over spread, per
  input: M-LSD 1.2-1.4, EfficientNet-Lite0 2.1-3.7 (6e-6, far below 0.001), a 20-deep relu6 conv
  stack with gain 4 (tests/support/check_traits.deep_relu6) 1.0-1.4, a 12-deep one with gain 8 (chaotic:
  errors swing 2x between inputs) 2.3-6.6.
Per output: ``atol = max(0.001, SAFETY * u * sqrt(L) * slope * scale, SAFETY * spread)``, capped
by a squashing op's range, ``rtol`` 0.001: never tighter than the 0.001/0.001 every bundle promised
before. The manifest's format has room for a pair per path (tandoor_contract.agreement); none
differs today.

Ties. TopK's indices, and whatever is gathered with them, depend on which of equal scores comes
first (onnxruntime and TVM order ties differently): rows of tied scores, or a tie between the
k-th and the (k+1)-th score, may come in any order. ArgMax between equal maxima may name either.
Those elements are listed as free: compared only for being finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from tandoor_contract import agreement

U32, U16 = 2.0 ** -24, 2.0 ** -11
SAFETY = 8.0      # measured: TVM's and onnxruntime's differences are ~1x sqrt(L) u scale (tests)
TIE_RTOL, TIE_ATOL = 1e-5, 1e-6   # scores this close are a tie: the paths' rounding can swap them

# an op whose output is its input's values moved about: the output's scale is its input's
MOVING = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Slice", "Concat",
          "Expand", "Tile", "Gather", "GatherElements", "Split", "Cast", "Dropout"}
# squashing op -> (steepest slope, range): its output error is at most slope * input error, capped
SQUASH = {"Sigmoid": (0.25, 1.0), "Softmax": (1.0, 1.0), "Tanh": (1.0, 2.0), "HardSigmoid": (None, 1.0)}
# ops whose float output is exact (no rounding): :func:`rounding_noise` leaves them alone
EXACT = MOVING | {"Relu", "Clip", "MaxPool", "GlobalMaxPool", "Max", "Min", "Abs", "Neg", "Pad", "Where",
                  "Floor", "Ceil", "Round", "Sign", "ReduceMax", "ReduceMin", "TopK", "Shape", "Size",
                  "ConstantOfShape", "Constant", "DepthToSpace", "SpaceToDepth"}
#: the name under which :class:`Reference` shows an output of the noisy run (``runs``' key)
NOISY = "#noisy"
# ops that keep a TopK row where it is, with elementwise (right-aligned) broadcasting
ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Mod", "Cast", "Floor", "Ceil", "Sigmoid", "Relu", "Neg", "Abs",
               "Identity", "Clip", "Exp", "Log", "Sqrt", "Max", "Min", "Expand"}
# ops that only add or drop axes of 1 around a TopK row (when the shapes say so)
RESHAPING = {"Unsqueeze", "Squeeze", "Reshape", "Flatten"}


@dataclass
class Tie:
    """An output whose rows (along ``axis``) follow a TopK's order, or whose elements name an
    ArgMax's choice."""
    output: str
    kind: str                  # "topk" | "argmax"
    node_input: str            # the scores (TopK/ArgMax input)
    axis: int                  # TopK/ArgMax axis in its input
    k: int = 0
    largest: bool = True
    out_axis: int = 0          # TopK: the row axis in the output
    keepdims: bool = True


@dataclass
class Facts:
    names: list[str]
    reduction: dict[str, int]              # output -> longest reduction upstream
    reduction_op: dict[str, str]
    reduced: dict[str, str]                # output -> the tensor its longest reduction made
    fp16: dict[str, bool]
    scale_of: dict[str, tuple[str, str | None]]   # output -> (tensor whose |max| scales it, squash op)
    ties: list[Tie] = field(default_factory=list)
    given: set[str] = field(default_factory=set)    # graph inputs and initializers: not computed

    @property
    def extra(self) -> list[str]:
        """Tensors beyond the outputs that onnxruntime must show (scales, scores of ties)."""
        want = [t for t, _ in self.scale_of.values()] + list(self.reduced.values())
        for t in self.ties:
            want.append(t.node_input)
        return [n for n in dict.fromkeys(want) if n not in self.names and n not in self.given]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def analyse(model: onnx.ModelProto) -> Facts:
    """The facts of each graph output (see the module doc) from the graph alone."""
    try:
        g = onnx.shape_inference.infer_shapes(model).graph
    except Exception:    # (a model over 2 GB, an op onnx cannot infer) the shapes the file states
        g = model.graph
    shapes: dict[str, list[int | None]] = {}
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        if t.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    consts: dict[str, np.ndarray] = {}
    for init in g.initializer:
        types[init.name] = init.data_type
        shapes[init.name] = list(init.dims)
        if init.data_type == TensorProto.INT64 and math.prod(init.dims) <= 64:
            consts[init.name] = numpy_helper.to_array(init)
    producer = {o: n for n in g.node for o in n.output if o}

    def length(n: onnx.NodeProto) -> int:
        s = [shapes.get(i) for i in n.input]
        known = lambda dims: dims is not None and all(d for d in dims)   # noqa: E731
        op = n.op_type
        if op in ("Conv", "ConvTranspose") and len(s) > 1 and known(s[1]):
            return int(math.prod(s[1][1:]) if op == "Conv" else s[1][0] * math.prod(s[1][2:]))
        if op in ("MatMul", "Gemm") and known(s[0]):
            return int(s[0][-2] if op == "Gemm" and _attr(n, "transA", 0) else s[0][-1])
        if op in ("GlobalAveragePool", "GlobalLpPool", "InstanceNormalization") and known(s[0]):
            return int(math.prod(s[0][2:]))
        if op in ("AveragePool", "LpPool"):
            return int(math.prod(_attr(n, "kernel_shape", [1])))
        if op.startswith("Reduce") and op not in ("ReduceMax", "ReduceMin") and known(s[0]):
            axes = _attr(n, "axes") or (list(consts[n.input[1]]) if len(n.input) > 1 and n.input[1] in consts else None)
            return int(math.prod(s[0][a] for a in axes) if axes else math.prod(s[0]))
        if op in ("Softmax", "LogSoftmax", "LayerNormalization") and known(s[0]):
            ax = int(_attr(n, "axis", -1))
            return int(math.prod(s[0][ax:]) if op == "LayerNormalization" else s[0][ax])
        return 1

    red: dict[str, tuple[int, str, str]] = {}     # tensor -> (longest reduction upstream, its op, its output)
    f16: dict[str, bool] = {i.name: i.data_type == TensorProto.FLOAT16 for i in g.initializer}
    for n in g.node:       # the normaliser sorts the graph: producers come first
        up = max([red.get(i, (1, "", "")) for i in n.input if i] + [(1, "", "")])
        mine = (length(n), n.op_type, n.output[0])
        half = any(f16.get(i, False) or types.get(i) == TensorProto.FLOAT16 for i in n.input if i) \
            or (n.op_type == "Cast" and _attr(n, "to") == TensorProto.FLOAT16)
        for o in n.output:
            red[o] = max(up, mine)
            f16[o] = half or types.get(o) == TensorProto.FLOAT16

    def scale(name: str) -> tuple[str, str | None]:
        seen = name
        for _ in range(64):
            n = producer.get(seen)
            if n is None or n.op_type not in MOVING:
                break
            seen = n.input[0]
        n = producer.get(seen)
        if n is not None and n.op_type in SQUASH:
            return n.input[0], n.op_type
        return name, None

    names = [o.name for o in g.output]
    longest = {o: red.get(o, (1, "", o)) for o in names}
    return Facts(names=names, reduction={o: v[0] for o, v in longest.items()},
                 reduction_op={o: v[1] for o, v in longest.items()},
                 reduced={o: v[2] or o for o, v in longest.items()},
                 fp16={o: f16.get(o, False) for o in names}, scale_of={o: scale(o) for o in names},
                 ties=_ties(g, producer, shapes, names),
                 given={i.name for i in g.input} | {i.name for i in g.initializer})


def _ties(g: onnx.GraphProto, producer: dict, shapes: dict, names: Sequence[str]) -> list[Tie]:
    """Outputs that follow a TopK's order (through ops that keep its rows) or an ArgMax's choice."""
    out = []
    for name in names:
        tie = _trace(name, producer, shapes)
        if tie is not None:
            tie.output = name
            out.append(tie)
    return out


def _rank(shapes: dict, name: str) -> int | None:
    s = shapes.get(name)
    return None if s is None else len(s)


def _trace(name: str, producer: dict, shapes: dict, depth: int = 0) -> Tie | None:
    """The Tie whose rows ``name`` follows, with its row axis in ``name``; None when it follows
    none (or through ops this does not follow)."""
    n = producer.get(name)
    if n is None or depth > 32:
        return None
    r = _rank(shapes, name)
    if n.op_type == "TopK" and name == n.output[1]:
        rank = _rank(shapes, n.input[0]) or 1
        axis = int(_attr(n, "axis", -1)) % rank
        k = (shapes.get(name) or [None] * rank)[axis]
        return Tie("", "topk", n.input[0], axis, int(k or 0), bool(_attr(n, "largest", 1)), axis)
    if n.op_type in ("ArgMax", "ArgMin"):
        rank = _rank(shapes, n.input[0]) or 1
        return Tie("", n.op_type.lower(), n.input[0], int(_attr(n, "axis", 0)) % rank,
                   keepdims=bool(_attr(n, "keepdims", 1)))
    if r is None:
        return None
    if n.op_type in ("Gather", "GatherElements") and len(n.input) > 1:
        tie = _trace(n.input[1], producer, shapes, depth + 1)
        if tie is None or tie.kind != "topk":
            return None
        gax = int(_attr(n, "axis", 0)) % (_rank(shapes, n.input[0]) or 1)
        tie.out_axis = gax + tie.out_axis if n.op_type == "Gather" else tie.out_axis
        return tie
    if n.op_type in RESHAPING:
        tie = _trace(n.input[0], producer, shapes, depth + 1)
        if tie is None or tie.kind != "topk":
            return None
        axis = _same_row(shapes.get(n.input[0]), shapes.get(name), tie.out_axis)
        if axis is None:
            return None
        tie.out_axis = axis
        return tie
    if n.op_type in ELEMENTWISE:
        for i in n.input:
            tie = _trace(i, producer, shapes, depth + 1) if i else None
            ri = _rank(shapes, i) if i else None
            if tie is not None and tie.kind == "topk" and ri is not None:
                tie.out_axis += r - ri     # broadcasting aligns the last axes
                return tie
    return None


def _same_row(before: list | None, after: list | None, axis: int) -> int | None:
    """Where axis ``axis`` of a tensor shaped ``before`` is once reshaped to ``after``, when the
    reshape only adds or drops axes of 1 (Squeeze, Unsqueeze, a Reshape/Flatten of that kind)."""
    if not before or not after or None in before or None in after or not 0 <= axis < len(before):
        return None
    if [d for d in before if d != 1] != [d for d in after if d != 1] or before[axis] == 1:
        return None
    nth = sum(1 for d in before[:axis] if d != 1)
    return [j for j, d in enumerate(after) if d != 1][nth]


def _largest(runs: Sequence[Mapping[str, np.ndarray]], tensor: str) -> float:
    """The largest finite |value| of ``tensor`` over onnxruntime's runs (0 for none)."""
    vals = [np.asarray(r[tensor]) for r in runs if tensor in r]
    return max((float(np.max(np.abs(v[np.isfinite(v)]), initial=0.0)) for v in vals
                if np.issubdtype(v.dtype, np.number)), default=0.0)


def rounding_noise(model: onnx.ModelProto, seed: int = 1) -> onnx.ModelProto:
    """A copy of ``model`` in which every op that rounds (not in :data:`EXACT`) has each float32
    output multiplied by 1 + r, r uniform in [-u, u] per element: one rounding error per op, drawn
    by onnxruntime's RandomUniformLike with fixed seeds (the same promise on every compile)."""
    try:
        g = onnx.shape_inference.infer_shapes(model).graph
    except Exception:
        g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for n in out.graph.node:
        nodes.append(n)
        if n.op_type in EXACT or n.domain not in ("", "ai.onnx"):
            continue
        for j, o in enumerate(n.output):
            if not o or types.get(o) != TensorProto.FLOAT:
                continue
            n.output[j] = exact = f"{o}#exact"
            nodes += [onnx.helper.make_node("RandomUniformLike", [exact], [f"{o}#r"], low=-U32, high=U32,
                                            seed=float(seed * 100003 + len(nodes))),
                      onnx.helper.make_node("Mul", [exact, f"{o}#r"], [f"{o}#d"]),
                      onnx.helper.make_node("Add", [exact, f"{o}#d"], [o])]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


# One requantization in this many rounds a step the other way in requant_flips: a quantized layer
# alone on ACL (fixed-point requantization) against onnxruntime's float one is within a step on
# every element and equal on 95% or more (tests/agent/test_quantized_orders.py).
FLIP_RATE = 0.05


def constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """{tensor name: its value} for a model's constants: initializers and Constant nodes' values."""
    out = {i.name: i for i in model.graph.initializer}
    out.update({n.output[0]: n.attribute[0].t for n in model.graph.node
                if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    return out


def requant_flips(model: onnx.ModelProto, rate: float = FLIP_RATE, seed: int = 1) -> onnx.ModelProto:
    """A copy of a QDQ ``model`` in which each QuantizeLinear's input moves by one of its steps,
    up or down, on a ``rate`` fraction of its elements (onnxruntime's RandomUniformLike, fixed
    seeds): another implementation's roundings, whose drift through the following layers is what
    an INT8 order's probe allows (tandoor_contract.probe.drift). Per-tensor activations only: a
    constant's QuantizeLinear (a weight) and per-axis ones stay as they are."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    consts = constants(out)
    nodes = []
    for n in out.graph.node:
        scale = consts.get(n.input[1]) if n.op_type == "QuantizeLinear" and len(n.input) > 1 else None
        if (n.op_type == "QuantizeLinear" and n.domain in ("", "ai.onnx") and n.input[0] not in consts
                and scale is not None and int(np.prod(scale.dims)) == 1):
            x, t = n.input[0], f"{n.input[0]}#flip{len(nodes)}"
            h = onnx.helper.make_node
            nodes += [h("RandomUniformLike", [x], [t + "u"], low=0.0, high=1.0, seed=float(seed * 100003 + len(nodes))),
                      h("RandomUniformLike", [x], [t + "v"], low=-1.0, high=1.0, seed=float(seed * 100003 + len(nodes) + 1)),
                      h("Constant", [], [t + "r"], value=onnx.helper.make_tensor("r", TensorProto.FLOAT, [], [rate])),
                      h("Less", [t + "u", t + "r"], [t + "m"]), h("Cast", [t + "m"], [t + "mf"], to=TensorProto.FLOAT),
                      h("Sign", [t + "v"], [t + "s"]), h("Mul", [t + "mf", t + "s"], [t + "f"]),
                      h("Mul", [t + "f", n.input[1]], [t + "d"]), h("Add", [x, t + "d"], [t + "x"])]
            n.input[0] = t + "x"
        nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _spread(runs: Sequence[Mapping[str, np.ndarray]], output: str, free: Sequence[np.ndarray | None]) -> float | None:
    """The largest change of ``output`` in the noisy runs (:class:`Reference` with ``noisy``),
    over the elements no tie makes arbitrary (``free[k]``: run k's, from :func:`ties`): a rounding
    that reorders tied TopK rows says nothing about how far the values may move, and counting it
    made a detector's promise as wide as its coordinates (atol 6650 on a YOLO end-to-end head)."""
    spreads = []
    for r, f in zip(runs, free):
        if output + NOISY not in r or output not in r or not np.issubdtype(np.asarray(r[output]).dtype, np.floating):
            continue
        a, b = np.asarray(r[output], np.float64).reshape(-1), np.asarray(r[output + NOISY], np.float64).reshape(-1)
        if a.shape != b.shape:
            continue
        keep = np.isfinite(a) & np.isfinite(b)
        if f is not None:
            keep[f] = False
        spreads.append(float(np.max(np.abs(b - a)[keep], initial=0.0)))
    return max(spreads) if spreads else None


def promise(facts: Facts, runs: Sequence[Mapping[str, np.ndarray]],
            tied: Sequence[Mapping[str, np.ndarray]] | None = None) -> dict:
    """The manifest's ``tolerance`` (see the module doc) from the facts and onnxruntime's runs
    (with the noisy outputs when :class:`Reference` ran with ``noisy``); ``tied``: :func:`ties` of
    each run when the caller has them already."""
    base = agreement.DEFAULT
    outputs = {}
    tied = [ties(facts, r) for r in runs] if tied is None else tied
    for o in facts.names:
        u = U16 if facts.fp16[o] else U32
        L = facts.reduction[o]
        t, squash = facts.scale_of[o]
        slope, cap = SQUASH.get(squash, (1.0, math.inf))
        slope = 1.0 if slope is None else slope
        # rounding scales with the values summed: the output's own (its squashing op's input's), or
        # what its longest reduction made, which a later subtraction may have cancelled
        summed = _largest(runs, facts.reduced[o])
        own = _largest(runs, t)
        scale = max(own, summed)
        spread = _spread(runs, o, [t.get(o) for t in tied])
        err = min(cap, SAFETY * max(u * math.sqrt(L) * slope * scale, spread or 0.0))
        why = (f"{'fp16' if facts.fp16[o] else 'fp32'} upstream, longest reduction {L}"
               + (f" ({facts.reduction_op[o]}) making values up to {summed:.3g}" if L > 1 else "")
               + (f", {squash} of values up to {own:.3g}" if squash else f", values up to {own:.3g}")
               + (f", one rounding per op moving it by {spread:.3g}" if spread else ""))
        if squash and err >= cap:
            why += f": rounding alone decides this {squash}, any value in its range is right"
        outputs[o] = {"atol": float(max(base["atol"], err)), "rtol": base["rtol"], "why": why}
    return {"atol": max([base["atol"]] + [e["atol"] for e in outputs.values()]), "rtol": base["rtol"],
            "outputs": outputs}


def ties(facts: Facts, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{output: flat indices a tie makes arbitrary} for one run (``values``: onnxruntime's outputs
    and :attr:`Facts.extra` by name); outputs without such elements are left out."""
    out = {}
    for t in facts.ties:
        if t.output not in values or t.node_input not in values:
            continue
        shape = np.shape(values[t.output])
        if t.kind == "topk":
            free = _topk_free(np.asarray(values[t.node_input], np.float64), t)
            if free is None:
                continue
            if math.prod(free.shape[:-1]) == 1:      # one set of rows: broadcast over the other axes
                if not 0 <= t.out_axis < len(shape) or shape[t.out_axis] != free.shape[-1]:
                    continue
                rows = [1] * len(shape)
                rows[t.out_axis] = free.shape[-1]
                mask = np.broadcast_to(free.reshape(rows), shape)
            elif np.moveaxis(free, -1, t.out_axis).shape == tuple(shape):
                mask = np.moveaxis(free, -1, t.out_axis)
            else:
                continue
        else:
            x = np.asarray(values[t.node_input], np.float64)
            best = x.max(axis=t.axis, keepdims=True) if t.kind == "argmax" else x.min(axis=t.axis, keepdims=True)
            near = np.abs(x - best) <= TIE_ATOL + TIE_RTOL * np.abs(best)
            mask = near.sum(axis=t.axis, keepdims=t.keepdims) > 1
            if mask.size != math.prod(shape):
                continue
        idx = np.flatnonzero(mask.reshape(-1))
        if idx.size:
            out[t.output] = idx.astype(np.int64)
    return out


def _topk_free(x: np.ndarray, t: Tie) -> np.ndarray | None:
    """Per TopK row position (the last axis of the result), whether a tie makes it
    arbitrary: its score ties with a neighbour's, or the k-th score ties with the (k+1)-th."""
    x = np.moveaxis(x, t.axis, -1)
    if t.k <= 0 or t.k > x.shape[-1]:
        return None
    s = -np.sort(-x, axis=-1) if t.largest else np.sort(x, axis=-1)
    s = s[..., : t.k + 1]
    close = np.abs(np.diff(s, axis=-1)) <= TIE_ATOL + TIE_RTOL * np.abs(s[..., 1:])   # (.., k) pairs j, j+1
    free = np.zeros(s.shape, bool)
    free[..., :-1] |= close
    free[..., 1:] |= close
    return free[..., : t.k]


class Reference:
    """onnxruntime on the model, showing :attr:`Facts.extra` beside the outputs: ``run`` gives the
    outputs, and ``last`` every shown tensor by name (for :func:`ties` and :func:`promise`)."""

    def __init__(self, model: onnx.ModelProto, facts: Facts | None = None, noisy: bool = False):
        """``noisy``: ``run`` also runs :func:`rounding_noise`'s copy and shows its outputs as name + NOISY
        (what :func:`promise` measures the spread by; one more onnxruntime run per call: 0.4 s more
        for EfficientNet-Lite0's two golden pairs, 0.7 s for M-LSD's)."""
        import onnxruntime as ort

        self.facts = facts or analyse(model)
        shown = onnx.ModelProto()
        shown.CopyFrom(model)
        for name in self.facts.extra:
            shown.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.session = ort.InferenceSession(shown.SerializeToString(), so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.noisy = None
        if noisy:
            try:
                self.noisy = ort.InferenceSession(rounding_noise(model).SerializeToString(), so,
                                                  providers=["CPUExecutionProvider"])
            except Exception:    # no spread measured: the promise falls back to the reduction's rule
                self.noisy = None
        self.last: dict[str, np.ndarray] = {}

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        got = self.session.run(None, dict(feeds))
        self.last = {**{k: np.asarray(v) for k, v in feeds.items()}, **dict(zip(self.names, (np.asarray(a) for a in got)))}
        if self.noisy is not None:
            try:
                moved = self.noisy.run(self.facts.names, dict(feeds))
            except Exception:    # as above: the reduction's rule alone, never a failed compile
                self.noisy = None
            else:
                self.last.update({n + NOISY: np.asarray(a) for n, a in zip(self.facts.names, moved)})
        return [self.last[n] for n in self.facts.names]
