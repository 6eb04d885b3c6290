"""The user's optimizer stepped on part of its parameters at a time.

Two users of the same mechanism (`SubsetStep`):

- the step inside the backward (memopt.stepper) steps one parameter as its gradient
  completes;
- `ChunkedStep` runs the user's `optimizer.step()` over chunks of each parameter group, when
  the plan needs it: a foreach step (CUDA's default for Adam, AdamW, SGD with momentum...)
  allocates its temporaries for the whole list at once (Adam: about one more copy of the
  parameters), and the step's peak, the parameters, gradients and state plus those
  temporaries, is often the whole step's. In chunks of `chunk_bytes` the temporaries are
  those of one chunk (memopt.optimizer.OptimizerBytes.chunked_step_bytes).

How a subset is stepped: the optimizer's own class steps a shadow of it (the same state,
hyperparameters and defaults, no hooks) whose group lists only the subset, with the class's
`step` below torch's hook wrapper, so the user's step hooks and an LR scheduler's step
counter see one step. Elementwise optimizers (torch.optim's but LBFGS and SparseAdam) update
each parameter from its own gradient and state only, so a subset's update is exactly the one
the whole step makes (foreach kernels act tensor by tensor). Another class's step (a subclass
that overrides it too) may not: a global gradient norm, or a counter kept in the parameter
group, counted once per subset (an Adam whose group["step"] went to 27 in 3 steps, found from
outside). memopt steps those whole (`in_parts`), unless the user asks for the step inside
the backward by name.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from memopt.passes._torch_compat import step_pre_hook_last, step_pre_hooks_after


#: torch.optim's optimizers whose step updates each parameter from its own gradient and
#: state alone (by name: a class this torch lacks is left out)
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta",
    "ASGD", "Rprop", "Adafactor") if hasattr(torch.optim, name))


def in_parts(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer`'s step cannot be run on part of its parameters at a time (the module
    docstring), or None where it can."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS needs a closure over the whole model"
    if isinstance(optimizer, torch.optim.SparseAdam):
        return "SparseAdam steps sparse gradients, which memopt's graphs do not make"
    if any(isinstance(optimizer, cls) and type(optimizer).step is cls.step
           for cls in ELEMENTWISE):
        return None
    return (f"{type(optimizer).__name__} is not one of torch.optim's elementwise optimizers, "
            f"so its step may not update each parameter from its own gradient and state "
            f"alone (a global gradient norm, a counter in its parameter group); pass "
            f"step_in_backward=True to memopt.compile if it does")


class SubsetStep:
    """Step `optimizer`'s class on a subset of one of its parameter groups."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        step = type(optimizer).step
        # the class's step below torch's hook wrapper: the user's step hooks (and the LR
        # scheduler's step counter) run once, on the user's optimizer.step()
        self._step = step.__wrapped__ if getattr(step, "hooked", False) else step
        self._shadow = object.__new__(type(optimizer))

    def __call__(self, group: dict, params: list[torch.Tensor]) -> None:
        """One step of `params` (each with its `.grad` set) with `group`'s hyperparameters
        and the optimizer's state."""
        shadow = self._shadow
        shadow.__dict__.update(self.optimizer.__dict__)  # live state, defaults
        shadow.__dict__.pop("step", None)  # an LR scheduler's wrapper of the bound step
        shadow._optimizer_step_pre_hooks = {}
        shadow._optimizer_step_post_hooks = {}
        listed = group["params"]
        group["params"] = params
        shadow.param_groups = [group]
        try:
            self._step(shadow)
        finally:
            group["params"] = listed
            shadow.__dict__.clear()


def chunks(params: list[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into runs of at most `chunk_bytes` (at least one each)."""
    out: list[list[torch.Tensor]] = []
    size = chunk_bytes + 1
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class ChunkedStep:
    """The user's `optimizer.step()` run in chunks of at most `chunk_bytes` of parameters
    per group (the module docstring). A pre-hook steps the chunks and hides their gradients
    from the real step, which then steps nothing; a post-hook gives the gradients back, so
    the loop sees `.grad` as after an ordinary step. A step given a closure (LBFGS-style)
    runs whole."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_bytes: int) -> None:
        self.optimizer = optimizer
        self.chunk_bytes = int(chunk_bytes)
        self.steps = 0  # optimizer steps run in chunks (tests, evidence)
        self._subset = SubsetStep(optimizer)
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._last, self._warned = False, False  # a pre-hook registered after this one
        self._handles = (optimizer.register_step_pre_hook(self._before),
                         optimizer.register_step_post_hook(self._after))

    def narrow(self, chunk_bytes: int) -> None:
        """A plan needs chunks no larger than `chunk_bytes` (the smallest asked is kept)."""
        self.chunk_bytes = min(self.chunk_bytes, int(chunk_bytes))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _before(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # torch passes the step's own arguments, `self` first (accelerate passes closure=None)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:  # the step re-evaluates the model: it runs whole
            return
        if step_pre_hooks_after(opt, self._handles[0]):
            # a pre-hook registered since runs after this one (one scaling the gradients
            # was skipped, silently; found from outside): this step runs whole, after it,
            # and from the next one this hook runs last
            self._last = True
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "a step pre-hook was registered on the optimizer after memopt's: this "
                    "optimizer.step() runs whole, not in chunks, and can exceed the plan by "
                    "its foreach temporaries; from the next step memopt's chunks run after "
                    "the hook.", UserWarning, stacklevel=2)
            return
        stepped = False
        for group in opt.param_groups:
            # plain tensors only: not None, not a consumed gradient, not a DTensor
            params = [p for p in group["params"] if type(p.grad) is torch.Tensor]
            parts = chunks(params, self.chunk_bytes)
            if len(parts) < 2:
                continue
            with torch.no_grad():
                for part in parts:
                    self._subset(group, part)
            for p in params:
                self._hidden.append((p, p.grad))
                p.grad = None
            stepped = True
        self.steps += stepped

    def _after(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = []
        if self._last:
            self._last = False
            step_pre_hook_last(opt, self._handles[0])
