"""Bundle format: round trips and every way a bundle can be rejected, on real files."""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tandoor_contract import hmod
from tandoor_contract.hmod import (
    BadSignature, BundleError, ExtraMember, FormatVersionError, HashMismatch, KeyFileError,
    MissingMember, NoLibForArch, NotABundle, UnsafeMember, UnsignedBundle,
)

OTHER_ARCH = "riscv64" if hmod.machine_arch() != "riscv64" else "x86_64"


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _manifest(arch: str | None = None) -> dict:
    arch = arch or hmod.machine_arch()
    return {
        "model": {"name": "demo", "version": "1", "source_sha256": "0" * 64},
        "targets": {"t0": {"arch": arch, "lib": "lib/t0.so", "fallback": None, "llvm": {}}},
        "partitions": [{"symbol": "demo_acl_0", "ops": ["Conv"], "delegate": True,
                        "order": "orders/demo_acl_0.json", "weights": "orders/demo_acl_0.bin"}],
        "golden": [{"inputs": ["golden/input_0_0.npy"], "outputs": ["golden/output_0_0.npy"]}],
        "tolerance": {"atol": 1e-4, "rtol": 1e-3},
    }


GOLD_IN = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)
GOLD_OUT = np.array([[0.25, 0.75]], dtype=np.float32)
ORDER = {"order_version": 1, "symbol": "demo_acl_0", "inputs": [], "outputs": [], "tensors": {},
         "weights": {}, "ops": []}


def _members(tmp_path: Path) -> dict:
    lib = tmp_path / "src_t0.so"
    # Bigger than io's read buffer, so members before it are re-read from disk (see below).
    lib.write_bytes(b"\x7fELF" + bytes(range(256)) * 256)
    return {
        "lib/t0.so": lib,  # a Path member is streamed from disk
        "orders/demo_acl_0.json": json.dumps(ORDER).encode(),
        "orders/demo_acl_0.bin": bytes(64) + b"\x01\x02\x03\x04",
        "golden/input_0_0.npy": _npy(GOLD_IN),
        "golden/output_0_0.npy": _npy(GOLD_OUT),
        "labels.txt": b"cat\ndog\n",
    }


@pytest.fixture
def keys(tmp_path: Path) -> dict:
    d = tmp_path / "keys"
    d.mkdir()
    fp = hmod.generate_keypair(d / "a.pem", d / "a.pub")
    hmod.generate_keypair(d / "b.pem", d / "b.pub")
    return {"fp": fp, "priv": d / "a.pem", "pub": d / "a.pub", "other_pub": d / "b.pub",
            "other_priv": d / "b.pem"}


def _write(tmp_path: Path, name: str = "m.hmod", manifest: dict | None = None,
           key=None) -> Path:
    out = tmp_path / name
    hmod.write_bundle(out, manifest or _manifest(), _members(tmp_path), private_key=key)
    return out


def _rezip(src: Path, dst: Path, replace: dict | None = None, drop: set = frozenset(),
           add: list | None = None) -> Path:
    """Copy a bundle entry by entry, optionally replacing/dropping/adding raw entries."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename in drop:
                continue
            zout.writestr(info, replace.get(info.filename, zin.read(info.filename)))
        for info, data in add or ():
            zout.writestr(info, data)
    return dst


def _flip(b: bytes, i: int = -1) -> bytes:
    ba = bytearray(b)
    ba[i] ^= 0x01
    return bytes(ba)


# ------------------------------------------------------------------------------- round trip
def test_round_trip(tmp_path: Path) -> None:
    man = _manifest()
    out = tmp_path / "m.hmod"
    written = hmod.write_bundle(out, man, _members(tmp_path))
    assert "files" not in man  # caller's dict untouched
    assert sorted(os.listdir(tmp_path)) == ["m.hmod", "src_t0.so"]

    with hmod.open_bundle(out) as b:
        assert b.manifest == written
        assert b.manifest["format_version"] == hmod.PLAIN_FORMAT_VERSION
        assert b.path == out and not b.signed and b.verified_by is None
        assert set(b.manifest["files"]) == set(_members(tmp_path))
        assert b.read("labels.txt") == b"cat\ndog\n"
        assert b.read("lib/t0.so") == (tmp_path / "src_t0.so").read_bytes()
        assert b.order("demo_acl_0") == ORDER
        assert b.weights("demo_acl_0").endswith(b"\x01\x02\x03\x04")
        [(ins, outs)] = b.golden()
        np.testing.assert_array_equal(ins[0], GOLD_IN)
        np.testing.assert_array_equal(outs[0], GOLD_OUT)
        assert b.lib_for() == "t0"
        with pytest.raises(MissingMember):
            b.read("nope.txt")

        dest = b.extract(tmp_path / "x")
        assert (dest / "labels.txt").read_bytes() == b"cat\ndog\n"
        assert json.loads((dest / hmod.MANIFEST).read_text()) == written

    with zipfile.ZipFile(out) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        assert zf.namelist()[0] == hmod.MANIFEST
        raw = zf.read(hmod.MANIFEST)
    assert raw == (json.dumps(written, sort_keys=True, indent=1) + "\n").encode()


def test_write_is_deterministic(tmp_path: Path, keys: dict) -> None:
    a = _write(tmp_path, "a.hmod", key=keys["priv"])
    b = _write(tmp_path, "b.hmod", key=hmod.load_private_key(keys["priv"]))
    assert a.read_bytes() == b.read_bytes()


def test_arch_helpers() -> None:
    assert hmod.normalize_arch("arm64") == "aarch64"
    assert hmod.normalize_arch("AMD64") == "x86_64"
    assert hmod.machine_arch() == hmod.normalize_arch(hmod.machine_arch())


# -------------------------------------------------------------------------------- signatures
def test_signed_and_verified(tmp_path: Path, keys: dict) -> None:
    out = _write(tmp_path, key=keys["priv"])
    # Paths and key objects both work; a non-matching key earlier in the list is skipped.
    trusted = [keys["other_pub"], hmod.load_public_key(keys["pub"])]
    with hmod.open_bundle(out, trusted_keys=trusted) as b:
        assert b.signed and b.verified and b.verified_by == keys["fp"]
        assert b.verified_by == hmod.key_fingerprint(hmod.load_public_key(keys["pub"]))
        assert len(b.verified_by) == 16


def test_signed_without_keys_is_reported_not_verified(tmp_path: Path, keys: dict) -> None:
    out = _write(tmp_path, key=keys["priv"])
    with hmod.open_bundle(out) as b:
        assert b.signed and not b.verified and b.verified_by is None


def test_wrong_key(tmp_path: Path, keys: dict) -> None:
    out = _write(tmp_path, key=keys["priv"])
    with pytest.raises(BadSignature):
        hmod.open_bundle(out, trusted_keys=[keys["other_pub"]])


def test_unsigned_with_keys(tmp_path: Path, keys: dict) -> None:
    out = _write(tmp_path)
    with pytest.raises(UnsignedBundle):
        hmod.open_bundle(out, trusted_keys=[keys["pub"]])
    with hmod.open_bundle(out, trusted_keys=[keys["pub"]], require_signature=False) as b:
        assert not b.signed
    with pytest.raises(ValueError):
        hmod.open_bundle(out, require_signature=True)


def test_a_renamed_signature_is_named_as_the_unlisted_member_it_is(tmp_path: Path, keys: dict) -> None:
    """manifest.sig renamed: with or without trusted keys the answer is the true cause, the
    member the manifest does not list (and, with keys, that the bundle has no signature)."""
    out = _write(tmp_path, key=keys["priv"])
    with zipfile.ZipFile(out) as zf:
        sig = zf.read(hmod.SIGNATURE)
    renamed = _rezip(out, tmp_path / "renamed.hmod", drop={hmod.SIGNATURE}, add=[(_entry("manifest.sig.old"), sig)])
    with pytest.raises(ExtraMember, match=r"\['manifest.sig.old'\] are not listed in the manifest"):
        hmod.open_bundle(renamed)
    with pytest.raises(ExtraMember, match=r"\['manifest.sig.old'\] are not listed .*no manifest.sig"):
        hmod.open_bundle(renamed, trusted_keys=[keys["pub"]])


def test_flipped_manifest_byte_breaks_signature(tmp_path: Path, keys: dict) -> None:
    out = _write(tmp_path, key=keys["priv"])
    with zipfile.ZipFile(out) as zf:
        raw = zf.read(hmod.MANIFEST)
    tampered = raw.replace(b'"demo"', b'"demn"', 1)  # still valid JSON, same format_version
    assert tampered != raw and json.loads(tampered)["format_version"] == hmod.PLAIN_FORMAT_VERSION
    bad = _rezip(out, tmp_path / "bad.hmod", replace={hmod.MANIFEST: tampered})
    with pytest.raises(BadSignature):
        hmod.open_bundle(bad, trusted_keys=[keys["pub"]])


# ---------------------------------------------------------------------------- tampered data
def test_flipped_member_byte(tmp_path: Path) -> None:
    out = _write(tmp_path)
    with zipfile.ZipFile(out) as zf:
        data = zf.read("orders/demo_acl_0.bin")
    bad = _rezip(out, tmp_path / "bad.hmod", replace={"orders/demo_acl_0.bin": _flip(data)})
    with pytest.raises(HashMismatch, match="orders/demo_acl_0.bin") as ei:
        hmod.open_bundle(bad)
    assert ei.value.exit_code == 12


def test_flipped_byte_in_place(tmp_path: Path) -> None:
    # Flipping the stored bytes directly also breaks the zip CRC; still a HashMismatch.
    out = _write(tmp_path)
    raw = out.read_bytes()
    i = raw.index(b"cat\ndog\n")
    out.write_bytes(_flip(raw, i))
    with pytest.raises(HashMismatch, match="labels.txt"):
        hmod.open_bundle(out)


def test_member_changed_after_open(tmp_path: Path) -> None:
    out = _write(tmp_path)
    with hmod.open_bundle(out) as b:
        raw = out.read_bytes()
        i = raw.index(b"cat\ndog\n")
        # In place, so the open zip handle sees it (labels.txt is not in its read buffer).
        with open(out, "r+b") as f:
            f.seek(i)
            f.write(b"bat")
        with pytest.raises(HashMismatch, match="labels.txt"):
            b.read("labels.txt")


def test_truncated(tmp_path: Path) -> None:
    out = _write(tmp_path)
    raw = out.read_bytes()
    for n in (0, 10, len(raw) // 2, len(raw) - 1):
        out.write_bytes(raw[:n])
        with pytest.raises(NotABundle):
            hmod.open_bundle(out)


def test_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(NotABundle):
        hmod.open_bundle(tmp_path / "missing.hmod")
    (tmp_path / "text.hmod").write_text("hello")
    with pytest.raises(NotABundle):
        hmod.open_bundle(tmp_path / "text.hmod")
    with zipfile.ZipFile(tmp_path / "nomanifest.hmod", "w") as zf:
        zf.writestr("labels.txt", b"x")
    with pytest.raises(NotABundle):
        hmod.open_bundle(tmp_path / "nomanifest.hmod")
    bad = _rezip(_write(tmp_path), tmp_path / "badjson.hmod", replace={hmod.MANIFEST: b"{nope"})
    with pytest.raises(NotABundle):
        hmod.open_bundle(bad)


def _entry(name: str, mode: int | None = None, compress: int = zipfile.ZIP_STORED):
    zi = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type = compress
    zi.create_system = 3
    if mode is not None:
        zi.external_attr = mode << 16
    return zi


@pytest.mark.parametrize("entry", [
    _entry("../../x"),
    _entry("orders/../../x"),
    _entry("/etc/passwd"),
    _entry("lib\\..\\x"),
    _entry("link", mode=0o120777),          # symlink
    _entry("fifo", mode=0o010644),          # FIFO
    _entry("adir/", mode=0o040755),         # directory
    _entry("packed.txt", compress=zipfile.ZIP_DEFLATED),
], ids=["dotdot", "nested-dotdot", "absolute", "backslash", "symlink", "fifo", "dir", "deflated"])
def test_unsafe_members(tmp_path: Path, entry: zipfile.ZipInfo) -> None:
    out = _write(tmp_path)
    bad = _rezip(out, tmp_path / "bad.hmod", add=[(entry, b"/etc/passwd")])
    with pytest.raises(UnsafeMember) as ei:
        hmod.open_bundle(bad)
    assert ei.value.exit_code == 11


def test_duplicate_entries(tmp_path: Path) -> None:
    out = _write(tmp_path)
    with pytest.warns(UserWarning):  # zipfile warns, but writes it anyway
        bad = _rezip(out, tmp_path / "dup.hmod", add=[(_entry("labels.txt"), b"evil")])
    with pytest.raises(UnsafeMember):
        hmod.open_bundle(bad)


def test_extra_and_missing_member(tmp_path: Path) -> None:
    out = _write(tmp_path)
    extra = _rezip(out, tmp_path / "extra.hmod", add=[(_entry("payload.so"), b"\x7fELF")])
    with pytest.raises(ExtraMember, match="payload.so"):
        hmod.open_bundle(extra)
    missing = _rezip(out, tmp_path / "missing.hmod", drop={"labels.txt"})
    with pytest.raises(MissingMember, match="labels.txt"):
        hmod.open_bundle(missing)


def test_format_version(tmp_path: Path) -> None:
    out = _write(tmp_path)
    with zipfile.ZipFile(out) as zf:
        man = json.loads(zf.read(hmod.MANIFEST))
    man["format_version"] = 99
    bad = _rezip(out, tmp_path / "v99.hmod",
                 replace={hmod.MANIFEST: json.dumps(man).encode()})
    with pytest.raises(FormatVersionError, match="99"):
        hmod.open_bundle(bad)


def test_one_fallback_library_per_target_is_format_4_and_older_readers_refuse_it(tmp_path: Path, monkeypatch) -> None:
    """The writer picks the oldest format that holds the manifest: 4 only for one fallback library
    per target (a function per subgraph since), so an agent that knows 1-3 refuses it by its
    version check, in one line, and still runs every other bundle."""
    base = {"model": {"name": "m", "version": "1"}, "inputs": [], "outputs": []}
    one = {"host": {"lib": "lib/host.so", "fallback": dict.fromkeys(["m_acl_0", "m_acl_1"], hmod.fallback_lib("host"))}}
    old = {"host": {"lib": "lib/host.so", "fallback": {"m_acl_0": "fallback/host/m_acl_0.so"}}}
    for targets, want in ((one, 4), (old, 2), ({}, 2)):
        assert hmod.format_version_for({**base, "targets": targets}) == want
    written = hmod.write_bundle(tmp_path / "v4.hmod", {**base, "targets": one}, {"lib/host.so": b"l", hmod.fallback_lib("host"): hmod.pack_lib(b"f")})
    assert written["format_version"] == hmod.FALLBACK_LIB_FORMAT_VERSION == 4
    assert [hmod.fallback_function(v, "m_acl_1") for v in (1, 2, 3, 4, None)] == ["main"] * 3 + ["m_acl_1", "main"]
    monkeypatch.setattr(hmod, "SUPPORTED_FORMAT_VERSIONS", frozenset({1, 2, 3}))   # an agent before 4
    with pytest.raises(FormatVersionError, match=r"has format_version 4; this agent supports \[1, 2, 3\]") as e:
        hmod.open_bundle(tmp_path / "v4.hmod")
    assert "\n" not in str(e.value) and e.value.exit_code == 16


def test_a_packed_library_unpacks_and_a_bomb_or_garbage_is_refused(monkeypatch) -> None:
    lib = b"\x7fELF" + bytes(range(256)) * 64
    assert hmod.unpack_lib(hmod.pack_lib(lib), "fallback/host.so.z") == lib
    monkeypatch.setattr(hmod, "UNPACKED_MAX", 1 << 20)
    for data, why in ((hmod.pack_lib(bytes(2 << 20)), "more than 1048576 bytes"),
                      (b"not zlib", "no packed library"), (hmod.pack_lib(lib)[:-9], "truncated")):
        with pytest.raises(hmod.NotABundle, match=why):
            hmod.unpack_lib(data, "fallback/host.so.z")


def test_order_version(tmp_path: Path) -> None:
    members = _members(tmp_path)
    members["orders/demo_acl_0.json"] = json.dumps({**ORDER, "order_version": 7}).encode()
    out = tmp_path / "o.hmod"
    hmod.write_bundle(out, _manifest(), members)
    with hmod.open_bundle(out) as b, pytest.raises(FormatVersionError):
        b.order("demo_acl_0")


def test_an_order_kind_says_which_executors_may_run_it() -> None:
    from tandoor_contract import orders

    layers, onnx_order = dict(ORDER), {**ORDER, "order_version": 3, "kind": "onnx", "onnx_ops": ["LSTM"]}
    assert all(orders.refuses(e, layers) is None for e in orders.EXECUTORS if e != "rknn")
    assert orders.refuses("rknn", layers) == "an layers order (layers) runs on armnn, onnxruntime, tvm only"
    rknn_order = {**ORDER, "order_version": 4, "kind": "rknn", "onnx_ops": ["Conv"]}
    assert orders.refuses("rknn", rknn_order) is None and orders.refuses("onnxruntime", rknn_order) is None
    assert orders.refuses("armnn", rknn_order) == "an rknn order (Conv) runs on rknn, onnxruntime only"
    assert orders.refuses("onnxruntime", onnx_order) is None
    assert orders.refuses("armnn", onnx_order) == "an onnx order (LSTM) runs on onnxruntime only"
    assert "unknown to this agent" in orders.refuses("onnxruntime", {**ORDER, "kind": "tflite"})


def test_no_lib_for_arch(tmp_path: Path) -> None:
    out = _write(tmp_path, manifest=_manifest(arch=OTHER_ARCH))
    with hmod.open_bundle(out) as b:
        with pytest.raises(NoLibForArch, match=OTHER_ARCH) as ei:
            b.lib_for()
        assert hmod.machine_arch() in str(ei.value)
        assert b.lib_for(OTHER_ARCH) == "t0"


# --------------------------------------------------------------------------------- writing
def test_failed_write_leaves_old_file(tmp_path: Path) -> None:
    out = _write(tmp_path)
    before = out.read_bytes()
    listing = sorted(os.listdir(tmp_path))
    members = _members(tmp_path)
    members["zz/late.bin"] = tmp_path / "does-not-exist.bin"  # fails after the temp file exists
    with pytest.raises(FileNotFoundError):
        hmod.write_bundle(out, _manifest(), members)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == listing  # no temp files left behind


def test_failed_write_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new.hmod"
    man = _manifest()
    man["predicted_speedup"] = float("nan")  # not JSON: fails while serialising
    with pytest.raises(ValueError):
        hmod.write_bundle(out, man, _members(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["src_t0.so"]


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../b", "a\\b", "a//b", hmod.MANIFEST,
                                  hmod.SIGNATURE])
def test_write_rejects_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafeMember):
        hmod.write_bundle(tmp_path / "m.hmod", _manifest(), {name: b"x"})
    assert os.listdir(tmp_path) == []


def test_extract_does_not_follow_symlinks(tmp_path: Path) -> None:
    out = _write(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "lib").symlink_to(outside, target_is_directory=True)
    with hmod.open_bundle(out) as b, pytest.raises(UnsafeMember):
        b.extract(dest)
    assert list(outside.iterdir()) == []


# ------------------------------------------------------------------------------------ keys
def test_keys(tmp_path: Path, keys: dict) -> None:
    with pytest.raises(KeyFileError):
        hmod.generate_keypair(keys["priv"], tmp_path / "new.pub")
    assert not (tmp_path / "new.pub").exists()
    with pytest.raises(KeyFileError):
        hmod.generate_keypair(tmp_path / "new.pem", keys["pub"])
    assert not (tmp_path / "new.pem").exists()
    assert keys["priv"].stat().st_mode & 0o077 == 0

    with pytest.raises(KeyFileError, match="public key"):
        hmod.load_private_key(keys["pub"])
    with pytest.raises(KeyFileError, match="private key"):
        hmod.load_public_key(keys["priv"])
    (tmp_path / "junk").write_text("not a key")
    for loader in (hmod.load_private_key, hmod.load_public_key):
        with pytest.raises(KeyFileError):
            loader(tmp_path / "junk")
        with pytest.raises(KeyFileError):
            loader(tmp_path / "absent")


def test_exit_codes_distinct() -> None:
    classes = [NotABundle, UnsafeMember, HashMismatch, MissingMember, ExtraMember, BadSignature,
               UnsignedBundle, FormatVersionError, NoLibForArch, KeyFileError]
    codes = [c.exit_code for c in classes]
    assert len(set(codes)) == len(codes)
    assert BundleError.exit_code not in codes
    assert all(issubclass(c, BundleError) for c in classes)
    assert (NotABundle.exit_code, UnsafeMember.exit_code, HashMismatch.exit_code,
            BadSignature.exit_code, UnsignedBundle.exit_code, FormatVersionError.exit_code,
            NoLibForArch.exit_code) == (10, 11, 12, 14, 15, 16, 17)
    msg = str(HashMismatch("member 'a' differs\nsecond line"))
    assert "\n" not in msg and "; " in msg


def test_generated_golden_inputs_are_the_probes_and_stored_ones_still_read(tmp_path: Path) -> None:
    """format_version 2: a golden pair may say its inputs are generated (inputs "probe", seed k):
    the reader makes probe.inputs of the manifest's inputs with that seed (bit for bit what the
    compiler fed onnxruntime), one set per seed, none equal to an order's probe (seed 0); a pair
    with stored inputs (format 1) reads as before; a seed out of range is a malformed bundle."""
    from tandoor_contract import probe

    man = _manifest()
    man["inputs"] = [{"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32"},
                     {"name": "q", "shape": [2, 5], "dtype": "uint8"}]
    man["golden"] = [{"inputs": "probe", "seed": 1, "outputs": ["golden/output_0_0.npy"]},
                     {"inputs": "probe", "seed": 2, "outputs": ["golden/output_0_0.npy"]},
                     {"inputs": ["golden/input_0_0.npy"], "outputs": ["golden/output_0_0.npy"]}]
    with hmod.open_bundle(_write(tmp_path, manifest=man)) as b:
        assert b.manifest["format_version"] == 2
        (in1, out1), (in2, _), (in3, _) = b.golden()
    want = probe.inputs({"inputs": man["inputs"]}, seed=1)
    assert [a.dtype for a in in1] == [np.float32, np.uint8] and [a.shape for a in in1] == [(1, 3, 8, 8), (2, 5)]
    assert all(np.array_equal(a, w) for a, w in zip(in1, want)) and np.array_equal(out1[0], GOLD_OUT)
    assert not np.array_equal(in1[0], in2[0])
    assert not np.array_equal(in1[0], probe.inputs({"inputs": man["inputs"]})[0])
    assert abs(float(in1[0].std()) - 1.0) < 0.2 and np.array_equal(in3[0], GOLD_IN)
    for seed in (0, 4096, "1"):
        man["golden"] = [{"inputs": "probe", "seed": seed, "outputs": ["golden/output_0_0.npy"]}]
        with hmod.open_bundle(_write(tmp_path, f"s{seed}.hmod", manifest=man)) as b, \
                pytest.raises(hmod.NotABundle, match="seed"):
            b.golden()
