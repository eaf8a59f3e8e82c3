"""A/B slots on real bundles and real files: install -> trial -> commit, rollback, the transition
table, the same job twice, refusals that leave the primary untouched, a full disk (a real tmpfs),
a corrupt or lost state.json, simulated crashes in every state, and real kill -9 of a child
process at every step of an install/commit/rollback, each followed by recover_on_start()."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from support.bundle_edit import sha, members_of, rewrite, version
from support.cli import compiled
from tandoor_contract import hmod
from tandoor_agent.update import slots
from tandoor_agent.serve.config import committed_bundle
from tandoor_agent.update.slots import Busy, InstallRefused, SlotStore, TransitionError
from tandoor_zoo import models as zoo


# --- helpers -----------------------------------------------------------------------------------

HOST_LIB = "host lib"   # flip_byte's name for the host target's lib member (packed in format 4)


def flip_byte(src: Path, dst: Path, member: str) -> Path:
    with zipfile.ZipFile(src) as z:
        if member == HOST_LIB:
            member = json.loads(z.read(hmod.MANIFEST))["targets"]["host"]["lib"]
        info = z.getinfo(member)
    data = bytearray(src.read_bytes())
    local = data[info.header_offset:info.header_offset + 30]
    off = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    data[off + info.compress_size // 2] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


def temp_files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name.endswith((".tmp", ".stream")))


def assert_consistent(d: Path, pub: Path, expect_sha: str | None = None) -> dict:
    """The slot directory is in a committed, serveable state: no trial, nothing installing, the
    primary is good and its bundle opens, verifies and has a lib for this machine."""
    st = json.loads((d / "state.json").read_text())
    slots.check_state(st)
    assert st["trial"] is None, st
    assert all(s["state"] in ("good", "bad", "empty") for s in st["slots"].values()), st
    assert st["primary"] in ("a", "b"), st
    p = SlotStore(d).primary_bundle()
    assert p == d / st["primary"] / "model.hmod"
    with hmod.open_bundle(p, [pub]) as b:
        assert b.verified
        b.lib_for()
    assert sha(p) == st["slots"][st["primary"]]["sha256"]
    if expect_sha is not None:
        assert sha(p) == expect_sha
    path, slot = committed_bundle(d)  # what the agent's service reads
    assert (path, slot) == (p, st["primary"])
    assert temp_files(d) == []
    return st


# --- fixtures: real bundles --------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("slotkeys")
    for k in ("k1", "k2"):
        hmod.generate_keypair(d / f"{k}.pem", d / f"{k}.pub.pem")
    return {"k1": d / "k1.pem", "k1.pub": d / "k1.pub.pem", "k2": d / "k2.pem", "k2.pub": d / "k2.pub.pem"}


@pytest.fixture(scope="module")
def B(bundles_dir, keys, tmp_path_factory) -> dict[str, Path]:
    """dynamic_batch (1x3x32x32, host + aarch64) compiled by the real CLI, then versions 1..3
    signed with k1, and the bad ones."""
    base = compiled("dynamic_batch", zoo.dynamic_batch(), bundles_dir, "--input", "input=1x3x32x32")
    d = tmp_path_factory.mktemp("slotbundles")
    out = {v: rewrite(base, d / f"{v}.hmod", version(v[1:]), keys["k1"]) for v in ("v1", "v2", "v3")}
    out["k2"] = rewrite(base, d / "k2.hmod", version("9"), keys["k2"])
    out["unsigned"] = rewrite(base, d / "unsigned.hmod", version("9"))
    out["tampered"] = flip_byte(out["v2"], d / "tampered.hmod", HOST_LIB)
    here = hmod.machine_arch()

    def other_arch_only(man, members):
        gone = [t for t, v in man["targets"].items() if v["arch"] == here]
        for t in gone:
            v = man["targets"].pop(t)
            members.pop(v["lib"])
            fb = v.get("fallback")
            for m in (fb.values() if isinstance(fb, dict) else [fb] if fb else []):
                members.pop(m, None)
        assert gone and man["targets"]
    out["wrong_arch"] = rewrite(base, d / "wrong_arch.hmod", other_arch_only, keys["k1"])
    # a future format_version: a consistent zip whose (re-signed) manifest says one this agent does not read
    man, members = members_of(out["v2"])
    man["format_version"] = hmod.FORMAT_VERSION + 1
    mbytes = (json.dumps(man, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode()
    with zipfile.ZipFile(d / "future.hmod", "w", zipfile.ZIP_STORED) as z:
        z.writestr(hmod.MANIFEST, mbytes)
        z.writestr(hmod.SIGNATURE, hmod.load_private_key(keys["k1"]).sign(mbytes))
        for n, data in members.items():
            z.writestr(n, data)
    out["future"] = d / "future.hmod"
    (d / "truncated.hmod").write_bytes(out["v2"].read_bytes()[:5000])
    out["truncated"] = d / "truncated.hmod"
    return out


@pytest.fixture
def store(tmp_path) -> SlotStore:
    return SlotStore(tmp_path / "slots")


def committed(store: SlotStore, bundle: Path, job: str, pub: Path) -> str:
    slot = store.install(bundle, job, [pub])
    store.commit()
    return slot


# --- 1. the happy paths ------------------------------------------------------------------------

def test_empty_store_layout(store):
    st = store.load()
    d = store.dir
    assert (d / "state.json").is_file() and (d / "a").is_dir() and (d / "b").is_dir() and (d / "staging").is_dir()
    assert st["version"] == 1 and st["primary"] is None and st["trial"] is None
    assert st["slots"]["a"] == {"bundle": "a/model.hmod", "sha256": None, "model": None, "state": "empty",
                                "installed_at": None, "job_id": None, "reason": None, "verified_by": None,
                                "signer_key": None}
    assert store.primary_bundle() is None
    assert store.inactive_slot() == "a"
    assert store.recover_on_start() == []


def test_install_trial_commit(store, B, keys):
    pub = keys["k1.pub"]
    assert store.install(B["v1"], "j1", [pub]) == "a"
    st = store.load()
    assert st["slots"]["a"]["state"] == "trial" and st["primary"] is None
    assert st["trial"]["slot"] == "a" and st["trial"]["job_id"] == "j1" and st["trial"]["previous"] is None
    assert st["slots"]["a"]["sha256"] == sha(B["v1"])
    assert st["slots"]["a"]["model"] == {"name": "dynamic_batch", "version": "1"}
    assert store.job("j1")["outcome"] == "trial"
    store.commit()
    assert_consistent(store.dir, pub, sha(B["v1"]))
    assert store.job("j1")["outcome"] == "committed"

    # the next one goes to b; a keeps serving during b's trial
    assert store.inactive_slot() == "b"
    assert store.install(B["v2"], "j2", [pub]) == "b"
    st = store.load()
    assert st["primary"] == "a" and st["trial"]["previous"] == "a"
    assert store.primary_bundle() == store.dir / "a/model.hmod"
    store.mark_good("b")
    st = assert_consistent(store.dir, pub, sha(B["v2"]))
    assert st["primary"] == "b" and st["slots"]["a"]["state"] == "good"
    moves = [(h["slot"], h["from"], h["to"]) for h in st["history"]]
    assert moves == [("a", "empty", "installing"), ("a", "installing", "trial"), ("a", "trial", "good"),
                     ("b", "empty", "installing"), ("b", "installing", "trial"), ("b", "trial", "good")]

    # the third overwrites a (good, not primary)
    assert store.install(B["v3"], "j3", [pub]) == "a"
    store.commit()
    assert_consistent(store.dir, pub, sha(B["v3"]))


def test_install_then_rollback(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    assert store.install(B["v2"], "j2", [pub]) == "b"
    st = store.rollback("golden self-test failed: test")
    assert st["primary"] == "a" and st["trial"] is None
    assert st["slots"]["b"]["state"] == "bad" and "golden self-test failed" in st["slots"]["b"]["reason"]
    assert store.job("j2") | {"at": None} == {"outcome": "rolled_back", "slot": "b", "sha256": sha(B["v2"]),
                                              "reason": "golden self-test failed: test", "kind": None, "at": None}
    assert_consistent(store.dir, pub, sha(B["v1"]))
    # a bad slot is the next install's target
    assert store.install(B["v3"], "j3", [pub]) == "b"
    store.commit()
    assert_consistent(store.dir, pub, sha(B["v3"]))


def test_rollback_of_a_committed_update(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)
    st = store.rollback("operator: fleet rollback")
    assert st["primary"] == "a" and st["slots"]["b"]["state"] == "bad"
    assert store.job("j2")["outcome"] == "rolled_back"
    assert_consistent(store.dir, pub, sha(B["v1"]))
    with pytest.raises(TransitionError, match="nothing to roll back"):
        store.rollback("again")


def test_install_from_a_stream_and_from_staging(store, B, keys):
    pub = keys["k1.pub"]
    with open(B["v1"], "rb") as f:
        assert store.install(f, "j1", [pub]) == "a"
    store.commit()
    # a download assembled in staging is moved into the slot, not copied
    part = store.staging_path("j2")
    shutil.copyfile(B["v2"], part)
    ino = part.stat().st_ino
    assert store.install(part, "j2", [pub], expected_sha256=sha(B["v2"])) == "b"
    assert not part.exists() and store.bundle_path("b").stat().st_ino == ino
    store.commit()
    assert_consistent(store.dir, pub, sha(B["v2"]))
    assert list(store.staging_dir.iterdir()) == []


def test_installing_over_bytes_in_memory(store, B, keys):
    assert store.install(io.BytesIO(B["v1"].read_bytes()), "j1", [keys["k1.pub"]]) == "a"


# --- 2. the state machine ----------------------------------------------------------------------

def test_transition_table_is_explicit_and_enforced(store, B, keys):
    for (frm, to), ops in slots.TRANSITIONS.items():
        assert frm in slots.SLOT_STATES and to in slots.SLOT_STATES and ops
    pub = keys["k1.pub"]
    with pytest.raises(TransitionError, match="no trial in progress: nothing to commit"):
        store.commit()
    with pytest.raises(TransitionError, match="nothing to roll back"):
        store.rollback("x")
    committed(store, B["v1"], "j1", pub)
    with pytest.raises(TransitionError, match="slot a is good"):
        store.mark_good("a")
    store.install(B["v2"], "j2", [pub])
    with pytest.raises(TransitionError, match="slot a is not in trial"):
        store.mark_good("a")
    with pytest.raises(Busy, match="job j2 is in trial on slot b"):
        store.install(B["v3"], "j3", [pub])
    with pytest.raises(slots.SlotError, match="unknown slot"):
        store.mark_good("c")
    # the table itself refuses a move nobody may make, with the allowed ones listed
    st = store.load()
    with pytest.raises(TransitionError, match=r"slot a: commit cannot move it from good to trial"):
        store._set(st, "a", "trial", "commit", "no")
    with pytest.raises(TransitionError, match="slot b: install cannot move it from trial to installing"):
        store._set(st, "b", "installing", "install", "no")
    st = store.load()
    st["trial"] = None
    st["slots"]["b"]["state"] = "good"
    with pytest.raises(TransitionError, match="slot a is primary"):
        store._set(st, "a", "installing", "install", "no")
    # nothing of that was written
    assert store.load()["trial"]["slot"] == "b"


def test_same_job_twice_is_a_no_op(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    assert store.install(B["v2"], "j2", [pub]) == "b"
    before = (store.dir / "state.json").read_bytes()
    st_ino = store.bundle_path("b").stat().st_ino
    assert store.install(B["v2"], "j2", [pub]) == "b"   # during the trial
    assert (store.dir / "state.json").read_bytes() == before
    assert store.bundle_path("b").stat().st_ino == st_ino
    store.commit()
    before = (store.dir / "state.json").read_bytes()
    assert store.install(B["v2"], "j2", [pub]) == "b"   # after the commit: same final answer
    assert store.install(B["v1"], "j1", [pub]) == "a"
    assert (store.dir / "state.json").read_bytes() == before
    assert store.job("j2")["outcome"] == "committed"
    # a refused job gets the same refusal again, marked as a repeat, without re-reading the bundle
    with pytest.raises(InstallRefused) as e1:
        store.install(B["k2"], "j3", [pub])
    with pytest.raises(InstallRefused) as e2:
        store.install(B["v3"], "j3", [pub])
    assert str(e1.value) == str(e2.value) and e2.value.kind == "bad_signature" and e2.value.repeated
    assert store.job("j3")["outcome"] == "failed"


# --- 3. refusals leave the primary untouched ---------------------------------------------------

@pytest.mark.parametrize("which,kind,code,phrase", [
    ("k2", "bad_signature", 14, "does not verify with any trusted key"),
    ("unsigned", "unsigned", 15, "is not signed but trusted keys are configured"),
    ("tampered", "hash_mismatch", 12, "'lib/host.so"),
    ("wrong_arch", "wrong_arch", 17, f"has no lib for {hmod.machine_arch()}"),
    ("future", "format_version", 16, f"has format_version {hmod.FORMAT_VERSION + 1}"),
    ("truncated", "not_a_bundle", 10, "is not a readable zip"),
])
def test_bad_bundles_are_refused_and_the_primary_is_untouched(store, B, keys, which, kind, code, phrase):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    before = store.load()
    with pytest.raises(InstallRefused) as e:
        store.install(B[which], "bad", [pub])
    assert e.value.kind == kind and e.value.exit_code == code
    assert str(e.value).startswith("bundle refused: ") and phrase in str(e.value)
    assert "\n" not in str(e.value)
    after = store.load()
    assert after["primary"] == "a" and after["slots"] == before["slots"] and after["trial"] is None
    assert not store.bundle_path("b").exists()
    assert store.job("bad")["outcome"] == "failed" and store.job("bad")["kind"] == kind
    assert_consistent(store.dir, pub, sha(B["v1"]))


def test_expected_sha256_mismatch_refused(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    with pytest.raises(InstallRefused, match="differs from the job's") as e:
        store.install(B["v2"], "j2", [pub], expected_sha256=sha(B["v3"]))
    assert e.value.kind == "sha256_mismatch"
    assert_consistent(store.dir, pub, sha(B["v1"]))


# --- 4. a full disk (a real, small tmpfs) ------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """mount_tmpfs(bytes) -> a directory on a tmpfs of that size; unmounted afterwards."""
    mounts = []

    def mount(size: int) -> Path:
        d = tmp_path / f"tmpfs{len(mounts)}"
        d.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounts.append(d)
        return d

    def leave_free(d: Path, free: int) -> None:
        """Shrink d's tmpfs to what it holds now plus ``free`` bytes: what a bundle needs beyond its
        file (the libs the store unpacks) is counted as it is, however small the test bundle."""
        st = os.statvfs(d)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        res = subprocess.run(["mount", "-o", f"remount,size={_page_up(used + free)}", str(d)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr

    mount.leave_free = leave_free
    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _page_up(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def test_disk_full_refused_and_the_old_primary_keeps_working(tmpfs, B, keys):
    pub = keys["k1.pub"]
    size = B["v1"].stat().st_size
    reserve = 64 * 1024
    d = tmpfs(8 * size + 2 * reserve)
    store = SlotStore(d / "slots", reserve_bytes=reserve)
    committed(store, B["v1"], "j1", pub)
    tmpfs.leave_free(d, size // 2)  # v1 is there; half a bundle more is not room for v2
    before = store.load()
    with pytest.raises(InstallRefused, match="not enough disk space") as e:
        store.install(B["v2"], "j2", [pub])
    assert e.value.kind == "no_space" and "running model is untouched" in str(e.value)
    assert store.load()["slots"] == before["slots"]
    assert not store.bundle_path("b").exists()
    # a stream of unknown size: the disk fills up while staging -> ENOSPC, cleaned up, refused
    with open(B["v2"], "rb") as f, pytest.raises(InstallRefused, match="No space left on device") as e:
        store.install(f, "j3", [pub])
    assert e.value.kind == "no_space"
    assert list(store.staging_dir.iterdir()) == []
    # known size: refused before a byte is written
    with open(B["v2"], "rb") as f, pytest.raises(InstallRefused, match="not enough disk space"):
        store.install(f, "j4", [pub], size=size)
    # not recorded as the job's final answer: the same job may succeed once there is room
    assert store.job("j2") is None
    st = assert_consistent(store.dir, pub, sha(B["v1"]))
    assert st["slots"]["b"]["state"] == "empty"
    # and the old primary still runs (in a child process, like the agent would)
    res = subprocess.run([str(Path(sys.executable).parent / "tandoor-agent"), "run", str(store.primary_bundle()),
                          "--trusted-key", str(pub), "--delegate", "onnxruntime", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["outputs"][0]["shape"] == [1, 10]


def test_disk_tight_reuses_the_inactive_slots_old_bundle(tmpfs, B, keys):
    pub = keys["k1.pub"]
    size = B["v1"].stat().st_size
    reserve = 64 * 1024
    d = tmpfs(8 * size + 2 * reserve)
    store = SlotStore(d / "slots", reserve_bytes=reserve)
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)
    tmpfs.leave_free(d, reserve + size // 2)  # two bundles fit, three do not
    # v3 fits only because slot a's old v1 is dropped first (good -> installing)
    assert store.install(B["v3"], "j3", [pub]) == "a"
    store.commit()
    st = assert_consistent(store.dir, pub, sha(B["v3"]))
    assert ("a", "good", "installing") in [(h["slot"], h["from"], h["to"]) for h in st["history"]]


# --- 5. a corrupt or lost state.json -----------------------------------------------------------

def test_corrupt_state_json_is_kept_and_the_state_rebuilt(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    time.sleep(0.01)
    committed(store, B["v2"], "j2", pub)
    garbage = b'{"version": 1, "primary": "b", "slo'
    (store.dir / "state.json").write_bytes(garbage)
    (store.dir / "state.json.prev").write_bytes(b"\0" * 100)  # the previous state is no help either
    fresh = SlotStore(store.dir, trusted_keys=[pub])
    st = fresh.load()
    kept = list(store.dir.glob("state.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == garbage
    assert any("state.json was corrupt" in n and kept[0].name in n for n in fresh.notes)
    # the older bundle was committed for sure (installs go to the non-primary slot): primary;
    # the newer may never have passed its health gate: bad
    assert st["primary"] == "a" and st["slots"]["b"]["state"] == "bad"
    assert "not known to be committed" in st["slots"]["b"]["reason"]
    assert_consistent(store.dir, pub, sha(B["v1"]))
    # usable again: the next install goes to b
    assert fresh.install(B["v3"], "j3", [pub]) == "b"


def test_a_truncated_or_bit_flipped_state_json_goes_back_to_the_previous_state(tmp_path, B, keys):
    """The state before the last write is kept (state.json.prev, a hard link); state.json cut in
    half, or with one bit flipped in a sha256 that no invariant would catch (the checksum does),
    is kept aside and the previous state, one step older and so consistent, comes back: here the
    trial of j2, which recovery then rolls back, leaving v1 committed and serving."""
    pub = keys["k1.pub"]
    for damage in ("truncated", "bit flipped"):
        store = SlotStore(tmp_path / damage.replace(" ", "-"))
        committed(store, B["v1"], "j1", pub)
        committed(store, B["v2"], "j2", pub)
        good = (store.dir / "state.json").read_bytes()
        assert json.loads((store.dir / "state.json.prev").read_text())["trial"]["job_id"] == "j2"
        if damage == "truncated":
            bad = good[: len(good) // 2]
        else:
            want = json.loads(good)["slots"]["b"]["sha256"]
            i = good.index(want.encode()) + 5
            bad = good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1:]
            st = json.loads(bad)  # still valid JSON with every invariant intact: only the checksum sees it
            st.pop("checksum")
            slots.check_state(st)
        (store.dir / "state.json").write_bytes(bad)
        fresh = SlotStore(store.dir, trusted_keys=[pub])
        notes = fresh.recover_on_start()
        assert any("state.json was corrupt" in n and "previous state" in n for n in notes), notes
        assert [p.read_bytes() for p in store.dir.glob("state.json.corrupt-*")] == [bad]
        st = assert_consistent(store.dir, pub, sha(B["v1"]))
        assert st["jobs"]["j2"]["outcome"] == "rolled_back", st["jobs"]


def test_nothing_safe_to_serve_refuses_to_start_in_one_line(tmp_path, B, keys):
    """state.json and its previous copy damaged, and no slot bundle verifies: the real agent
    refuses to start with one line saying how to repair (exit 24), not a traceback."""
    from support.agents import write_config
    from support.cli import run_cli

    pub = keys["k1.pub"]
    store = SlotStore(tmp_path / "slots")
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)
    for s_ in ("a", "b"):
        flip_byte(store.bundle_path(s_), store.bundle_path(s_), HOST_LIB)
    (store.dir / "state.json").write_bytes(b'{"version": 1, "prim')
    (store.dir / "state.json.prev").write_bytes(b"")
    cfg = write_config(tmp_path / "agent.toml", device_id="broken", slot_dir=str(store.dir), trusted_keys=[str(pub)],
                       broker={"port": 1}, camera={"source": "synthetic:64x48@5"})
    r = run_cli("tandoor-agent", "--config", str(cfg), timeout=300)
    assert r.returncode == 24, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("tandoor-agent: error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "is corrupt" in err[0] and "to repair, copy a signed bundle to" in err[0], err


def test_state_that_breaks_an_invariant_is_treated_as_corrupt(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    st = json.loads((store.dir / "state.json").read_text())
    st["slots"]["a"]["state"] = "trial"  # primary in trial: impossible
    st.pop("checksum")  # as an older agent (or a hand) wrote it: only the invariant is broken
    (store.dir / "state.json").write_text(json.dumps(st))
    (store.dir / "state.json.prev").unlink()
    fresh = SlotStore(store.dir, trusted_keys=[pub])
    assert fresh.primary() == "a"
    assert any("primary slot a is trial, not good" in n for n in fresh.notes)
    assert_consistent(store.dir, pub, sha(B["v1"]))


def test_corrupt_state_and_a_damaged_bundle(store, B, keys):
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)
    flip_byte(store.bundle_path("a"), store.bundle_path("a"), HOST_LIB)
    (store.dir / "state.json").write_text("not json")
    (store.dir / "state.json.prev").unlink()
    fresh = SlotStore(store.dir, trusted_keys=[pub])
    st = fresh.load()
    assert st["primary"] == "b" and st["slots"]["a"]["state"] == "bad"
    assert "does not verify" in st["slots"]["a"]["reason"]
    assert_consistent(store.dir, pub, sha(B["v2"]))


def test_lost_state_json_and_adopting_current_hmod(tmp_path, B, keys):
    pub = keys["k1.pub"]
    s1 = SlotStore(tmp_path / "s1")
    committed(s1, B["v1"], "j1", pub)
    (s1.dir / "state.json").unlink()
    assert SlotStore(s1.dir, trusted_keys=[pub]).primary() == "a"
    assert_consistent(s1.dir, pub, sha(B["v1"]))
    # a directory from before slots: <slot_dir>/current.hmod
    d = tmp_path / "s2"
    d.mkdir()
    shutil.copyfile(B["v2"], d / "current.hmod")
    s2 = SlotStore(d, trusted_keys=[pub])
    assert s2.primary() == "a" and any("adopted current.hmod" in n for n in s2.notes)
    assert_consistent(d, pub, sha(B["v2"]))


def test_a_directory_in_place_of_state_json_is_moved_aside_and_the_state_recovered(store, B, keys):
    """Anything unreadable at state.json's path (here a directory) is a damaged state: moved
    aside, the previous state back, and the recovery described for the status message."""
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)
    store.confirm_boot()
    (store.dir / "state.json").unlink()
    (store.dir / "state.json").mkdir()
    fresh = SlotStore(store.dir, trusted_keys=[pub])
    fresh.recover_on_start()
    rec = fresh.recovery
    assert rec["damaged"] == "state.json" and "Is a directory" in rec["reason"], rec
    assert (store.dir / rec["kept_as"]).is_dir() and (store.dir / "state.json").is_file()
    assert rec["chose"]["slot"] == "b" and rec["chose"]["how"].startswith("the previous state"), rec
    assert_consistent(store.dir, pub, sha(B["v2"]))


def test_a_lost_state_follows_the_acks_journal_to_the_committed_bundle(store, B, keys):
    """state.json and its previous copy both damaged: without evidence the older valid bundle is
    chosen (the newer may never have passed its gate); with the acks journal saying the newer was
    committed, the newer is, and nothing is marked bad; a journal saying it was rolled back later
    wins over its commit."""
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    committed(store, B["v2"], "j2", pub)

    def damage():
        (store.dir / "state.json").write_bytes(b"\0" * 10)
        (store.dir / "state.json.prev").write_bytes(b"")

    damage()
    plain = SlotStore(store.dir, trusted_keys=[pub])
    assert plain.primary() == "a" and plain.recovery["marked_bad"][0]["slot"] == "b", plain.recovery
    assert "nothing says the newer one was committed" in plain.recovery["chose"]["how"]
    committed_v2 = {"sha256": sha(B["v2"]), "outcome": "committed", "job_id": "j2", "at": 2.0}
    for journal, want in (([committed_v2], "b"),
                          ([committed_v2, {**committed_v2, "outcome": "rolled_back", "at": 3.0}], "a")):
        store.bundle_path("b").write_bytes(B["v2"].read_bytes())  # the plain recovery marked it bad, kept it
        damage()
        fresh = SlotStore(store.dir, trusted_keys=[pub])
        fresh.evidence = lambda journal=journal: journal
        st = fresh.load()
        assert st["primary"] == want, (journal, fresh.recovery)
        if want == "b":
            assert fresh.recovery["marked_bad"] == [] and st["slots"]["a"]["state"] == "good", fresh.recovery
            assert "the acks journal says job j2 committed it" in fresh.recovery["chose"]["how"]
        else:
            assert [m["slot"] for m in fresh.recovery["marked_bad"]] == ["b"], fresh.recovery
            assert "rolled back" in fresh.recovery["marked_bad"][0]["reason"]


def test_a_previous_state_one_step_older_is_brought_up_to_the_journal(store, B, keys):
    """state.json damaged right after a commit: its previous copy is the trial; the acks journal
    says the job committed, so the trial is committed again rather than rolled back."""
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    store.install(B["v2"], "j2", [pub])
    store.commit()
    (store.dir / "state.json").write_bytes(b'{"truncated')
    fresh = SlotStore(store.dir, trusted_keys=[pub])
    fresh.evidence = lambda: [{"sha256": sha(B["v2"]), "outcome": "committed", "job_id": "j2", "at": 1.0}]
    fresh.recover_on_start()
    assert "the acks journal says job j2 committed it" in fresh.recovery["chose"]["how"], fresh.recovery
    st = assert_consistent(store.dir, pub, sha(B["v2"]))
    assert st["boot"]["slot"] == "b"  # it has not been seen serving: its starts count


def test_trust_is_recorded_at_install(store, B, keys):
    """The key that verified a bundle at install is recorded with it, and a good slot's bundle
    opens with that key however the trusted keys change later, as long as it is the same bytes."""
    pub = keys["k1.pub"]
    committed(store, B["v1"], "j1", pub)
    st = store.load()
    fp = hmod.key_fingerprint(hmod.load_public_key(pub))
    assert st["slots"]["a"]["verified_by"] == fp and "BEGIN PUBLIC KEY" in st["slots"]["a"]["signer_key"]
    keys_, want = store.install_trust("a")
    assert want == sha(B["v1"])
    with hmod.open_bundle(store.bundle_path("a"), keys_) as b:
        assert b.verified_by == fp
    assert store.install_trust("b") is None  # empty


def test_a_rollback_is_written_on_a_full_disk_and_a_commit_is_not(tmpfs, B, keys):
    """The agent's store keeps a small reserve file: when the disk is full a rollback (an undo)
    spends it and is written; a commit (a new commitment) is refused with ENOSPC."""
    import errno

    pub = keys["k1.pub"]
    size = B["v1"].stat().st_size
    d = tmpfs(4 * size + 4 * slots.RESERVE_BYTES)
    store = SlotStore(d / "slots", reserve_bytes=4096)
    committed(store, B["v1"], "j1", pub)
    store.recover_on_start()
    assert (store.dir / slots.RESERVE_NAME).stat().st_size == slots.RESERVE_BYTES
    for job in ("j2", "j3"):
        store.install(B["v2"], job, [pub])
        with open(d / "filler", "wb", buffering=0) as f:
            with pytest.raises(OSError) as e:
                while True:
                    f.write(b"\0" * 4096)
        assert e.value.errno == errno.ENOSPC
        if job == "j2":
            with pytest.raises(OSError, match="No space left"):
                store.commit()
        store.rollback("the disk is full")
        (d / "filler").unlink()
        assert_consistent(store.dir, pub, sha(B["v1"]))
        assert store.job(job)["outcome"] == "rolled_back"
    store.install(B["v3"], "j4", [pub])
    assert (store.dir / slots.RESERVE_NAME).stat().st_size == slots.RESERVE_BYTES  # back once there is room


# --- 6. simulated crashes: the state each step leaves behind, then a restart -------------------

def _crash_image(store: SlotStore, B, pub, where: str) -> None:
    """Leave the directory as a process that died ``where`` would."""
    committed(store, B["v1"], "j1", pub)
    d = store.dir
    if where == "installing, file half written":
        st = store.load()
        store._set(st, "b", "installing", "install", "job j2")
        st["slots"]["b"]["job_id"] = "j2"
        store._write(st, "installing")
        (d / "b" / ".model.hmod.123.tmp").write_bytes(B["v2"].read_bytes()[:1000])
    elif where == "installing, file in place":
        st = store.load()
        store._set(st, "b", "installing", "install", "job j2")
        st["slots"]["b"]["job_id"] = "j2"
        store._write(st, "installing")
        shutil.copyfile(B["v2"], d / "b" / "model.hmod")
    elif where == "trial":
        store.install(B["v2"], "j2", [pub])
    elif where == "trial, commit's temp state written":
        store.install(B["v2"], "j2", [pub])
        st = store.load()
        st["primary"], st["trial"] = "b", None
        st["slots"]["b"]["state"] = "good"
        (d / ".state.json.999.tmp").write_text(json.dumps(st))
    elif where == "committed":
        committed(store, B["v2"], "j2", pub)
    elif where == "rolled back":
        store.install(B["v2"], "j2", [pub])
        store.rollback("test")
    elif where == "primary's bundle damaged, other slot good":
        committed(store, B["v2"], "j2", pub)
        flip_byte(store.bundle_path("b"), store.bundle_path("b"), HOST_LIB)
    elif where == "staging leftovers":
        (d / "staging" / "j2.hmod.part.tmp").write_bytes(b"partial")
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("where,primary_version,job_outcome", [
    ("installing, file half written", "v1", None),
    ("installing, file in place", "v1", None),
    ("trial", "v1", "rolled_back"),
    ("trial, commit's temp state written", "v1", "rolled_back"),
    ("committed", "v2", "committed"),
    ("rolled back", "v1", "rolled_back"),
    ("primary's bundle damaged, other slot good", "v1", "committed"),
    ("staging leftovers", "v1", None),
])
def test_recover_after_a_simulated_crash(tmp_path, B, keys, where, primary_version, job_outcome):
    pub = keys["k1.pub"]
    _crash_image(SlotStore(tmp_path / "slots"), B, pub, where)
    restarted = SlotStore(tmp_path / "slots", trusted_keys=[pub])
    done = restarted.recover_on_start()
    st = assert_consistent(restarted.dir, pub, sha(B[primary_version]))
    assert (restarted.job("j2") or {}).get("outcome") == job_outcome
    if where == "trial":
        assert st["slots"]["b"]["state"] == "bad"
        assert any("trial of job j2 rolled back" in x for x in done)
        assert restarted.job("j2")["reason"] == "the agent restarted before the trial was committed"
    if where.startswith("installing"):
        assert st["slots"]["b"]["state"] == "empty" and not restarted.bundle_path("b").exists()
    if where == "primary's bundle damaged, other slot good":
        assert st["slots"]["b"]["state"] == "bad" and any("sha256" in x for x in done)
    assert restarted.recover_on_start() == []  # a second start finds nothing to do
    # and the store takes the next update
    slot = restarted.install(B["v3"], "j3", [pub])
    restarted.commit()
    assert_consistent(restarted.dir, pub, sha(B["v3"]))
    assert slot != st["primary"]


# --- 7. real kill -9 at every step --------------------------------------------------------------

CHILD = r"""
import os, signal, sys
from tandoor_agent.update import slot_state, slots
slot_dir, bundle, pub, job, flow, pause = sys.argv[1:]
pause = int(pause)
seen = [0]
def hook(name):
    print("STEP", name, flush=True)
    if seen[0] == pause:
        print("PAUSED", name, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    seen[0] += 1
slot_state._hook = hook  # the failpoint every step of the store calls
st = slots.SlotStore(slot_dir)
st.recover_on_start()
if flow == "stream":
    with open(bundle, "rb") as f:
        st.install(f, job, [pub])
else:
    st.install(bundle, job, [pub])
if flow == "rollback":
    st.rollback("child: rollback")
else:
    st.commit("child: commit")
hook("done")
print("FINISHED", flush=True)
"""


def _run_child(slot_dir: Path, bundle: Path, pub: Path, flow: str, pause: int) -> tuple[list[str], str | None, int]:
    """Run the child; at step ``pause`` it stops itself and we kill -9 it. Returns (steps seen,
    the step it was killed at or None if it finished, return code)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(slot_dir), str(bundle), str(pub), "j2", flow,
                             str(pause)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    steps, killed_at = [], None
    try:
        for line in proc.stdout:
            kind, _, name = line.strip().partition(" ")
            if kind == "STEP":
                steps.append(name)
            elif kind == "PAUSED":
                for _ in range(500):  # wait until it is really stopped there
                    with open(f"/proc/{proc.pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "T":
                            break
                    time.sleep(0.01)
                os.kill(proc.pid, signal.SIGKILL)
                killed_at = name
                break
        proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        watchdog.cancel()
    if killed_at is None:
        assert proc.returncode == 0, err
    else:
        assert proc.returncode == -signal.SIGKILL
    return steps, killed_at, proc.returncode


@pytest.mark.parametrize("flow", ["commit", "rollback", "overwrite", "stream"])
def test_kill9_at_every_step_recovers_to_a_committed_slot(tmp_path, B, keys, flow):
    pub = keys["k1.pub"]
    template = tmp_path / "template"
    s = SlotStore(template)
    committed(s, B["v1"], "j1", pub)
    old, new = B["v1"], B["v2"]
    if flow == "overwrite":  # a holds the previous good bundle, b is primary; the update goes to a
        committed(s, B["v2"], "j0", pub)
        old, new = B["v2"], B["v3"]
    # a run without a kill lists every step
    dry = tmp_path / "dry"
    shutil.copytree(template, dry)
    steps, killed, _ = _run_child(dry, new, pub, flow, 10**6)
    assert killed is None and steps[-1] == "done"
    want = {"install:verified", "installing:tmp_written", "installing:replaced", "install:copy_renamed",
            "trial:tmp_written", "trial:replaced"}
    want |= {"rollback:tmp_written", "rollback:replaced"} if flow == "rollback" else {
        "commit:begin", "commit:tmp_written", "commit:replaced"}
    want |= {"install:copy_written", "install:copy_synced"} if flow != "stream" else {"install:staged"}
    want |= {"install:reclaimed"} if flow == "overwrite" else set()
    assert want <= set(steps), steps
    assert_consistent(dry, pub, sha(new if flow != "rollback" else old))

    commit_at = steps.index("commit:replaced") if "commit:replaced" in steps else len(steps)
    for k, step in enumerate(steps):
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d)
        seen, killed, rc = _run_child(d, new, pub, flow, k)
        assert killed == step, (k, step, seen)
        restarted = SlotStore(d, trusted_keys=[pub])
        restarted.recover_on_start()
        # the commit is the one atomic rename: killed before it -> the old slot, at/after -> the new
        expect = new if (flow != "rollback" and k >= commit_at) else old
        st = assert_consistent(d, pub, sha(expect))
        outcome = (restarted.job("j2") or {}).get("outcome")
        if expect is new:
            assert outcome == "committed", (step, outcome)
        else:
            assert outcome in (None, "rolled_back"), (step, outcome)
        # the same job again after the restart: either its recorded answer, or a fresh install
        if outcome is None:
            slot = restarted.install(new, "j2", [pub])
            restarted.commit()
            assert_consistent(d, pub, sha(new))
            assert slot != st["primary"]
        else:
            before = (d / "state.json").read_bytes()
            restarted.install(new, "j2", [pub])
            assert (d / "state.json").read_bytes() == before
        shutil.rmtree(d)


# --- 7. hostile bundles, fuzzed ------------------------------------------------------------------

def _zip_with(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            z.writestr(info, data)
    return buf.getvalue()


def _hostile_cases(base: bytes, rng) -> list[tuple[str, bytes]]:
    """(label, bundle bytes): flipped bytes anywhere, truncations, huge members, path tricks."""
    cases = []
    for _ in range(1200):
        i = int(rng.integers(0, len(base)))
        cases.append((f"flip@{i}", base[:i] + bytes([base[i] ^ int(rng.integers(1, 256))]) + base[i + 1:]))
    for _ in range(200):
        n = int(rng.integers(0, len(base)))
        cases.append((f"truncated@{n}", base[:n]))
    with zipfile.ZipFile(io.BytesIO(base)) as z:
        members = {n: z.read(n) for n in z.namelist()}
    man = members["manifest.json"]
    for name in ("../escape.so", "/abs/escape.so", "lib/../../escape.so", "lib\\escape.so", "lib/./x.so",
                 "lib//x.so", "nul\x00.so", "C:/escape.so", "lib/", ""):
        info = zipfile.ZipInfo(name or "x")
        if not name:
            info.filename = ""
        cases.append((f"name {name!r}", _zip_with([("manifest.json", man), (info, b"\x7fELF")])))
    for mode, what in ((0o120777, "symlink"), (0o020644, "char device"), (0o010644, "fifo"), (0o040755, "directory")):
        info = zipfile.ZipInfo("lib/host.so")
        info.external_attr = mode << 16
        cases.append((what, _zip_with([("manifest.json", man), (info, b"/etc/passwd")])))
    lib = json.loads(man)["targets"]["host"]["lib"]
    cases.append(("duplicate member", _zip_with([("manifest.json", man), *members.items(), (lib, b"evil")])))
    cases.append(("extra member of 20 MiB", _zip_with([*members.items(), ("lib/extra.so", bytes(20 << 20))])))
    cases.append(("manifest of 8 MiB", _zip_with([("manifest.json", b" " * (8 << 20) + man),
                                                   *[(n, d) for n, d in members.items() if n != "manifest.json"]])))
    # a member whose headers claim 8 GiB: the sizes in the local and central headers are lies
    lie = bytearray(base)
    for sig, off in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = lie.find(sig, lie.find(b"lib/host.so") - 200 if sig == b"PK\x03\x04" else 0)
        while at != -1 and b"lib/host.so" not in bytes(lie[at:at + 120]):
            at = lie.find(sig, at + 4)
        if at != -1:
            lie[at + off:at + off + 4] = (0xFFFFFFF0).to_bytes(4, "little")
    cases.append(("a member claiming 4 GiB", bytes(lie)))
    comp = io.BytesIO()
    with zipfile.ZipFile(comp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in members.items():
            z.writestr(n, d)
        z.writestr("lib/bomb.so", bytes(64 << 20))  # 64 MiB of zeros in a few KiB: a decompression bomb
    cases.append(("deflated, with a bomb", comp.getvalue()))
    return cases


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")  # the duplicate-member case, on purpose
def test_hostile_bundles_are_each_refused_with_a_reason_and_never_used(tmp_path, B, keys, capsys):
    """A seeded mutation loop over a real signed bundle, through the device's install gate
    (SlotStore.install, what every update job goes through): every case is refused with an
    InstallRefused naming a kind and a reason, or (a flip in zip metadata that no reader uses)
    installs exactly the original members; nothing lands outside the slot directory, nothing is
    extracted, the committed slot keeps serving v1. The number of cases is printed."""
    import numpy as np

    pub = keys["k1.pub"]
    store = SlotStore(tmp_path / "slots")
    committed(store, B["v1"], "seed", pub)
    base = B["v2"].read_bytes()
    with zipfile.ZipFile(B["v2"]) as z:
        originals = {n: z.read(n) for n in z.namelist()}
    outside = set(p.name for p in tmp_path.iterdir())
    src = tmp_path / "case.hmod"
    kinds: dict[str, int] = {}
    accepted = 0
    cases = _hostile_cases(base, np.random.default_rng(20261201))
    for k, (label, data) in enumerate(cases):
        src.write_bytes(data)
        try:
            slot = store.install(src, f"fuzz-{k}", [pub])
        except InstallRefused as e:
            assert e.kind and e.kind not in ("install_refused",) and str(e), (label, e)
            assert "\n" not in str(e), (label, str(e))
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
            continue
        except Exception as e:  # anything else is a bug: a traceback where a reason belongs
            pytest.fail(f"{label}: {type(e).__name__}: {e}")
        accepted += 1
        with zipfile.ZipFile(store.bundle_path(slot)) as z:
            assert {n: z.read(n) for n in z.namelist()} == originals, label
        store.rollback("fuzz: the next case")
    print(f"\nhostile bundles: {len(cases)} cases, {len(cases) - accepted} refused {dict(sorted(kinds.items()))}, "
          f"{accepted} harmless flips installed the original members unchanged")
    assert len(cases) >= 1400 and accepted < len(cases) // 10
    assert set(p.name for p in tmp_path.iterdir()) - {"case.hmod", "slots"} == outside - {"case.hmod", "slots"}
    assert not list(tmp_path.rglob("escape.so")) and not list(tmp_path.rglob("*bomb*"))
    assert_consistent(store.dir, pub, sha(B["v1"]))
