"""The compiler's user-facing error: one line naming the problem and the fix, exit code 2."""


class CompileError(Exception):
    """Bad input or environment. str(err) is the one-line message shown to the user."""

    exit_code = 2
