"""Where a bundle's bytes go (`tandoor inspect --sizes`): its members grouped by what they are,
with the bytes each group takes in the file, the ZIP's own headers included in the total."""

from __future__ import annotations

import zipfile
from pathlib import Path

from tandoor_contract import hmod

# (kind, what it is), in the order they are shown; KIND_OF decides which a member is
KINDS: tuple[tuple[str, str], ...] = (
    ("order weights", "orders/<symbol>.bin: the delegated subgraphs' weights, stored once"),
    ("TVM libraries", "lib/<target>.so: the TVM part, one per target"),
    ("TVM fallbacks", "fallback/<target>.so.z (format 4: one per target, zlib; before: one per subgraph and target)"),
    ("fallback weights", "fallback/<symbol>.params.bin: fallback weights no order holds"),
    ("GPU libraries", "gpu/<target>.<sm>.so.z: the GPU part, one per SM, its kernels cubins (docs/gpu.md)"),
    ("GPU weights", "gpu/lib_params.bin: GPU part weights neither an order nor lib/params.bin holds"),
    ("order JSON", "orders/<symbol>.json"),
    ("ONNX renderings", "orders/<symbol>.onnx (weights: external data in the order's blob)"),
    ("probes", "orders/<symbol>.probe.npz: the load-time check's reference"),
    ("NPU models", "orders/<symbol>.rknn"),
    ("per-axis quant", "orders/<symbol>.tflite: per-channel scales for Arm NN's TfLite parser"),
    ("golden", "golden/*.npy: outputs (and format 1's inputs) replayed by the health check"),
    ("manifest", "manifest.json and manifest.sig"),
    ("other", "labels and anything else"),
)


def kind_of(name: str) -> str:
    if name in (hmod.MANIFEST, hmod.SIGNATURE):
        return "manifest"
    if name.startswith("lib/"):
        return "TVM libraries"
    if name.startswith("fallback/"):
        return "fallback weights" if name.endswith(".params.bin") else "TVM fallbacks"
    if name.startswith("gpu/"):
        return "GPU weights" if name.endswith(".bin") else "GPU libraries"
    if name.startswith("golden/"):
        return "golden"
    if name.startswith("orders/"):
        for suffix, kind in ((".probe.npz", "probes"), (".bin", "order weights"), (".json", "order JSON"),
                             (".onnx", "ONNX renderings"), (".rknn", "NPU models"), (".tflite", "per-axis quant")):
            if name.endswith(suffix):
                return kind
    return "other"


def sizes(path: Path) -> dict:
    """{file_bytes, format_version, kinds: [{kind, what, members, bytes, share}]} for a bundle that
    opens (hmod.open_bundle checks it first: sizes of a damaged file would mislead)."""
    with hmod.open_bundle(path) as b:
        version = b.manifest.get("format_version")
    total = path.stat().st_size
    by: dict[str, list[int]] = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            n = by.setdefault(kind_of(info.filename), [0, 0])
            n[0] += 1
            n[1] += info.compress_size
    kinds = [{"kind": k, "what": what, "members": by[k][0], "bytes": by[k][1], "share": by[k][1] / total}
             for k, what in KINDS if k in by]
    kinds.sort(key=lambda r: -r["bytes"])
    return {"file_bytes": total, "format_version": version,
            "zip_overhead": total - sum(r["bytes"] for r in kinds), "kinds": kinds}


def lines(info: dict) -> list[str]:
    out = [f"{info['file_bytes'] / 1e6:.2f} MB (format_version {info['format_version']})"]
    for r in info["kinds"]:
        out.append(f"  {r['kind']:16s} {r['bytes'] / 1e6:8.3f} MB {100 * r['share']:5.1f}%  "
                   f"{r['members']:4d} member(s)  {r['what']}")
    out.append(f"  {'zip headers':16s} {info['zip_overhead'] / 1e6:8.3f} MB")
    return out
