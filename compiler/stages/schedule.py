"""CPU schedules for the TVM side: what makes TVM-only code fast enough without MetaSchedule.

TVM 0.27's default CPU pipeline (relax.get_default_pipeline) legalises and fuses ops but leaves
every PrimFunc as naive single-threaded scalar loops: EfficientNet-Lite0 takes ~150-190 ms on this
2-core x86 host against onnxruntime's ~16 ms. MetaSchedule segfaults in this wheel and dlight's
CPU rules only cover GEMV and row reductions. So here are three small rule-based schedules
(dlight ScheduleRules, no tuning), measured in docs/benchmarks.md:

* ConvNHWC - conv2d (regular, depthwise, grouped) in NHWC with HWIO kernels: an output tile of
  `wi` pixels x `ci` channels is accumulated in registers over (kh, kw, cin) with the channel axis
  vectorised; bias/activation/residual epilogues are fused into the tile's store; the (n, h) loop
  runs in parallel. The kernel layout matters: OHWI (what ACL wants) puts the vectorised output
  channel on the slowest axis; HWIO makes it contiguous, so the pipeline converts TVM-side convs
  to HWIO (the weights are constants, FoldConstant transposes them at compile time).
* InnerSpatialReduction - matmul with [K, N] weights, pooling, means over H and W: the reduction
  moved outside the last spatial axis, which is vectorised, tiles in parallel.
* Elementwise - spatial-only functions (transposes, adds, activations): fused, parallel, vectorised.

A rule that does not apply (or fails) leaves the function to the next one; anything no rule takes
keeps TVM's default loops, so correctness never depends on these rules matching.

Threads are the runtime's business, not the library's: TVM's pool uses TVM_NUM_THREADS and counts
1 on a 2-vCPU VM when it is unset, and bound workers stall under load (TVM_BIND_THREADS=0 helps);
tandoor_agent.run.board.configure_tvm_threads() sets both (and lets idle workers spin only when the cores are not shared)
before TVM's pool starts.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.base import ScheduleRule

#: Conv kernel layout of the TVM side (ACL's orders keep OHWI; they are made before this).
TVM_CONV_LAYOUT = ["NHWC", "HWIO"]


def vector_regs(target: tvm.target.Target) -> tuple[int, int]:
    """(float32 lanes per vector register, vector registers) for an LLVM target."""
    attrs = target.attrs or {}
    mtriple = str(attrs.get("mtriple", "") or "")
    if mtriple.startswith(("aarch64", "arm64")):
        return 4, 32                                   # NEON: 32 x 128-bit
    if mtriple.startswith("arm"):
        return 4, 16
    try:
        from tvm.target import codegen

        if codegen.llvm_cpu_has_features("avx512f", target):
            return 16, 32
        if codegen.llvm_cpu_has_features("avx2", target) or codegen.llvm_cpu_has_features("avx", target):
            return 8, 16
    except Exception:
        pass
    return 4, 16                                       # SSE2, the generic x86-64 baseline


#: x86-64 micro-architecture levels, best first, with the features that define them for our kernels
X86_LEVELS = (("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma")),
              ("x86-64-v3", ("avx2", "fma")))


def host_target(target: dict) -> dict:
    """The host's LLVM target with its CPU named. A bare {"kind": "llvm"} means generic x86-64
    (SSE2, no FMA): a quarter of an AVX-512 machine's vector width and no fused multiply-add. On
    x86 the CPU becomes the highest x86-64 level this machine has: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)
    or x86-64-v3 (AVX2 + FMA, any x86 since 2013), levels rather than this CPU's model so the host
    lib runs on any workstation of that level; elsewhere the system CPU. onnxruntime picks its
    AVX-512 kernels at run time on the same machine: on a 1x1 conv the AVX2 build peaks at half its
    speed (docs/benchmarks.md). Targets that name a triple or a CPU (the board presets) are
    returned as they are."""
    if target.get("mtriple") or target.get("mcpu"):
        return target
    import platform

    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu() or "")
    if not cpu or cpu == "generic":
        return target
    if platform.machine() in ("x86_64", "AMD64"):
        native = tvm.target.Target({**target, "mcpu": cpu})
        for level, features in X86_LEVELS:
            if all(codegen.llvm_cpu_has_features(f, native) for f in features):
                return {**target, "mcpu": level}
        return target
    return {**target, "mcpu": cpu}


# --- rules ---------------------------------------------------------------------------------------

def _kinds(sch, block) -> str:
    return "".join("S" if int(iv.iter_type) == 0 else "R" for iv in sch.get(block).iter_vars)


def _extent(sch, loop) -> int | None:
    e = sch.get(loop).extent
    return int(e) if isinstance(e, tirx.IntImm) else None


def _divisor(n: int, candidates) -> int:
    return next((c for c in candidates if n % c == 0), 1)


def _blocks(sch):
    return sch.get_child_blocks(sch.get_sblock("root"))


def _pads(sch, block) -> bool:
    """A block that writes a larger tensor than it reads (a padding), not a same-shape copy."""
    st = sch.get(block)
    shapes = lambda regions: [[int(d) for d in reg.source.shape] for reg in regions]
    return any(w != r for w in shapes(st.writes) for r in shapes(st.reads))


def _index(sch, blocks, block) -> int:
    return [sch.get(b).same_as(sch.get(block)) for b in blocks].index(True)


class _SafeRule(ScheduleRule):
    """Any failure inside a rule means 'not applicable': the next rule (or no schedule) follows."""

    def apply(self, func, target, tunable):
        if not isinstance(func, tirx.PrimFunc):
            return None
        try:
            return self._apply(s_tir.Schedule(func), target)
        except Exception:
            return None

    def _apply(self, sch, target):
        raise NotImplementedError


PARTIAL_TILE = 0.5


def _vector_of(ci: int, lanes: int) -> int:
    """The vector a tile of `ci` channels is made of: the target's (a tile of three vectors is
    three vectors, never one 48-lane vector: LLVM scalarised those, 4 GF/s against 192), or the
    largest power of two dividing `ci` below it."""
    v = lanes
    while v > 1 and ci % v:
        v //= 2
    return v


def _vectorize_tail(sch, loop, vec: int) -> None:
    n = _extent(sch, loop) or 0
    if n == vec or n <= 1:
        sch.vectorize(loop)
    elif n % vec == 0:
        sch.vectorize(sch.split(loop, [None, vec])[1])


def conv_tile(width: int, channels: int, lanes: int, regs: int) -> tuple[int, int]:
    """(output channels, output pixels) of one register tile of a conv: `pixels` x
    `ceil(channels / lanes)` vector accumulators stay in registers while the reduction runs,
    leaving 4 registers for the weights and the broadcast input.

    The tile with the most useful accumulator lanes wins. Channel widths: one to four vectors
    that divide the channels, else one to four half vectors (AVX-512's 8-lane ymm), else 4 or 2.
    A row whose width the pixel count
    does not divide ends in a partial tile, whose predicate costs (measured: a 1x1 conv on
    40-pixel rows took 2.1x as long with 14-pixel tiles as with 10), so such a tile counts its real
    pixels' share, halved. Ties go to two vectors of channels (one weight load feeds `pixels`
    FMAs, one broadcast feeds two), then four, three, one."""
    acc = regs - 4
    widths = {v * lanes for v in (1, 2, 3, 4) if channels % (v * lanes) == 0}
    if lanes > 8:   # half vectors (AVX-512's ymm) where whole ones do not divide
        widths |= {v * 8 for v in (1, 2, 3, 4) if channels % (v * 8) == 0 and (v * 8) % lanes}
    widths = sorted(widths) or [_divisor(channels, (4, 2))]
    rank = {2: 0, 4: 1, 3: 2, 1: 3}
    best: tuple = (-1.0, 0, 0, 0)
    for ci in widths:
        v = ci // _vector_of(ci, lanes)
        for wi in range(1, max(min(width, acc // v), 1) + 1):
            used = width / (-(-width // wi) * wi)
            # a partial tile's predicate stays inside the reduction: up to 2x slower (1x1, W 40)
            lanes_used = wi * min(ci, v * lanes) / lanes * (1.0 if used == 1.0 else used * PARTIAL_TILE)
            best = max(best, (round(lanes_used, 6), -rank.get(v, 4), ci, wi))
    return best[2], best[3]


def _numel(sch, block) -> int:
    return int(np.prod([int(d) for d in sch.get(block).writes[0].source.shape]))


def _nhwc_conv(sch, block) -> bool:
    """(n, h, w, co | kh, kw, ci) writing out[n, h, w, co]: not an NCHW conv of the same shape
    (conv2d_transpose runs in NCHW on the TVM side, passes.legalise_for_tvm)."""
    st = sch.get(block)
    ivs = [iv.var for iv in st.iter_vars]
    out = [r.min for r in st.writes[0].region]
    if len(out) != 4 or not all(_is_var(e, v) for e, v in zip(out, ivs[:4])):
        return False
    # the kernel is [kh, kw, ci, co] (HWIO): some 4-D read runs along co
    return any(len(r.region) == 4 and _is_var(r.region[-1].min, ivs[3]) for r in st.reads)


class ConvNHWC(_SafeRule):
    """One 7-axis reduction block (n, h, w, co | kh, kw, ci), pads before it, injective epilogue.

    An epilogue that writes a larger tensor than the conv (squeeze-excite: the 1x1-spatial conv's
    hard-sigmoid times the block's feature map, which FuseOps fuses in) is not computed per
    register tile: the conv's own epilogue (bias, activation) stays at the tile and the broadcast
    product is one vectorised pass over the big tensor (160x160x96: 2.3 ms -> ~0.1 ms)."""

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        convs = [b for b in blocks if _kinds(sch, b) == "SSSSRRR"]
        if len(convs) != 1 or not _nhwc_conv(sch, convs[0]):
            return None
        conv = convs[0]
        k = _index(sch, blocks, conv)
        pre, post = blocks[:k], blocks[k + 1:]
        if any("R" in _kinds(sch, b) for b in pre + post):
            return None
        n, h, w, co, rh, rw, rc = sch.get_loops(conv)
        for b in pre:
            self.prologue(sch, b, target, _extent(sch, rc) or 1)
        size = _numel(sch, conv)
        tile_post = [b for b in post if _numel(sch, b) == size]
        wide_post = [b for b in post if _numel(sch, b) != size]
        if post != tile_post + wide_post:
            return None
        for b in tile_post[:-1] + wide_post[:-1]:   # bias, clip, residual add ... -> one block each
            sch.compute_inline(b)
        post = tile_post[-1:]
        n, h, w, co, rh, rw, rc = sch.get_loops(conv)
        W, CO = _extent(sch, w), _extent(sch, co)
        if W is None or CO is None:
            return None
        lanes, regs = vector_regs(target)
        ci, wi = self.tile(W, CO, lanes, regs)
        vec = _vector_of(ci, lanes)
        wo, wii = sch.split(w, [None, wi])
        coo, cob, coi = sch.split(co, [None, ci // vec, vec])
        # Weights bigger than the input (deep, small layers: 28x28x192 -> 13x13x384 3x3 has 2.6 MB
        # of them): each channel tile's weights stay in cache across all rows instead of all the
        # weights streaming past once per row (measured cold: 2713 -> 1493 us, onnxruntime 1356).
        st = sch.get(conv)
        ins = [r.source for r in st.reads if len(r.source.shape) == 4]
        in_elems = int(np.prod([int(d) for d in ins[0].shape])) if ins else 0
        _, _, _, _, KH, KW, RC = (int(iv.dom.extent) for iv in st.iter_vars)
        co_outer = KH * KW * RC * CO > in_elems
        if co_outer:
            sch.reorder(n, coo, h, wo, rh, rw, rc, wii, cob, coi)
        else:
            sch.reorder(n, h, wo, coo, rh, rw, rc, wii, cob, coi)
        if post:
            sch.reverse_compute_at(post[-1], wo if co_outer else coo)
            _vectorize_tail(sch, sch.get_loops(post[-1])[-1], vec)
        sch.parallel(sch.fuse(n, coo, h) if co_outer else sch.fuse(n, h))
        sch.unroll(wii)
        sch.unroll(cob)
        sch.vectorize(coi)
        init = sch.decompose_reduction(conv, rh)
        _vectorize_tail(sch, sch.get_loops(init)[-1], vec)
        if wide_post:
            _injective(sch, wide_post[-1], lanes)
        return sch

    @staticmethod
    def tile(width: int, channels: int, lanes: int, regs: int) -> tuple[int, int]:
        return conv_tile(width, channels, lanes, regs)

    def prologue(self, sch, block, target, reduce_channels: int) -> None:
        """A block before the conv: a copy (no padding) is read straight from the input inside the
        tile, and so is a depthwise conv's padding (one tap per channel vector: the border test is
        cheaper than a second pass over the input, 112x112x32 3x3: 160 vs 289 us). A conv that
        reduces over input channels gets its padding written out once, parallel and vectorised:
        tested inside the tile, the border kept LLVM from holding the accumulators in registers
        (40x40x64 3x3: 1224 -> 520 us, onnxruntime 528 us)."""
        if reduce_channels < 2 or not _pads(sch, block):
            sch.compute_inline(block)
            return
        loops = sch.get_loops(block)
        sch.parallel(sch.fuse(*loops[:-2]))
        sch.vectorize(sch.fuse(*loops[-2:]) if _extent(sch, loops[-1]) and _extent(sch, loops[-1]) < 8 else loops[-1])


class InnerSpatialReduction(_SafeRule):
    """One reduction block with iterators S..S R..R whose last spatial axis is wide (matmul with
    [K, N] weights, NHWC pooling, mean over H, W): reduction outside, last spatial axis vectorised."""

    TILE = (64, 32, 16, 8)

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        red = [b for b in blocks if "R" in _kinds(sch, b)]
        if len(red) != 1:
            return None
        block = red[0]
        kinds = _kinds(sch, block)
        ns = kinds.index("R")
        if ns < 1 or kinds[ns:] != "R" * (len(kinds) - ns):
            return None
        k = _index(sch, blocks, block)
        pre, post = blocks[:k], blocks[k + 1:]
        if any("R" in _kinds(sch, b) for b in pre + post):
            return None
        for b in pre:
            sch.compute_inline(b)
        for b in post[:-1]:
            sch.compute_inline(b)
        loops = sch.get_loops(block)
        spatial, reduce = loops[:ns], loops[ns:]
        J = _extent(sch, spatial[-1])
        if J is None or J < 8:
            return None
        jo, ji = sch.split(spatial[-1], [None, _divisor(J, self.TILE)])
        sch.reorder(*spatial[:-1], jo, *reduce, ji)
        # An epilogue that writes another shape than the reduction (a Pad after the pool: the
        # face-attribute ResNet's channel padding of its residual branch) does not follow the
        # reduction's tiles: computed at them, TVM 0.27 writes only the part those tiles cover
        # and the padded channels hold garbage (max abs err 48.7). It gets a loop nest of its own.
        apart = bool(post) and _shape(sch.get(post[-1]).writes[0].source) != _shape(sch.get(block).writes[0].source)
        if post and not apart:
            sch.reverse_compute_at(post[-1], jo)
            sch.vectorize(sch.get_loops(post[-1])[-1])
        sch.parallel(sch.fuse(*spatial[:-1], jo))
        sch.vectorize(ji)
        init = sch.decompose_reduction(block, reduce[0])
        sch.vectorize(sch.get_loops(init)[-1])
        if apart:
            _injective(sch, post[-1], vector_regs(target)[0])
        return sch


def _shape(buffer) -> list[int | None]:
    """A TIR buffer's shape (None for a symbolic dim)."""
    return [int(d) if isinstance(d, tirx.IntImm) else None for d in buffer.shape]


class ReductionPasses(_SafeRule):
    """Several blocks, reductions among them, each reducing over axes outside its output's
    innermost one (a softmax over channels of a [1, 16, 4, 2100] DFL head, normalisations): one
    parallel pass per block with that innermost axis vectorised and the reductions' loops moved
    outside it. dlight's Reduction rule took 4.6 ms for YOLOv8's DFL softmax, onnxruntime 0.96 ms.
    A reduction over the innermost axis is left to the next rule."""

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        if len(blocks) < 2 or not any("R" in _kinds(sch, b) for b in blocks):
            return None
        for b in blocks[:-1]:
            if "R" not in _kinds(sch, b):
                try:
                    sch.compute_inline(b)
                except Exception:
                    pass
        lanes, _ = vector_regs(target)
        plan = []
        for b in _blocks(sch):
            kinds = _kinds(sch, b)
            ns = kinds.count("S")
            st = sch.get(b)
            if ns < 1 or kinds != "S" * ns + "R" * (len(kinds) - ns) or not st.writes \
                    or not _is_var(st.writes[0].region[-1].min, st.iter_vars[ns - 1].var):
                return None
            plan.append((b, ns))
        for b, ns in plan:
            loops = sch.get_loops(b)
            spatial, reduce = loops[:ns], loops[ns:]
            v = _vector_width(_extent(sch, spatial[-1]) or 0, lanes)
            if v < 4:
                return None
            jo, ji = sch.split(spatial[-1], [None, v])
            sch.reorder(*spatial[:-1], jo, *reduce, ji)
            sch.parallel(sch.fuse(*spatial[:-1], jo))
            sch.vectorize(ji)
            if reduce:
                init = sch.decompose_reduction(b, reduce[0])
                sch.vectorize(sch.get_loops(init)[-1])
        return sch


def _vector_width(n: int, lanes: int) -> int:
    """Lanes for a loop of extent n: a whole number of vectors dividing it (up to 4), else the
    largest divisor of n up to four vectors (LLVM splits an odd width into vectors and a tail),
    else 1."""
    for v in (4 * lanes, 2 * lanes, lanes):
        if n % v == 0:
            return v
    return next((d for d in range(min(n, 4 * lanes), 3, -1) if n % d == 0), 1)


def _is_var(e, var) -> bool:
    return isinstance(e, tirx.Var) and e.same_as(var)


def _inner_contiguous(sch, block) -> bool:
    """The block's store moves along its innermost iterator (the last axis of what it writes)."""
    st = sch.get(block)
    last = st.iter_vars[-1].var
    return bool(st.writes) and _is_var(st.writes[0].region[-1].min, last)


def _concat_parts(sch, block) -> list[int] | None:
    """A concatenation along the innermost axis: the sizes of its inputs along that axis, in
    order, from the offsets of its reads (y[..., c] = if c >= 32: b[..., c - 32] ...)."""
    st = sch.get(block)
    last = st.iter_vars[-1].var
    total = int(st.iter_vars[-1].dom.extent)
    offsets = []
    from tvm.sym.analyzer import Analyzer

    ana = Analyzer()
    for r in st.reads:
        e = r.region[-1].min
        off = ana.simplify(e - last)
        if not isinstance(off, tirx.IntImm):
            return None
        offsets.append((-int(off), int(r.source.shape[-1])))
    starts = sorted(set(offsets))
    if len(starts) < 2 or starts[0][0] != 0:
        return None
    sizes = [b[0] - a[0] for a, b in zip(starts, starts[1:])] + [total - starts[-1][0]]
    return sizes if all(sz > 0 for sz in sizes) and sum(sizes) == total else None


class Elementwise(_SafeRule):
    """Spatial-only functions (activations, adds, slices, concats, transposes): producers
    inlined; per block the outer loops fused and parallel, the innermost axis kept whole and
    vectorised when the store runs along it. (Fusing every loop and cutting the fused index into
    vectors, as before, rebuilt each lane's 4-D index with div/mod: a slice + channel concat of
    80x80x48 took 789 us.) A concatenation along the innermost axis is first partitioned at its
    inputs' boundaries so that each piece is a plain copy without a select per element."""

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        if any("R" in _kinds(sch, b) for b in blocks):
            return None
        for b in blocks[:-1]:
            try:
                sch.compute_inline(b)
            except Exception:
                pass
        lanes, _ = vector_regs(target)
        for b in _blocks(sch):
            _injective(sch, b, lanes)
        return sch


def _injective(sch, b, lanes: int) -> None:
    """One spatial block: outer loops fused and parallel, the innermost vectorised along the
    store (partitioned first at a concatenation's boundaries)."""
    loops = sch.get_loops(b)
    if not loops:
        return
    if len(loops) > 1:
        outer = sch.fuse(*loops[:-1])
        if (_extent(sch, outer) or 0) > 1:
            sch.parallel(outer)
    inner = sch.get_loops(b)[-1]
    n = _extent(sch, inner) or 0
    if n < 4 or not _inner_contiguous(sch, b):
        return
    parts = _concat_parts(sch, b)
    pieces = sch.loop_partition(inner, [*parts[:-1], None]) if parts else [inner]
    for piece in pieces:
        m = _extent(sch, piece) or 0
        v = _vector_width(m, lanes) if m >= 4 else 1
        if v == m or (parts and m <= 16 * lanes):   # a partition's loop cannot be split
            sch.vectorize(piece)
        elif v > 1 and not parts:
            sch.vectorize(sch.split(piece, [None, v])[1])


class Guarded(ScheduleRule):
    """A rule of TVM's own (dlight) under the same promise: a failure is 'not applicable'. Its CPU
    Reduction rule raises ScheduleError on some multi-output reductions (BatchNormalization in
    training mode, from onnx's backend tests)."""

    def __init__(self, rule: ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception:
            return None


def rules() -> list[ScheduleRule]:
    return [ConvNHWC(), InnerSpatialReduction(), ReductionPasses(), Guarded(dl.cpu.GEMV()),
            Guarded(dl.cpu.Reduction()), Elementwise()]


def rule_name(rule: ScheduleRule) -> str:
    inner = getattr(rule, "rule", None)
    return f"dlight.{type(inner).__name__}" if inner is not None else type(rule).__name__


#: PrimFunc attribute naming the rule that scheduled it ("none": TVM's default loops), read by
#: `tandoor bench --kernels`
RULE_ATTR = "tandoor.rule"


@tvm.transform.module_pass(opt_level=0, name="TandoorSchedule")
class ApplyRules:
    """dlight's ApplyDefaultSchedule (first rule that applies wins), also recording the rule's
    name on each PrimFunc (RULE_ATTR). ``observe``, if given, gets {PrimFunc name: (the function
    as fusion left it, the rule's name)}: what `tandoor bench --kernels` reads patterns from."""

    def __init__(self, rule_list: list[ScheduleRule], observe=None) -> None:
        self.rules, self.observe = rule_list, observe

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        done, seen = {}, {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or int(func.attrs.get("tirx.is_scheduled", 0) if func.attrs else 0):
                continue
            target = (func.attrs.get("target") if func.attrs else None) or tvm.target.Target.current(allow_none=False)
            done[gv] = func.with_attr(RULE_ATTR, "none")
            for rule in self.rules:
                sch = rule.apply(func, target, False)
                if isinstance(sch, list):
                    sch = sch[0] if sch else None
                if sch is not None:
                    done[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr(RULE_ATTR, rule_name(rule))
                    break
        for gv, func in done.items():
            seen[gv.name_hint] = (mod[gv], str(func.attrs[RULE_ATTR]))
            mod[gv] = func
        if self.observe is not None:
            self.observe(seen)
        return mod


def _fast_sigmoid(x):
    from tvm import topi

    one = tirx.const(1.0, x.dtype)
    return topi.divide(one, topi.add(one, topi.fast_exp(topi.negative(x))))


@relax.expr_functor.mutator
class _FastExp(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or getattr(call.ty, "dtype", None) != "float32":
            return call
        if call.op.name == "relax.sigmoid":
            return self.builder_.call_te(_fast_sigmoid, call.args[0], primfunc_name_hint="sigmoid")
        if call.op.name == "relax.nn.softmax":
            from tvm import topi

            return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis),
                                         primfunc_name_hint="softmax")
        return call


@tvm.transform.module_pass(opt_level=0, name="TandoorFastExp")
def fast_exp(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """float32 sigmoid as 1 / (1 + exp(-x)) and softmax (topi.nn.fast_softmax) with TVM's
    polynomial exp (topi.fast_exp) instead of LLVM's exp, which x86 and NEON lower to one libm
    call per lane: a 1x1 conv with SiLU at 40x40x64 spent 390 of its 455 us there. The sigmoid's
    error is that of onnxruntime's own logistic or smaller (max abs 8.8e-8 vs 1.6e-7 on
    [-100, 100], against float64); fast_exp's relative error is below 4.1e-6."""
    m = _FastExp(mod)
    for gv, f in mod.functions_items():
        if isinstance(f, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(f))
    return m.builder_.get()


def _ints(a) -> list[int]:
    return [int(v) for v in a]


@relax.expr_functor.mutator
class _SubPixel(relax.PyExprMutator):
    """conv2d_transpose whose kernel equals its stride (no overlap: DBNet's and CenterFace's
    2x2 stride-2 upsamplers) as what it is: a 1x1 conv to kh*kw*Cout channels, then those
    channels spread over the kh x kw output pixels (a pixel shuffle). TVM's own conv2d_transpose
    inserts zeros between the input's pixels and convolves the result: for PP-OCRv4's detector
    36 ms against onnxruntime's 4 ms. Transposes that meet their inverse cancel."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.name == "relax.permute_dims":
            return self._permute(call)
        if call.op.name == "relax.nn.conv2d_transpose":
            new = self._conv_transpose(call)
            return call if new is None else new
        return call

    def _permute(self, call):
        axes = _ints(call.attrs.axes) if call.attrs.axes is not None else None
        inner = call.args[0]
        bound = self.lookup_binding(inner) if isinstance(inner, relax.Var) else None
        if axes is None or not (isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op)
                                and bound.op.name == "relax.permute_dims" and bound.attrs.axes is not None):
            return call
        first = _ints(bound.attrs.axes)
        composed = [first[a] for a in axes]
        if composed == list(range(len(composed))):
            return bound.args[0]
        return relax.op.permute_dims(bound.args[0], composed)

    def _conv_transpose(self, call):
        a = call.attrs
        x, w = call.args
        try:
            cin, cout, kh, kw = (int(d) for d in w.ty.shape.values)
            shape = [int(d) for d in x.ty.shape.values]
        except Exception:
            return None
        layout = str(a.data_layout)
        if (str(a.kernel_layout) != "IOHW" or str(a.out_layout) != layout or layout not in ("NCHW", "NHWC")
                or int(a.groups) != 1 or _ints(a.strides) != [kh, kw] or any(_ints(a.padding))
                or any(_ints(a.output_padding)) or _ints(a.dilation) != [1, 1]):
            return None
        n, h, wd = (shape[0], shape[2], shape[3]) if layout == "NCHW" else shape[:3]
        bb = self.builder_
        xn = bb.emit(self._permute(relax.op.permute_dims(x, [0, 2, 3, 1]))) if layout == "NCHW" else x
        k = bb.emit(relax.op.reshape(relax.op.permute_dims(w, [2, 3, 1, 0]), [kh * kw * cout, 1, 1, cin]))
        z = bb.emit(relax.op.nn.conv2d(xn, k, data_layout="NHWC", kernel_layout="OHWI", out_dtype=str(call.ty.dtype)))
        z = bb.emit(relax.op.reshape(z, [n, h, wd, kh, kw, cout]))
        z = bb.emit(relax.op.permute_dims(z, [0, 1, 3, 2, 4, 5]))
        y = relax.op.reshape(z, [n, h * kh, wd * kw, cout])
        return relax.op.permute_dims(bb.emit(y), [0, 3, 1, 2]) if layout == "NCHW" else y


@tvm.transform.module_pass(opt_level=0, name="TandoorSubPixel")
def sub_pixel(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    m = _SubPixel(mod)
    for gv, f in mod.functions_items():
        if isinstance(f, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(f))
    return relax.transform.DeadCodeElimination()(m.builder_.get())


def prepare_passes() -> list:
    """Before TVM's own CPU passes: every binding that is used only inside its dataflow block made a
    dataflow var (the partitioner's inlined regions leave each composite's result as a block output,
    and FuseOps never fuses across one: a conv's hard-swish or SiLU ran as a kernel of its own,
    writing and re-reading the whole tensor), the TVM-side conv layout with its kernels folded, and
    sigmoid and softmax with a vectorisable exp."""
    return [relax.transform.CanonicalizeBindings(),
            sub_pixel,
            relax.transform.ConvertLayout({"relax.nn.conv2d": TVM_CONV_LAYOUT}),
            relax.transform.FoldConstant(),
            fast_exp]


def cpu_pipeline(target: tvm.target.Target, observe=None):
    """relax.get_default_pipeline(target) for CPUs plus the TVM-side conv layout and the rules
    above between fusion and lowering. A drop-in `relax_pipeline` for tvm.compile. ``observe``
    (optional): see ApplyRules."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="TandoorCPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(
                prepare_passes()
                + cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [ApplyRules(rules(), observe)]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline
