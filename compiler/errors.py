"""The compiler's user-facing errors: one line naming the problem and the fix.

    CompileError    bad input or environment (exit 2)
    InternalError   a stage failed unexpectedly (exit 3); names the stage, ``--debug`` shows why
"""

from tandoor_contract.errors import TandoorError


class CompileError(TandoorError):
    """Bad input or environment. str(err) is the one-line message shown to the user."""

    exit_code = 2
    kind = "compile"


class InternalError(TandoorError):
    """An unexpected failure inside a compile stage (a bug or a model trait we do not handle)."""

    exit_code = 3
    kind = "internal"
    hint = "rerun with --debug for the traceback, and report it with the model's traits"
