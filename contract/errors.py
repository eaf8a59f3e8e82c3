"""One error base for every Tandoor error a user can see: one line, an exit code, a hint.

    TandoorError(problem, hint=None)   str(err) == "<problem>; <hint>" on one line (or the
                                       problem alone when there is no hint)

Each family sets ``exit_code`` and (optionally) a default ``hint`` and a machine-readable
``kind``; CLIs print ``str(err)`` and exit with ``err.exit_code``. The exit codes are the CLIs'
contract: bundle errors 10-19 (tandoor_contract.hmod), slot errors 20-22, compile errors 2 and
3 (internal), agent runtime 3, camera 4.
"""

from __future__ import annotations


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class TandoorError(Exception):
    exit_code: int = 1
    hint: str | None = None
    kind: str = "error"

    def __init__(self, problem: object, hint: str | None = None, *, exit_code: int | None = None,
                 kind: str | None = None) -> None:
        hint = hint if hint is not None else self.hint
        super().__init__(one_line(f"{problem}; {hint}" if hint else problem))
        if exit_code is not None:
            self.exit_code = exit_code
        if kind is not None:
            self.kind = kind
