"""A backend is one thing (issue 41): one record in contract/backends.py per order kind, and for
each its compiler folder, the executors the agent registers, and its docs page; and no order-kind
literal anywhere but the registry, so that a new kind is added in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.cli import ROOT

from tandoor_contract import backends, orders

SOURCES = ("contract", "compiler", "agent", "host", "fleet", "zoo")
# compiler/backends/ folders that are no order kind: the GPU part is a TVM library, not an order
NOT_ORDERS = {"cuda"}


def test_every_order_kind_has_its_folder_its_executors_and_its_docs_page():
    from tandoor_agent.run import executors

    assert set(orders.KINDS) == set(backends.BACKENDS), "orders.KINDS is derived from the registry"
    folders = {p.name for p in (ROOT / "compiler" / "backends").iterdir() if (p / "__init__.py").is_file()}
    names = {b.name for b in backends.BACKENDS.values()}
    assert folders - NOT_ORDERS == names, f"compiler/backends/ folders {sorted(folders)} vs registry {sorted(names)}"
    readme = (ROOT / "README.md").read_text()
    for b in backends.BACKENDS.values():
        folder = ROOT / "compiler" / "backends" / b.name
        assert (folder / "__init__.py").read_text().lstrip().startswith('"""'), f"{folder} says what it is"
        assert b.executors and all(e in executors.REGISTRY for e in b.executors), b
        assert b.order_version in orders.ORDER_VERSIONS, b
        page = ROOT / b.docs
        assert page.is_file() and page.parent.name == "docs", b.docs
        text = page.read_text()
        assert f"`{b.kind}`" in text, f"{b.docs} never names its order kind `{b.kind}`"
        assert f"compiler/backends/{b.name}/" in text, f"{b.docs} never names its folder"
        assert b.docs in readme, f"README.md does not link {b.docs}"
    pages = [b.docs for b in backends.BACKENDS.values()]
    assert len(set(pages)) == len(pages), f"each backend has a page of its own: {pages}"


def _mentions_kind(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and "kind" in n.id) or (isinstance(n, ast.Attribute) and "kind" in n.attr)
               or (isinstance(n, ast.Constant) and n.value == "kind") for n in ast.walk(node))


def kind_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each order kind written as a string where a kind is meant: compared with
    something named kind, given to a keyword named kind, or the value of a "kind" key."""
    kinds = set(backends.BACKENDS)
    lits = lambda n: [c for c in ast.walk(n) if isinstance(c, ast.Constant) and c.value in kinds]  # noqa: E731
    out = []
    for node in ast.walk(ast.parse(source)):
        hits = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for i, s in enumerate(sides):
                if any(_mentions_kind(o) for j, o in enumerate(sides) if j != i):
                    hits += lits(s)
        elif isinstance(node, ast.Dict):
            hits += [c for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and k.value == "kind" and v is not None for c in lits(v)]
        elif isinstance(node, ast.keyword) and node.arg and "kind" in node.arg:
            hits += lits(node.value)
        out += [(h.lineno, h.value) for h in hits]
    return sorted(set(out))


def test_the_literal_finder_finds_each_form_it_looks_for():
    src = ('if part.get("kind") == "onnx": pass\nx = {"kind": "rknn"}\nf(kind="layers")\n'
           'y = g.kind in ("onnx", "rknn")\nz = {"onnx": 1}\nw = executor == "rknn"\n')
    assert kind_literals(src) == [(1, "onnx"), (2, "rknn"), (3, "layers"), (4, "onnx"), (4, "rknn")]


def test_no_order_kind_literal_outside_the_registry():
    bad = []
    for root in SOURCES:
        for path in sorted((ROOT / root).rglob("*.py")):
            if path == ROOT / "contract" / "backends.py" or "__pycache__" in path.parts:
                continue
            bad += [f"{path.relative_to(ROOT)}:{line}: {lit!r}" for line, lit in kind_literals(path.read_text())]
    assert not bad, ("order kinds written as literals (use tandoor_contract.backends.LAYERS/ONNX/RKNN):\n"
                     + "\n".join(bad))


def test_the_overview_says_how_to_add_a_backend_with_the_files_that_exist():
    text = (ROOT / "docs" / "overview.md").read_text()
    recipe = text[text.index("## A new backend"):]
    recipe = recipe[:recipe.find("\n## ", 3)] if "\n## " in recipe[3:] else recipe
    for path in ("contract/backends.py", "compiler/backends/", "agent/run/executors/"):
        assert path in recipe, f"the recipe does not name {path}"
    assert re.search(r"tests/contract/test_backends\.py", recipe), "the recipe names the test that holds it"
