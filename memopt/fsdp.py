"""FSDP2 (`torch.distributed.fsdp.fully_shard`) and memopt: which order works.

    model = fully_shard(memopt.compile(model, budget=...), mesh=mesh)   # works
    memopt.compile(fully_shard(model))                                  # InputError

`fully_shard(memopt.compile(model))` makes the compiled module one FSDP unit: FSDP's
forward pre-hook all-gathers the parameters into plain tensors before memopt's compiled
step runs, and its post-backward hook reduce-scatters the gradients memopt's backward
produced, so the graph memopt captures is the model's own. The plan counts the parameter
shards FSDP keeps for the whole step, and the all-gather buffer it keeps through the forward,
as held outside the graph (`fsdp_unit`); `MemoryPlan.fsdp` reports them, the all-gathered
bytes and the collectives' estimated peaks.

The other orders are refused up front (`refuse_fsdp`): a model with FSDP2 modules or
DTensor parameters inside. On torch 2.13 dynamo does not trace FSDP2's hooks (it skips
them, and a forward that calls sharded layers in a loop runs with no compiled graph),
and a DTensor parameter has no storage memopt can count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import InputError
from .memory_plan import FsdpRecord


def _fsdp_module_type() -> type | None:
    """FSDP2's module class, or None in a torch built without torch.distributed."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:
        return None
    return FSDPModule


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415
    except ImportError:
        return None
    return DTensor


def _sharded_part(model: nn.Module) -> str:
    """Where `model` is sharded ("" where it is not): the first FSDP2 module, else the
    first DTensor parameter, by name."""
    fsdp, dtensor = _fsdp_module_type(), _dtensor_type()
    if fsdp is not None:
        for name, module in model.named_modules():
            if isinstance(module, fsdp):
                return f"module {name or '(the root)'} is an FSDP2 unit ({type(module).__name__})"
    if dtensor is not None:
        for name, param in model.named_parameters():
            if isinstance(param, dtensor):
                return f"parameter {name!r} is a DTensor"
    return ""


def refuse_fsdp(model: nn.Module, api: str) -> None:
    """Raise InputError naming the order that works when `model` is, or holds, an FSDP2
    unit or DTensor parameters (a scan of its modules and parameters: no process group
    needed)."""
    where = _sharded_part(model)
    if not where:
        return
    raise InputError(
        f"{api} was given a model sharded by FSDP2 (fully_shard): {where}. memopt captures "
        f"the step as one graph of plain tensors, and on torch {torch.__version__} dynamo "
        f"does not trace FSDP2's all-gather and reshard hooks (it skips them, and a forward "
        f"that runs sharded layers in a loop would run eagerly, with no plan). Compile "
        f"first, then shard the compiled module as one FSDP unit: "
        f"fully_shard(memopt.compile(model, budget=...), mesh=...); the budget then counts "
        f"one rank's step with the parameters all-gathered. To keep FSDP2's units per block, "
        f"shard each repeated block and the root, then memopt.compile(model, budget=..., "
        f"blocks=True) (memopt.fsdp_blocks). DDP(memopt.compile(model)) works too. "
        f"memopt.plan the model before fully_shard.")


def refuse_sharded_inside(compiled: nn.Module, model: nn.Module) -> None:
    """At a call of `compiled` (an FSDP2 unit): refuse FSDP2 units inside the model it
    compiles, which `fully_shard` may have made after memopt.compile."""
    fsdp = _fsdp_module_type()
    inner = [name for name, m in model.named_modules() if isinstance(m, fsdp) and m is not compiled]
    if inner:
        raise InputError(
            f"module {inner[0] or '(the root)'} inside this memopt module was sharded with "
            f"fully_shard after memopt.compile; dynamo does not trace FSDP2's hooks, so "
            f"memopt would plan nothing. Shard only the compiled module, as one FSDP unit: "
            f"fully_shard(memopt.compile(model, budget=...), mesh=...); or, for FSDP2 per "
            f"block, shard the repeated blocks and the root first, then "
            f"memopt.compile(model, budget=..., blocks=True).")


@dataclass(frozen=True)
class FsdpUnit:
    """What the FSDP2 unit around a compiled module holds on this rank as its forward starts (after
    FSDP's pre-forward all-gather): `held`, resident for the whole step: the parameter shards, the
    gradient shards kept from earlier steps, and the flat all-gather output FSDP keeps for its
    post-forward hook (to overlap the copy-out with a next all-gather). That hook drops it, but on 2
    gloo ranks it was still allocated through the backward in 2 of 12 rank-runs (freed later,
    outside any op), which put the step 131 KB over a plan that freed it as the forward ended; so
    the plan holds it for the whole step. `record`: what `MemoryPlan.fsdp` reports.
    `after_backward`: what FSDP's post-backward allocates on top of what the step still holds as the
    backward ends (reduce_scatter_extra_bytes), planned as a last step of the backward
    (memopt.steps.Outside.after_backward)."""

    held: tuple[torch.Tensor, ...]
    record: FsdpRecord
    after_backward: int = 0


def fsdp_unit(module: nn.Module) -> FsdpUnit | None:
    """The FSDP2 unit `fully_shard` made of `module`, as its forward starts; None when
    `module` is not one (or FSDP2's private state moved: see fsdp_sharded_params)."""
    fsdp = _fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return None
    params = fsdp_sharded_params(module)
    if not params:
        return None
    shards = [local_tensor(p) for p in params]
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    kept = _kept_all_gather_output(module)
    world = params[0].device_mesh.size()
    sharded, grad_bytes = _storage_bytes(shards), _storage_bytes(grads)
    unsharded = sum(p.numel() * p.element_size() for p in params)  # DTensor: global sizes
    flat = sharded * world  # the padded flat buffer of one all-gather / reduce-scatter
    record = FsdpRecord(
        world_size=world, sharded_bytes=sharded, sharded_grad_bytes=grad_bytes,
        unsharded_bytes=unsharded, kept_all_gather_bytes=_storage_bytes(kept),
        all_gather_bytes=sharded + grad_bytes + flat + unsharded,
        reduce_scatter_bytes=sharded + grad_bytes + unsharded + flat + sharded)
    return FsdpUnit(tuple(shards + grads + kept), record,
                    reduce_scatter_extra_bytes(flat, sharded, _backend(params[0])))


def reduce_scatter_extra_bytes(flat: int, shard: int, backend: str) -> int:
    """What FSDP2's post-backward allocates as the unit's backward ends, while the
    unsharded gradients are still live: the flat reduce-scatter input they are copied
    into, its output shard, and on gloo, which has no reduce-scatter of its own, a second
    flat buffer for the collective. Measured on 2 gloo ranks (tests/test_fsdp.py): when
    these overlapped the end of memopt's backward the step measured 194,584 B above a plan
    that left them out, in 3 of 16 rank-runs."""
    return flat + shard + (flat if backend == "gloo" else 0)


def _backend(param: Any) -> str:
    """The process-group backend of a DTensor parameter's mesh ("" where unknown)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415

        return str(dist.get_backend(param.device_mesh.get_group()))
    except (AttributeError, RuntimeError, ValueError):
        return ""


def _kept_all_gather_output(module: nn.Module) -> list[torch.Tensor]:
    """The flat all-gather output FSDP2 keeps through the forward of the unit it just
    unsharded (FSDPParamGroup.wait_for_unshard: `comm_ctx.all_gather_state`, freed by the
    root's post-forward hook); [] where there is none or FSDP2's private state moved."""
    try:
        state = module._get_fsdp_state()._comm_ctx.all_gather_state
        return [] if state is None else [state.all_gather_result.all_gather_output]
    except AttributeError:
        return []


def fsdp_sharded_params(module: nn.Module) -> list[Any] | None:
    """The sharded parameters (DTensors) of the FSDP2 unit `fully_shard` made of `module`,
    which its forward pre-hook has swapped for all-gathered ones by the time the module's
    forward runs. FSDPModule has no public accessor for them in torch 2.13: this is the one
    place memopt reads FSDP2's private state; None where it moved (then the plan does not
    count the shards, and `MemoryPlan.fsdp` is None)."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        return [] if group is None else [p.sharded_param for p in group.fsdp_params]
    except AttributeError:
        return None


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer state); any
    other tensor as it is."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())
