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

# 2: the sampled indices are generated (``sample_indices``: n{j}, p{j}) instead of stored, and
# integer outputs keep their dtype: an INT8 order's probe was int32 indices + float32 values per
# element, 8 bytes for a 1-byte code (EfficientNet-Lite0 INT8: 0.59 of its 8.69 MB). Readers take 1 and 2;
# only format-4 bundles (hmod.FALLBACK_LIB_FORMAT_VERSION: every bundle with an ACL order) hold version 2.
PROBE_VERSION = 2
PROBE_VERSIONS = frozenset({1, PROBE_VERSION})

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


def sample_indices(n: int, p: int) -> np.ndarray:
    """The flat indices a version-2 probe samples of an ``n``-element output: k*p mod n for
    k < min(n, SAMPLE), sorted. ``p`` is coprime to n, so they are distinct, and large, so they
    spread over every channel and position (no random generator: its stream may change between
    numpy versions)."""
    k = min(n, SAMPLE)
    return np.sort((np.arange(k, dtype=np.int64) * p) % n) if n else np.zeros(0, np.int64)


def _multiplier(n: int) -> int:
    p = 1_000_003  # a prime: coprime to every n it does not divide
    while n % p == 0:
        p += 2
        while any(p % d == 0 for d in range(3, int(p ** 0.5) + 1, 2)):
            p += 2
    return p


def pack(outputs: Sequence[np.ndarray], drift: Sequence[tuple[float, float] | None] | None = None) -> bytes:
    """The recorded sample of each output (its size and multiplier, and the values at
    ``sample_indices``) as one .npz member; ``drift``: per quantized output, how far a correct
    implementation that rounds its requantizations differently moved it (:func:`drift`)."""
    arrays: dict[str, np.ndarray] = {"version": np.int64(PROBE_VERSION)}
    for j, a in enumerate(outputs):
        a = np.asarray(a)
        flat = a.reshape(-1) if a.dtype.kind in "iub" else a.astype(np.float32).reshape(-1)
        p = _multiplier(flat.size)
        arrays[f"n{j}"], arrays[f"p{j}"] = np.int64(flat.size), np.int64(p)
        arrays[f"v{j}"] = flat[sample_indices(flat.size, p)]
        if drift is not None and drift[j] is not None:
            arrays[f"d{j}"] = np.array(drift[j], np.float64)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def unpack(data: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """``pack``'s member back as (flat indices, float32 values) per output; ValueError when it is
    not one."""
    try:
        z = np.load(io.BytesIO(data), allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("an array, not an .npz archive")
        with z:
            version = int(z["version"])
            if version not in PROBE_VERSIONS:
                raise _Version(version)
            n = sum(1 for k in z.files if k[0] == "v" and k[1:].isdigit())
            recorded = []
            for j in range(n):
                v = z[f"v{j}"].astype(np.float32)
                if version == 1:
                    idx = z[f"i{j}"]
                else:
                    size, p = int(z[f"n{j}"]), int(z[f"p{j}"])
                    if not 0 <= size < 2 ** 40 or p < 1 or (size and math.gcd(size, p) != 1):
                        raise ValueError(f"output {j}: size {size}, multiplier {p}")
                    idx = sample_indices(size, p)
                if idx.shape != v.shape:
                    raise ValueError(f"output {j}: {idx.size} indices, {v.size} values")
                recorded.append((idx, v))
    except _Version as e:
        raise ValueError(f"probe version {e.args[0]}, this reader knows {sorted(PROBE_VERSIONS)}") from None
    except Exception as e:  # whatever numpy and zipfile raise for bytes that are no .npz
        raise ValueError(f"not a probe member ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    return recorded


class _Version(Exception):
    pass


# An INT8 order's drift (optional ``d{j}`` entries, 2026-12-05; readers that do not know them keep
# the strict rule): [fraction of the output's elements more than 1 step off, most steps off] between
# the order as the compiler ran it and the same order with one requantization in twenty rounding a
# step the other way (compiler/stages/check_facts.requant_flips). One-step differences grow layer by
# layer: EfficientNet-Lite0's residual blocks in one order ended 8% of their elements more than a
# step apart, up to 45 steps, whichever layers rounded differently, and ACL on CpuAcc was as far
# (8.6%, 41 steps) while the model's logits stayed within 2 of their 7 steps.
def drift(data: bytes) -> list[tuple[float, float] | None]:
    """Per output, the recorded drift (fraction, steps), or None where the probe has none."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            n = sum(1 for k in z.files if k[0] == "v" and k[1:].isdigit())
            out: list[tuple[float, float] | None] = []
            for j in range(n):
                d = z[f"d{j}"].astype(np.float64).reshape(-1) if f"d{j}" in z.files else None
                ok = d is not None and d.size == 2 and bool(np.all(np.isfinite(d))) and bool(np.all(d >= 0))
                out.append((float(d[0]), float(d[1])) if ok else None)
            return out
    except Exception as e:
        raise ValueError(f"not a probe member ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None


def sampled(outputs: Sequence[np.ndarray], recorded: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """The elements of ``outputs`` the probe recorded, in its order (to compare with its values)."""
    if len(outputs) != len(recorded):
        raise ValueError(f"{len(outputs)} outputs, the probe recorded {len(recorded)}")
    try:
        return [np.asarray(a).reshape(-1)[idx] for a, (idx, _) in zip(outputs, recorded)]
    except IndexError as e:
        raise ValueError(f"an output is smaller than the probe recorded ({e})") from None
