"""Backends of the compiler, one folder each (compiler/backends/<name>/): what a target's
hardware beyond its CPU gets from the bundle. ``acl``: the ARM Compute Library's table (order kind
``layers``, run by Arm NN) and the ONNX rendering of its orders. ``cuda``: the TVM side compiled for
NVIDIA GPUs."""
