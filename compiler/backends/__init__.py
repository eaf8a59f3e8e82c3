"""Backends of the compiler, one folder each (compiler/backends/<name>/): what a target's
hardware beyond its CPU gets from the bundle, each the compiler half of a record in
contract/backends.py. ``acl``: the ARM Compute Library's table (order kind ``layers``, run by Arm
NN) and the ONNX rendering of its orders. ``onnx``: the escape hatch (order kind ``onnx``, run by
onnxruntime). ``rknn``: the RK3588 NPU (order kind ``rknn``). ``cuda``: the TVM side compiled for
NVIDIA GPUs (no order kind: the GPU part is a TVM library)."""
