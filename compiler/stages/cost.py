"""How much work each op does, and whether a delegated subgraph pays for its boundary.

Per subgraph the model estimates its time on TVM and on each executor from FLOPs and bytes per
op and a per-target table of effective rates (a roofline: max(flops / GFLOP/s, bytes / GB/s) plus
a per-kernel overhead), and the bridge cost of delegating it: one call into the executor plus the
bytes crossing the boundary at copy bandwidth (tensors TVM would otherwise have kept fused in
registers are written and read back). A subgraph is kept only when its gain beats its boundary:

    gain = t_tvm - t_exec > t_bridge

which is the architecture's p > p_min with p = t_tvm / T_model, s_e = t_tvm / t_exec and
c_o = t_bridge / T_model:  S = 1 / ((1 - p) + p / s_e + c_o) > 1  <=>  p > c_o * s_e / (s_e - 1).
Both forms are recorded in the manifest (partitions[].est) so `tandoor inspect` shows the numbers.

Measured profiles (`tandoor profile`, compiler/stages/profile.py) replace the estimates subgraph by
subgraph: `decide()` takes measured microseconds where it has them.

The rate table: x86_64 rows are measured on the development host (2-core AMD EPYC, AVX2, see
docs/benchmarks.md); aarch64 rows are assumptions for a 4x Cortex-A76 board until a profile
measured on the board replaces them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import tvm
from tvm import relax

from ..backends import acl
from tandoor_contract import orders

# --- FLOPs and bytes per op ----------------------------------------------------------------------

S_E = 3.0      # the architecture's default executor speedup (only for the legacy speedup() helper)
C_O = 0.03     # one bridge crossing as a share of the whole model's time (idem)


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))


def _tensor_bytes(ty) -> int:
    try:
        if hasattr(ty, "fields"):
            return sum(_tensor_bytes(f) for f in ty.fields)
        dt = tvm.DataType(str(ty.dtype))
        return _numel(ty.shape) * max(dt.bits * dt.lanes // 8, 1)
    except Exception:
        return 0


def op_flops(call: relax.Call) -> float:
    """Work an op does, by the ACL table's formula for it (compiler/backends/acl/ RELAX_OPS); ops it
    gives no formula count one operation per output element."""
    row = acl.relax_op(call.op.name)
    try:
        if row.flops is not None:
            return float(row.flops(call))
        return float(_numel([int(d) for d in call.ty.shape]))
    except Exception:
        return 0.0


def module_flops(func: relax.Function) -> float:
    """Work of a whole function: every operator call's op_flops."""
    total = 0.0

    def visit(e):
        nonlocal total
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            total += op_flops(e)

    relax.analysis.post_order_visit(func.body, visit)
    return total


def op_bytes(call: relax.Call) -> int:
    """Bytes an op reads and writes: its tensor arguments (weights included) and its result."""
    total = _tensor_bytes(call.ty)
    for a in call.args:
        for x in (a.fields if isinstance(a, relax.Tuple) else [a]):
            total += _tensor_bytes(getattr(x, "ty", None))      # 0 for shapes and scalars
    return total


# --- the per-target rate table -------------------------------------------------------------------

@dataclass(frozen=True)
class Rate:
    gflops: float       # effective GFLOP/s on conv/matmul-like kernels
    gbps: float         # effective GB/s on memory-bound kernels
    kernel_us: float    # fixed cost per kernel (launch, threads)
    call_us: float      # fixed cost per call into the executor (0 for TVM: it is the caller)
    note: str = ""
    int8_x: float = 1.0  # how much faster a quantized conv/dense kernel runs (1: computed in float)


RATES: dict[str, dict[str, Rate]] = {
    "x86_64": {
        # fitted to `tandoor bench`/`tandoor profile` on the 2-core host (docs/benchmarks.md):
        # EfficientNet-Lite0 / MobileNetV2 regions, TVM 16.3 / 12.9 ms, onnxruntime 13.0 / 10.5 ms;
        # one onnxruntime call ~8 us (io_binding) + ~25 us executor wrapper; CpuRef ~770x onnxruntime
        # TVM computes a QDQ model's quantized ops in float between (de)quantize ops (int8_x 1);
        # onnxruntime's x86 kernels fuse uint8-activation QDQ convs (int8 ones stay float here)
        "tvm": Rate(55.0, 10.0, 3.0, 0.0, "compiler/stages/schedule.py rules, 2 threads (measured)"),
        "onnxruntime": Rate(70.0, 12.0, 2.0, 25.0, "onnxruntime CPU EP, 2 threads (measured)", int8_x=2.0),
        "armnn": Rate(0.09, 0.5, 5.0, 40.0, "Arm NN CpuRef: the reference backend (measured)"),
    },
    "aarch64": {
        # assumptions for 4x Cortex-A76 until `tandoor profile` measures the board; INT8: the
        # A76's dot-product instructions do 4x the MACs of fp32 FMA, assumed 2.5x delivered
        "tvm": Rate(12.0, 6.0, 5.0, 0.0, "assumed: rule-based NEON schedules, 4 threads"),
        "onnxruntime": Rate(20.0, 6.0, 3.0, 30.0, "assumed: MLAS NEON", int8_x=2.0),
        "armnn": Rate(30.0, 8.0, 4.0, 40.0, "assumed: Arm NN CpuAcc (ACL NEON)", int8_x=2.5),
    },
}
COPY_GBPS = {"x86_64": 8.0, "aarch64": 4.0}     # boundary tensors written and read back once
DELEGATE_US = 2.0                               # the VM's call_dps_packed into Python + dlpack views
EXECUTORS = tuple(e for e in orders.EXECUTORS if e != orders.FALLBACK)   # what a subgraph can be delegated to


def arch_of(targets) -> str:
    """The architecture decisions are made for: the first board target if any, else the host."""
    for t in targets:
        if getattr(t, "name", "host") != "host":
            return t.arch
    return targets[0].arch if targets else "x86_64"


def rates(arch: str) -> dict[str, Rate]:
    return RATES.get(arch, RATES["aarch64"])


# --- estimates -----------------------------------------------------------------------------------

def _roofline(flops: float, nbytes: float, r: Rate) -> float:
    return max(flops / (r.gflops * 1e3), nbytes / (r.gbps * 1e3)) + r.kernel_us


def kernel_us(calls: list[relax.Call], nbytes: float, r: Rate, fused: bool) -> float:
    """One kernel made of `calls`. `fused`: a TVM kernel whose elementwise ops ride along with a
    neighbour (no traffic of their own)."""
    flops = sum(op_flops(c) for c in calls)
    classes = {acl.relax_op(c.op.name).cost for c in calls}
    if classes <= {"free"}:
        return 0.0
    if fused and "heavy" not in classes:
        return flops / (r.gflops * 1e3)
    if r.int8_x != 1.0 and any(c.op.name == "relax.quantize" for c in calls):
        r = dataclasses.replace(r, gflops=r.gflops * r.int8_x)
    return _roofline(flops, nbytes, r)


def model_tvm_us(func: relax.Function, arch: str) -> float:
    """The whole model in TVM: one kernel per heavy op, elementwise ops fused."""
    r = rates(arch)["tvm"]
    total = 0.0

    def visit(e):
        nonlocal total
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op):
            total += kernel_us([e], op_bytes(e), r, fused=True)

    relax.analysis.post_order_visit(func.body, visit)
    return total


def _region_kernels(func: relax.Function) -> list[tuple[list[relax.Call], int]]:
    """A merged region's composites as kernels: (op calls, bytes read and written)."""
    from .partition import local_composites, calls as _calls

    out = []
    for comp in local_composites(func):
        calls = _calls(comp)
        nbytes = sum(_tensor_bytes(p.ty) for p in comp.params) + _tensor_bytes(comp.ret_ty if hasattr(comp, "ret_ty") else calls[-1].ty)
        seen = set()
        for c in calls:
            for a in c.args:
                if isinstance(a, tvm.ir.GenericConst) and id(a) not in seen:
                    seen.add(id(a))
                    nbytes += _tensor_bytes(a.ty)
        out.append((calls, nbytes))
    return out


def int8_flops(func: relax.Function) -> float:
    """The work of a region's quantized composites (compiler/backends/acl/'s q entries: they end in a
    quantize), which its executors run with integer kernels."""
    return sum(op_flops(c) for calls, _ in _region_kernels(func) if any(c.op.name == "relax.quantize" for c in calls)
               for c in calls)


def boundary_bytes(func: relax.Function) -> int:
    return sum(_tensor_bytes(p.ty) for p in func.params) + _tensor_bytes(func.body.body.ty)


def estimate(func: relax.Function, arch: str) -> dict:
    """Estimated microseconds of one region on TVM and on each executor, and its bridge cost."""
    rs = rates(arch)
    kernels = _region_kernels(func)
    flops = sum(op_flops(c) for calls, _ in kernels for c in calls)
    nbytes = sum(b for _, b in kernels)
    bb = boundary_bytes(func)
    tvm_us = sum(kernel_us(calls, b, rs["tvm"], fused=True) for calls, b in kernels)
    exec_us = {e: sum(kernel_us(calls, b, rs[e], fused=False) for calls, b in kernels)
               for e in EXECUTORS if e in rs}
    bridge = {e: DELEGATE_US + rs[e].call_us + bb / (COPY_GBPS.get(arch, 4.0) * 1e3) for e in exec_us}
    return {"flops": flops, "bytes": nbytes, "boundary_bytes": bb, "arch": arch,
            "tvm_us": tvm_us, "exec_us": exec_us, "bridge_us": bridge}


def decide(est: dict, model_us: float, measured: dict | None = None,
           allowed: tuple[str, ...] | None = None, source: str = "profile") -> tuple[bool, str, dict]:
    """Keep the subgraph iff its best executor's gain over TVM beats that executor's bridge.

    `measured` (from a profile): {"tvm_us": .., "exec_us": {executor: us}, "bridge_us": {executor: us}}
    replaces the estimates it covers. Returns (keep, reason citing the numbers, numbers for the
    manifest)."""
    tvm_us = est["tvm_us"]
    exec_us = dict(est["exec_us"])
    bridge = dict(est["bridge_us"])
    if not measured:
        source = "estimate"
    else:
        if measured.get("tvm_us") is not None:
            tvm_us = float(measured["tvm_us"])
        for e, v in (measured.get("exec_us") or {}).items():
            exec_us[e] = float(v)
        for e, v in (measured.get("bridge_us") or {}).items():
            bridge[e] = float(v)
        # executors the profile could not run on the board are not candidates there
        if measured.get("exec_us") is not None:
            exec_us = {e: v for e, v in exec_us.items() if e in measured["exec_us"]}
    if allowed is not None:
        exec_us = {e: v for e, v in exec_us.items() if e in allowed}
    nums = {"tvm_us": round(tvm_us, 2), "exec_us": {e: round(v, 2) for e, v in exec_us.items()},
            "bridge_us": {e: round(v, 2) for e, v in bridge.items() if e in exec_us}, "source": source}
    if not exec_us:
        return False, f"cost ({source}): no executor to delegate to", nums
    best = min(exec_us, key=lambda e: exec_us[e] + bridge[e])
    # decide and explain with the numbers as the manifest records them (2 decimals)
    tvm_us, t_e, t_b = nums["tvm_us"], nums["exec_us"][best], nums["bridge_us"][best]
    gain = round(tvm_us - t_e, 2)
    p = tvm_us / model_us if model_us > 0 else 0.0
    s_e = tvm_us / t_e if t_e > 0 else float("inf")
    c_o = t_b / model_us if model_us > 0 else 0.0
    pmin = c_o * s_e / (s_e - 1.0) if s_e > 1.0 else float("inf")
    nums.update(executor=best, gain_us=gain, p=round(p, 6), s_e=round(s_e, 3) if math.isfinite(s_e) else None,
                c_o=round(c_o, 6), p_min=round(pmin, 6) if math.isfinite(pmin) else None, model_tvm_us=round(model_us, 1))
    numbers = (f"TVM {tvm_us:.1f} us vs {best} {t_e:.1f} us + bridge {t_b:.1f} us "
               f"(p {p:.2%}, s_e {s_e:.2f}, p_min {pmin:.2%})" if math.isfinite(pmin) else
               f"TVM {tvm_us:.1f} us vs {best} {t_e:.1f} us + bridge {t_b:.1f} us (p {p:.2%}, s_e {s_e:.2f})")
    if gain > t_b:
        return True, f"cost ({source}): gain {gain:.1f} us > bridge {t_b:.1f} us: {numbers}", nums
    if gain <= 0:
        return False, f"cost ({source}): {best} is not faster than TVM here: {numbers}", nums
    return False, f"cost ({source}): gain {gain:.1f} us <= bridge {t_b:.1f} us: {numbers}", nums


def estimate_error(est: dict, measured: dict) -> dict:
    """The estimate beside the measurement: estimated microseconds and measured / estimated - 1 per
    side (TVM and each measured executor), for `tandoor inspect` and for refitting RATES."""
    out = {"tvm_us": round(est["tvm_us"], 2), "exec_us": {e: round(v, 2) for e, v in est["exec_us"].items()},
           "error": {}}
    if measured.get("tvm_us") and est["tvm_us"] > 0:
        out["error"]["tvm"] = round(float(measured["tvm_us"]) / est["tvm_us"] - 1.0, 3)
    for e, v in (measured.get("exec_us") or {}).items():
        if est["exec_us"].get(e):
            out["error"][e] = round(float(v) / est["exec_us"][e] - 1.0, 3)
    return out


def predicted_speedup(model_us: float, kept: list[dict]) -> float:
    """T_model / (T_model - sum(gain) + sum(bridge)) over the kept subgraphs' est numbers."""
    if model_us <= 0 or not kept:
        return 1.0
    t = model_us
    for n in kept:
        e = n.get("executor")
        if e is None:
            continue
        t += n["exec_us"][e] - n["tvm_us"] + n["bridge_us"][e]
    return model_us / t if t > 0 else 1.0


# --- the architecture's closed forms (kept for the docs and quick what-ifs) ----------------------

def p_min(s_e: float = S_E, c_o: float = C_O) -> float:
    return c_o * s_e / (s_e - 1.0)


def speedup(p: float, boundaries: int, s_e: float = S_E, c_o: float = C_O) -> float:
    if p <= 0:
        return 1.0
    return 1.0 / ((1.0 - p) + p / s_e + c_o * boundaries)
