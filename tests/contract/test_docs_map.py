"""The map matches the tree: every repository path and every Python import that README.md and
docs/*.md name exists, so a newcomer following the docs never lands on a file or a module that
moved (issue 41: the README's layout table and docs/benchmarks.md's commands had fallen behind)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("agent", "compiler", "contract", "fleet", "host", "zoo", "scripts", "tests", "docs", "systemd",
       "mosquitto", ".ci")
# a repository path: a top-level folder, then names; not a topic (``tandoor/~fleet/update/...``)
PATH_RE = re.compile(r"(?<![\w/.~-])((?:%s)/[\w./-]*[\w/])" % "|".join(re.escape(t) for t in TOP))
IMPORT_RE = re.compile(r"\bfrom (tandoor_\w+(?:\.\w+)*) import ([\w ,]+)|\bimport (tandoor_\w+(?:\.\w+)*)")


def _missing_path(p: str) -> bool:
    p = re.sub(r"(::.*|:\d+(-\d+)?)$", "", p).rstrip("./")
    if re.search(r"[*<>{}]", p) or (ROOT / p).exists():
        return False
    # module.attribute (compiler/stages/check_facts.requant_flips): the module's file exists
    head, _, attr = p.rpartition(".")
    return not (attr.isidentifier() and (ROOT / f"{head}.py").exists())


def _missing_import(mod: str, names: str | None) -> list[str]:
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        return [f"import {mod} ({e})"]
    out = []
    for name in re.split(r"[\s,]+", (names or "").strip()):
        if name and name != "as" and not hasattr(module, name) and importlib.util.find_spec(f"{mod}.{name}") is None:
            out.append(f"from {mod} import {name}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_path_and_import_a_doc_names_exists(doc):
    text = doc.read_text()
    bad = sorted({m.group(1) for m in PATH_RE.finditer(text) if _missing_path(m.group(1))})
    for m in IMPORT_RE.finditer(text):
        names = m.group(2)
        if names and " as " in f" {names} ":
            names = names.split(" as ")[0]
        bad += _missing_import(m.group(1) or m.group(3), names)
    assert not bad, f"{doc.relative_to(ROOT)} names what the tree does not have: {bad}"
