"""The probe an order is checked with on the device: inputs both halves generate bit for bit, and
the reference outputs the compiler records for them.

Arm NN computed some real models' orders wrongly on its accelerated backends while their layers
alone were right (20.08: a depthwise convolution sharing its input with another layer; 23.08: concat
inputs written in place), so the agent does not trust an order on CpuAcc/GpuAcc unchecked, even
after working around those two. The compiler runs each delegated order's ONNX rendering in
onnxruntime on :func:`inputs` and stores a sample of what comes out (:func:`pack`, the partition
entry's ``probe`` member); the agent runs the order on the same inputs at load and compares the same
elements. No onnxruntime is needed on the device for it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import numpy as np

PROBE_VERSION = 1

#: output elements recorded per output: 64 KiB of values, enough to see a defect that touches
#: 0.1% of an output (the agent's threshold) ~16 times over; an output this small is kept whole
SAMPLE = 16384


def inputs(order: Mapping, seed: int = 0) -> list[np.ndarray]:
    """The order's (or, with the manifest's ``inputs``, the model's: golden pairs) probe inputs,
    one set per ``seed`` (0 for an order's probe, 1.. for a bundle's golden pairs): unit-variance noise with tails (the sum of four uniforms, out to
    +-3.46; an int8/uint8 input: every code of its type, evenly: a defect in PP-OCRv4 det's FPN on Arm NN 20.08 showed on such inputs and on normal ones,
    0.14 and 0.07 at the output, and hid on uniform ones, 0.002), from integer hashing (splitmix64)
    and exact float steps only, so every machine and numpy release makes the same bits."""
    if not 0 <= seed < 4096:
        raise ValueError(f"probe seed {seed!r} is not in 0..4095")
    salt = np.uint64(seed << 52)      # above the input index (bits 40-51) and the draw (36-39)
    out = []
    for k, spec in enumerate(order["inputs"]):
        shape = tuple(int(d) for d in spec["shape"])
        n = math.prod(shape)
        if spec.get("dtype", "float32") in ("int8", "uint8"):   # every code of the type, evenly
            u = _uniform(np.arange(n, dtype=np.uint64) + np.uint64((k + 1) << 40) + salt)
            codes = np.floor(u * 256.0).astype(np.int16) - (128 if spec["dtype"] == "int8" else 0)
            out.append(codes.astype(spec["dtype"]).reshape(shape))
            continue
        total = np.zeros(n, np.float64)
        for r in range(4):   # a fixed order of float64 sums: the same bits everywhere
            total += _uniform(np.arange(n, dtype=np.uint64) + np.uint64(((k + 1) << 40) + (r << 36)) + salt)
        out.append(((total - 2.0) * math.sqrt(3.0)).astype(np.float32).reshape(shape))
    return out


def random_input(rng: np.random.Generator, spec: Mapping, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    """Random values an input of ``spec`` (shape, dtype) can take, for checks that need no fixed
    bits: every code of an integer dtype (a uint8 image's 0..255; noise cast to it would wrap), else
    uniform in [lo, hi)."""
    shape = tuple(int(d) for d in spec["shape"])
    dtype = np.dtype(spec.get("dtype", "float32"))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.uniform(lo, hi, shape).astype(dtype)


def _uniform(z: np.ndarray) -> np.ndarray:
    """[0, 1) from each uint64 by splitmix64's finaliser (53 bits, exact in float64)."""
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def pack(outputs: Sequence[np.ndarray]) -> bytes:
    """The recorded sample of each output (flat indices, values) as one .npz member."""
    arrays = {}
    for j, a in enumerate(outputs):
        flat = np.asarray(a, np.float32).reshape(-1)
        if flat.size > SAMPLE:
            idx = np.sort(np.random.default_rng(j).choice(flat.size, SAMPLE, replace=False))
        else:
            idx = np.arange(flat.size)
        arrays[f"i{j}"], arrays[f"v{j}"] = idx.astype(np.int64 if flat.size >= 2 ** 31 else np.int32), flat[idx]
    buf = io.BytesIO()
    # compressed: bundles store members as they are, and sorted indices shrink ~3x (PicoDet's eight
    # outputs: 1.1 MB -> 0.46 MB, 1.8% of its bundle)
    np.savez_compressed(buf, version=np.int64(PROBE_VERSION), **arrays)
    return buf.getvalue()


def unpack(data: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """``pack``'s member back as (flat indices, values) per output; ValueError when it is not one."""
    try:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("an array, not an .npz archive")
        with z:
            version = int(z["version"])
            n = sum(1 for k in z.files if k[0] == "v" and k[1:].isdigit())
            recorded = [(z[f"i{j}"], z[f"v{j}"]) for j in range(n)]
    except Exception as e:  # whatever numpy and zipfile raise for bytes that are no .npz
        raise ValueError(f"not a probe member ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if version != PROBE_VERSION:
        raise ValueError(f"probe version {version}, this reader knows {PROBE_VERSION}")
    return recorded


def sampled(outputs: Sequence[np.ndarray], recorded: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """The elements of ``outputs`` the probe recorded, in its order (to compare with its values)."""
    if len(outputs) != len(recorded):
        raise ValueError(f"{len(outputs)} outputs, the probe recorded {len(recorded)}")
    try:
        return [np.asarray(a).reshape(-1)[idx] for a, (idx, _) in zip(outputs, recorded)]
    except IndexError as e:
        raise ValueError(f"an output is smaller than the probe recorded ({e})") from None
