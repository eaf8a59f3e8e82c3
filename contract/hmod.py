"""The hybrid module bundle (``.hmod``): the one definition of the format, used by both sides.

The compiler writes bundles with :func:`write_bundle`; the agent reads them with
:func:`open_bundle`. See ``docs/bundle-format.md`` for the layout. Depends only on the stdlib,
numpy and cryptography so that a board can install it without the compiler stack.

``open_bundle`` checks everything before anything from the bundle is used, in this order:
container -> member names/types -> format version -> signature -> member hashes -> no extras.

Every error is a :class:`BundleError` whose ``exit_code`` a CLI can return directly:

====  ====================  ==========================================================
code  error                 meaning
====  ====================  ==========================================================
10    NotABundle            missing/truncated file, not a zip, no or malformed manifest
11    UnsafeMember          absolute/``..``/backslash name, link, dir, compressed entry
12    HashMismatch          a member's sha256 differs from the manifest
13    MissingMember         a member listed in the manifest is absent
14    BadSignature          signature does not verify with any trusted key
15    UnsignedBundle        no signature, but trusted keys are configured
16    FormatVersionError    unsupported format_version (or order_version)
17    NoLibForArch          no target for this machine's architecture
18    ExtraMember           a member is present but not listed in the manifest
19    KeyFileError          a key file is missing, of the wrong kind, or would be overwritten
====  ====================  ==========================================================
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import platform
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any, Union

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import durable, orders, probe
from .orders import ORDER_VERSION, ORDER_VERSIONS
from .signing import (key_fingerprint, generate_keypair, write_exclusive, read_key_file, load_private_key,  # noqa: F401  (re-exported)
                      load_public_key, public_key_from_pem, public_key_pem, command_bytes, sign_command,
                      verify_command, load_trusted)

__all__ = [
    "FORMAT_VERSION", "PLAIN_FORMAT_VERSION", "ORDER_VERSION", "ORDER_VERSIONS", "MANIFEST", "SIGNATURE", "SUFFIX",
    "BundleError", "NotABundle", "UnsafeMember", "HashMismatch", "MissingMember", "ExtraMember",
    "BadSignature", "UnsignedBundle", "FormatVersionError", "NoLibForArch", "KeyFileError",
    "Bundle", "open_bundle", "write_bundle", "generate_keypair", "load_private_key",
    "load_public_key", "key_fingerprint", "machine_arch", "normalize_arch", "fallback_lib",
    "fallback_function", "format_version_for", "pack_lib", "unpack_lib", "packed_lib", "PACKED", "LIB_PARAMS",
]

# 2: golden inputs may be generated (``{"inputs": "probe", "seed": k}``) instead of stored: a
# detector's two 640x480 noise images were half of CenterFace's bundle. Readers take 1 and 2.
# A uint8 model input (raw pixels the graph normalises) needs no new version: every format-2 reader
# makes its golden inputs as uint8 codes (probe.inputs) and feeds it the frame's pixels as they are
# (tests/agent/test_uint8_readers.py reads such a manifest as the agent does).
# 3: the manifest may have a ``tail`` (contract/tail.py): onnxruntime runs the model's end after the VM.
# A bundle is written with the lowest version that describes it (3 only with a tail), so agents
# that know 2 still run every other bundle, and refuse one with a tail instead of returning the VM's
# outputs as the model's.
# 4: one TVM fallback library per target for every delegated subgraph (``fallback/<target>.so``, a
# function per subgraph: fallback_function), instead of one library per subgraph and target: each
# carried ~65 KB of TVM's runtime glue whatever its code (a 51-subgraph classifier: 6.6 MB of its 7.5).
# Order probes may be probe version 2 (generated indices). A target may have ``lib_params``: the TVM
# main module's weights, out of its libraries and stored once for every target in LIB_PARAMS (a
# quantized kernel as its int8 codes). Written only for a bundle that has either (format_version_for),
# so every other bundle keeps the version older agents run.
FORMAT_VERSION = 4
FALLBACK_LIB_FORMAT_VERSION = 4
TAIL_FORMAT_VERSION = 3
PLAIN_FORMAT_VERSION = 2   # a bundle without a tail or one fallback library per target
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
SUFFIX = ".hmod"

SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2, TAIL_FORMAT_VERSION, FORMAT_VERSION})
#: the TVM main module's weights, one member for every target's lib (format_version 4: lib_params)
LIB_PARAMS = "lib/params.bin"
GENERATED = "probe"   # a golden pair's "inputs" when they are probe.inputs(manifest, seed)
_RESERVED = frozenset({MANIFEST, SIGNATURE})
CHUNK = 1 << 20
# Fixed timestamp and mode so that the same inputs give a byte-identical bundle.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_ZIP_MODE = (stat.S_IFREG | 0o644) << 16

PathLike = Union[str, "os.PathLike[str]"]
KeySource = Union[Ed25519PublicKey, PathLike]


from .bundle_errors import (BundleError, NotABundle, UnsafeMember, HashMismatch, MissingMember,  # noqa: F401  (re-exported)
                            BadSignature, UnsignedBundle, FormatVersionError, NoLibForArch, ExtraMember, KeyFileError)


# ---------------------------------------------------------------------------------- arch / keys
_ARCH_ALIASES = {"arm64": "aarch64", "armv8": "aarch64", "amd64": "x86_64", "x64": "x86_64"}


def blob_array(blob: bytes, spec: Mapping[str, Any]) -> np.ndarray:
    """The little-endian array ``spec`` ({offset, nbytes, shape, dtype}) places in ``blob``, as a
    read-only view. Raises ValueError when the range does not hold that shape and dtype."""
    dt = np.dtype(spec["dtype"]).newbyteorder("<")
    shape = tuple(int(d) for d in spec["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    off, nbytes = int(spec["offset"]), int(spec["nbytes"])
    if nbytes != count * dt.itemsize or off < 0 or off + nbytes > len(blob):
        raise ValueError(f"{nbytes} bytes at offset {off} do not hold {list(shape)} {spec['dtype']} "
                         f"inside a {len(blob)}-byte blob")
    return np.frombuffer(blob, dt, count, off).reshape(shape)


def fallback_lib(target: str) -> str:
    """The member holding every subgraph's TVM fallback for ``target`` (format_version 4), packed."""
    return f"fallback/{target}.so{PACKED}"


#: a library member named so is zlib data (pack_lib), format_version 4: code deflates to a quarter,
#: and a library is written out to disk to be loaded anyway (zip members stay stored, so agents
#: before 4 refuse such a bundle by its version, not as an unsafe entry)
PACKED = ".z"


def packed_lib(target: str) -> str:
    """The member of ``target``'s main library in a format-4 bundle (packed)."""
    return f"lib/{target}.so{PACKED}"


#: what a packed library may unpack to at most (a bomb is refused, not inflated)
UNPACKED_MAX = 256 << 20


def pack_lib(data: bytes) -> bytes:
    return zlib.compress(data, 9)


def unpack_lib(data: bytes, member: str) -> bytes:
    """A packed library's bytes; NotABundle when they are no zlib data or unpack past UNPACKED_MAX."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, UNPACKED_MAX)
        if d.unconsumed_tail or not d.eof:
            raise ValueError(f"more than {UNPACKED_MAX} bytes, or truncated")
    except (zlib.error, ValueError) as e:
        raise NotABundle(f"member {member!r} is no packed library ({e})") from None
    return out


def format_version_for(manifest: Mapping[str, Any]) -> int:
    """The oldest format that holds ``manifest``: 4 when a target's fallbacks are its one library
    (fallback_lib) or its lib takes lib_params, 3 with a tail, else 2, so agents that know only an
    older one still run it."""
    targets = manifest.get("targets") if isinstance(manifest.get("targets"), Mapping) else {}
    for name, t in targets.items():
        if not isinstance(t, Mapping):
            continue
        fb = t.get("fallback")
        if (isinstance(fb, Mapping) and fallback_lib(name) in fb.values() or t.get("lib_params")
                or str(t.get("lib", "")).endswith(PACKED)):
            return FALLBACK_LIB_FORMAT_VERSION
    return TAIL_FORMAT_VERSION if manifest.get("tail") else PLAIN_FORMAT_VERSION


def param_arrays(read: Callable[[str], bytes], specs: Iterable[Mapping[str, Any]]) -> list[np.ndarray]:
    """The arrays a list of parameter specs ({member, offset, nbytes, shape, dtype, perm?}: a
    target's ``lib_params``, a partition's ``fallback_params``) places in bundle members, each
    member read once through ``read``. ValueError naming the spec when one does not fit."""
    blobs: dict[str, bytes] = {}
    out = []
    for i, spec in enumerate(specs):
        try:
            member = spec["member"]
            if member not in blobs:
                blobs[member] = read(member)
            a = blob_array(blobs[member], spec)
            perm = spec.get("perm")
            if perm is not None:
                if sorted(perm) != list(range(a.ndim)):
                    raise ValueError(f"perm {perm} does not fit {list(a.shape)}")
                a = a.transpose(perm)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"[{i}] in {spec.get('member') if isinstance(spec, Mapping) else spec!r}: "
                             f"{err}") from None
        out.append(a)
    return out


def fallback_function(format_version: Any, symbol: str) -> str:
    """The function of a subgraph's TVM fallback library that runs it (``<it>_transform_params``
    turns its weights into what it takes): ``main`` of its own library before format_version 4,
    ``<symbol>`` of the target's one library since."""
    ok = isinstance(format_version, int) and format_version >= FALLBACK_LIB_FORMAT_VERSION
    return symbol if ok else "main"


def normalize_arch(arch: str) -> str:
    """Map OS spellings (macOS/Windows ``arm64``/``AMD64``) to the manifest's names."""
    a = arch.strip().lower()
    return _ARCH_ALIASES.get(a, a)


def _release_number(v: Any) -> tuple[int, ...] | None:
    """``"2"``, ``"v1.10.3"`` -> (2,), (1, 10, 3); anything else (``"arm-only"``) -> None."""
    text = str(v).strip().lower().removeprefix("v") if v is not None else ""
    parts = text.split(".")
    return tuple(int(x) for x in parts) if text and all(x.isdigit() for x in parts) else None


def downgrade_reason(new: Mapping[str, Any], old: Mapping[str, Any]) -> str | None:
    """Why the bundle with manifest ``new`` is older than the one with manifest ``old`` (TUF's
    rollback-attack defence: a validly signed old bundle replayed), or None.

    In order, the first that both manifests have decides: ``build`` (an integer the build
    system counts up), ``model.version`` when both are release numbers of the same model
    (``2`` < ``10``, ``1.2`` < ``1.10``), then ``created`` (the signed build time, which every
    bundle has). Equal is not older: the same build again is a no-op for the slots, not a replay."""
    nb, ob = new.get("build"), old.get("build")
    if isinstance(nb, int) and isinstance(ob, int) and not isinstance(nb, bool) and not isinstance(ob, bool):
        return f"build {nb} is older than the committed build {ob}" if nb < ob else None
    nm, om = new.get("model") or {}, old.get("model") or {}
    nv, ov = _release_number(nm.get("version")), _release_number(om.get("version"))
    if nv is not None and ov is not None and nm.get("name") == om.get("name"):
        if nv == ov:
            return None
        return (f"version {nm.get('version')} is older than the committed version {om.get('version')}"
                if nv < ov else None)
    nc, oc = str(new.get("created") or ""), str(old.get("created") or "")
    if nc and oc and nc < oc:  # ISO-8601 UTC strings of one format sort as times
        return f"built {nc}, before the committed bundle ({oc})"
    return None


def machine_arch() -> str:
    """This machine's architecture as the manifest spells it (``aarch64``, ``x86_64``, ...)."""
    return normalize_arch(platform.machine())


# ------------------------------------------------------------------------------------- helpers
def _check_name(name: str) -> None:
    """Member names are plain relative POSIX paths, so extraction can never leave the dest dir."""
    if not isinstance(name, str) or not name:
        raise UnsafeMember(f"member name {name!r} is empty or not a string")
    if "\\" in name or "\x00" in name:
        raise UnsafeMember(f"member {name!r} contains a backslash or NUL")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeMember(f"member {name!r} is an absolute path")
    parts = name.split("/")
    if ".." in parts:
        raise UnsafeMember(f"member {name!r} contains '..'")
    if any(p in ("", ".") for p in parts):
        raise UnsafeMember(f"member {name!r} is not a normalised path (empty or '.' segment)")


def _check_entry(info: zipfile.ZipInfo) -> None:
    mode = info.external_attr >> 16
    if not info.filename:  # before is_dir(), which indexes the name (the bundle fuzzer found it)
        raise UnsafeMember("a member has an empty name")
    # Checked whatever create_system claims: a crafted zip can say "DOS" and still carry a link.
    if info.is_dir() or info.external_attr & 0x10 or stat.S_ISDIR(mode):
        raise UnsafeMember(f"member {info.filename!r} is a directory entry")
    _check_name(info.filename)
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
        kind = "a symlink" if stat.S_ISLNK(mode) else f"not a regular file (mode {mode:o})"
        raise UnsafeMember(f"member {info.filename!r} is {kind}")
    if info.flag_bits & 0x1:
        raise UnsafeMember(f"member {info.filename!r} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED:
        # The format is stored-only; refusing compression also rules out decompression bombs.
        raise UnsafeMember(f"member {info.filename!r} is compressed (bundles are stored-only)")


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    # Deterministic so that a signature over these bytes is reproducible; NaN is not JSON.
    return (json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False)
            + "\n").encode("utf-8")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:  # parsers disagree on which duplicate wins; don't let a signed file be ambiguous
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _sha256_stream(f: IO[bytes]) -> str:
    h = hashlib.sha256()
    while chunk := f.read(CHUNK):
        h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------- writing
def write_bundle(out_path: PathLike, manifest: Mapping[str, Any],
                 members: Mapping[str, bytes | Path],
                 private_key: Ed25519PrivateKey | PathLike | None = None) -> dict[str, Any]:
    """Write a bundle atomically: either a complete, good file appears at out_path, or nothing
    changes there. ``members`` maps member name to its bytes or to a file to copy. The caller's
    manifest is not modified; the manifest as written (with ``files`` and ``format_version``)
    is returned."""
    out = Path(out_path)
    for name, src in members.items():
        _check_name(name)
        if name in _RESERVED:
            raise UnsafeMember(f"member name {name!r} is reserved for the bundle itself",
                               "rename the member")
        if not isinstance(src, (bytes, bytearray, memoryview, Path)):
            raise TypeError(f"member {name!r}: expected bytes or pathlib.Path, not {type(src)}")
    key = (private_key if isinstance(private_key, Ed25519PrivateKey) or private_key is None
           else load_private_key(private_key))

    man = copy.deepcopy(dict(manifest))
    man["format_version"] = format_version_for(man)
    # Temp file in the same directory, so os.replace is an atomic rename on one filesystem.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w+b") as f:
            files: dict[str, str] = {}
            for name in sorted(members):
                src = members[name]
                if isinstance(src, Path):
                    with src.open("rb") as sf:
                        files[name] = _sha256_stream(sf)
                else:
                    files[name] = hashlib.sha256(src).hexdigest()
            man["files"] = files
            mbytes = _manifest_bytes(man)

            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
                zf.writestr(_zinfo(MANIFEST, len(mbytes)), mbytes)
                if key is not None:
                    sig = key.sign(mbytes)
                    zf.writestr(_zinfo(SIGNATURE, len(sig)), sig)
                for name in sorted(members):
                    _write_member(zf, name, members[name], files[name])
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a bundle is not secret
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    durable.fsync_dir(out.parent)
    return man


def _zinfo(name: str, size: int) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
    zi.compress_type = zipfile.ZIP_STORED
    zi.create_system = 3  # unix, so readers interpret external_attr as a mode
    zi.external_attr = _ZIP_MODE
    zi.file_size = size  # lets zipfile pick zip64 up front for big members
    return zi


def _write_member(zf: zipfile.ZipFile, name: str, src: bytes | Path, sha: str) -> None:
    if not isinstance(src, Path):
        zf.writestr(_zinfo(name, len(src)), bytes(src))
        return
    with src.open("rb") as sf:
        size = os.fstat(sf.fileno()).st_size
        h = hashlib.sha256()
        with zf.open(_zinfo(name, size), "w", force_zip64=size >= zipfile.ZIP64_LIMIT) as dst:
            while chunk := sf.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
    if h.hexdigest() != sha:  # streamed, not buffered: catch a file changing under us
        raise RuntimeError(f"{src} changed while the bundle was being written; try again")


# ------------------------------------------------------------------------------------- reading
def is_bundle(path: PathLike) -> bool:
    """Whether ``path`` looks like a bundle (a zip with a manifest): for the one-line hint when a
    bundle is given where a model is expected. Not a check of the bundle."""
    try:
        with zipfile.ZipFile(path) as z:
            return MANIFEST in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def open_bundle(path: PathLike, trusted_keys: Iterable[KeySource] = (),
                require_signature: bool | None = None) -> Bundle:
    """Open and fully verify a bundle; nothing in it is used before every check passes.

    With trusted keys, a signature is required (unless ``require_signature=False``) and must
    verify with one of them. Without keys, a signature is not checked: the bundle reports
    ``signed=True, verified_by=None``. ``require_signature=True`` without keys is a
    configuration error (ValueError)."""
    keys = load_trusted(trusted_keys)
    if require_signature is None:
        require_signature = bool(keys)
    if require_signature and not keys:
        raise ValueError("require_signature=True needs at least one trusted key")

    p = Path(path)
    try:
        zf = zipfile.ZipFile(p, "r")
    except FileNotFoundError:
        raise NotABundle(f"{p} does not exist") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise NotABundle(f"{p} is not a readable zip ({e})") from None
    try:
        manifest, signed, verified_by = _verify(p, zf, keys, require_signature)
    except BaseException:
        zf.close()
        raise
    return Bundle(p, zf, manifest, signed, verified_by)


def _verify(p: Path, zf: zipfile.ZipFile, keys: list[Ed25519PublicKey],
            require_signature: bool) -> tuple[dict[str, Any], bool, str | None]:
    infos = zf.infolist()
    names = [i.filename for i in infos]
    if MANIFEST not in names:
        raise NotABundle(f"{p} has no {MANIFEST}")

    # 1. Every entry is a safe regular file, named once (duplicates make "which one?" ambiguous).
    for info in infos:
        _check_entry(info)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise UnsafeMember(f"{p} has duplicate entries {dup}")

    # 2. Manifest parses and has a version we understand.
    try:
        mbytes = zf.read(MANIFEST)
        manifest = json.loads(mbytes.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        raise NotABundle(f"{p}: {MANIFEST} is unreadable or not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise NotABundle(f"{p}: {MANIFEST} is not a JSON object")
    ver = manifest.get("format_version")
    if type(ver) is not int or ver not in SUPPORTED_FORMAT_VERSIONS:
        raise FormatVersionError(
            f"{p} has format_version {ver!r}; this agent supports "
            f"{sorted(SUPPORTED_FORMAT_VERSIONS)}")

    # 3. Signature over the exact manifest bytes (which in turn pin every member's hash).
    signed = SIGNATURE in names
    verified_by = None
    if not signed and require_signature:
        files = manifest.get("files")
        extra = sorted(set(names) - set(files) - _RESERVED) if isinstance(files, dict) else []
        if extra:  # e.g. a renamed manifest.sig: name the member, the true cause
            raise ExtraMember(f"{p}: member(s) {extra} are not listed in the manifest, and there is no "
                              f"{SIGNATURE} (was it renamed?)")
        raise UnsignedBundle(f"{p} is not signed but trusted keys are configured")
    if signed and keys:
        try:
            sig = zf.read(SIGNATURE)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise BadSignature(f"{p}: {SIGNATURE} is unreadable ({e})") from None
        for k in keys:
            try:
                k.verify(sig, mbytes)
            except InvalidSignature:
                continue
            verified_by = key_fingerprint(k)
            break
        else:
            fps = ", ".join(key_fingerprint(k) for k in keys)
            raise BadSignature(f"{p}: signature does not verify with any trusted key ({fps})")

    # 4. Every listed member is present with the promised hash; nothing else is in the zip.
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise NotABundle(f"{p}: {MANIFEST} has no valid 'files' table")
    present = set(names)
    for name in sorted(files):
        if name not in present:
            raise MissingMember(f"{p}: member {name!r} is listed in the manifest but absent")
        actual = _member_sha(zf, name)
        if actual != files[name].lower():
            raise HashMismatch(f"{p}: member {name!r} has sha256 {actual[:16]}..., "
                               f"manifest says {files[name][:16]}...")
    extra = sorted(present - set(files) - _RESERVED)
    if extra:
        raise ExtraMember(f"{p}: member(s) {extra} are not listed in the manifest")
    return manifest, signed, verified_by


def _member_sha(zf: zipfile.ZipFile, name: str) -> str:
    try:
        with zf.open(name) as f:
            return _sha256_stream(f)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        # e.g. zip CRC error: the bytes on disk are not the ones that were written
        raise HashMismatch(f"member {name!r} is corrupt ({e})") from None


class Bundle:
    """A verified, open bundle. Get one from :func:`open_bundle`, not by constructing it."""

    def __init__(self, path: Path, zf: zipfile.ZipFile, manifest: dict[str, Any],
                 signed: bool, verified_by: str | None) -> None:
        self.path = path
        self.manifest = manifest
        self.signed = signed
        self.verified_by = verified_by  # fingerprint of the trusted key that verified it
        self._zf = zf

    @property
    def verified(self) -> bool:
        return self.verified_by is not None

    @property
    def members(self) -> list[str]:
        return sorted(self.manifest["files"])

    def read(self, member: str) -> bytes:
        """Bytes of a listed member, re-hashed on every read: the file on disk could have been
        changed in place since open_bundle checked it."""
        sha = self.manifest["files"].get(member)
        if sha is None:
            raise MissingMember(f"{self.path} has no member {member!r}",
                                "check the name against the manifest's 'files'")
        try:
            data = self._zf.read(member)
        except (zipfile.BadZipFile, OSError, EOFError, KeyError) as e:
            raise HashMismatch(f"{self.path}: member {member!r} is unreadable ({e})") from None
        if hashlib.sha256(data).hexdigest() != sha.lower():
            raise HashMismatch(f"{self.path}: member {member!r} changed since it was verified")
        return data

    def _partition(self, symbol: str) -> dict[str, Any]:
        for part in self.manifest.get("partitions") or ():
            if isinstance(part, dict) and part.get("symbol") == symbol:
                return part
        return {}

    def order(self, symbol: str) -> dict[str, Any]:
        """The order (delegated subgraph) for ``symbol``, with its order_version checked."""
        name = self._partition(symbol).get("order") or f"orders/{symbol}.json"
        try:
            order = json.loads(self.read(name).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise NotABundle(f"{self.path}: order {name!r} is not valid JSON ({e})") from None
        ver = order.get("order_version") if isinstance(order, dict) else None
        if type(ver) is not int or ver not in ORDER_VERSIONS:
            raise FormatVersionError(f"{self.path}: order {name!r} has order_version {ver!r}; "
                                     f"this agent supports {', '.join(map(str, ORDER_VERSIONS))}")
        if ver >= orders.SCALE_REF_ORDER_VERSION:   # scale lists may be references into the blob
            try:
                order = orders.resolve_scales(order, self.weights(symbol))
            except ValueError as e:
                raise NotABundle(f"{self.path}: order {name!r}: {e}") from None
        return order

    def library(self, member: str) -> bytes:
        """A TVM library member's bytes as the loader takes them (unpacked when PACKED)."""
        data = self.read(member)
        return unpack_lib(data, member) if member.endswith(PACKED) else data

    def weights(self, symbol: str) -> bytes:
        """Raw weights blob of ``symbol`` (offsets are in the order's ``weights`` table)."""
        return self.read(self._partition(symbol).get("weights") or f"orders/{symbol}.bin")

    def _npy(self, member: str) -> np.ndarray:
        # allow_pickle=False: a .npy from a bundle must never be able to run code
        return np.load(io.BytesIO(self.read(member)), allow_pickle=False)

    def golden(self) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
        """Golden (inputs, outputs) pairs recorded by the compiler; generated inputs are made
        here, bit for bit as the compiler made them (contract/probe.py)."""
        pairs = []
        for g in self.manifest.get("golden") or ():
            ins = g.get("inputs", ())
            if ins == GENERATED:
                seed = g.get("seed")
                if type(seed) is not int or not 1 <= seed < 4096:
                    raise NotABundle(f"{self.path}: a golden pair's generated inputs have seed {seed!r}, not 1..4095")
                ins = probe.inputs({"inputs": self.manifest.get("inputs") or []}, seed=seed)
            else:
                ins = [self._npy(m) for m in ins]
            pairs.append((ins, [self._npy(m) for m in g.get("outputs", ())]))
        return pairs

    def lib_for(self, arch: str | None = None) -> str:
        """Name of the target built for ``arch`` (default: this machine)."""
        want = normalize_arch(arch) if arch else machine_arch()
        targets = self.manifest.get("targets") or {}
        have = {t: normalize_arch(str(v.get("arch", "?")))
                for t, v in sorted(targets.items()) if isinstance(v, dict)}
        for t, a in have.items():
            if a == want:
                return t
        listing = ", ".join(f"{t} ({a})" for t, a in have.items()) or "none"
        raise NoLibForArch(f"{self.path} has no lib for {want}; it has: {listing}",
                           f"recompile the model with a target for {want}")

    def extract(self, dest_dir: PathLike) -> Path:
        """Write the manifest, signature and all members under ``dest_dir``; returns it."""
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        root = dest.resolve()
        names = [MANIFEST] + ([SIGNATURE] if self.signed else []) + self.members
        for name in names:
            _check_name(name)
            data = self.read(name) if name not in _RESERVED else self._zf.read(name)
            target = root / name
            # Names are already safe, but a pre-existing symlink in dest could redirect a parent:
            # check the resolved parent before creating anything, and again after.
            for _ in range(2):
                if not target.parent.resolve().is_relative_to(root):
                    raise UnsafeMember(f"extracting {name!r} would leave {root}",
                                       "remove symlinks from the destination directory")
                target.parent.mkdir(parents=True, exist_ok=True)
            # O_NOFOLLOW: never write through a symlink planted at the final component.
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
            try:
                fd = os.open(target, flags, 0o644)
            except OSError as e:
                raise UnsafeMember(f"cannot write {target} ({e.strerror or e})",
                                   "extract into a fresh directory") from None
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return root

    def close(self) -> None:
        self._zf.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"verified by {self.verified_by}" if self.verified else (
            "signed, not verified" if self.signed else "unsigned")
        return f"<Bundle {self.path} ({state})>"
