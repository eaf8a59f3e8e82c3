"""The keyring on real files: retirements that no damage to keyring.json can undo, and a keyring
lost or unreadable falling back to the configured keys minus every retired one (fail closed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tandoor_agent.update.keys import Keyring
from tandoor_contract import hmod


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    for k in ("k1", "k2", "k3"):
        hmod.generate_keypair(tmp_path / f"{k}.pem", tmp_path / f"{k}.pub.pem")
    return {k: tmp_path / f"{k}.pem" for k in ("k1", "k2", "k3")} | \
        {f"{k}.pub": tmp_path / f"{k}.pub.pem" for k in ("k1", "k2", "k3")}


def fp(pub: Path) -> str:
    return hmod.key_fingerprint(hmod.load_public_key(pub))


def command(op: str, signer: Path, **body) -> bytes:
    msg = {"op": op, "id": f"k-{time.monotonic_ns()}", "issued": time.time(), **body}
    return json.dumps(hmod.sign_command(msg, signer)).encode()


@pytest.mark.parametrize("damage", ["garbage", "directory", "missing"])
def test_a_lost_keyring_trusts_the_configured_keys_minus_every_retired_one(tmp_path, keys, damage):
    """k1 and k2 configured, k3 added, k1 retired; then keyring.json and its copy are damaged
    (or gone): k3 is forgotten, k1 stays retired, only k2 is trusted, and the keyring says so."""
    d = tmp_path / "keys"
    ring = Keyring([str(keys["k1.pub"]), str(keys["k2.pub"])], d)
    ring.load()
    ring.apply(command("add-key", keys["k1"], key=keys["k3.pub"].read_text()))
    ring.apply(command("retire-key", keys["k2"], fingerprint=fp(keys["k1.pub"])))
    assert sorted(ring.fingerprints()) == sorted([fp(keys["k2.pub"]), fp(keys["k3.pub"])])
    for name in ("keyring.json", "keyring.json.prev"):
        p = d / name
        p.unlink()
        if damage == "garbage":
            p.write_bytes(b'{"added": ["')
        elif damage == "directory":
            p.mkdir()
    again = Keyring([str(keys["k1.pub"]), str(keys["k2.pub"])], d)
    again.load()
    assert again.fingerprints() == [fp(keys["k2.pub"])]
    st = again.status()
    assert st["state"] == "rebuilt" and st["retired"] == [fp(keys["k1.pub"])], st
    assert again.recovered["damaged"] == "keys/keyring.json" and again.recovered["reason"], again.recovered
    assert again.refusal() is None  # k2 is still trusted: bundles it signed are taken
    # the next start reads the rewritten keyring: still rebuilt (said on status) until a command is applied
    third = Keyring([str(keys["k1.pub"]), str(keys["k2.pub"])], d)
    third.load()
    assert third.status()["state"] == "rebuilt" and third.recovered is None
    third.apply(command("add-key", keys["k2"], key=keys["k3.pub"].read_text()))
    assert third.status()["state"] == "ok"


def test_with_every_configured_key_retired_and_the_keyring_lost_nothing_is_trusted(tmp_path, keys):
    d = tmp_path / "keys"
    ring = Keyring([str(keys["k1.pub"])], d)
    ring.load()
    ring.apply(command("add-key", keys["k1"], key=keys["k2.pub"].read_text()))
    ring.apply(command("retire-key", keys["k2"], fingerprint=fp(keys["k1.pub"])))
    (d / "keyring.json").write_bytes(b"\x00" * 8)
    (d / "keyring.json.prev").unlink()
    again = Keyring([str(keys["k1.pub"])], d)
    again.load()
    assert again.trusted == [] and "every configured key is retired" in again.refusal()


def test_a_full_disk_refuses_a_key_command_by_its_id_and_applies_nothing(tmp_path, keys):
    """The keyring's disk is full (a real tmpfs, filled): add-key is refused as no_space naming the
    command's id (what the fleet matches answers by), and the keyring on disk and in memory is
    what it was, k3 not trusted."""
    from tandoor_agent.update.keys import KeyOpError
    from support.tmpfs import small_tmpfs

    with small_tmpfs(tmp_path / "mnt", 64 * 1024) as mnt:
        d = mnt / "keys"
        ring = Keyring([str(keys["k1.pub"]), str(keys["k2.pub"])], d)
        ring.load()
        ring.apply(command("add-key", keys["k1"], key=keys["k2.pub"].read_text()))   # the keyring exists
        before = sorted(ring.fingerprints())
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)   # every free block taken
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        cmd = command("add-key", keys["k1"], key=keys["k3.pub"].read_text())
        with pytest.raises(KeyOpError) as err:
            ring.apply(cmd)
        assert err.value.kind == "no_space" and err.value.op_id == json.loads(cmd)["id"]
        assert "nothing applied" in str(err.value)
        assert sorted(ring.fingerprints()) == before and fp(keys["k3.pub"]) not in ring.fingerprints()
        (mnt / "filler").unlink()
        again = Keyring([str(keys["k1.pub"]), str(keys["k2.pub"])], d)
        again.load()
        assert sorted(again.fingerprints()) == before
