"""The ONNX rendering of an order moved to compiler/backends/acl/order_onnx.py (the ACL backend's
folder: it renders that backend's orders for the onnxruntime executor); this module is kept for the
callers that have not moved yet (pipeline.py and tests import ``tandoor_compiler.order_onnx``) and
re-exports the names they use."""

from .backends.acl.order_onnx import OPSET, _Renderer, order_to_onnx, with_zero_run, zero_run

__all__ = ["OPSET", "_Renderer", "order_to_onnx", "with_zero_run", "zero_run"]
