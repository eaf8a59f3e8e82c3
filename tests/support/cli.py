"""The real command-line tools, run as a user would: in a subprocess, from this venv."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run_cli(*args: str, check: bool = False, env: dict | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    """Run `tandoor ...` (or `tandoor-agent ...`) as a user would, in a subprocess."""
    cmd = [str(BIN / args[0]), *args[1:]]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}\nstdout:{res.stdout}\nstderr:{res.stderr}")
    return res


_compiled: dict[str, Path] = {}


def compiled(name: str, model: Path, out_dir: Path, *extra: str) -> Path:
    """Compile `model` for host + aarch64 once per session."""
    key = name + "|" + " ".join(extra)
    if key not in _compiled:
        out = out_dir / f"{name}{abs(hash(key)) % 10000}.hmod"
        run_cli("tandoor", "compile", str(model), "-o", str(out), "--target", "aarch64", "-q", *extra, check=True)
        _compiled[key] = out
    return _compiled[key]


def manifest_of(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("manifest.json"))
