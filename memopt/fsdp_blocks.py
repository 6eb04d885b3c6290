"""FSDP2 per block under memopt's step budget: `fully_shard` on each repeated block and on
the root (torchtitan's pattern), then memopt over the model with `blocks=True`.

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model = memopt.compile(model, budget=..., blocks=True)

With `blocks=True` each block's forward is its own graph (memopt.blocks). FSDP2's hooks
are dynamo-disabled, so dynamo runs the frame that calls the sharded blocks (the loop over
them) as eager code and compiles each block's forward on its own: FSDP2's hooks run between
memopt's graphs, as in eager. A block's parameters are all-gathered by its pre-forward hook
just before its graph runs and resharded after it (`reshard_after_forward=True`); its
backward gathers them again, and its recomputation runs inside that backward, while they
are gathered: recomputation never all-gathers a second time.

What the step holds beside each graph's own inputs (the gathered parameters of the block
it runs), as memopt.steps counts it (`BlockShards`):

- every unit's parameter shards, for the whole step (the model's parameters are FSDP2's
  sharded DTensors; memopt.steps counts their local shards), and the gradient shards;
- the root unit's gathered parameters (its embedding and head), from its first graph on;
- in the forward, the flat all-gather output FSDP keeps after a block's all-gather (one
  block's bytes); in the backward, the block FSDP prefetches while a block's backward runs
  (its parameters and its flat buffer), the reduce-scatter input of the block before, and
  one more block's bytes that collective buffers held at some steps on 2 gloo ranks (four
  blocks' bytes, `BACKWARD_BLOCKS`);
- with `reshard_after_forward=False`, every earlier block's gathered parameters, held until
  its own backward;
- as each graph's backward ends, the reduce-scatter's buffers (memopt.fsdp).

The other order, `memopt.compile` first and `fully_shard` on its blocks after, is refused
at the first call (memopt.fsdp.refuse_sharded_inside), as is FSDP2 on a module that is
neither the root nor a repeated block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import InputError
from .fsdp import (
    _backend,
    _fsdp_module_type,
    fsdp_sharded_params,
    local_tensor,
    reduce_scatter_extra_bytes,
)


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP2 units inside `model` (itself included), by name."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, fsdp)]


def check_sharded_blocks(model: nn.Module, groups: list[list[nn.Module]]) -> None:
    """Refuse FSDP2 units other than the root and the repeated blocks (memopt.blocks),
    naming the first, and blocks sharded without the root."""
    blocks = {id(b) for group in groups for b in group}
    units = fsdp_units(model)
    for name, module in units:
        if module is not model and id(module) not in blocks:
            raise InputError(
                f"module {name!r} is an FSDP2 unit (fully_shard) but not one of the model's "
                f"repeated blocks, which memopt.compile(..., blocks=True) runs as graphs "
                f"between FSDP2's hooks; dynamo does not trace those hooks, so its forward "
                f"would run unplanned. Shard each repeated block and the root only "
                f"(found: {', '.join(type(g[0]).__name__ for g in groups) or 'none'}), or "
                f"shard the compiled model as one unit: "
                f"fully_shard(memopt.compile(model, budget=...)).")
    if units and all(module is not model for _, module in units):
        raise InputError(
            "the model's blocks are FSDP2 units but the model is not: call fully_shard on "
            "the root too (after the blocks), so that FSDP2 gathers and frees the "
            "parameters outside the blocks, then memopt.compile(model, blocks=True).")


#: Blocks' bytes held beside the graphs while a backward runs (BlockShards.backward_extra)
BACKWARD_BLOCKS = 4


@dataclass(frozen=True)
class BlockShards:
    """FSDP2 units on the root and the repeated blocks, as memopt.steps counts them (module
    docstring): `block_bytes`, the largest block unit's flat all-gather buffer (its
    parameters gathered, padded); `keep_gathered`, some block keeps its parameters gathered
    after its forward (reshard_after_forward=False); `after_backward`, the reduce-scatter's
    buffers as a backward ends."""

    root: nn.Module | None
    block_bytes: int
    keep_gathered: bool
    after_backward: int

    @property
    def forward_extra(self) -> int:
        """Held while a graph's forward runs: the flat all-gather output FSDP keeps."""
        return self.block_bytes

    @property
    def backward_extra(self) -> int:
        """Held while a graph's backward runs: the block FSDP prefetches (its gathered
        parameters and its flat buffer), the reduce-scatter input of the block before,
        which FSDP frees at the next reduce-scatter, and a fourth block's bytes that 2 gloo
        ranks on CPU held at some steps and not at others (collective buffers freed as
        their work completes): BACKWARD_BLOCKS blocks."""
        return BACKWARD_BLOCKS * self.block_bytes

    @property
    def per_earlier_run(self) -> int:
        """Held around a run for each run before it: a block kept gathered."""
        return self.block_bytes if self.keep_gathered else 0

    def gathered_root(self) -> list[torch.Tensor]:
        """The root unit's gathered parameters (where FSDP2's private state is as in torch
        2.13; [] otherwise: then the plan misses them)."""
        try:
            group = self.root._get_fsdp_state()._fsdp_param_group
            return [] if group is None else [p.unsharded_param for p in group.fsdp_params]
        except (AttributeError, RuntimeError):
            return []


def block_shards(model: nn.Module, groups: list[list[nn.Module]]) -> BlockShards | None:
    """BlockShards of a model whose repeated blocks (and root) are FSDP2 units; None where
    none is."""
    fsdp = _fsdp_module_type()
    blocks = [b for g in groups for b in g if fsdp is not None and isinstance(b, fsdp)]
    if not blocks:
        return None
    flat, keep, after = 0, False, 0
    for block in blocks:
        params = fsdp_sharded_params(block) or []
        if not params:
            continue
        world = params[0].device_mesh.size()
        shard = sum(local_tensor(p).numel() * p.element_size() for p in params)
        flat = max(flat, shard * world)
        after = max(after, reduce_scatter_extra_bytes(shard * world, shard, _backend(params[0])))
        keep = keep or not _reshards_after_forward(block)
    return BlockShards(model if isinstance(model, fsdp) else None, flat, keep, after)


def _reshards_after_forward(module: Any) -> bool:
    """Whether FSDP2 frees the unit's gathered parameters after its forward (True where its
    private state moved: the plan then counts the lower bound)."""
    try:
        return module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
    except AttributeError:
        return True
