"""What every `tandoor` command shares: the group that turns any error into the one-line answer
(exit 2 for a bad input, the error family's code, or 3 naming the stage), ``--debug`` (or
TANDOOR_DEBUG=1) for the traceback and what native code printed, and the flag parsers commands
share. The commands are host/commands/, one module each; host/cli.py assembles them."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract.errors import TandoorError


DEBUG = os.environ.get("TANDOOR_DEBUG", "") not in ("", "0")
_native_log: Path | None = None     # where fd 2 goes while a command runs (without --debug)


def fail(err: BaseException) -> None:
    if DEBUG:
        traceback.print_exception(err.__cause__ or err, file=sys.stderr)
    click.echo(f"tandoor: error: {err}", err=True)
    sys.exit(getattr(err, "exit_code", 2))


def _set_debug(ctx, param, value) -> None:
    global DEBUG
    if value:
        DEBUG = True


def debug_option(f):
    return click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
                        help="On failure, print the traceback and what TVM printed natively.")(f)


class Tool(click.Group):
    """The tandoor group: turns any error that reaches it into the one-line answer, and keeps what
    native code prints on fd 2 (TVM's C++ warnings, a compiler's chatter) off the user's screen
    unless --debug: fd 2 goes to a log file, Python's stderr to the real terminal."""

    def invoke(self, ctx):
        global DEBUG
        from tandoor_agent.run.lean import tvm_without_torch

        tvm_without_torch()    # TVM would import torch (3.5 s) when it is installed; no command needs it
        DEBUG = DEBUG or "--debug" in sys.argv[1:]     # a subcommand's --debug is parsed later than this
        if not DEBUG:
            warnings.simplefilter("ignore")     # TVM's importer warns about renamed inputs and the like
        with contextlib.ExitStack() as stack:
            if not DEBUG:
                stack.enter_context(_native_stderr_to_log())
            try:
                return super().invoke(ctx)
            except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
                raise
            except KeyboardInterrupt:
                click.echo("tandoor: interrupted; nothing was written", err=True)
                sys.exit(130)
            except TandoorError as err:
                fail(err)
            except Exception as err:
                cmd = ctx.invoked_subcommand or "tandoor"
                text = " ".join(str(err).split()) or type(err).__name__
                fail(_Internal(f"internal error in {cmd}: {type(err).__name__}: {text[:300]}; rerun with "
                                "--debug for the traceback", err))


class _Internal(TandoorError):
    exit_code = 3

    def __init__(self, msg: str, cause: BaseException) -> None:
        super().__init__(msg)
        self.__cause__ = cause


@contextlib.contextmanager
def _native_stderr_to_log():
    global _native_log
    fd, path = tempfile.mkstemp(prefix="tandoor-native-", suffix=".log")
    _native_log = Path(path)
    sys.stderr.flush()
    real = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    old = sys.stderr
    sys.stderr = os.fdopen(real, "w", buffering=1, closefd=False)
    try:
        yield
    finally:
        import gc

        gc.collect()               # native objects freed now print their farewells into the log
        sys.stderr.flush()
        sys.stderr = old
        os.dup2(real, 2)
        os.close(real)
        _native_log.unlink(missing_ok=True)


def floats(text: str | None, opt: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise CompileError(f"{opt} '{text}': expected comma-separated numbers such as 0.485,0.456,0.406") from None


def decoder_options(pairs: tuple[str, ...]) -> dict:
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        try:
            if not sep or not k:
                raise ValueError
            out[k.strip()] = json.loads(v)
        except ValueError:
            raise CompileError(f"--decoder-option {pair!r}: expected KEY=JSON, e.g. strides=[8,16,32] or agnostic=true") from None
    return out


@contextlib.contextmanager
def progress(what: str, quiet: bool = False):
    """A spinner on stderr saying ``what`` runs, and the callback long work reports its steps to
    (each shown on the spinner and logged above it); ``quiet`` (``--json``) shows nothing."""
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    with console.status(what) as status:
        def say(msg: str) -> None:
            status.update(msg)
            console.log(msg)

        yield say
