"""The device's trusted keys and their rotation (docs/updates.md, "Key rotation").

Trusted = the config's ``trusted_keys`` + keys added by signed ``add-key`` commands - keys
retired by signed ``retire-key`` commands. Several keys may be trusted at once, so a fleet
rotates without a flag day: add the new key, sign bundles with it, retire the old one. A command
(on ``<prefix>/<device>/update/keys``, made by ``tandoor fleet keys``)::

    {"op": "add-key", "id": "k-...", "issued": 1718000000.0, "key": "<PEM public key>",
     "signature": "<hex>", "signer": "<fingerprint>"}
    {"op": "retire-key", "id": "k-...", "issued": ..., "fingerprint": "<16 hex>", ...}

is applied only when it verifies with a key trusted now (``hmod.verify_command``) and was issued
after the last command applied (a replayed old command is refused); a retired key is never
trusted again (re-adding it is refused) and the last trusted key cannot be retired (the device
would take no update ever again). What was applied is in ``<slot_dir>/keys/keyring.json``
(atomically replaced) with the added keys beside it as ``<fingerprint>.pub.pem``. A bundle
signed by a retired key is refused with kind ``retired_key``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from tandoor_contract import durable, hmod, protocol
from tandoor_contract.errors import TandoorError

log = logging.getLogger("tandoor.keys")

OPS = ("add-key", "retire-key")
MAX_COMMAND_BYTES = 16 * 1024


class KeyOpError(TandoorError):
    def __init__(self, kind: str, msg: str, op_id: str | None = None) -> None:
        super().__init__(msg, kind=kind)
        self.op_id = op_id


class Keyring:
    """``trusted`` is the agent's live list of trusted keys (paths or key objects), kept
    current in place, so everything that opens bundles with it sees a rotation at once."""

    def __init__(self, trusted: list[Any], directory: Path | None) -> None:
        self.trusted = trusted
        self._base = list(trusted)
        self.dir = directory
        self._st: dict[str, Any] = {"added": [], "retired": {}, "last_issued": 0.0, "applied": []}

    @property
    def _path(self) -> Path:
        return self.dir / "keyring.json"

    def load(self) -> None:
        if self.dir is None:
            return
        try:
            st = json.loads(self._path.read_text())
            if isinstance(st, dict) and isinstance(st.get("added"), list) and isinstance(st.get("retired"), dict):
                self._st = {**self._st, **st}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # keep the config's keys: never fewer than those
            log.error("%s is unreadable (%s): trusting the configured keys only", self._path, e)
        self._rebuild()

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

    def fingerprints(self) -> list[str]:
        out = []
        for k in self.trusted:
            try:
                out.append(hmod.key_fingerprint(_as_key(k)))
            except hmod.BundleError:
                pass
        return out

    def retired_signer(self, bundle: Path) -> str | None:
        """The fingerprint of the retired key that signed ``bundle``, if one did."""
        keys = []
        for pem in self._st["retired"].values():
            try:
                keys.append(hmod.public_key_from_pem(pem))
            except hmod.BundleError:
                continue
        if not keys:
            return None
        try:
            with hmod.open_bundle(bundle, keys) as b:
                return b.verified_by
        except hmod.BundleError:
            return None

    def apply(self, payload: bytes) -> dict[str, Any]:
        """Check and apply one signed command; returns {"id", "op", "fingerprint"}."""
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
        if op == "add-key":
            fp = self._add(msg, op_id)
        else:
            fp = self._retire(msg, op_id)
        self._st["last_issued"] = float(issued)
        self._st["applied"] = (self._st["applied"] + [{"id": op_id, "op": op, "fingerprint": fp, "signer": signer,
                                                       "issued": issued, "at": durable.now_iso()}])[-32:]
        self._save()
        self._rebuild()
        log.warning("keyring: %s %s (signed by %s); trusted now: %s", op, fp, signer, ", ".join(self.fingerprints()))
        return {"id": op_id, "op": op, "fingerprint": fp}

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

    def _retire(self, msg: dict, op_id: str) -> str:
        fp = msg.get("fingerprint")
        current = dict(zip(self.fingerprints(), self.trusted))
        if fp not in current:
            raise KeyOpError("unknown_key", f"retire-key: {fp!r} is not a trusted key here "
                                            f"({', '.join(current)})", op_id)
        if len(current) == 1:
            raise KeyOpError("last_key", f"retire-key refused: {fp} is the only trusted key; add its successor "
                                         f"first", op_id)
        self._st["retired"][fp] = hmod.public_key_pem(_as_key(current[fp]))
        return fp

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        durable.atomic_write(self._path, json.dumps(self._st, indent=1).encode())


def _as_key(k: Any):
    return k if hasattr(k, "verify") else hmod.load_public_key(k)
