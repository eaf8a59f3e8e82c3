"""Ed25519 keys and signatures: key files (made, loaded, fingerprinted), and signed fleet commands
(add-key / retire-key). The bundle's own signature is written and checked in hmod.py with these."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .bundle_errors import BadSignature, KeyFileError

PathLike = Union[str, "os.PathLike[str]"]
KeySource = Union[Ed25519PublicKey, PathLike]


def key_fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Short, stable id of a key for logs: first 16 hex digits of sha256(raw public bytes)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(private_path: PathLike, public_path: PathLike) -> str:
    """Write a new Ed25519 key pair as PEM; never overwrites. Returns the key fingerprint."""
    priv_p, pub_p = Path(private_path), Path(public_path)
    for p in (priv_p, pub_p):
        if p.exists() or p.is_symlink():
            raise KeyFileError(f"refusing to overwrite existing key file {p}",
                               "move it away or choose another path")
    key = Ed25519PrivateKey.generate()
    priv_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
    pub_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    write_exclusive(priv_p, priv_pem, 0o600)  # private key readable by the owner only
    try:
        write_exclusive(pub_p, pub_pem, 0o644)
    except BaseException:
        priv_p.unlink(missing_ok=True)  # don't leave half a key pair behind
        raise
    return key_fingerprint(key)


def write_exclusive(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # O_EXCL: no overwrite race
    except FileExistsError:
        raise KeyFileError(f"refusing to overwrite existing key file {path}",
                           "move it away or choose another path") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_key_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e.strerror or e}",
                           "check the path in the configuration") from None


def load_private_key(path: PathLike) -> Ed25519PrivateKey:
    """Load an unencrypted PKCS8 PEM Ed25519 private key (as written by generate_keypair)."""
    p = Path(path)
    data = read_key_file(p)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise KeyFileError(f"{p} is an encrypted private key",
                           "use an unencrypted key from generate_keypair") from None
    except ValueError:
        what = "a public key" if b"PUBLIC KEY" in data else "not a PEM private key"
        raise KeyFileError(f"{p} is {what}", "pass the private key (PKCS8 PEM)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{p} is a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(path: PathLike) -> Ed25519PublicKey:
    """Load a SubjectPublicKeyInfo PEM Ed25519 public key."""
    p = Path(path)
    data = read_key_file(p)
    if b"PRIVATE KEY" in data:  # trust lists must hold public keys; keep secrets off the board
        raise KeyFileError(f"{p} is a private key", "pass the matching public key file instead")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise KeyFileError(f"{p} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{p} is a {type(key).__name__}, not an Ed25519 public key")
    return key


def public_key_from_pem(pem: str | bytes) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM text (a key carried in a message, not a file)."""
    data = pem.encode() if isinstance(pem, str) else pem
    if b"PRIVATE KEY" in data:
        raise KeyFileError("that is a private key", "send the matching public key instead")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise KeyFileError("not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"a {type(key).__name__}, not an Ed25519 public key")
    return key


def public_key_pem(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def command_bytes(body: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k not in ("signature", "signer")},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_command(body: Mapping[str, Any], private_key: PathLike | Ed25519PrivateKey) -> dict[str, Any]:
    """``body`` plus ``signature`` (Ed25519 over its canonical JSON, hex) and ``signer`` (the
    key's fingerprint): a command a device checks with :func:`verify_command` (key rotation)."""
    key = private_key if isinstance(private_key, Ed25519PrivateKey) else load_private_key(private_key)
    return {**body, "signature": key.sign(command_bytes(body)).hex(), "signer": key_fingerprint(key)}


def verify_command(msg: Mapping[str, Any], trusted_keys: Iterable[KeySource]) -> str:
    """The fingerprint of the trusted key that signed ``msg``; BadSignature otherwise."""
    sig = msg.get("signature")
    try:
        raw = bytes.fromhex(sig) if isinstance(sig, str) else b""
    except ValueError:
        raw = b""
    data = command_bytes(msg)
    for k in load_trusted(trusted_keys):
        try:
            k.verify(raw, data)
        except InvalidSignature:
            continue
        return key_fingerprint(k)
    raise BadSignature("the command's signature does not verify with any trusted key")


def load_trusted(keys: Iterable[KeySource]) -> list[Ed25519PublicKey]:
    out = []
    for k in keys:
        if isinstance(k, Ed25519PublicKey):
            out.append(k)
        elif isinstance(k, (str, os.PathLike)):
            out.append(load_public_key(k))
        else:
            raise TypeError(f"trusted key must be an Ed25519PublicKey or a path, not {type(k)}")
    return out
