"""The RK3588 NPU backend: nodes the NPU's table takes become orders of kind ``rknn``
(contract/backends.py), converted by Rockchip's RKNN toolkit, which lives in its own venv
(.venv-rknn) and is driven as a subprocess.

- ``npu.py``: the NPU's op table (``NpuOp``: what it takes, with reasons for what it refuses), how
  it picks regions (``pick``), converts them (``convert_groups``) and judges them on the simulator.
- ``stages.py``: what ``compile --npu`` adds to the pipeline, top to bottom: cut the model at the
  picked regions, convert, cut again without what the toolkit refused, the manifest's ``npu``
  and each output's promise on the ``rknn`` path.
- ``toolkit.py``: the toolkit's venv, its worker process and its simulator (``Simulator``).
- ``worker.py``: runs inside .venv-rknn (the toolkit's pins: numpy<=1.26, onnx<=1.18): one JSON
  request per conversion.

docs/npu.md is its page.
"""
