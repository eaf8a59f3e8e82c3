"""Backends of the compiler, one folder each (compiler/backends/<name>/): what a target's
hardware beyond its CPU gets from the bundle. ``cuda``: the TVM side compiled for NVIDIA GPUs."""
