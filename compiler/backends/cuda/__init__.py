"""The TVM side for NVIDIA GPUs (a Jetson's, or a data-centre GPU for checks): cubins per SM.

What runs where: the GPU libraries are built from the model with no ACL region delegated (policy
none: a Jetson's GPU outruns ACL on its CPU cores, so an ACL region there only adds two copies), so
the whole model runs on the GPU except the onnxruntime orders (ops the device's TVM runtime lacks,
compiler/backends/onnx/hatch.py), whose inputs and outputs cross between GPU and host memory at each call: that
copy is the boundary's cost. The bundle keeps its CPU library with its ACL orders beside the GPU
ones, as the fallback an agent runs when the GPU cannot be used.

    build.py   the relax module -> one library per SM: TVM's CUDA pipeline (dlight's default GPU
               rules; MetaSchedule records where a tuning database is given), its kernels compiled
               by NVRTC (PyPI's nvidia-cuda-nvrtc) to cubins on this GPU-less workstation, and the
               library's packed imports rewritten to carry them (contract/gpu.py reads them back)
    params.py  their weights as byte ranges of the orders' blobs and lib/params.bin where the bytes
               are there already (the GPU module is the whole model: stored again, they doubled it)

The device side is agent/run/gpu.py; the manifest's ``gpu`` entry is contract/gpu.py.
"""

from .build import GpuBuild, build_gpu, bundle_part, nvrtc_available
from .params import shared_params

__all__ = ["GpuBuild", "build_gpu", "bundle_part", "nvrtc_available", "shared_params"]
