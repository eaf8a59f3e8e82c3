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
tandoor_agent.run.board.configure_tvm_threads() sets both before TVM's pool starts.
"""

from __future__ import annotations

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


def host_target(target: dict) -> dict:
    """The host's LLVM target with its CPU named. A bare {"kind": "llvm"} means generic x86-64
    (SSE2, no FMA): half this machine's vector width and no fused multiply-add. On x86 the CPU
    becomes x86-64-v3 (AVX2 + FMA, any x86 since 2013) when this machine has it, so a host lib still
    runs on other modern workstations; elsewhere the system CPU. Targets that name a triple or a
    CPU (the board presets) are returned as they are."""
    if target.get("mtriple") or target.get("mcpu"):
        return target
    import platform

    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu() or "")
    if not cpu or cpu == "generic":
        return target
    if platform.machine() in ("x86_64", "AMD64"):
        native = tvm.target.Target({**target, "mcpu": cpu})
        if all(codegen.llvm_cpu_has_features(f, native) for f in ("avx2", "fma")):
            return {**target, "mcpu": "x86-64-v3"}
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


class ConvNHWC(_SafeRule):
    """One 7-axis reduction block (n, h, w, co | kh, kw, ci), pads before it, injective epilogue."""

    CI = (8, 4, 2)          # output channels per tile (8 floats: one AVX2 / two NEON registers)
    WI = (8, 7, 4, 2)       # output pixels per tile, largest that divides W and fits the registers

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        convs = [b for b in blocks if _kinds(sch, b) == "SSSSRRR"]
        if len(convs) != 1:
            return None
        conv = convs[0]
        k = _index(sch, blocks, conv)
        pre, post = blocks[:k], blocks[k + 1:]
        if any("R" in _kinds(sch, b) for b in pre + post):
            return None
        for b in pre:               # padding: read straight from the input inside the tile
            sch.compute_inline(b)
        for b in post[:-1]:         # bias, clip, residual add ... -> one epilogue block
            sch.compute_inline(b)
        n, h, w, co, rh, rw, rc = sch.get_loops(conv)
        W, CO = _extent(sch, w), _extent(sch, co)
        if W is None or CO is None:
            return None
        lanes, regs = vector_regs(target)
        ci = _divisor(CO, self.CI)
        per_pixel = max(1, -(-ci // lanes))
        wi = next((d for d in self.WI if W % d == 0 and d * per_pixel <= regs - 4), 1)
        wo, wii = sch.split(w, [None, wi])
        coo, coi = sch.split(co, [None, ci])
        sch.reorder(n, h, wo, coo, rh, rw, rc, wii, coi)
        if post:
            sch.reverse_compute_at(post[-1], coo)
            sch.vectorize(sch.get_loops(post[-1])[-1])
        sch.parallel(sch.fuse(n, h))
        sch.unroll(wii)
        sch.vectorize(coi)
        init = sch.decompose_reduction(conv, rh)
        sch.vectorize(sch.get_loops(init)[-1])
        return sch


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
        if post:
            sch.reverse_compute_at(post[-1], jo)
            sch.vectorize(sch.get_loops(post[-1])[-1])
        sch.parallel(sch.fuse(*spatial[:-1], jo))
        sch.vectorize(ji)
        init = sch.decompose_reduction(block, reduce[0])
        sch.vectorize(sch.get_loops(init)[-1])
        return sch


class Elementwise(_SafeRule):
    """Spatial-only functions: producers inlined, loops fused, split into parallel x vector."""

    def _apply(self, sch, target):
        blocks = _blocks(sch)
        if any("R" in _kinds(sch, b) for b in blocks):
            return None
        for b in blocks[:-1]:
            try:
                sch.compute_inline(b)
            except Exception:
                pass
        for b in _blocks(sch):
            loops = sch.get_loops(b)
            if not loops:
                continue
            fused = sch.fuse(*loops)
            n = _extent(sch, fused)
            if n is None or n < 64:
                continue
            outer, inner = sch.split(fused, [None, _divisor(n, (64, 32, 16, 8))])
            sch.parallel(outer)
            sch.vectorize(inner)
        return sch


class _Guarded(ScheduleRule):
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
    return [ConvNHWC(), InnerSpatialReduction(), _Guarded(dl.cpu.GEMV()), _Guarded(dl.cpu.Reduction()), Elementwise()]


def cpu_pipeline(target: tvm.target.Target):
    """relax.get_default_pipeline(target) for CPUs plus the TVM-side conv layout and the rules
    above between fusion and lowering. A drop-in `relax_pipeline` for tvm.compile."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="TandoorCPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(
                [relax.transform.ConvertLayout({"relax.nn.conv2d": TVM_CONV_LAYOUT}),
                 relax.transform.FoldConstant()]
                + cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [dl.ApplyDefaultSchedule(*rules())]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline
