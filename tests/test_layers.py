"""Imports run one way: memopt -> passes -> allocator (STYLE.md, sec. 1).

Read from the source with `ast` (nothing is imported): no module of `allocator/` imports
torch, memopt or the passes; no module of `passes/` imports memopt's own modules (only
`memopt.passes.*` and `memopt.allocator.*`; the runtimes of memopt's operators reach the
passes through memopt.passes.runtime); and among memopt's modules the imports form no
cycle (memopt.api imports memopt.backend, never the reverse); and no module but
memopt.passes._torch_compat and memopt.passes._inductor_compat (inductor's pieces) names a
private torch module (`torch._*`, `torch.utils._*`), so a torch upgrade touches those files
only (DESIGN.md).
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


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations
    only, which never run: they make no cycle and cross no layer at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return (n for n in ast.walk(tree) if id(n) not in skip)


def imports(name: str) -> set[str]:
    """Absolute names of what module `name` imports at run time, anywhere in its source."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
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
    """The parser sees a relative import that climbs out of the passes, and skips only
    what `if TYPE_CHECKING:` guards."""
    assert "memopt.passes.runtime" in imports("memopt.passes.chain_costs")
    assert "memopt.backend" in imports("memopt.api")
    assert "memopt.backend" not in imports("memopt.compiled_graph")  # annotations only
    assert "memopt.graph_breaks" in imports("memopt.compiled_graph")


#: The modules that may name PyTorch's private modules (DESIGN.md: "isolate every private
#: torch import in one module so a torch upgrade touches one file"; inductor's pieces
#: in a second, for the first's size)
TORCH_COMPAT = "memopt.passes._torch_compat"
INDUCTOR_COMPAT = "memopt.passes._inductor_compat"
_PRIVATE = ("torch._", "torch.utils._")


def _dotted(node: ast.AST) -> str | None:
    """`torch._ops.OpOverload` as that string; None for anything but a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def private_torch_names(source: str) -> list[str]:
    """Every place `source` names a private torch module: `import torch._x`,
    `from torch._x import y`, `from torch import _x`, an attribute chain `torch._x...`
    or `torch.utils._x...`, and a string naming one (`"torch._dynamo"`, matched on an
    error's module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node) or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith(_PRIVATE) and " " not in node.value:
            names = [node.value]
        found += [f"line {node.lineno}: {n}" for n in names
                  if n.startswith(_PRIVATE) and not n.startswith(("torch.__", "torch.utils.__"))]
    return sorted(set(found))


@pytest.mark.parametrize("name", sorted(n for n in MODULES
                                         if n not in (TORCH_COMPAT, INDUCTOR_COMPAT)))
def test_private_torch_names_only_in_the_compat_module(name: str) -> None:
    bad = private_torch_names(MODULES[name].read_text())
    assert not bad, f"{name} names private torch modules (move them to {TORCH_COMPAT}): {bad}"


@pytest.mark.parametrize("snippet", [
    "import torch._dynamo", "from torch._guards import detect_fake_mode",
    "import torch\nx = isinstance(1, torch._ops.OpOverload)",
    "import torch\ntorch.utils._pytree.tree_leaves([])",
    "ok = type(e).__module__.startswith('torch._dynamo')"])
def test_the_private_torch_check_can_fail(snippet: str) -> None:
    assert private_torch_names(snippet)


def test_the_private_torch_check_passes_public_names() -> None:
    assert not private_torch_names("import torch\nfrom torch import fx\ntorch.ops.aten.mm\n"
                                   "s = 'see torch._dynamo.config for the limit'")
