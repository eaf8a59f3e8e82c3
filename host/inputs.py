"""Input files of the host commands, checked while the command line is parsed: a path that is not
there is answered in one line at once, not after the seconds a command spends importing TVM."""

from __future__ import annotations

from pathlib import Path

import click

from tandoor_compiler.errors import CompileError
from tandoor_contract import hmod


class InputFile(click.Path):
    """An existing file: an ONNX model (``what="model"``) or a bundle (``what="bundle"``); a
    missing one raises the error the command would raise later (its one line and exit code)."""

    def __init__(self, what: str) -> None:
        super().__init__(dir_okay=False, path_type=Path)
        self.what = what

    def convert(self, value, param, ctx) -> Path:
        p = super().convert(value, param, ctx)
        if not Path(p).is_file():
            if self.what == "bundle":
                raise hmod.NotABundle(f"{p} does not exist")
            raise CompileError(f"{p}: no such file; give the path of an .onnx model")
        return p
