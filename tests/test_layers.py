"""Imports run one way: memopt -> passes -> allocator (issue 15, item 4; STYLE.md, sec. 1).

Read from the source with `ast` (nothing is imported): no module of `allocator/` imports
torch, memopt or the passes; no module of `passes/` imports memopt's own modules (only
`memopt.passes.*` and `memopt.allocator.*`; the runtimes of memopt's operators reach the
passes through memopt.passes.runtime); and among memopt's modules the imports form no
cycle (memopt.api imports memopt.backend, never the reverse).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"memopt": ROOT / "memopt", "memopt.passes": ROOT / "passes",
            "memopt.allocator": ROOT / "allocator"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def imports(name: str) -> set[str]:
    """Absolute names of what module `name` imports, anywhere in its source."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module or ""
            absolute = (f"{base}.{module}" if module else base) if node.level else module
            submodules = {f"{absolute}.{alias.name}" for alias in node.names
                          if f"{absolute}.{alias.name}" in MODULES}
            found.update(submodules)
            if module or not submodules:  # `from . import ops` imports the submodule only
                found.add(absolute)
    return found


def _layer(name: str) -> str:
    for prefix in ("memopt.allocator", "memopt.passes"):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return "memopt"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "memopt.allocator"))
def test_the_allocator_imports_neither_torch_nor_the_layers_above(name: str) -> None:
    bad = {i for i in imports(name) if i.split(".")[0] == "torch"
           or (i.startswith("memopt") and _layer(i) != "memopt.allocator")}
    assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "memopt.passes"))
def test_passes_import_nothing_of_memopt_above_them(name: str) -> None:
    bad = {i for i in imports(name) if i.startswith("memopt") and _layer(i) == "memopt"}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_memopts_own_modules_import_no_cycle() -> None:
    own = {n for n in MODULES if _layer(n) == "memopt"}
    edges = {n: {i for i in imports(n) if i in own and i != n} for n in own}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(own):
        if name not in state:
            visit(name, [])


def test_the_checks_can_fail() -> None:
    """The parser sees a relative import that climbs out of the passes."""
    assert "memopt.passes.runtime" in imports("memopt.passes.chains")
    assert "memopt.backend" in imports("memopt.api")
