"""The bundle's errors as one table: (name, exit code, hint). Each is a :class:`BundleError`
whose one-line message is the problem, then ``hint`` (what to do); a CLI returns ``exit_code``.
The table in contract/hmod.py's docstring says when each is raised."""

from __future__ import annotations

from .errors import TandoorError


class BundleError(TandoorError):
    """Base of all bundle errors; the message is one line: the problem, then what to do."""

    exit_code: int = 1
    hint: str = "rebuild the bundle with tandoor"


def _error(name: str, exit_code: int, hint: str) -> type[BundleError]:
    return type(name, (BundleError,), {"exit_code": exit_code, "hint": hint, "__module__": "tandoor_contract.hmod",
                                       "__doc__": f"{name} (exit {exit_code}): {hint}."})


NotABundle = _error('NotABundle', 10, 'check the path, or copy/rebuild the bundle again (it may be truncated)')
UnsafeMember = _error('UnsafeMember', 11, 'refusing to use it; rebuild the bundle with tandoor')
HashMismatch = _error('HashMismatch', 12, 'the bundle was modified or corrupted; copy or rebuild it again')
MissingMember = _error('MissingMember', 13, 'the bundle is incomplete; rebuild it with tandoor')
BadSignature = _error('BadSignature', 14, 'the bundle was modified or signed by an untrusted key; re-sign it or fix the trusted keys')
UnsignedBundle = _error('UnsignedBundle', 15, 'sign it with a trusted key, or configure no trusted keys to accept unsigned bundles')
FormatVersionError = _error('FormatVersionError', 16, 'use an agent and compiler from the same tandoor release')
NoLibForArch = _error('NoLibForArch', 17, 'recompile the model with a target for this architecture')
ExtraMember = _error('ExtraMember', 18, 'the bundle was modified after it was built; rebuild it with tandoor')
KeyFileError = _error('KeyFileError', 19, 'pass an Ed25519 PEM key made by generate_keypair (private: PKCS8, public: .pub)')
