"""A bundle's tail: the model's end that the device runs in onnxruntime after the VM.

An op whose output size depends on the data (NonMaxSuppression, NonZero, ...) cannot be a call
inside TVM's VM, whose calls write into buffers sized before the call. The compiler
(compiler/backends/onnx/hatch.py) cuts such an op and everything after it into one ONNX rendering; the VM then
returns what the tail reads, and the tail makes the model's outputs, of any size. The manifest's
``tail`` (bundle format 3, docs/bundle-format.md)::

    "tail": {"symbol": "m_tail", "onnx": "orders/m_tail.onnx", "ops": ["onnx.NonMaxSuppression", ...],
             "reason": "...", "nodes": [...],
             "feeds":   [{"name": "boxes", "vm": 0}, {"name": "image", "input": 0}],   # per tail input
             "outputs": [{"tail": 0}, {"vm": 1}],                                   # per model output
             "tail_outputs": [{"name": "kept", "shape": [-1, 4], "dtype": "float32"}]}

The manifest's ``outputs`` stay the model's own (a dim the data decides is -1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np


def feeds(tail: Mapping, inputs: Sequence[np.ndarray], vm_outputs: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """The tail's inputs by name, from the model's inputs and the VM's outputs."""
    return {f["name"]: (inputs[f["input"]] if "input" in f else vm_outputs[f["vm"]]) for f in tail["feeds"]}


def outputs(tail: Mapping, vm_outputs: Sequence[np.ndarray], tail_outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The model's outputs, in the manifest's order."""
    return [tail_outputs[o["tail"]] if "tail" in o else vm_outputs[o["vm"]] for o in tail["outputs"]]


def finish(tail: Mapping | None, inputs: Sequence[np.ndarray], vm_outputs: Sequence[np.ndarray],
           run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The model's outputs from the VM's: through ``run`` (the tail's onnxruntime session, feeds
    by name -> its outputs in ``tail_outputs`` order) when the bundle has a tail."""
    if not tail:
        return list(vm_outputs)
    return outputs(tail, vm_outputs, run(feeds(tail, inputs, vm_outputs)))
