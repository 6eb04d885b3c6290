"""`memopt.plan(model, ..., blocks=True)`: the plan of `memopt.compile(model, blocks=True)`'s
step, for a model on the meta device (issue 27: an LLM planned block by block).

memopt.plan never runs the model: it captures the step as one graph and plans it. With
`blocks=True` there is no one graph: each repeated block is its own graph and the loop
over them is Python (memopt.blocks), so the step has to run for the graphs to exist. On
the meta device it can: every tensor is a shape without data, the eager code between the
graphs runs on shapes, and memopt's compiled graphs run op by op on meta tensors, at no
cost. The forward of such a step is run here once, under `storages.meta_counted()` (meta
tensors count their bytes, as the real ones of the same shapes would), and its plan is
returned: a StepPlan of the graphs, with the block graph's plan per block position
(memopt.run_plans). The backward is not run: every plan is made, and re-made with the
whole forward known, by the end of the forward (memopt.steps).

What it leaves behind: nothing on the model (the blocks' boundary hooks are removed, no
`.grad` is made); dynamo keeps the loop's frame marked to run eagerly, as after
memopt.compile(model, blocks=True) (a later torch.compile of the same class compiles each
block's frame apart).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memopt.passes._torch_compat import pytree

from .errors import InputError
from .memory_plan import MemoryPlan, StepPlan
from .storages import meta_counted


def check_meta(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """InputError unless the model's tensors and the example tensors are all on meta."""
    tensors = [*model.parameters(), *model.buffers()]
    examples = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    real = [t for t in [*tensors, *examples] if t.device.type != "meta"]
    if real:
        raise InputError(
            f"memopt.plan(..., blocks=True) plans a model on the meta device (it runs the "
            f"step's forward on shapes alone: the loop over the blocks is Python), but a "
            f"tensor is on {real[0].device}. Plan a meta copy (build the model under "
            f"`with torch.device('meta'):`, with meta inputs), or run one step of "
            f"memopt.compile(model, blocks=True) and read its memopt_plan.")


def plan_blocks(compiled: nn.Module, args: tuple, kwargs: dict[str, Any]
                ) -> MemoryPlan | StepPlan:
    """Run `compiled` (a blocks=True CompiledModule of a meta model) forward once and
    return its plan; the model is left as it was (module docstring)."""
    model = compiled.original_module
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        with meta_counted():
            out = compiled(*args, **kwargs)
        del out
        plan = compiled.memopt_plan
    finally:
        for handle in compiled._memopt_block_hooks:
            handle.remove()
        for p, grad in grads:
            p.grad = grad
    if plan is None:
        raise InputError(
            "memopt.plan(..., blocks=True) found no training graph: nothing the forward "
            "returns needs a gradient, so there is no backward pass to plan.")
    return plan
