"""griffe extensions that let the API reference see memopt as Python does once installed.

griffe reads source files; two things memopt's install does are invisible to it:

- `PackageDir`: pyproject.toml installs `passes/` and `allocator/` as `memopt.passes` and
  `memopt.allocator` (`[tool.setuptools.package-dir]`). Without this, an alias such as
  `memopt.recurrent.solve` (imported from `allocator/`) does not resolve and is silently
  left out of the page. This loads every mapped folder under its installed name.
- `LazyExports`: `memopt/__init__.py` loads its public names lazily from a table
  (`_EXPORTS`, read by `__getattr__`), so that `import memopt.allocator` stays free of
  torch. This adds each of them as an alias, so the reference can say `memopt.compile`
  (and link to it) rather than `memopt.api.compile`.

The reference documents public names only; these just let griffe follow their imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the docs extra installs tomli there
    import tomli as tomllib


def _root(pkg: griffe.Module) -> Path | None:
    """The repository root: the folder with pyproject.toml above `<pkg>/__init__.py`."""
    root = Path(pkg.filepath).parent.parent
    return root if (root / "pyproject.toml").is_file() else None


class PackageDir(griffe.Extension):
    """Load setuptools' `package-dir` folders under the top-level package griffe loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        root = _root(pkg)
        if root is None:
            return
        config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
        mapping = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
        for name, folder in mapping.items():
            parent, _, leaf = name.rpartition(".")
            init = root / folder / "__init__.py"
            if parent != pkg.path or leaf in pkg.members or not init.is_file():
                continue
            module = loader._load_module(leaf, init, submodules=True, parent=pkg)
            pkg.set_member(leaf, module)


class LazyExports(griffe.Extension):
    """Add the names of a package's `_EXPORTS = {name: submodule}` table as aliases."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader,
                   **kwargs: Any) -> None:
        table = pkg.members.get("_EXPORTS")
        if table is None or table.is_alias or not table.is_attribute:
            return
        for name, module in ast.literal_eval(str(table.value)).items():
            if name not in pkg.members:
                target = f"{pkg.path}.{module}.{name}"
                pkg.set_member(name, griffe.Alias(name, target, parent=pkg))
