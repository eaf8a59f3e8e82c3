"""The TVM side -> one library per SM whose kernels are cubins made here, without a GPU.

TVM 0.27 builds a CUDA target on a host without libcuda, but keeps the kernels as CUDA C source in
the library (its CUDA module factory falls back to source when the CUDA runtime is not linked; only
a host with the runtime calls ``tvm_callback_cuda_compile``). A device would have to compile that
source at load, which the agent's runtime-only TVM cannot. So: the hook is registered for the build
(a workstation with a GPU compiles through it), and the library's packed imports, where the CUDA
module is stored as (format, function table, code), are rewritten on export to carry the cubin
NVRTC made from that source for the SM (format "cubin"), as a real CUDA module saves itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax

from tandoor_contract import gpu as gpu_contract

from ...errors import CompileError

#: what TVM's CUDA schedules may assume of every SM named here (Orin's sm_87, Hopper's sm_90)
LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152, "thread_warp_size": 32}
HOOK = "tvm_callback_cuda_compile"
INSTALL = "pip install -e '.[host]' (it brings nvidia-cuda-nvrtc, nvidia-cuda-runtime's headers and cuda-bindings)"


@dataclass
class GpuBuild:
    libs: dict[str, Path] = field(default_factory=dict)          # SM -> library
    cubin_bytes: dict[str, int] = field(default_factory=dict)    # SM -> size of its kernels


def _cuda_home() -> Path | None:
    """PyPI's CUDA 13 wheels' shared folder (nvidia/cu13: NVRTC, the runtime's and CCCL's headers)."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        home = Path(base) / "cu13"
        if (home / "include" / "cuda_runtime.h").is_file() and (home / "include" / "nvrtc.h").is_file():
            return home
    return None


def nvrtc_available() -> tuple[bool, str]:
    if _cuda_home() is None:
        return False, f"NVRTC and the CUDA headers are not installed: {INSTALL}"
    if importlib.util.find_spec("cuda.bindings") is None:
        return False, f"cuda-bindings is not installed: {INSTALL}"
    return True, ""


def nvrtc(source: str, sm: str) -> bytes:
    """A cubin for ``sm`` from TVM's CUDA source, by NVRTC (TVM's own driver of it)."""
    from tvm.support import nvcc

    home = _cuda_home()
    old = os.environ.get("CUDA_PATH")
    os.environ["CUDA_PATH"] = str(home)     # where nvcc.py looks for the headers
    try:
        return bytes(nvcc.compile_cuda(source, "cubin", arch=sm, compiler="nvrtc",
                                       options=[f"-I{home / 'include' / 'cccl'}"]))
    except Exception as err:
        raise RuntimeError(f"NVRTC could not compile the {sm} kernels ({' '.join(str(err).split())[:300]})") from None
    finally:
        if old is None:
            os.environ.pop("CUDA_PATH", None)
        else:
            os.environ["CUDA_PATH"] = old


@contextlib.contextmanager
def _hook(sm: str) -> Iterator[None]:
    """TVM's compile hook, for this SM, while the module builds (called only where CUDA is linked)."""
    before = tvm_ffi.get_global_func(HOOK, allow_missing=True)
    tvm_ffi.register_global_func(HOOK, lambda code, *_: nvrtc(code, sm), override=True)
    try:
        yield
    finally:
        if before is not None:
            tvm_ffi.register_global_func(HOOK, before, override=True)


def gpu_pipeline(target: tvm.target.Target, database: Path | None = None, observe=None):
    """relax's CUDA pipeline (dlight's default GPU rules) with MetaSchedule's records applied first
    where ``database`` (a tuning work dir for this GPU) is given; ``observe``: a pass run last."""
    from tvm.relax.backend.cuda import pipeline as cuda
    from tvm.s_tir import dlight as dl

    from ...stages.schedule import Guarded

    # relax's CUDA legalisation ends in dlight's default rules; each guarded here, so that a rule
    # that raises is 'not applicable' and the next one schedules the function (TVM 0.27's GEMV
    # asserts a constant loop extent: yolov8n's DFL head raised)
    @tvm.transform.module_pass(opt_level=0, name="TandoorCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:     # MetaScheduleApplyDatabase reads the target when it is made
            legalize = cuda.legalize_passes(target)[:-1]
            if database is not None:     # tuned functions first; dlight then schedules only the rest
                legalize.append(relax.transform.MetaScheduleApplyDatabase(str(database)))
            legalize.append(dl.ApplyDefaultSchedule(*[Guarded(r) for r in (
                dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())]))
            seq = tvm.transform.Sequential(
                [relax.transform.CanonicalizeBindings(), relax.transform.FoldConstant()]
                + cuda.library_dispatch_passes(target) + legalize
                + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target)
                + ([observe] if observe is not None else []))
            return seq(mod)

    return _pipeline


# --- the packed imports (apache/tvm src/target/codegen.cc PackImportsToBytes) -----------------
# u64 size, then the import tree (two u64 vectors), then per module group its kind (a string) and,
# unless "_lib", its bytes (a string); a CUDA module's bytes are format, function table, code.

def _u64(data: bytes, at: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", data, at)[0], at + 8


def _string(data: bytes, at: int) -> tuple[bytes, int]:
    n, at = _u64(data, at)
    if at + n > len(data):
        raise ValueError("truncated string")
    return data[at:at + n], at + n


def _w(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _cuda_payload(payload: bytes, sm: str, compiled: dict[str, bytes]) -> bytes:
    fmt, at = _string(payload, 0)
    for k in range(at, len(payload) - 7):        # the code is the last field: find its length
        n = struct.unpack_from("<Q", payload, k)[0]
        if k + 8 + n == len(payload):
            table, code = payload[at:k], payload[k + 8:]
            break
    else:
        raise ValueError("no code field in the CUDA module")
    if fmt == b"cuda":
        cubin = compiled.setdefault(sm, nvrtc(code.decode(), sm))
    elif fmt == b"cubin" and gpu_contract.sm_of(code) == sm:     # compiled through the hook already
        cubin = code
    else:
        raise ValueError(f"the CUDA module holds {fmt.decode(errors='replace')} code, not {sm}")
    return _w(b"cubin") + table + _w(cubin)


def rewrite_imports(blob: bytes, sm: str) -> bytes:
    """The packed imports with every CUDA module's code as a cubin for ``sm``."""
    size, at = _u64(blob, 0)
    body = blob[at:at + size]
    rows, at = _u64(body, 0)
    row_end = at + 8 * rows
    children, at = _u64(body, row_end)
    at += 8 * children
    out, compiled = [body[:at]], {}
    for _ in range(rows - 1):
        kind, at = _string(body, at)
        out.append(_w(kind))
        if kind == b"_lib":
            continue
        payload, at = _string(body, at)
        out.append(_w(_cuda_payload(payload, sm, compiled) if kind == b"cuda" else payload))
    data = b"".join(out)
    return struct.pack("<Q", len(data)) + data


def _packer(sm: str):
    """export_library's ``fpack_imports``: the imports as C (as TVM's PackImportsToC writes them),
    rewritten for ``sm``."""

    def pack(mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        if is_system_lib or prefix:
            raise RuntimeError("a CUDA system library is not supported")
        blob = tvm.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy().tobytes()
        try:
            blob = rewrite_imports(blob, sm)
        except ValueError as err:
            raise RuntimeError(f"the library's CUDA module: {err}") from None
        name = tvm.get_global_func("runtime.ModuleImportsBlobName")()
        path = Path(workspace_dir) / "devc.c"
        rows = (",".join(str(b) for b in blob[i:i + 40]) for i in range(0, len(blob), 40))
        path.write_text(f'#ifdef __cplusplus\nextern "C" {{\n#endif\n'
                        f"extern const unsigned char {name}[];\n"
                        f"const unsigned char {name}[{len(blob)}] = {{\n" + ",\n".join(rows) + "\n};\n"
                        "#ifdef __cplusplus\n}\n#endif\n")
        return str(path)

    return pack


def build_gpu(mod: tvm.IRModule, llvm: dict, cross_cc: str | None, sms: tuple[str, ...], provided: frozenset[str],
              out_dir: Path, name: str, database: Path | None = None) -> GpuBuild:
    """The lowered TVM side (what codegen.build takes for the CPU) as one CUDA library per SM."""
    from tvm.support import cc

    from ..onnx import hatch
    from ...stages import schedule
    from ...stages.codegen import LINK_OPTIONS
    from ...stages.passes import legalise_for_tvm

    ok, why = nvrtc_available()
    if not ok:
        raise CompileError(f"the GPU part needs NVRTC: {why}")
    host = llvm if cross_cc else schedule.host_target(llvm)
    mod = legalise_for_tvm(mod)
    out = GpuBuild()
    for sm in sms:
        target = tvm.target.Target({"kind": "cuda", "arch": sm, **LIMITS}, host=host)
        calls: set[str] = set()
        with _hook(sm):
            ex = tvm.compile(mod, target=target, relax_pipeline=gpu_pipeline(target, database, hatch.observer(calls)))
        hatch.check_runtime(calls, provided)
        path = out_dir / f"{name}.{sm}.so"
        triple = host.get("mtriple")
        fcompile = cc.cross_compiler(cross_cc, get_target_triple=lambda t=triple: t) if cross_cc else None
        ex.export_library(str(path), fcompile=fcompile, fpack_imports=_packer(sm), options=LINK_OPTIONS)
        found = gpu_contract.cubins(path.read_bytes())
        if not found:       # every op of the TVM part was delegated: no kernel for the GPU to run
            return GpuBuild()
        if any(s != sm for s, _ in found):
            raise RuntimeError(f"the {sm} library carries cubins for {sorted({s for s, _ in found})}")
        out.libs[sm] = path
        out.cubin_bytes[sm] = sum(n for _, n in found)
    return out


def bundle_part(mod: tvm.IRModule, target, provided: frozenset[str], tmp: Path, members: dict, packed: bool,
                say=lambda s: None, database: Path | None = None) -> dict | None:
    """``target``'s GPU part (a targets.TargetPreset with ``gpu`` SMs): its libraries as bundle
    members (packed when the CPU lib is) and the manifest target's ``gpu`` entry (contract/gpu.py);
    None when the TVM part has no kernel (every op delegated)."""
    say(f"compiling the TVM part for {target.name}'s GPU ({', '.join(target.gpu)} cubins)")
    built = build_gpu(mod, target.llvm, target.cross_cc, target.gpu, provided, tmp, f"{target.name}.gpu", database)
    if not built.libs:
        say(f"no GPU part for {target.name}: every op of the model is delegated, the TVM part has no kernel")
        return None
    libs = {}
    for sm, path in built.libs.items():
        name = gpu_contract.member(target.name, sm, packed)
        from tandoor_contract import hmod

        members[name] = hmod.pack_lib(path.read_bytes()) if packed else path.read_bytes()
        libs[sm] = name
    return {"version": gpu_contract.GPU_VERSION, "kind": gpu_contract.KIND, "runtime": gpu_contract.RUNTIME,
            "libs": libs, "cubin_bytes": built.cubin_bytes,
            "schedules": "metaschedule database + dlight" if database is not None else "dlight default rules"}
