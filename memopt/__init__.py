"""memopt: a memory-optimizing compiler for PyTorch training.

    model = memopt.compile(model, budget="4GB")   # then train as usual
    print(memopt.plan(model, x).summary())        # what is saved, shared, rewritten

See README.md for what works today and docs in each module for the algorithms
(Chen et al. 2016; Gruslys et al. 2016; MacKay et al. 2018).
"""

from .api import CompiledModule, compile, plan
from .backend import MemoptBackend, memopt_backend
from .budget import Budget, format_bytes, parse_budget
from .errors import BudgetError, CaptureError, MemoptError, PassError
from .plan import MemoryPlan

__all__ = [
    "Budget",
    "BudgetError",
    "CaptureError",
    "CompiledModule",
    "MemoptBackend",
    "MemoptError",
    "MemoryPlan",
    "PassError",
    "compile",
    "format_bytes",
    "memopt_backend",
    "parse_budget",
    "plan",
]
__version__ = "0.1.0"
