"""memopt: a memory-optimizing compiler for PyTorch training.

    model = memopt.compile(model, budget="4GB")   # then train as usual
    print(memopt.plan(model, x).summary())        # what is saved, shared, rewritten

See README.md for what works today and the docs in each module for the
algorithms (Chen et al. 2016; Gruslys et al. 2016; MacKay et al. 2018).

The public names load lazily, so `import memopt.allocator` (pure-Python
solvers) does not import torch, and `python -m memopt.measure` starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CompiledModule": "api",
    "compile": "api",
    "plan": "api",
    "MemoptBackend": "backend",
    "memopt_backend": "backend",
    "Budget": "budget",
    "format_bytes": "budget",
    "parse_budget": "budget",
    "BudgetError": "errors",
    "BudgetFormatError": "errors",
    "CaptureError": "errors",
    "InputError": "errors",
    "MemoptError": "errors",
    "NoTimelineError": "errors",
    "OptionalDependencyError": "errors",
    "PassError": "errors",
    "Link": "link",
    "MemoryPlan": "memory_plan",
    "StepPlan": "memory_plan",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in ("recurrent", "nn"):  # memopt.recurrent.Recurrent, memopt.nn.RevGRU
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'memopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
