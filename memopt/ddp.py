"""DistributedDataParallel around a memopt module: the gradient buckets each rank holds.

    ddp = DDP(memopt.compile(model, budget="4GB"))   # the budget is one rank's

DDP's reducer allocates flat bucket tensors when DDP is built, one element per element of
every parameter it all-reduces (in `bucket_cap_mb` chunks, the first one small, regrouped
in gradient order after the first iteration), and keeps them for as long as DDP lives:
about the size of the gradients again, held through every step. With the default
`gradient_as_bucket_view=False` each gradient is copied into its bucket, all-reduced
there and copied back, so the buckets are a second copy of the gradients. With
`gradient_as_bucket_view=True` the reducer makes every `.grad` a view of its bucket at
the first backward: from then on the buckets *are* the kept `.grad` tensors, which the
plan already counts (memopt.grads), and only a step that finds `.grad` unset (the first,
or after `zero_grad(set_to_none=True)`) holds the buckets beside the new gradients.
Measured on 2 gloo ranks (tests/test_ddp_accumulation.py): DDP's construction allocates
exactly the parameters' bytes, in either mode.

How memopt learns it is wrapped, at each call of the compiled module (no option to pass):
DDP's forward runs its module inside `DDP._inside_ddp_forward()`, which sets the class
attribute `DistributedDataParallel._active_ddp_module` to that DDP for the duration of the
call (dynamo's DDPOptimizer finds DDP the same way, through `_get_active_ddp_module()`).
The active DDP whose `.module` is the compiled module is its wrapper. Other ways
considered: walking the caller's frames for a DDP `self` (depends on DDP's call chain),
`gc.get_referrers` (slow, and finds a DDP that is built but not running), or an explicit
`memopt.compile(..., ddp=True)` (the user repeats what the code already says, and a wrong
value goes unnoticed). Not detected: DDP in compiled-autograd mode
(`torch._dynamo.config.optimize_ddp = "python_reducer"`), which does not set the
attribute; and a DDP around a module that merely contains the compiled one.

The bucket sizes are DDP's own: `DDP._get_ddp_logging_data()["bucket_sizes"]`, recorded
when DDP is built (the rebuild after the first iteration regroups the same parameters,
so their sum, what the plan counts, stays). Both are private names of a public class;
where a torch release moves them, the sum of the synced parameters' bytes stands in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DDPBuckets:
    """The gradient buckets of the DDP that runs a module, as the plan counts them.

    `nbytes`: all of DDP's bucket storage on this rank. `counted_bytes`: the part the
    plan adds as held for the whole step, beside the parameters: all of it, less the
    kept `.grad` tensors that are views of the buckets (`bucket_view`), which the plan
    counts as existing gradients already."""

    nbytes: int
    counted_bytes: int
    bucket_view: bool


def active_wrapper(module: nn.Module) -> Any | None:
    """The DistributedDataParallel whose forward is running `module` now, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = getter() if getter is not None else None
    return ddp if ddp is not None and getattr(ddp, "module", None) is module else None


def bucket_bytes(ddp: Any) -> int:
    """Bytes of `ddp`'s gradient buckets on this rank (see the module docstring)."""
    try:
        sizes = str(ddp._get_ddp_logging_data()["bucket_sizes"])
        return sum(int(s) for s in sizes.split(",") if s.strip())
    except Exception:  # noqa: BLE001 - torch moved the logging data: count what DDP syncs
        return _synced_parameter_bytes(ddp)


def _synced_parameter_bytes(ddp: Any) -> int:
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    return sum(p.numel() * p.element_size() for name, p in ddp.module.named_parameters()
               if p.requires_grad and name not in ignored)


def buckets_of(module: nn.Module, model: nn.Module) -> DDPBuckets | None:
    """The buckets of the DDP running `module` (a memopt module of `model`) now, with
    what of them the plan must add (see DDPBuckets); None when no DDP runs it."""
    ddp = active_wrapper(module)
    if ddp is None:
        return None
    total = bucket_bytes(ddp)
    bucket_view = bool(getattr(ddp, "gradient_as_bucket_view", False))
    in_grads = 0
    if bucket_view:  # the reducer made every kept .grad a view of its bucket
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        grads = [p.grad for name, p in model.named_parameters()
                 if p.requires_grad and p.grad is not None and name not in ignored]
        in_grads = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                        for g in grads}.values())
    return DDPBuckets(nbytes=total, counted_bytes=max(0, total - in_grads),
                      bucket_view=bucket_view)
