"""Tandoor's compiler: ONNX model -> signed hybrid module bundle (.hmod).

The public API (compiler/api.py), imported lazily so that ``tandoor_compiler.errors`` stays light:

    from tandoor_compiler import compile_model, quantize, Options, Compiled, CompileError
"""

from __future__ import annotations

__all__ = ["compile_model", "quantize", "Options", "Compiled", "CompileError", "InternalError"]


def __getattr__(name: str):
    if name in ("compile_model", "quantize", "Compiled"):
        from . import api

        return getattr(api, name)
    if name == "Options":
        from .pipeline import Options

        return Options
    if name in ("CompileError", "InternalError"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'tandoor_compiler' has no attribute {name!r}")
