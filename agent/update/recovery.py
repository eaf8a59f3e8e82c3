"""The slot store's recovery: at agent start (a trial never committed is rolled back, an install
that never finished forgotten, the primary re-verified) and after a damaged or lost state.json
(moved aside, rebuilt from its previous copy or the verified bundles, made to agree with the acks
journal). Mixed into :class:`slots.SlotStore`; docs/updates.md has the argument."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tandoor_contract import hmod
from tandoor_contract import durable

from . import record
from .slot_state import (
    PREV_NAME, SLOTS, STATE_NAME, StateCorrupt, check_state, empty_state
)

log = logging.getLogger("tandoor.slots")


class Recovery:
    """Recovery half of the slot store (uses its ``_locked``, ``_write``, ``_set``, ``load``)."""

    def _recover_corrupt(self, err: str) -> dict[str, Any]:
        """A damaged state.json (truncated, bit-flipped, breaking an invariant, or a directory or
        an unreadable file in its place): moved aside, then the previous state if it is sound and
        its primary's bundle is the one recorded (a state one step older is consistent too: every
        step is safe to lose), else rebuilt from the bundles that verify; either way made to agree
        with the acks journal's last word (``evidence``), so a committed update is not lost. With
        nothing to serve: StateCorrupt, saying how to repair."""
        keep = record.move_aside(self.state_path)
        if keep is None and self.state_path.exists() and not self.state_path.is_file():
            raise StateCorrupt(f"{self.state_path} is unusable ({err}) and cannot be moved aside; remove it "
                               f"and start again (the state is then rebuilt from the slot bundles)")
        where = f"kept it as {keep.name}" if keep else "it could not be kept"
        st = self._previous_state()
        if st is not None:
            self._note(f"state.json was corrupt ({err}); {where} and went back to the previous state ({PREV_NAME})")
            how = f"the previous state ({PREV_NAME})"
            fixed = self._reconcile(st)
            if fixed:
                self._note(fixed)
                how += f"; {fixed}"
            self._recovered(err, keep, st, how)
            self._write(st, "restore")
            return st
        self._note(f"state.json was corrupt ({err}); {where} and rebuilt the state from the bundles on disk")
        st, how = self._rebuild_from_disk(f"state.json was corrupt ({err})")
        if st["primary"] is None and any(self.bundle_path(s).exists() for s in SLOTS):
            raise StateCorrupt(f"{self.state_path} is corrupt ({err}), {PREV_NAME} is no help and no slot bundle "
                               f"verifies with the trusted keys: nothing safe to serve; to repair, copy a signed "
                               f"bundle to {self.dir / 'current.hmod'} and remove {self.state_path} (it is adopted "
                               f"at the next start), or set bundle = PATH in the agent's config")
        self._recovered(err, keep, st, how)
        self._write(st, "rebuild")
        return st

    def _recovered(self, reason: str, kept: Path | None, st: dict[str, Any], how: str) -> None:
        """What this recovery did, for the status message and telemetry (``self.recovery``)."""
        p = st["primary"]
        chose = None if p is None else {"slot": p, "model": st["slots"][p]["model"], "sha256": st["slots"][p]["sha256"],
                                         "how": how}
        marked = [{"slot": h["slot"], "reason": h["reason"]} for h in st["history"][self._history_mark:]
                  if h["to"] == "bad"]
        self.recovery = {"damaged": STATE_NAME, "reason": reason, "kept_as": kept.name if kept else None,
                         "chose": chose, "marked_bad": marked, "at": durable.now_iso()}

    def _previous_state(self) -> dict[str, Any] | None:
        st = record.previous(self.state_path)
        try:
            if st is None:
                return None
            check_state(st)
        except ValueError:
            return None
        p = st["primary"]
        if p is not None:
            try:
                if durable.sha256_file(self.bundle_path(p)) != st["slots"][p]["sha256"]:
                    return None
            except OSError:
                return None
        self._history_mark = len(st["history"])
        return st

    def _journal(self) -> list[dict[str, Any]]:
        """The acks journal's events about bundles ({"sha256", "outcome", "job_id", "at"}), oldest
        first; empty when there is none or it cannot be read."""
        if self.evidence is None:
            return []
        try:
            return sorted((e for e in self.evidence() if isinstance(e.get("sha256"), str)),
                          key=lambda e: e.get("at") or 0)
        except Exception as e:  # evidence is a hint: never a reason to fail the recovery
            log.warning("cannot read the acks journal: %s", e)
            return []

    def _last_word(self, shas: dict[str, str]) -> dict[str, Any] | None:
        """The journal's latest event about one of ``shas`` ({sha256: slot})."""
        last = None
        for ev in self._journal():
            if ev["sha256"] in shas and ev.get("outcome") in ("committed", "rolled_back"):
                last = ev
        return last

    def _reconcile(self, st: dict[str, Any]) -> str | None:
        """Make a recovered state agree with the journal's last word on the bundles it holds: a
        trial (or good slot) the journal says was committed becomes primary; a primary the
        journal says was rolled back gives way to the other good slot. Returns what it changed."""
        live = {st["slots"][s]["sha256"]: s for s in SLOTS if st["slots"][s]["state"] in ("trial", "good")}
        ev = self._last_word(live)
        if ev is None:
            return None
        s, job = live[ev["sha256"]], ev.get("job_id")
        other = "b" if s == "a" else "a"
        if ev["outcome"] == "committed" and st["primary"] != s:
            if st["slots"][s]["state"] == "trial":
                self._set(st, s, "good", "commit", f"recovered: the acks journal says job {job} committed it", job)
                st["trial"] = None
                st["boot"] = {"slot": s, "job_id": job, "attempts": 0}
            st["primary"] = s
            return f"slot {s} is primary: the acks journal says job {job} committed it"
        if ev["outcome"] == "rolled_back" and st["primary"] == s and st["slots"][other]["state"] == "good":
            self._set(st, s, "bad", "recover", f"recovered: the acks journal says job {job} was rolled back", job)
            st["primary"], st["boot"] = other, None
            return f"slot {s} is bad and slot {other} primary: the acks journal says job {job} was rolled back"
        return None

    def _verify_file(self, p: Path, keys: Iterable[hmod.KeySource]) -> dict[str, Any]:
        """What the slot records of a bundle that opens, verifies and has a lib for here: its
        sha256, model, and the key that verified it (fingerprint and PEM: trust is decided at
        install, so the bundle keeps serving after that key is retired)."""
        keys = list(keys)
        with hmod.open_bundle(p, keys) as b:
            b.lib_for()
            model = b.manifest.get("model") or {}
            manifest = b.manifest
            by = b.verified_by
        pem = None
        for k in keys:
            obj = k if hasattr(k, "verify") else hmod.load_public_key(k)
            if by is not None and hmod.key_fingerprint(obj) == by:
                pem = hmod.public_key_pem(obj)
                break
        return {"sha256": durable.sha256_file(p), "model": {"name": model.get("name"), "version": model.get("version")},
                "verified_by": by, "signer_key": pem, "_manifest": manifest}

    def _rebuild_from_disk(self, why: str) -> tuple[dict[str, Any], str]:
        """The state was lost: trust only bundles that verify, with the trusted keys (or, for a
        bundle the acks journal says was committed, with a key since retired: it was verified at
        install). The journal's last word names the committed one; without one, installs always go
        to the slot that is not primary, so of two valid bundles the older (by build, version,
        then signing time) was committed when the newer one was installed: it becomes primary and
        the newer one, which might never have passed its gate, is marked bad. Returns the state
        and how the primary was chosen."""
        st = empty_state()
        self._history_mark = 0
        valid: dict[str, dict[str, Any]] = {}
        journal_shas = {e["sha256"] for e in self._journal() if e.get("outcome") == "committed"}
        for s in SLOTS:
            p = self.bundle_path(s)
            if not p.exists():
                continue
            try:
                facts = self._verify_file(p, self.trusted_keys)
            except hmod.BundleError as e:
                facts = self._proven_by_journal(p, journal_shas, e)
                if facts is None:
                    self._set(st, s, "bad", "adopt", f"{why}; bundle does not verify: {e}")
                    self._note(f"slot {s}: bundle does not verify ({e}); marked bad")
                    continue
            facts["_mtime"] = p.stat().st_mtime_ns
            valid[s] = facts
            st["slots"][s].update({k: v for k, v in facts.items() if not k.startswith("_")},
                                  installed_at=durable.now_iso())
        if not valid:
            return st, "nothing verifies"
        ev = self._last_word({f["sha256"]: s for s, f in valid.items()})
        if ev is not None and ev["outcome"] == "committed":
            primary = next(s for s, f in valid.items() if f["sha256"] == ev["sha256"])
            how = f"rebuilt from the bundles on disk: the acks journal says job {ev.get('job_id')} committed it"
        else:
            primary = next(s for s in valid if not any(self._newer(valid[s], f) for f in valid.values()))
            how = ("rebuilt from the bundles on disk: " + ("the older valid bundle (nothing says the newer one was "
                                                           "committed)" if len(valid) > 1 else "the one valid bundle"))
        for s in sorted(valid, key=lambda s: s != primary):
            if s == primary:
                self._set(st, s, "good", "adopt", f"{why}; {how}")
                st["primary"] = s
                self._note(f"slot {s} is primary again ({how})")
                continue
            newer = self._newer(valid[s], valid[primary])
            rolled = self._last_word({valid[s]["sha256"]: s})
            if (rolled is not None and rolled["outcome"] == "rolled_back") or (newer and ev is None):
                reason = ("the acks journal says it was rolled back" if rolled is not None
                          and rolled["outcome"] == "rolled_back" else "newer bundle, not known to be committed")
                self._set(st, s, "bad", "adopt", f"{why}; {reason}")
                self._note(f"slot {s}: {reason}; marked bad")
            else:
                self._set(st, s, "good", "adopt", f"{why}; a valid bundle committed before slot {primary}'s")
        return st, how

    def _proven_by_journal(self, p: Path, committed: set[str], err: hmod.BundleError) -> dict[str, Any] | None:
        """A bundle that no trusted key verifies any more, but whose sha256 the acks journal
        records as committed: verified at install, so proven; it must still verify with a key
        once trusted (``retired_keys``) and be whole."""
        if not isinstance(err, (hmod.BadSignature, hmod.UnsignedBundle)) or not committed:
            return None
        try:
            if durable.sha256_file(p) not in committed:
                return None
            return self._verify_file(p, list(self.trusted_keys) + list(self.retired_keys))
        except (OSError, hmod.BundleError):
            return None

    @staticmethod
    def _newer(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Whether bundle ``a`` is newer than ``b``: by their manifests' build, version, then
        signing time (hmod.downgrade_reason's order), else by the files' times."""
        if hmod.downgrade_reason(b["_manifest"], a["_manifest"]) is not None:
            return True
        if hmod.downgrade_reason(a["_manifest"], b["_manifest"]) is not None:
            return False
        return a["_mtime"] > b["_mtime"]

    def _adopt_current(self, st: dict[str, Any]) -> dict[str, Any]:
        """A directory from before slots (<slot_dir>/current.hmod): copy it into slot a."""
        src = self.dir / "current.hmod"
        try:
            facts = self._verify_file(src, self.trusted_keys)
        except hmod.BundleError as e:
            self._note(f"current.hmod does not verify ({e}); starting with empty slots")
            return st
        self._copy_durably(src, self.bundle_path("a"), facts["sha256"])
        st["slots"]["a"].update({k: v for k, v in facts.items() if not k.startswith("_")},
                                installed_at=durable.now_iso())
        self._set(st, "a", "good", "adopt", "adopted current.hmod")
        st["primary"] = "a"
        self._note("adopted current.hmod into slot a as primary")
        return st

    def _note(self, msg: str) -> None:
        self.notes.append(msg)
        log.warning("%s: %s", self.dir, msg)

    def recover_on_start(self, verify: bool = True) -> list[str]:
        """Call once when the agent starts, before serving. Rolls back a trial that was never
        committed, forgets an install that never finished, removes temp files, and (``verify``)
        checks that the primary's bundle is still the one recorded, falling back to the other
        good slot if not. Returns what it did (also logged), empty when nothing was needed."""
        with self._locked():
            self.notes = []
            self._reserve_wanted = True
            st = self._read()
            done = list(self.notes)
            changed = False
            for s in SLOTS:
                for t in (self.dir / s).glob(".*.tmp"):
                    t.unlink(missing_ok=True)
                    done.append(f"removed the temp file {s}/{t.name}")
            for t in self.dir.glob(f".{STATE_NAME}.*.tmp"):
                t.unlink(missing_ok=True)
            for pattern in ("*.tmp", "*.stream"):  # ours: a stream being staged by install()
                for t in self.staging_dir.glob(pattern):
                    t.unlink(missing_ok=True)
                    done.append(f"removed the staged file staging/{t.name}")
            for s in SLOTS:
                if st["slots"][s]["state"] == "installing":
                    job = self._forget_install(st, s, "the install was interrupted (agent restarted)")
                    done.append(f"slot {s}: install of job {job} was interrupted; slot emptied")
                    changed = True
            trial = st["trial"]
            if trial is not None:
                s = trial["slot"]
                reason = "the agent restarted before the trial was committed"
                self._set(st, s, "bad", "recover", reason, trial.get("job_id"))
                st["trial"] = None
                if trial.get("job_id") is not None:
                    self._record_job(st, trial["job_id"], "rolled_back", s, reason, st["slots"][s]["sha256"])
                done.append(f"slot {s}: trial of job {trial.get('job_id')} rolled back ({reason})")
                changed = True
            if verify:
                changed |= self._verify_primary(st, done)
            if changed:
                self._write(st, "recover")
            self._keep_reserve()
            for msg in done[len(self.notes):]:
                log.warning("%s: %s", self.dir, msg)
            return done

    def _forget_install(self, st: dict[str, Any], s: str, reason: str) -> str | None:
        """installing -> empty in ``st`` (not yet written); removes the half-written bundle."""
        slot = st["slots"][s]
        job = slot.get("job_id")
        self.bundle_path(s).unlink(missing_ok=True)
        for t in (self.dir / s).glob(".*.tmp"):
            t.unlink(missing_ok=True)
        self._set(st, s, "empty", "recover", reason, job)
        slot.update(sha256=None, model=None, installed_at=None)
        return job

    def _verify_primary(self, st: dict[str, Any], done: list[str]) -> bool:
        changed = False
        for _ in SLOTS:  # at most one fallback per slot
            cur = st["primary"]
            if cur is None:
                return changed
            p = self.bundle_path(cur)
            want = st["slots"][cur]["sha256"]
            try:
                got = durable.sha256_file(p)
                problem = None if got == want else f"its bundle's sha256 is {got[:16]}..., recorded {want[:16]}..."
            except OSError as e:
                problem = f"its bundle is unreadable ({e.strerror or e})"
            if problem is None:
                return changed
            self._set(st, cur, "bad", "recover", f"primary bundle damaged: {problem}")
            other = "b" if cur == "a" else "a"
            st["primary"] = other if st["slots"][other]["state"] == "good" else None
            done.append(f"slot {cur}: {problem}; marked bad, primary is now {st['primary']}")
            changed = True
        return changed
