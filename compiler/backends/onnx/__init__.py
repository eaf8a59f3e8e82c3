"""The escape hatch backend (order kind ``onnx``, run by onnxruntime on the device): the ONNX nodes
that neither ACL nor the device's TVM runtime can run, cut out of the model and written as ONNX
orders (``hatch.py``: why each node goes, ``cut``, the placeholder TVM imports, the orders).
docs/escape-hatch.md is its page."""
