"""Executors for delegated orders (docs/bundle-format.md): each builds one order and runs it.

``REGISTRY`` is the one list of them; the CLIs' choices (``CHOICES``), the auto mode's order of
preference and the profile's columns all come from it. An executor module is imported only when
its executor is built or asked whether it is available, so naming them costs nothing.

A new executor: a module here with ``available() -> (bool, why)`` and a class with
``run_into(inputs, outputs)``/``close()``, plus one ``Kind`` entry below.
"""

from __future__ import annotations

import os

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandoor_contract import backends, hmod, orders, probe

from .errors import Unavailable


@dataclass(frozen=True)
class BuildContext:
    bundle: hmod.Bundle
    symbol: str
    order: dict
    part: dict                      # the order's manifest partition entry
    target: str                     # the manifest target whose libs this machine runs
    workdir: Path
    armnn_backends: tuple[str, ...]
    npu_cores: tuple[int, ...] = (0, 1, 2)      # the RK3588 NPU cores an rknn order runs on


@dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    available: Callable[[], tuple[bool, str]]
    build: Callable[[BuildContext], Any]


def _armnn_available() -> tuple[bool, str]:
    from . import armnn

    return armnn.available()


def _build_armnn(ctx: BuildContext):
    from . import armnn

    ok, why = armnn.available()
    if not ok:
        raise Unavailable(why)
    ex = armnn.ArmnnExecutor(ctx.order, ctx.bundle.weights(ctx.symbol), preferred=ctx.armnn_backends)
    if _check_wanted(ex.backend, ctx):
        try:
            _check_order(ex, ctx, armnn)
        except BaseException:
            ex.close()
            raise
    return ex


def _check_wanted(backend: str, ctx: BuildContext) -> bool:
    """TANDOOR_ARMNN_CHECK: "1" (the default; any other value too) checks orders on Arm NN's
    accelerated backends, "0" none, "all" CpuRef too (Arm NN's reference: on request only)."""
    mode = os.environ.get("TANDOOR_ARMNN_CHECK", "1")
    if mode == "0" or (backend == "CpuRef" and mode != "all"):
        return False
    return bool(ctx.part.get("probe")) or _ort_available()[0]


def _check_order(ex, ctx: BuildContext, armnn) -> None:
    """Run the order once in Arm NN on the probe inputs (tandoor_contract.probe) and compare with
    what onnxruntime gave the compiler for them (the bundle's probe member), or, in a bundle made
    before probes, with this machine's onnxruntime on a seeded input. A result that differs means
    this Arm NN computes the order wrongly here. Both releases did, for real models whose layers
    alone are right (armnn.Api's depthwise_own_input and concat_by_copy say which and how the
    builder now avoids them), so ACL results are not trusted unchecked."""
    import numpy as np

    member = ctx.part.get("probe")
    if member:
        try:
            data = ctx.bundle.read(member)
            recorded = probe.unpack(data)
            why = armnn.differs(probe.sampled(ex.run(probe.inputs(ctx.order)), recorded), [v for _, v in recorded],
                                probe.drift(data))
        except ValueError as e:
            raise Unavailable(f"the order's probe cannot be checked ({e})") from None
    else:
        rng = np.random.default_rng(0)
        specs = ctx.order["inputs"]
        floats = [i.get("dtype", "float32") == "float32" for i in specs]
        codes = probe.inputs(ctx.order) if not all(floats) else []   # a quantized input takes codes of its dtype
        xs = [rng.standard_normal(tuple(i["shape"])).astype(np.float32) if f else codes[k]
              for k, (i, f) in enumerate(zip(specs, floats))]
        ref = _build_ort(ctx)
        try:
            why = armnn.differs(ex.run(xs), ref.run(xs))
        finally:
            getattr(ref, "close", lambda: None)()
    if why:
        raise Unavailable(f"Arm NN {armnn.api().release} on {ex.backend} computes this order wrongly ({why})")


def _ort_available() -> tuple[bool, str]:
    from . import ort

    return ort.available()


def _build_ort(ctx: BuildContext):
    from . import ort

    ok, why = ort.available()
    if not ok:
        raise Unavailable(why)
    # external data of the ONNX rendering: file name it uses -> bundle member holding it
    external = {name: ctx.bundle.read(member) for name, member in (ctx.part.get("onnx_external") or {}).items()}
    return ort.OrtExecutor(ctx.order, ctx.bundle.read(ctx.part.get("onnx") or f"orders/{ctx.symbol}.onnx"),
                           external=external)


def _tvm_available() -> tuple[bool, str]:
    try:
        import tvm  # noqa: F401
    except Exception as e:
        return False, f"TVM's runtime is not importable ({type(e).__name__}: {e})"
    return True, "TVM runtime"


def _build_tvm(ctx: BuildContext):
    from .tvm_exec import TvmExecutor, fallback_params

    member = (ctx.bundle.manifest["targets"][ctx.target].get("fallback") or {}).get(ctx.symbol)
    if not member:
        raise Unavailable(f"the bundle has no TVM fallback for {ctx.symbol} on {ctx.target}")
    # format_version 4: one packed library holds every subgraph's fallback, written out once; named
    # by its hash, so that a library of another bundle in the same directory is never taken for it
    version = ctx.bundle.manifest.get("format_version")
    entry = hmod.fallback_function(version, ctx.symbol)
    sha = str((ctx.bundle.manifest.get("files") or {}).get(member, ""))[:16]
    path = ctx.workdir / f"{member.replace('/', '_')}.{sha}.so"
    if not path.exists():
        path.write_bytes(ctx.bundle.library(member))
    return TvmExecutor(ctx.order, path, fallback_params(ctx.bundle, ctx.part), entry=entry)


def _rknn_available() -> tuple[bool, str]:
    from . import rknn

    return rknn.available()


def _build_rknn(ctx: BuildContext):
    from . import rknn

    member = ctx.part.get("rknn") or f"orders/{ctx.symbol}.rknn"
    return rknn.RknnExecutor(ctx.order, ctx.bundle.read(member), ctx.workdir, ctx.npu_cores,
                             runtime=rknn_runtime(ctx) if rknn_runtime else None)


# An RKNNLite-shaped runtime for rknn orders instead of RKNNLite itself: ``rknn_runtime(ctx)``. None
# on boards; tests on the host set the toolkit's simulator (tandoor_compiler.backends.rknn.toolkit.Simulator).
rknn_runtime: Callable[[BuildContext], Any] | None = None


REGISTRY: dict[str, Kind] = {k.name: k for k in [
    Kind("armnn", "Arm NN layer by layer: CpuAcc = ACL NEON, GpuAcc = ACL OpenCL, CpuRef = reference",
         _armnn_available, _build_armnn),
    Kind("onnxruntime", "the order's ONNX rendering in onnxruntime's CPU provider", _ort_available, _build_ort),
    Kind("tvm", "the order compiled by TVM alone (in the bundle): runs wherever the bundle runs",
         _tvm_available, _build_tvm),
    Kind("rknn", "an rknn order's .rknn on the RK3588 NPU (rknn-toolkit-lite2's RKNNLite over librknnrt.so)",
         _rknn_available, _build_rknn),
]}
assert tuple(REGISTRY) == orders.EXECUTORS, "the registry and the contract's executor names differ"
assert all(e in REGISTRY for b in backends.BACKENDS.values() for e in b.executors), \
    "a backend of tandoor_contract.backends names an executor this agent lacks"

NAMES: tuple[str, ...] = tuple(REGISTRY)
AUTO = "auto"
CHOICES: tuple[str, ...] = (AUTO, *NAMES)


def build(kind: str, ctx: BuildContext):
    try:
        k = REGISTRY[kind]
    except KeyError:
        raise Unavailable(f"unknown executor {kind!r}; choose from {', '.join(CHOICES)}") from None
    if why := orders.refuses(kind, ctx.order):
        raise Unavailable(why)
    return k.build(ctx)


def auto_order(acl_here: bool) -> list[str]:
    """auto's order of preference: armnn first only where it brings ACL (CpuAcc/GpuAcc); its
    CpuRef backend is a reference implementation, seconds per CNN inference."""
    npu = ["rknn"]     # the executor only rknn orders name (backends.BACKENDS): the others never try it
    if acl_here:
        return npu + [n for n in NAMES if n not in npu]
    return npu + ["onnxruntime", "armnn", orders.FALLBACK]
