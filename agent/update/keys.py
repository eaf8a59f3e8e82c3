"""The device's trusted keys and their rotation (docs/updates.md, "Key rotation").

Trusted = the config's ``trusted_keys`` + keys added by signed ``add-key`` commands - keys
retired by signed ``retire-key`` commands. Several keys may be trusted at once, so a fleet
rotates without a flag day: add the new key, sign bundles with it, retire the old one. A command
(on ``<prefix>/<device>/update/keys``, made by ``tandoor fleet keys``)::

    {"op": "add-key", "id": "k-...", "issued": 1718000000.0, "key": "<PEM public key>",
     "signature": "<hex>", "signer": "<fingerprint>"}
    {"op": "retire-key", "id": "k-...", "issued": ..., "fingerprint": "<16 hex>", "force"?: true, ...}

is applied only when it verifies with a key trusted now (``hmod.verify_command``) and was issued
after the last command applied (a replayed old command is refused); a retired key is never
trusted again (re-adding it is refused) and the last trusted key cannot be retired (the device
would take no update ever again). Trust in a bundle is decided at install (slots.py records the
key that verified it), so a committed model keeps serving after its key is retired; retire-key
says which installed models the key signed (``affects``) and refuses to retire the key of every
good model here unless the command says ``force``.

On disk, under ``<slot_dir>/keys/``: ``keyring.json`` (a durable, checksummed record with its
previous copy, record.py), the added keys as ``<fingerprint>.pub.pem``, and every retirement
again as ``retired/<fingerprint>.json``, written before the keyring, so no damage to the keyring
can bring a retired key back. When neither keyring.json nor its previous copy can be read, the
device trusts no more than the config's keys minus every retired key (an added key is forgotten
until it is added again), says so on ``status`` (``keyring.state`` "rebuilt") and refuses what it
cannot prove.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandoor_contract import durable, hmod, protocol
from tandoor_contract.errors import TandoorError

from . import record

log = logging.getLogger("tandoor.keys")

OPS = ("add-key", "retire-key")
MAX_COMMAND_BYTES = 16 * 1024
KEYRING = "keyring.json"
RETIRED = "retired"


class KeyOpError(TandoorError):
    def __init__(self, kind: str, msg: str, op_id: str | None = None, **extra: Any) -> None:
        super().__init__(msg, kind=kind)
        self.op_id = op_id
        self.extra = extra


def _empty() -> dict[str, Any]:
    return {"version": 1, "added": [], "retired": {}, "last_issued": 0.0, "applied": [], "rebuilt": None}


def _sound(st: Any) -> bool:
    return (isinstance(st, dict) and isinstance(st.get("added"), list) and isinstance(st.get("retired"), dict)
            and isinstance(st.get("last_issued", 0.0), (int, float)))


class Keyring:
    """``trusted`` is the agent's live list of trusted keys (paths or key objects), kept
    current in place, so everything that opens bundles with it sees a rotation at once.
    ``installed()`` lists the slots ({"slot", "state", "primary", "model", "verified_by"}) for
    retire-key's answer."""

    def __init__(self, trusted: list[Any], directory: Path | None,
                 installed: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.trusted = trusted
        self._base = list(trusted)
        self.dir = directory
        self.installed = installed
        self._st = _empty()
        self.recovered: dict[str, Any] | None = None  # what load() had to repair, for status and telemetry
        self._retired_issued: dict[str, float] = {}   # when each retirement was issued (replay floor)

    @property
    def _path(self) -> Path:
        return self.dir / KEYRING

    @property
    def configured(self) -> bool:
        """Whether the config names trusted keys (then a bundle must be signed by one trusted now)."""
        return bool(self._base)

    # ------------------------------------------------------------------------------ loading
    def load(self) -> None:
        if self.dir is None:
            return
        retired = self._retired_records()
        st, damage, kept = None, None, None
        try:
            st = record.read(self._path)
            if st is not None and not _sound(st):
                raise record.Damaged("not a keyring (added/retired missing)")
            if st is None and (retired or any(self.dir.glob("*.pub.pem"))):  # it existed: lost, not new
                raise record.Damaged("it is missing, but keys were added or retired here")
        except record.Damaged as e:
            damage = f"{KEYRING}: {e}"
            prev = record.previous(self._path)
            kept = record.move_aside(self._path)
            st = prev if _sound(prev) else None
            how = f"the previous copy ({KEYRING}{record.PREV_SUFFIX})"
            if st is None:
                damage += f"; {KEYRING}{record.PREV_SUFFIX}: missing or damaged too"
                how = ("rebuilt: the configured keys minus every retired key (keys/retired/); keys added since "
                       "are not trusted until they are added again")
                st = _empty()
                st["rebuilt"] = {"at": durable.now_iso(), "reason": damage}
            self.recovered = {"damaged": f"keys/{KEYRING}", "reason": damage, "kept_as": kept.name if kept else None,
                              "chose": {"how": how}, "marked_bad": [], "at": durable.now_iso()}
            log.error("%s is unreadable (%s): trusting %s", self._path, damage, how)
        if st is not None:
            self._st = {**_empty(), **st}
        for fp, pem in retired.items():  # a retirement the keyring lost still stands
            self._st["retired"].setdefault(fp, pem)
            self._st["last_issued"] = max(float(self._st["last_issued"]), self._retired_issued.get(fp, 0.0))
        self._rebuild()
        if damage is not None:
            try:
                self._save()
            except OSError as e:
                log.warning("cannot rewrite %s: %s", self._path, e.strerror or e)

    def _retired_records(self) -> dict[str, str | None]:
        """fingerprint -> PEM (None when its record is damaged: the name alone keeps it retired)."""
        out: dict[str, str | None] = {}
        self._retired_issued = {}
        d = self.dir / RETIRED
        for p in sorted(d.glob("*.json")) if d.is_dir() else ():
            fp = p.stem
            try:
                rec = record.read(p) or {}
            except record.Damaged:
                rec = {}
            out[fp] = rec.get("key") if isinstance(rec.get("key"), str) else None
            if isinstance(rec.get("issued"), (int, float)):
                self._retired_issued[fp] = float(rec["issued"])
        return out

    def _rebuild(self) -> None:
        retired = self._st["retired"]
        keys: list[Any] = []
        for k in self._base:
            try:
                if hmod.key_fingerprint(_as_key(k)) not in retired:
                    keys.append(k)
            except hmod.BundleError:
                keys.append(k)  # the config check reports a bad key file; not ours to drop
        for fp in self._st["added"]:
            p = self.dir / f"{fp}.pub.pem"
            if fp not in retired and p.is_file():
                keys.append(str(p))
        self.trusted[:] = keys

    # ------------------------------------------------------------------------------ reading
    def fingerprints(self) -> list[str]:
        out = []
        for k in self.trusted:
            try:
                out.append(hmod.key_fingerprint(_as_key(k)))
            except hmod.BundleError:
                pass
        return out

    def retired_keys(self) -> list[Any]:
        """The public keys retired here (for a bundle the slot store can prove was committed)."""
        keys = []
        for pem in self._st["retired"].values():
            try:
                keys.append(hmod.public_key_from_pem(pem))
            except (hmod.BundleError, TypeError, ValueError):
                continue
        return keys

    def status(self) -> dict[str, Any]:
        """For the status message: what is trusted and retired, and whether the keyring had to
        be rebuilt (then the reason)."""
        rebuilt = self._st.get("rebuilt")
        out: dict[str, Any] = {"state": "rebuilt" if rebuilt else "ok", "trusted": self.fingerprints(),
                               "retired": sorted(self._st["retired"])}
        if rebuilt:
            out["reason"] = rebuilt.get("reason")
            out["since"] = rebuilt.get("at")
        return out

    def retired_signer(self, bundle: Path) -> str | None:
        """The fingerprint of the retired key that signed ``bundle``, if one did."""
        keys = self.retired_keys()
        if not keys:
            return None
        try:
            with hmod.open_bundle(bundle, keys) as b:
                return b.verified_by
        except hmod.BundleError:
            return None

    def refusal(self) -> str | None:
        """Why no bundle can be trusted now, or None: keys are configured but none is trusted
        (every one retired and the added ones lost with a damaged keyring). An empty list must not
        fall back to "no keys: signatures not checked"."""
        if self.configured and not self.trusted:
            why = f" (the keyring was rebuilt: {self._st['rebuilt']['reason']})" if self._st.get("rebuilt") else ""
            return (f"no key is trusted here: every configured key is retired{why}; add a key with "
                    f"`tandoor fleet keys add` signed by a trusted key, or list one in trusted_keys")
        return None

    # ----------------------------------------------------------------------------- applying
    def apply(self, payload: bytes) -> dict[str, Any]:
        """Check and apply one signed command; returns {"id", "op", "fingerprint"} (and, for a
        retire-key, "affects": the installed models it signed)."""
        if self.dir is None:
            raise KeyOpError("not_supported", "key rotation needs slot_dir (where the keyring is kept)")
        try:
            msg = protocol.json_object(payload, MAX_COMMAND_BYTES, "key command")
        except ValueError as e:
            raise KeyOpError("malformed", str(e)) from None
        op_id = msg.get("id") if isinstance(msg.get("id"), str) else None
        op, issued = msg.get("op"), msg.get("issued")
        if op not in OPS or not op_id or not 1 <= len(op_id) <= 100:
            raise KeyOpError("malformed", f"key command: op must be one of {', '.join(OPS)} with an id", op_id)
        if not isinstance(issued, (int, float)) or isinstance(issued, bool) or not math.isfinite(issued):
            raise KeyOpError("malformed", "key command: issued must be epoch seconds", op_id)
        if not isinstance(msg.get("force", False), bool):
            raise KeyOpError("malformed", "key command: force must be true or false", op_id)
        if not self.trusted:
            raise KeyOpError("bad_signature", "no trusted keys: this device checks no signatures, so it takes "
                                              "no key commands", op_id)
        try:
            signer = hmod.verify_command(msg, self.trusted)
        except hmod.BundleError as e:
            raise KeyOpError("bad_signature", f"key command refused: {e} ({', '.join(self.fingerprints())})",
                             op_id) from None
        if issued <= self._st["last_issued"]:
            raise KeyOpError("replayed", f"key command refused: issued {issued} is not after the last one "
                                         f"applied ({self._st['last_issued']}); a replay?", op_id)
        out: dict[str, Any] = {"id": op_id, "op": op}
        try:
            if op == "add-key":
                out["fingerprint"] = self._add(msg, op_id)
            else:
                out["fingerprint"], out["affects"] = self._retire(msg, op_id, issued)
            self._st["last_issued"] = float(issued)
            self._st["rebuilt"] = None  # a command applied: the keyring is the fleet's again
            self._st["applied"] = (self._st["applied"] + [{"id": op_id, "op": op, "fingerprint": out["fingerprint"],
                                                           "signer": signer, "issued": issued,
                                                           "at": durable.now_iso()}])[-32:]
            self._save()
        except OSError as e:    # the file on disk stays what it was; a retirement already recorded stands
            self.load()
            fp = msg.get("fingerprint")
            stands = op == "retire-key" and fp in self._st["retired"]
            raise KeyOpError(durable.io_kind(e), f"cannot write the keyring: {e.strerror or e}"
                             + ("; the retirement was recorded and stands" if stands else "; nothing applied"),
                             op_id, **({"retired": fp} if stands else {})) from None
        self._rebuild()
        log.warning("keyring: %s %s (signed by %s); trusted now: %s", op, out["fingerprint"], signer,
                    ", ".join(self.fingerprints()))
        return out

    def _add(self, msg: dict, op_id: str) -> str:
        try:
            key = hmod.public_key_from_pem(str(msg.get("key") or ""))
        except hmod.BundleError as e:
            raise KeyOpError("malformed", f"add-key: {e}", op_id) from None
        fp = hmod.key_fingerprint(key)
        if fp in self._st["retired"]:
            raise KeyOpError("retired_key", f"add-key refused: key {fp} was retired and is never trusted again",
                             op_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        durable.atomic_write(self.dir / f"{fp}.pub.pem", hmod.public_key_pem(key).encode())
        if fp not in self._st["added"]:
            self._st["added"].append(fp)
        return fp

    def _affected(self, fp: str) -> tuple[list[dict[str, Any]], bool]:
        """The installed models ``fp`` verified ({"slot", "state", "primary", "model"}), and
        whether it signed every good one."""
        slots = self.installed() if self.installed is not None else []
        hit = [{k: s.get(k) for k in ("slot", "state", "primary", "model")} for s in slots
               if s.get("verified_by") == fp and s.get("state") in ("good", "trial")]
        good = [s for s in slots if s.get("state") == "good"]
        return hit, bool(good) and all(s.get("verified_by") == fp for s in good)

    def _retire(self, msg: dict, op_id: str, issued: float) -> tuple[str, list[dict[str, Any]]]:
        fp = msg.get("fingerprint")
        current = dict(zip(self.fingerprints(), self.trusted))
        if fp not in current:
            raise KeyOpError("unknown_key", f"retire-key: {fp!r} is not a trusted key here "
                                            f"({', '.join(current)})", op_id)
        if len(current) == 1:
            raise KeyOpError("last_key", f"retire-key refused: {fp} is the only trusted key; add its successor "
                                         f"first", op_id)
        affects, every_good = self._affected(fp)
        if every_good and not msg.get("force"):
            names = "; ".join(f"slot {a['slot']}: {(a['model'] or {}).get('name')} v{(a['model'] or {}).get('version')}"
                              + (" (serving)" if a["primary"] else "") for a in affects)
            raise KeyOpError("only_good_model", f"retire-key refused: {fp} signed every good model here ({names}); it "
                                                f"would keep serving (trusted at install), but nothing it signed could "
                                                f"be proven again if its state were lost; deploy a model signed by "
                                                f"another key first, or retire with --force", op_id, affects=affects)
        pem = hmod.public_key_pem(_as_key(current[fp]))
        d = self.dir / RETIRED
        d.mkdir(parents=True, exist_ok=True)
        body = {"fingerprint": fp, "key": pem, "issued": issued, "id": op_id, "at": durable.now_iso()}
        durable.atomic_write(d / f"{fp}.json", record.seal(body))  # before the keyring: it cannot be lost
        self._st["retired"][fp] = pem
        return fp, affects

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        record.write(self._path, json.loads(json.dumps(self._st)))


def _as_key(k: Any):
    return k if hasattr(k, "verify") else hmod.load_public_key(k)
