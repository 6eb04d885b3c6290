"""The runtimes of memopt's own operators, as the passes that insert and price them see them.

passes.cell_loops and passes.chain_policy rewrite graphs into calls of ``memopt::chain_fwd`` /
``chain_bwd`` and price them; passes.reversible_stacks prices ``memopt::reversible_fwd`` /
``reversible_bwd``; passes.lm_heads inserts and prices ``memopt::head_fwd`` / ``head_bwd``.
The operators, and the Python that runs inside them, belong to
memopt's runtime above the passes (memopt.recurrent.ops, memopt.recurrent.modules,
memopt.nn.ops), which register themselves here when they are imported, so that imports
run one way: memopt -> passes -> allocator. memopt.backend imports those runtimes before
any pass runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Runtimes:
    """Filled in by the runtime modules at import."""

    chains: Any = None      # memopt.recurrent.ops: ChainSpec, register, spec_of, LAST_STATS
    loop_step: Any = None   # memopt.recurrent.modules.loop_step
    reversible: Any = None  # memopt.nn.ops: spec_of, the buffer bound
    heads: Any = None       # memopt.lm_head: the chunked head's ops


RUNTIMES = Runtimes()


def runtime(name: str) -> Any:
    """A registered runtime; RuntimeError naming the module to import when it is not."""
    found = getattr(RUNTIMES, name)
    if found is None:
        module = {"chains": "memopt.recurrent.ops", "loop_step": "memopt.recurrent.modules",
                  "reversible": "memopt.nn.ops", "heads": "memopt.lm_head"}[name]
        raise RuntimeError(f"memopt's {name} runtime is not loaded: import {module} "
                           f"(memopt.compile and memopt.plan do) before running this pass")
    return found
