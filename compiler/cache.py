"""The compile cache: a model compiled once per machine for the same bytes, options and compiler.

Users recompile the same model with the same flags all day (a CI job per commit, a demo script,
a test suite); a compile is seconds for a tiny model and a minute for a detector. Each entry is
the bundle a compile wrote, unsigned, under a key made of

* the model's bytes (and those of any external-data file it names),
* every option that changes what the compiler writes (``Options`` minus the manifest-only ones:
  the signing key, ``version``, ``build``, and how frames become inputs and outputs results:
  ``--mean/--std/--bgr/--resize/...``, ``--decoder`` and its options, ``--labels``; files given
  as options by their content),
* the compiler's own source: every ``.py`` of tandoor_compiler, tandoor_contract and
  tandoor_agent (the self-check and ``--measure`` run the agent's code), so a changed compiler
  never hits a stale entry,
* the libraries that shape the output (apache-tvm, onnx, onnxruntime, numpy) and this machine's
  CPU (the host lib is built for its x86-64 level; ``--measure`` decides from its times).

A hit rewrites the entry with this compile's manifest-only fields, ``created`` and signature, and
records ``cache: {key, hit: true, compiled}`` in the manifest (``tandoor inspect`` shows it).
Entries are written whole (temp + rename) under a per-key lock, so two processes compiling the same
model wait for one compile instead of doing two. The oldest entries go when the cache passes its
size (TANDOOR_COMPILE_CACHE_MB, default 4096).

Where: ``$TANDOOR_COMPILE_CACHE``, else ``$TANDOOR_CACHE/compile``, else ``~/.cache/tandoor/compile``;
TANDOOR_COMPILE_CACHE=0 (or ``off``) turns it off, as ``tandoor compile --no-cache`` does per run.
Nothing here imports TVM: a hit costs the hashing and one bundle rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandoor_contract import durable

#: bump when an entry's layout or the key's recipe changes
CACHE_VERSION = 1
#: Options fields that only the manifest (or the signature) holds: rewritten on a hit, not keyed
MANIFEST_ONLY = ("key", "version", "build", "check", "cache",
                 # pipeline._media: what frames and results are, not what is compiled
                 "labels", "mean", "std", "layout", "bgr", "resize", "letterbox_align", "pad_value", "pixel_range",
                 "decoder", "decoder_options")
#: option fields that name files: keyed by their content; directories: by their files' content
FILE_OPTIONS = ("profile",)
DIR_OPTIONS = ("gpu_tuning",)
# options that are lists of lists of arrays (the NPU's calibration inputs): keyed by their bytes
ARRAY_OPTIONS = ("npu_samples",)
PACKAGES = ("tandoor_compiler", "tandoor_contract", "tandoor_agent")
LIBRARIES = ("apache-tvm", "apache-tvm-ffi", "onnx", "onnxruntime", "numpy", "nvidia-cuda-nvrtc")   # NVRTC: the cubins
DEFAULT_MB = 4096
OFF = ("0", "off", "no", "false")


def directory() -> Path | None:
    """The cache's directory, or None when TANDOOR_COMPILE_CACHE turns it off."""
    env = os.environ.get("TANDOOR_COMPILE_CACHE", "").strip()
    if env.lower() in OFF:
        return None
    if env:
        return Path(env).expanduser()
    root = os.environ.get("TANDOOR_CACHE") or Path.home() / ".cache" / "tandoor"
    return Path(root) / "compile"


@dataclass(frozen=True)
class Entry:
    key: str
    bundle: Path           # the cached bundle (unsigned)
    meta: dict             # {"checked": bool, "compiled": iso time, "model": name, ...}


# --------------------------------------------------------------------------------- the key
_SOURCE_HASH: str | None = None


def source_fingerprint() -> str:
    """sha256 over every .py file of the packages the output depends on (names and bytes)."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        import importlib.util

        roots = {}
        for pkg in PACKAGES:
            spec = importlib.util.find_spec(pkg)
            for root in (spec.submodule_search_locations or []) if spec else []:
                roots[pkg] = Path(root)
        _SOURCE_HASH = fingerprint(roots)
    return _SOURCE_HASH


def fingerprint(roots: dict[str, Path]) -> str:
    """sha256 over the .py files under each root, named relative to their package."""
    h = hashlib.sha256()
    for pkg, root in sorted(roots.items()):
        for f in sorted(root.rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            h.update(f"{pkg}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for lib in LIBRARIES:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = ""
    return out


def _machine() -> dict[str, str]:
    """What of this machine shapes the output: its architecture and CPU features (the host lib's
    x86-64 level, measured decisions)."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith(("flags", "Features", "model name", "CPU part")):
                cpu += line.split(":", 1)[-1].strip() + "\n"
                if line.startswith(("flags", "Features")):
                    break
    return {"arch": platform.machine(), "cpu": hashlib.sha256(cpu.encode()).hexdigest()[:16]}


def _external_data(model: Path) -> list[str]:
    """Files next to the model that its tensors name as external data (their bytes are the model's)."""
    try:
        import onnx

        proto = onnx.load(str(model), load_external_data=False)
    except Exception:
        return []   # the compile itself says what is wrong with the file
    names = set()
    for t in list(proto.graph.initializer) + [a.t for n in proto.graph.node for a in n.attribute if a.HasField("t")]:
        for e in t.external_data:
            if e.key == "location":
                names.add(e.value)
    return sorted(names)


def _arrays_digest(samples: list) -> str:
    h = hashlib.sha256()
    for xs in samples:
        for a in xs:
            a = np.ascontiguousarray(a)
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def key(model: str | Path, opts: Any, targets: list[str]) -> str:
    """The cache key of compiling ``model`` with ``opts`` (pipeline.Options) for ``targets``."""
    model = Path(model)
    fields = {}
    for f in dataclasses.fields(opts):
        if f.name in MANIFEST_ONLY:
            continue
        v = getattr(opts, f.name)
        if f.name in FILE_OPTIONS and v is not None:
            v = durable.sha256_file(Path(v))
        if f.name in DIR_OPTIONS and v is not None:
            v = {str(p.relative_to(v)): durable.sha256_file(p) for p in sorted(Path(v).rglob("*")) if p.is_file()}
        if f.name in ARRAY_OPTIONS and v is not None:
            v = _arrays_digest(v)
        fields[f.name] = v
    fields["targets"] = list(targets)
    if getattr(opts, "npu", False):     # the toolkit lives in its own venv: its version by its dist-info
        from .backends.rknn import toolkit as rknn

        fields["rknn_toolkit"] = sorted(p.name for p in rknn.python().parents[1].glob("lib/python*/site-packages/"
                                                                                      "rknn_toolkit2-*.dist-info"))
    ext = {}
    for name in _external_data(model):
        p = model.parent / name
        ext[name] = durable.sha256_file(p) if p.is_file() else "missing"
    recipe = {
        "cache_version": CACHE_VERSION,
        "model": durable.sha256_file(model),
        "external_data": ext,
        "options": fields,
        "source": source_fingerprint(),
        "libraries": _library_versions(),
        "machine": _machine(),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------------- entries
def _paths(root: Path, k: str) -> tuple[Path, Path]:
    return root / f"{k}.hmod", root / f"{k}.json"


def get(k: str) -> Entry | None:
    """The entry for key ``k``, or None (no cache, no entry, or a damaged one: it is dropped)."""
    root = directory()
    if root is None:
        return None
    bundle, meta_path = _paths(root, k)
    try:
        meta = json.loads(meta_path.read_text())
        if not bundle.is_file() or meta.get("key") != k or meta.get("size") != bundle.stat().st_size:
            raise ValueError("incomplete")
    except (OSError, ValueError):
        drop(k)
        return None
    with contextlib.suppress(OSError):
        os.utime(meta_path)   # recently used: pruned last
    return Entry(k, bundle, meta)


def put(k: str, bundle: Path, meta: dict) -> Entry | None:
    """Copy ``bundle`` into the cache as the entry for ``k`` (whole or not at all). A cache that
    cannot be written (read-only, full) is skipped: the compile itself succeeded."""
    root = directory()
    if root is None:
        return None
    dst, meta_path = _paths(root, k)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(bundle, tmp)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        meta = {**meta, "key": k, "size": dst.stat().st_size}
        durable.atomic_write(meta_path, json.dumps(meta, indent=1, sort_keys=True).encode())
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM):
            raise
        drop(k)
        return None
    prune()
    return Entry(k, dst, meta)


def mark_checked(entry: Entry) -> None:
    root = directory()
    if root is None:
        return
    with contextlib.suppress(OSError):
        durable.atomic_write(_paths(root, entry.key)[1],
                             json.dumps({**entry.meta, "checked": True}, indent=1, sort_keys=True).encode())


def drop(k: str) -> None:
    root = directory()
    if root is None:
        return
    for p in _paths(root, k):
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def locked(k: str) -> Iterator[None]:
    """Hold key ``k`` while compiling it: a second compile of the same thing waits, then hits."""
    root = directory()
    if root is None:
        yield
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / f"{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield       # an unwritable cache: compile without it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def entries() -> list[dict]:
    """Every entry's meta (newest use first), for ``tandoor cache``."""
    root = directory()
    if root is None or not root.is_dir():
        return []
    out = []
    for meta_path in root.glob("*.json"):
        try:
            meta = json.loads(meta_path.read_text())
            meta["used"] = meta_path.stat().st_mtime
        except (OSError, ValueError):
            continue
        out.append(meta)
    return sorted(out, key=lambda m: -m["used"])


def prune(max_bytes: int | None = None) -> int:
    """Drop the least recently used entries until the cache holds at most ``max_bytes``
    (TANDOOR_COMPILE_CACHE_MB); returns how many went."""
    if max_bytes is None:
        try:
            max_bytes = int(float(os.environ.get("TANDOOR_COMPILE_CACHE_MB", DEFAULT_MB)) * (1 << 20))
        except ValueError:
            max_bytes = DEFAULT_MB << 20
    ents = entries()
    total = sum(int(m.get("size", 0)) for m in ents)
    dropped = 0
    for m in reversed(ents):      # oldest use first
        if total <= max_bytes:
            break
        drop(m["key"])
        total -= int(m.get("size", 0))
        dropped += 1
    return dropped


def clear() -> int:
    """Remove every entry (and stale lock or temp file); returns how many entries went."""
    root = directory()
    if root is None or not root.is_dir():
        return 0
    n = len(entries())
    for p in root.iterdir():
        if p.suffix in (".hmod", ".json", ".lock", ".tmp"):
            with contextlib.suppress(OSError):
                p.unlink()
    return n
