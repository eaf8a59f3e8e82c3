"""The architecture, kept true: each half imports the contract and never the other half.

The agent is installed alone on boards (no compiler, onnx or rich there), and the compiler must
not drag the agent's runtime into a compile. Checked on the sources' import statements (static,
so a lazy import inside a function counts too) and on a real process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import ROOT

PACKAGES = {"tandoor_contract": "contract", "tandoor_agent": "agent", "tandoor_compiler": "compiler",
            "tandoor_fleet": "fleet", "tandoor_host": "host", "tandoor_zoo": "zoo"}
# package -> the Tandoor packages it may import
ALLOWED = {
    "tandoor_contract": set(),
    "tandoor_agent": {"tandoor_contract"},
    "tandoor_compiler": {"tandoor_contract"},
    "tandoor_fleet": {"tandoor_contract"},
    "tandoor_zoo": {"tandoor_contract"},
    "tandoor_host": {"tandoor_contract", "tandoor_compiler", "tandoor_agent", "tandoor_fleet"},
}
# folders allowed one more package, each with its reason: INT8's calibration and its judge make the
# model inputs and read the outputs as the device does (the agent's Preprocessor, its decoders, its
# HybridModule), so that what is judged is what the camera will feed; nothing else of the compiler may
FOLDER_ALLOWED = {"compiler/int8": {"tandoor_agent"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_package_imports_only_what_the_architecture_allows(package):
    bad = []
    for path in sorted((ROOT / PACKAGES[package]).rglob("*.py")):
        for mod in _imports(path) & set(PACKAGES):
            extra = FOLDER_ALLOWED.get(path.parent.relative_to(ROOT).as_posix(), set())
            if mod != package and mod not in ALLOWED[package] | extra:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def _module_graph() -> dict[str, set[str]]:
    """Every Tandoor module -> the Tandoor modules it imports, at the top or inside a function
    (a lazy import is still an arrow), relative imports resolved."""
    mods: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [pkg, *f.relative_to(ROOT / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        here = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                for a in node.names:
                    edges.add(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target)
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def test_no_import_cycle_counting_imports_inside_functions():
    """Issue 41: the layers only point down. A cycle (even through a lazy import inside a function)
    means two modules that are really one, or a helper that lives in the wrong one."""
    graph = _module_graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(v: str, path: list[str]) -> None:
        state[v] = 1
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w):] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v, [v])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_contract_needs_only_the_stdlib_numpy_and_cryptography():
    third_party = set()
    for path in (ROOT / "contract").rglob("*.py"):
        third_party |= _imports(path) - set(sys.stdlib_module_names) - set(PACKAGES)
    # tvm/onnxruntime/pyarmnn are only probed for their versions, inside try blocks (contract/profile.py)
    assert third_party <= {"numpy", "cryptography", "tvm", "onnxruntime", "pyarmnn"}, third_party


def test_running_a_compile_module_loads_no_agent_module():
    code = ("import sys, tandoor_compiler.pipeline, tandoor_compiler.backends.acl, tandoor_compiler.stages.codegen; "
            "print(sorted(m for m in sys.modules if m.startswith('tandoor_agent')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_readme_layout_table_matches_the_tree():
    import re

    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout"):]
    table = table[:table.index("\n\n", table.index("| path |"))]
    rows = re.findall(r"^\| `([^`]+)` \| (.*) \|$", table, re.M)
    listed = {path.rstrip("/") for path, _ in rows}
    for path, what in rows:
        assert (ROOT / path).exists(), f"README lists {path}, which does not exist"
        for name in re.findall(r"`([A-Za-z_]+\.py|[A-Za-z_]+/)`", what):
            assert (ROOT / path / name).exists(), f"README says {path} has {name}"
    for d in ("contract", "compiler", "agent/run", "agent/serve", "agent/update", "agent/telemetry", "fleet",
              "host", "zoo", "tests", "scripts", "docs"):
        assert d in listed, f"{d}/ is not in the README's layout table"
    # every module of a package folder is on its row (issue 41: the table named 11 of the compiler's 24)
    for path, what in rows:
        if path.rstrip("/") in ("tests", "scripts", "docs", "systemd", "mosquitto"):
            continue
        named = set(re.findall(r"`([A-Za-z0-9_]+\.py)`", what))
        missing = sorted(f.name for f in (ROOT / path).glob("*.py") if f.name != "__init__.py" and f.name not in named)
        assert not missing, f"README's layout row for {path} leaves out {missing}"


def test_the_format_doc_shows_the_op_vocabulary_as_the_code_defines_it():
    from tandoor_contract import orders

    text = (ROOT / "docs" / "bundle-format.md").read_text()
    start = text.index("<!-- ops table: generated, do not edit -->\n") + len("<!-- ops table: generated, do not edit -->\n")
    end = text.index("\n<!-- end of ops table -->")
    assert text[start:end] == orders.markdown_table(), "regenerate the table with orders.markdown_table()"


def test_every_order_op_type_has_an_onnx_rendering_and_an_armnn_builder():
    from tandoor_agent.run.executors.armnn_ops import BUILDERS
    from tandoor_compiler.backends import acl
    from tandoor_compiler.backends.acl.order_onnx import _Renderer
    from tandoor_contract import orders

    for t in orders.OPS:
        assert hasattr(_Renderer, f"_op_{t}"), f"order op {t} has no ONNX rendering"
        assert t in BUILDERS, f"order op {t} has no Arm NN builder"
    assert set(BUILDERS) == set(orders.OPS), f"Arm NN builders of no order op: {set(BUILDERS) - set(orders.OPS)}"
    emitted = {e.order_type for e in acl.ENTRIES}
    assert emitted == set(orders.OPS), f"op types no ACL entry writes: {set(orders.OPS) - emitted}"
