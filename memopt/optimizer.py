"""The optimizer's share of a training step: the state it keeps between steps and what
its `step()` allocates on top of the parameters, gradients and that state.

    memopt.compile(model, budget="4GB", optimizer=opt)

With `optimizer=` the budget counts both (issue 26). Without it, they are outside the
budget (docs/budgets.md, "What a budget counts").

- **State**: per parameter, the bytes of the tensors the optimizer keeps in
  `optimizer.state[p]` on the parameter's device (Adam's `exp_avg` and `exp_avg_sq`, SGD's
  momentum buffer, Adafactor's factored rows and columns). Where the state exists (a
  resumed optimizer) it is read; otherwise it is predicted by stepping the optimizer's own
  class, with the group's hyperparameters, on meta copies of the parameters (no memory,
  any `torch.optim` optimizer whose step needs no value of a tensor), else on a real copy
  of one parameter at a time on the CPU. A scalar `step` kept on the host is not the
  device's memory and is not counted.
- **Step**: what `optimizer.step()` allocates above the state while it runs (foreach
  temporaries: Adam's denominator, the bias corrections). Measured on the model's device
  on probe matrices of the group's hyperparameters and dtype, at the second step (the
  first also makes the state), over one, two and three probes. What the third adds grows
  with the whole list (a foreach step: temporaries for every parameter at once); the
  rest is a for-loop's window, the parameter stepping plus what the one before it left
  (Adam's for-loop: two of the parameter's size, one of the previous parameter's, still
  bound to a local until it is replaced), applied along the group's parameter order.
  Groups and dtypes step one after another, so the step's bytes are the largest over
  them.

After the first real `optimizer.step()` the state is read back and compared with the
prediction (`check_after_first_step`): a state larger than predicted is warned about with
both numbers, as the plan's peak is then low by the difference.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .budget import format_bytes
from .errors import InputError
from .fsdp import local_tensor
from .passes.allocated import allocation_peak, can_track, note_unmeasured, say_untracked

log = logging.getLogger("memopt")

#: Elements of one probe tensor for the step's bytes (256 KiB in fp32): large enough that
#: a kernel's fixed allocations are small beside it, small enough to cost nothing.
PROBE_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class OptimizerBytes:
    """What an optimizer adds to a training step on one device (the module docstring)."""

    name: str               # the optimizer's class name
    state_bytes: int        # resident through the step once it has stepped
    step_bytes: int         # allocated above that while optimizer.step() runs
    predicted: bool         # the state was predicted (no real state existed yet)
    #: what stepping one parameter alone allocates, per byte of the parameter (the step
    #: inside the backward, memopt.stepper): the largest over groups and dtypes
    alone_per_byte: float = 0.0
    #: per group and dtype: (what a foreach step allocates per byte of the list, the
    #: list's bytes, the for-loop window's bytes): what a step in chunks allocates
    parts: tuple[tuple[float, int, int], ...] = ()
    #: the largest parameter's bytes: the smallest chunk a chunked step can take
    largest_param: int = 0
    #: to be counted again (memopt.backend): counted while a profiler recorded (the step
    #: charged its state's bytes), or the optimizer has gained parameters since
    #: (`add_param_group`: `params_of`)
    recount: bool = False
    #: (groups, parameters) of the optimizer when counted
    counted_params: tuple[int, int] = (0, 0)

    def alone_bytes(self, nbytes: int) -> int:
        """What stepping one parameter of `nbytes` alone allocates above its state."""
        return int(self.alone_per_byte * nbytes + 0.5)

    def chunked_step_bytes(self, chunk_bytes: int) -> int:
        """What `optimizer.step()` allocates above the state run in chunks of at most
        `chunk_bytes` of parameters (memopt.optimizer_step.ChunkedStep): one chunk's
        foreach temporaries and the for-loop window, the largest over the groups."""
        if not self.parts:
            return self.step_bytes
        return max(int(per * min(chunk_bytes, total) + window)
                   for per, total, window in self.parts)

    def chunk_for(self, step_bytes: int) -> int | None:
        """The largest chunk whose step allocates at most `step_bytes`, or None where no
        chunk (one parameter at least) does, or chunks do not lower the step."""
        foreach = [(per, window) for per, _, window in self.parts if per > 0]
        if not foreach or self.largest_param <= 0:
            return None
        chunk = min(int((step_bytes - window) / per) for per, window in foreach)
        return chunk if chunk >= self.largest_param else None


def check_optimizer(optimizer: Any, model: torch.nn.Module) -> None:
    """Raise InputError unless `optimizer` is a torch.optim.Optimizer over parameters of
    `model` (at least one; every one of its parameters the model's)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(f"optimizer= expects a torch.optim.Optimizer (the one the training "
                         f"loop steps), got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in params if id(p) not in own]
    if not params or foreign:
        raise InputError(
            f"optimizer= got a {type(optimizer).__name__} over {len(params)} parameters, "
            f"{len(foreign)} of them not the model's: build the optimizer on the parameters of "
            f"the model given to memopt (model.parameters(), before or after memopt.compile: "
            f"they are the same tensors)")


def optimizer_bytes(optimizer: torch.optim.Optimizer, device: torch.device) -> OptimizerBytes:
    """The state and step bytes of `optimizer` for its parameters on `device`."""
    device = torch.device(device)
    state, predicted, step, alone, parts, largest = 0, False, 0, 0.0, [], 0
    recount = False
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if _on(p, device)]
        if not params:
            continue
        have = [p for p in params if optimizer.state.get(p)]
        mine = sum(_state_bytes(optimizer.state[p], p.device) for p in have)
        # FSDP2's parameters are DTensors: the state and the step are of their local shards
        todo = [local_tensor(p) for p in params if not optimizer.state.get(p)]
        if todo:
            predicted = True
            mine += _predicted_state(optimizer, group, todo)
        state += mine
        params = [local_tensor(p) for p in params]
        largest = max([largest, *(p.untyped_storage().nbytes() for p in params)])
        measured = _step_bytes(optimizer, group, params, device)
        if measured is None:  # not trackable: charged the state's bytes (Adam's two moments)
            measured, recount = (mine, 2.0, ()), True
            note_unmeasured()
        step, alone = max(step, measured[0]), max(alone, measured[1])
        parts.extend(measured[2])
    return OptimizerBytes(type(optimizer).__name__, state, step, predicted, alone,
                          tuple(parts), largest, recount, params_of(optimizer))


def params_of(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """How many parameter groups and parameters `optimizer` steps: a group added since it
    was counted (progressive unfreezing) holds state the plans do not count (1.17x a
    budget at every step after it, found from outside)."""
    groups = optimizer.param_groups
    return len(groups), sum(len(g["params"]) for g in groups)


def _on(p: torch.Tensor, device: torch.device) -> bool:
    return p.requires_grad and p.device.type == device.type and (
        device.index is None or p.device.index in (None, device.index))


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _state_bytes(state: dict, device: torch.device, meta_for: torch.device | None = None
                 ) -> int:
    """Bytes of the state's tensors on `device` (a `step` scalar kept on the host is not
    the device's memory, unless the device is the CPU). `meta_for`: the state is of a
    meta copy of a parameter on that device (what a meta run keeps on the host would be
    kept there as well)."""
    def counted(t: torch.Tensor) -> bool:
        if meta_for is not None:
            return t.device.type == "meta" or (meta_for.type == "cpu" == t.device.type)
        return t.device == device

    local = [local_tensor(t) for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.untyped_storage().nbytes() for t in local if counted(t))


def _run(cls: type, group: dict, params: list[torch.Tensor], steps: int = 2
         ) -> torch.optim.Optimizer:
    """`cls` over `params` (leaves with zero gradients) with `group`'s hyperparameters,
    stepped `steps` times."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = cls([{**_hyper(group), "params": params}])
    for _ in range(steps):
        opt.step()
    return opt


def _predicted_state(optimizer: torch.optim.Optimizer, group: dict,
                     params: list[torch.Tensor]) -> int:
    """The state the optimizer will keep for `params` (the module docstring)."""
    cls = type(optimizer)
    try:
        metas = [torch.empty_like(p, device="meta").requires_grad_() for p in params]
        with torch.no_grad():
            opt = _run(cls, group, metas)
        return sum(_state_bytes(opt.state[m], m.device, p.device)
                   for m, p in zip(metas, params))
    except Exception as exc:  # a step that reads a value (.item()): real copies instead
        log.debug("memopt optimizer: %s does not step on meta tensors (%s); predicting its "
                  "state on CPU copies", cls.__name__, exc)
    total, seen = 0, {}
    for p in params:
        key = (tuple(p.shape), p.dtype)
        if key not in seen:
            try:
                real = torch.zeros(p.shape, dtype=p.dtype).requires_grad_()
                with torch.no_grad():
                    opt = _run(cls, group, [real])
                seen[key] = _state_bytes(opt.state[real], real.device)
            except Exception as exc:
                raise InputError(
                    f"memopt cannot predict the state of {cls.__name__} (stepping it on a "
                    f"copy of a parameter of shape {tuple(p.shape)} raised "
                    f"{type(exc).__name__}: {exc}). Step the optimizer once before "
                    f"memopt.compile, so that its state exists and is read, or leave "
                    f"optimizer= out (the budget then does not count it)") from exc
        total += seen[key]
    return total


def _step_bytes(optimizer: torch.optim.Optimizer, group: dict, params: list[torch.Tensor],
                device: torch.device) -> tuple[int, float, list] | None:
    """What one step of `group` allocates above its state (the module docstring), what
    stepping one parameter alone allocates per byte of it, and per dtype (OptimizerBytes.
    parts) the foreach bytes per byte, the list's bytes and the window, on the CPU's probes for a meta
    device; None where allocations cannot be tracked (a profiler is recording: the group's
    state bytes are charged instead, counted high for Adam's steps, which allocate at most
    as much as its two moments)."""
    where = device if device.type in ("cpu", "cuda") else torch.device("cpu")
    if not can_track(where):
        say_untracked("optimizer", " (a profiler is recording); the optimizer's step is "
                      "charged its state's bytes")
        return None
    largest, alone, parts = 0, 0.0, []
    for dtype in sorted({p.dtype for p in params}, key=str):
        one, two, three = (_probe(type(optimizer), group, dtype, where, n) for n in (1, 2, 3))
        probe = PROBE_ELEMENTS * torch.empty((), dtype=dtype).element_size()
        per_total = max(0, three - two) / probe          # foreach: the whole list's bytes
        this = max(0, one - per_total * probe) / probe   # for-loop: the parameter stepping
        last = max(0, two - one - per_total * probe) / probe  # what the one before left
        nbytes = [p.untyped_storage().nbytes() for p in params if p.dtype == dtype]
        window = max(this * b + last * a for a, b in zip([0, *nbytes], nbytes))
        largest = max(largest, int(per_total * sum(nbytes) + window))
        alone = max(alone, one / probe)
        parts.append((per_total, sum(nbytes), int(window)))
    return largest, alone, parts


def _probe(cls: type, group: dict, dtype: torch.dtype, device: torch.device, count: int
           ) -> int:
    """Bytes the second step of `cls` over `count` probe tensors allocates above its
    state (0 where the optimizer cannot step on them)."""
    try:
        side = int(PROBE_ELEMENTS ** 0.5)  # matrices: most of a model's bytes
        params = [torch.zeros(side, side, dtype=dtype, device=device).requires_grad_()
                  for _ in range(count)]
        with torch.no_grad():
            opt = _run(cls, group, params, steps=1)
            with allocation_peak(device, collect=False, own_only=True) as seen:
                opt.step()
    except Exception as exc:
        log.debug("memopt optimizer: %s did not step on probes (%s); its step is charged "
                  "0 bytes", cls.__name__, exc)
        return 0
    return max(0, seen.peak - max(0, seen.end))


def check_after_first_step(optimizer: torch.optim.Optimizer, expected: OptimizerBytes,
                           device: torch.device) -> Any:
    """A post-step hook (returned as its handle) that reads the state after the first
    `optimizer.step()` and warns when it is larger than `expected` predicted."""
    done = []

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if done:  # (a hook cannot remove itself while the optimizer iterates its hooks)
            return
        done.append(True)
        real = sum(_state_bytes(opt.state[p], p.device) for g in opt.param_groups
                   for p in g["params"] if _on(p, device) and opt.state.get(p))
        if real > expected.state_bytes:
            warnings.warn(
                f"memopt predicted {format_bytes(expected.state_bytes)} of {expected.name} "
                f"state and its first step made {format_bytes(real)}: the plan's peak is low "
                f"by the difference. Step the optimizer once before memopt.compile so its "
                f"state is read, or please report this optimizer.", UserWarning, stacklevel=2)

    return optimizer.register_step_post_hook(hook)

