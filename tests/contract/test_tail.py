"""The manifest's tail (contract/tail.py): which tensors feed it and which outputs it makes; a
bundle with a tail is format 3, one without stays format 2 (older agents run it)."""

from __future__ import annotations

import numpy as np

from tandoor_contract import hmod, tail

TAIL = {"feeds": [{"name": "boxes", "vm": 1}, {"name": "image", "input": 0}],
        "outputs": [{"tail": 1}, {"vm": 0}, {"tail": 0}]}


def test_the_tail_reads_inputs_and_vm_outputs_by_name_and_orders_the_model_outputs():
    image, vm = np.zeros((1, 3)), [np.ones(2), np.arange(8.0).reshape(2, 4)]
    seen = {}

    def run(feeds):
        seen.update(feeds)
        return [feeds["boxes"][:1], feeds["image"].sum(axis=1)]   # sizes of the data's choosing

    outs = tail.finish(TAIL, [image], vm, run)
    assert seen["boxes"] is vm[1] and seen["image"] is image
    assert [o.shape for o in outs] == [(1,), (2,), (1, 4)] and outs[1] is vm[0]
    assert all(a is b for a, b in zip(tail.finish(None, [image], vm, run), vm))   # no tail: the VM gives the outputs


def test_a_bundle_is_format_3_only_with_a_tail_and_no_fallback_library(tmp_path):
    base = {"model": {"name": "m", "version": "1"}, "inputs": [], "outputs": [], "targets": {}}
    for man, want in ((base, hmod.PLAIN_FORMAT_VERSION), ({**base, "tail": {**TAIL, "onnx": "t.onnx"}}, 3)):
        written = hmod.write_bundle(tmp_path / f"b{want}.hmod", man, {"t.onnx": b"x"})
        assert written["format_version"] == want
    assert 3 in hmod.SUPPORTED_FORMAT_VERSIONS and hmod.PLAIN_FORMAT_VERSION == 2
