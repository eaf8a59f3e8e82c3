"""The backends, one record per order kind: what a delegated order of that kind is, which
executors run it, which bundle members it owns, its label for reports and ``inspect``, and its
docs page. Both halves read this one table: the contract derives ``orders.KINDS`` from it, the
agent's executor registry checks it has every executor named here, and the compiler's backend that
writes the kind names it by these constants, never by a literal.

A new backend (docs/overview.md, "A new backend"): one record here, one folder in the compiler
(``compiler/backends/<name>/``: its op table, how it picks and cuts regions, converts them and what
it promises), one executor in ``agent/run/executors/`` and one docs page.
"""

from __future__ import annotations

from dataclasses import dataclass

# the order kinds (an order's ``kind``; absent means LAYERS)
LAYERS = "layers"
ONNX = "onnx"
RKNN = "rknn"


@dataclass(frozen=True)
class Backend:
    kind: str                       # the orders' ``kind``
    name: str                       # the backend's name: its compiler folder, its flag's word, its docs
    label: str                      # how reports, ``compile`` and ``inspect`` call it
    order_version: int              # the order format version that introduced the kind (orders.ORDER_VERSIONS)
    executors: tuple[str, ...]      # what runs it on a device, in the agent's order of preference
    members: tuple[str, ...]        # bundle members per order ({symbol} filled in), beyond the order's JSON
    docs: str                       # its page


BACKENDS: dict[str, Backend] = {b.kind: b for b in [
    Backend(LAYERS, "acl", "ACL (Arm NN)", 1, ("armnn", "onnxruntime", "tvm"),
            ("orders/{symbol}.bin", "orders/{symbol}.onnx", "orders/{symbol}.probe.npz"), "docs/acl.md"),
    Backend(ONNX, "onnx", "onnxruntime", 3, ("onnxruntime",), ("orders/{symbol}.onnx",), "docs/escape-hatch.md"),
    Backend(RKNN, "rknn", "the NPU (RKNN)", 4, ("rknn", "onnxruntime"),
            ("orders/{symbol}.rknn", "orders/{symbol}.onnx"), "docs/npu.md"),
]}


def backend_of(kind: str | None) -> Backend | None:
    """The record of an order kind (None or "" is LAYERS); None when this side does not know it."""
    return BACKENDS.get(kind or LAYERS)


def label(kind: str | None) -> str:
    b = backend_of(kind)
    return b.label if b is not None else str(kind)
