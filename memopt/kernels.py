"""Which kernels run memopt's plan: `kernels="aten"` (op by op) or `kernels="inductor"`.

memopt plans the joint forward+backward graph and partitions it (memopt.planner); what
runs the two graphs it returns is a separate choice:

- ``"aten"``: AOTAutograd's boxed GraphModules, one aten kernel per node. memopt's own
  in-place rewrites (Chen et al. 2016, Sec. 3; ``out=`` forms) and storage sharing are
  what runs, so the simulated peak is the step's.
- ``"inductor"``: TorchInductor generates the kernels of both graphs (fused pointwise and
  reduction kernels, its own buffer reuse), as `torch.compile` would, with memopt's
  partition function in place of inductor's min-cut one (inductor's
  ``custom_partitioner_fn`` hook, called after inductor's joint-graph passes). What
  memopt saves and recomputes is memopt's plan; how each graph is computed is
  inductor's.

What the inductor mode changes, and why (passes._torch_compat.INDUCTOR_SETTINGS):

1. The captured graph is decomposed with inductor's table (plus memopt's loss
   decompositions), so the graph memopt plans is the one inductor compiles.
2. memopt's in-place pass is off: inductor refuses ``out=`` ops, and reuses buffers
   itself. Fusion only removes buffers the plan counts, and inductor frees each buffer
   at its last use, so the plan's prediction is an upper estimate of what inductor holds.
3. ``fallback_random``: random ops run as eager's kernels on eager's generator, in
   program order, so dropout draws eager's masks, and memopt's saved-mask replay
   (passes.twins) recomputes dropout from eager's mask. Without it inductor would
   replace the draws with its own Philox stream inside the partitioner memopt replaces.
4. ``layout_optimization``, ``shape_padding`` and ``comprehensive_padding`` off: they add
   channels-last copies and padded buffers the plan does not hold (a ResNet measured
   1.24x over its budget with channels-last on).
5. AOTAutograd's cache off for memopt's compilations (a hit would skip the partitioner,
   and the plan); inductor's kernel cache stays on, keyed by the graphs it compiles.

memopt's own operators (chains, LM heads, reversible stacks) are registered custom ops
with fake implementations (torch.library), which inductor calls as extern kernels.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Callable, Sequence

from torch import fx

from memopt.passes._torch_compat import inductor_compile


class Kernels(str, enum.Enum):
    """What runs a plan's forward and backward graphs (the module docstring)."""

    ATEN = "aten"
    INDUCTOR = "inductor"

    @classmethod
    def parse(cls, value: object) -> "Kernels":
        if isinstance(value, Kernels):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f'kernels must be "aten" (memopt runs its graphs op by op) or "inductor" '
                f"(TorchInductor generates their kernels), got {value!r}") from None


#: The key inductor's kernel cache gets for memopt's partitioner: the graphs themselves
#: decide the kernels, so one constant per memopt version.
_CACHE_KEY = "memopt-partitioner-1"


def compile_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any],
                          partition_fn: Callable[..., Any]) -> Callable:
    """`gm` (a dynamo graph) compiled by TorchInductor with `partition_fn` (memopt's
    planner) partitioning its joint graph. `gm` itself is left as it was (inductor's
    pre-grad passes change the graph they are given), so that it can be planned again."""
    own = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    own.meta.update(gm.meta)
    return inductor_compile(own, list(example_inputs), partition_fn, _CACHE_KEY)
