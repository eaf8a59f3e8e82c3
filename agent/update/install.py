"""Installing a bundle into the inactive slot: the space check and the reserve kept for a rollback
on a full disk, the durable copy (fsync, rename), verification, and undoing a failed install.
Mixed into :class:`slots.SlotStore`."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from tandoor_contract import hmod
from tandoor_contract import durable

from .slot_state import (
    Busy, InstallRefused, RESERVE_BYTES, RESERVE_NAME, SLOTS, STATE_NAME, SourceLike, CHUNK,
    io_refusal, state_step, refusal_from
)

log = logging.getLogger("tandoor.slots")


class Install:
    """Install half of the slot store (uses its ``_locked``, ``_write``, ``_set``, ``load``)."""

    @property
    def _reserve_path(self) -> Path:
        return self.dir / RESERVE_NAME

    def _keep_reserve(self) -> None:
        """Put the reserve back once there is room (best effort: a full disk stays full)."""
        p = self._reserve_path
        if p.exists() or not self._reserve_wanted:
            return
        try:
            durable.atomic_write(p, bytes(RESERVE_BYTES), mode=0o600)
        except OSError:
            pass

    def _release_reserve(self) -> bool:
        try:
            self._reserve_path.unlink()
            return True
        except OSError:
            return False

    def install(self, source: SourceLike, job_id: str, trusted_keys: Iterable[hmod.KeySource] = (),
                expected_sha256: str | None = None, size: int | None = None) -> str:
        """Install a bundle into the inactive slot and start its trial; returns the slot name.

        ``source`` is a path (a file in staging_dir() is moved, anything else copied) or a
        binary stream (written to staging first; ``size``, if known, is checked against the free
        space up front). Before anything is written: signature against ``trusted_keys``, every
        sha256, the format version, a lib for this machine, ``expected_sha256`` of the whole
        file, and the free space. Refusals raise InstallRefused (``kind`` says why) and leave
        the running slot untouched.

        Idempotent: a job_id that already reached trial (or later) returns its slot without
        doing anything; one that was refused raises the same refusal again (``repeated``)."""
        job_id = str(job_id)
        keys = list(trusted_keys)
        with self._locked():
            st = self._read()
            done = st["jobs"].get(job_id)
            if done is not None:
                return self._repeat(job_id, done)
            for s in SLOTS:  # an install that died without recover_on_start(): forget it
                if st["slots"][s]["state"] == "installing":
                    self._forget_install(st, s, "an earlier install was interrupted")
                    self._write(st, "recover")
            if st["trial"] is not None:
                t = st["trial"]
                raise Busy(f"job {t.get('job_id')} is in trial on slot {t['slot']}; "
                           f"commit or roll it back before job {job_id}")
            slot = "b" if st["primary"] == "a" else "a"
            try:
                return self._install(st, slot, source, job_id, keys, expected_sha256, size)
            except InstallRefused as e:
                self._fail_job(job_id, e)
                raise

    def _repeat(self, job_id: str, done: dict[str, Any]) -> str:
        if done["outcome"] == "failed" or done.get("slot") is None:
            e = InstallRefused(done.get("reason") or "refused", kind=done.get("kind") or "install_refused")
            e.repeated = True
            raise e
        log.info("job %s already done (%s on slot %s): nothing to do", job_id, done["outcome"], done["slot"])
        return done["slot"]

    def _fail_job(self, job_id: str, e: InstallRefused) -> None:
        """Record a refusal so that the same job gets the same answer; transient refusals (disk
        space, I/O) are not recorded, so a retry of the job may succeed later."""
        if e.kind in ("no_space", "io_error"):
            return
        try:
            st = self._read()
            self._record_job(st, job_id, "failed", None, str(e), kind=e.kind)
            self._write(st, "refused")
        except OSError as err:  # e.g. the disk is full: the refusal itself still stands
            log.warning("could not record the refusal of job %s: %s", job_id, err)

    def _install(self, st: dict[str, Any], slot: str, source: SourceLike, job_id: str,
                 keys: list, expected_sha256: str | None, size: int | None) -> str:
        staged: Path | None = None
        owns_staged = False
        if hasattr(source, "read"):
            # not staging_path(): the caller may be streaming from that very file
            staged = self.staging_path(job_id).with_suffix(".stream")
            owns_staged = True
            if size is not None:
                self._check_space(st, slot, size)
            self._stream_to(source, staged)
            state_step("install:staged")
            src = staged
        else:
            src = Path(source)
            if src.resolve().parent == self.staging_dir.resolve():
                staged = src  # already on this filesystem: moved, not copied
        try:
            # 1. verify everything before anything is written to a slot
            try:
                facts = self._verify_file(src, keys)
            except hmod.BundleError as e:
                raise refusal_from(e) from None
            file_sha, model = facts["sha256"], facts["model"]
            if expected_sha256 and file_sha != expected_sha256.lower():
                raise InstallRefused(f"bundle sha256 {file_sha[:16]}... differs from the job's "
                                     f"{expected_sha256[:16]}...", kind="sha256_mismatch")
            state_step("install:verified")
            # 2. room for it (a move needs none)
            need = 0 if staged is not None else src.stat().st_size
            self._check_space(st, slot, need)
            # 3. the slot is being overwritten: say so durably before touching its file
            self._set(st, slot, "installing", "install", f"installing job {job_id}", job_id)
            st["slots"][slot].update(sha256=None, model=None, installed_at=None, job_id=job_id,
                                     verified_by=None, signer_key=None)
            try:
                self._write(st, "installing")
            except OSError as e:  # nothing changed: state.json is the old one
                raise io_refusal(e, f"cannot write {STATE_NAME}") from None
            dst = self.bundle_path(slot)
            try:
                if dst.exists():
                    dst.unlink()  # frees its space before the copy (it is no longer referenced)
                    durable.fsync_dir(dst.parent)
                    state_step("install:reclaimed")
                if staged is not None:
                    os.replace(staged, dst)
                    durable.fsync_dir(staged.parent)
                    durable.fsync_dir(dst.parent)
                    owns_staged = False
                    if durable.sha256_file(dst) != file_sha:
                        raise InstallRefused("the staged bundle changed while it was installed",
                                             kind="hash_mismatch")
                else:
                    self._copy_durably(src, dst, file_sha)
                state_step("install:copy_renamed")
                # 4. trial: the new slot is on disk; the primary is still the old one
                st = self._read()
                self._set(st, slot, "trial", "install", f"installed by job {job_id}", job_id)
                st["slots"][slot].update(sha256=file_sha, model=model, installed_at=durable.now_iso(), job_id=job_id,
                                         verified_by=facts["verified_by"], signer_key=facts["signer_key"])
                st["trial"] = {"slot": slot, "job_id": job_id, "started_at": durable.now_iso(),
                               "previous": st["primary"]}
                self._record_job(st, job_id, "trial", slot, None, file_sha)
                self._write(st, "trial")
            except BaseException as e:
                self._abort_install(slot, job_id, e)
                if isinstance(e, OSError):
                    raise io_refusal(e, f"cannot write the bundle into slot {slot}") from None
                raise
            log.info("job %s: %s installed in slot %s, in trial", job_id, model, slot)
            return slot
        finally:
            if owns_staged and staged is not None:
                staged.unlink(missing_ok=True)

    def _abort_install(self, slot: str, job_id: str, err: BaseException) -> None:
        """installing -> empty after a failed write; the primary was never touched."""
        try:
            self.bundle_path(slot).unlink(missing_ok=True)
            for t in (self.dir / slot).glob(".*.tmp"):
                t.unlink(missing_ok=True)
            st = self._read()
            if st["slots"][slot]["state"] == "installing":
                self._set(st, slot, "empty", "install_failed", f"job {job_id} failed: {err}", job_id)
                self._write(st, "install_failed")
        except OSError as e2:  # recover_on_start finishes this on the next start
            log.warning("slot %s: could not clean up after a failed install: %s", slot, e2)

    def _check_space(self, st: dict[str, Any], slot: str, need: int) -> None:
        free = shutil.disk_usage(self.dir).free
        reclaim = 0
        old = self.bundle_path(slot)
        if old.exists():
            reclaim = old.stat().st_size  # the inactive slot's old bundle is overwritten
        if need + self.reserve_bytes > free + reclaim:
            mib = 1024 * 1024
            raise InstallRefused(
                f"not enough disk space in {self.dir}: the bundle needs {need / mib:.2f} MiB plus "
                f"{self.reserve_bytes / mib:.2f} MiB reserve, {free / mib:.2f} MiB free"
                + (f" (+{reclaim / mib:.2f} MiB from slot {slot}'s old bundle)" if reclaim else "")
                + "; the running model is untouched", kind="no_space")

    def _stream_to(self, stream: IO[bytes], dst: Path) -> None:
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                while chunk := stream.read(CHUNK):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            dst.unlink(missing_ok=True)
            raise io_refusal(e, f"cannot stage the bundle in {dst.parent}") from None

    @staticmethod
    def _copy_durably(src: Path, dst: Path, want_sha: str) -> None:
        """Copy to a temp file beside dst, fsync, check it is the verified bytes, rename, fsync."""
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        try:
            h = hashlib.sha256()
            with open(src, "rb") as sf, open(tmp, "wb") as df:
                while chunk := sf.read(CHUNK):
                    h.update(chunk)
                    df.write(chunk)
                df.flush()
                state_step("install:copy_written")
                os.fsync(df.fileno())
            if h.hexdigest() != want_sha:
                raise InstallRefused(f"{src} changed between verification and copy",
                                     kind="hash_mismatch")
            state_step("install:copy_synced")
            os.replace(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        durable.fsync_dir(dst.parent)
