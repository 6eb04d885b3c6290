"""The optimizer step inside the backward: each parameter updated as its gradient
completes, and the gradient freed there (`memopt.compile(..., optimizer=opt)`, chosen by
the planner when the budget needs it; issue 26).

A training step holds every parameter's gradient from the moment it is produced to the
end of `optimizer.step()`: on a large model that is as many bytes as the parameters,
a floor no recomputation can lower. Stepping each parameter as soon as its gradient is
complete frees that gradient at once (PyTorch's tutorial "How to save memory by fusing
the optimizer step into the backward pass"; Lv et al. 2023, LOMO, Sec. 3). memopt's
backward graph calls `ParamStepper.add(grad, parameter)` where the gradient is complete
and the parameter is read no more (passes.gradients, which places it after the
parameter's last reader: a weight is read by the backward of its own matmul), and the
planner counts the gradient as freed there.

How a parameter is stepped: by the user's optimizer's own class, on its own state and
parameter group (so `optimizer.state_dict()`, LR schedulers writing `group["lr"]`, and
per-parameter counters work as before), with the group's parameter list narrowed to the
one parameter for the call. Every `torch.optim` optimizer updates a parameter from its
own gradient and state, so the result is eager's (LBFGS, which needs a closure and the
whole list, is refused at planning).

What the user's loop sees: `.grad` of a stepped parameter holds a `ConsumedGradient`, a
tensor without memory that raises `GradientConsumedError` when anything reads it.
`optimizer.step()` (a pre-hook clears the markers first) and `zero_grad()` do nothing for
these parameters. The loops the step in the backward cannot serve are detected there,
never silently wrong:

- gradient accumulation: a second backward, or a training forward, before
  `optimizer.step()` or `zero_grad()` (the first micro-step's update was applied);
- `clip_grad_norm_`, `GradScaler.unscale_`, logging gradient norms: they read `.grad`;
- a gradient that reaches the parameter from outside the compiled model after its step.

A parameter whose `.grad` holds a real tensor when its gradient completes (set by the
loop, or summed by autograd from a use outside the model) is not stepped: its gradient
goes to autograd as a plain compiled backward returns it, and `optimizer.step()` steps
it (memory above the plan by its bytes, with a warning).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memopt.passes._torch_compat import (engine_will_accumulate, foreach_zero_, pytree,
                                         step_pre_hook_last, step_pre_hooks_after)

from .errors import InputError
from .grads import GradSink, parameter_slots
from .markers import Memoryless
from .optimizer import OptimizerBytes
from .optimizer_step import SubsetStep, in_parts
from .planner import ExistingGrads


class GradientConsumedError(InputError, RuntimeError):
    """A parameter's gradient was read after memopt's optimizer step inside the backward
    consumed and freed it (memopt.stepper)."""


#: What a read of a consumed gradient most likely is, by the op that read it.
_READERS = {
    "add_": "a second gradient for a parameter already stepped in this backward: gradient "
            "accumulation (a second backward before optimizer.step() or zero_grad()), or "
            "the parameter also used outside the compiled model",
    "_foreach_norm": "clip_grad_norm_ (global-norm clipping needs every gradient before "
                     "any parameter steps)",
    "linalg_vector_norm": "clip_grad_norm_ or a gradient norm (global-norm clipping needs "
                          "every gradient before any parameter steps)",
    "_amp_foreach_non_finite_check_and_unscale_":
        "GradScaler.unscale_ / GradScaler.step (a skipped step must skip every parameter, "
        "which is decided after the whole backward)",
}


class ConsumedGradient(Memoryless):
    """The `.grad` of a parameter memopt stepped inside the backward: the parameter's shape,
    dtype and device, no memory (memopt.markers). `zero_()` and `detach_()` do nothing
    (zero_grad with set_to_none=False); any other op raises GradientConsumedError."""

    @classmethod
    def like(cls, param: torch.Tensor) -> "ConsumedGradient":
        return cls(param.shape, param.dtype, param.device)

    @classmethod
    def _on_op(cls, func: Any, args: Any) -> Any:
        name = func.overloadpacket.__name__
        if name in ("zero_", "detach_"):
            return args[0]
        if name == "_foreach_zero_":
            real = [t for t in args[0] if not isinstance(t, ConsumedGradient)]
            if real:
                foreach_zero_(real)
            return None
        why = _READERS.get(name, f"{func} read it after backward")
        raise GradientConsumedError(
            f"memopt stepped this parameter's optimizer inside the backward and freed its "
            f"gradient (step_in_backward=True asked for it, or memopt.compile(..., "
            f"optimizer=...) chose it to fit the budget), and then {why}. A loop that reads "
            f"gradients after backward (gradient accumulation, clip_grad_norm_, GradScaler, "
            f"gradient logging) cannot step in the backward: pass step_in_backward=False to "
            f"memopt.compile (a budget that needs the step in the backward is then refused "
            f"with the smallest one that fits). Parameters stepped before this error keep "
            f"their update.")


class ParamStepper(GradSink):
    """The runtime side of the step inside the backward: the parameters the forward calls
    were given (GradSink's binding, by storage), and `add(grad, parameter)`, which steps
    `optimizer` on that parameter with `grad` and frees it (returns None), or returns the
    gradient for autograd where stepping could differ from what eager would do: autograd
    does not accumulate into this parameter in this backward (`torch.autograd.grad`,
    `backward(inputs=...)`), a higher-order backward (`create_graph=True`), the parameter
    has gradient hooks or a real `.grad`, or is not the optimizer's."""

    def __init__(self, slots: dict[str, int], optimizer: torch.optim.Optimizer) -> None:
        super().__init__(slots)
        self.optimizer = optimizer
        self.stepped = 0          # parameters stepped in the backward (tests, evidence)
        self._groups: tuple[Any, int, dict[int, dict]] = (None, 0, {})
        self._markers: dict[int, ConsumedGradient] = {}
        self._marked: list[weakref.ref] = []
        self._warned = False
        self._subset = SubsetStep(optimizer)  # memopt.optimizer_step
        self._hook: Any = None
        #: the outputs of the last training forward whose backward has not run yet
        self._pending: list[weakref.ref] = []
        #: the 2-norm of each gradient stepped since the last training forward (for the
        #: global gradient norm a loop logs: `grad_norm`)
        self._norms: list[torch.Tensor] = []

    def activate(self) -> None:
        """The plan steps in the backward: clear the consumed gradients before each of
        the user's `optimizer.step()` from now on."""
        if self._hook is None:
            self._hook = self.optimizer.register_step_pre_hook(self._clear)

    # ---------------------------------------------------------------------- runtime

    def add(self, grad: torch.Tensor | None, saved: torch.Tensor) -> torch.Tensor | None:
        self._pending = []
        param = self._param(saved)
        if self.unreached and id(param) in self.unreached:
            return None  # no gradient in eager: not stepped (memopt.unused_outputs)
        if grad is None or param is None or torch.is_grad_enabled() \
                or not engine_will_accumulate(param):
            self.returned += grad is not None
            return grad
        existing = param.grad
        if isinstance(existing, ConsumedGradient):
            raise GradientConsumedError(
                "memopt stepped this parameter's optimizer in an earlier backward and a "
                "second backward began before optimizer.step() or zero_grad(): gradient "
                "accumulation cannot step in the backward (the first micro-step's update "
                "was applied). Pass step_in_backward=False to memopt.compile, or call "
                "optimizer.step() and zero_grad() after every backward.")
        group = self._group_of(param)
        if existing is not None or group is None or param._backward_hooks \
                or getattr(param, "_post_accumulate_grad_hooks", None):
            self._left_to_autograd(grad)
            return grad
        self._step_one(param, group, grad)
        return None

    def watch(self, out: Any) -> None:
        """A training forward returned `out`: until its backward runs, another training
        forward would save parameters that backward updates."""
        self._pending = [weakref.ref(t) for t in pytree.tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.requires_grad]
        self._norms = []

    def grad_norm(self) -> torch.Tensor | None:
        """The global 2-norm of the gradients the last backward stepped with (what
        `clip_grad_norm_(params, inf)` returns in eager, for logging), None if none."""
        if not self._norms:
            return None
        return torch.linalg.vector_norm(torch.stack(self._norms))

    def check_forward(self) -> None:
        """A training forward begins: raise where the last forward's output still waits
        for its backward (two forwards, one backward: a loss summed over micro-batches),
        or no optimizer.step() ran since the last backward (its consumed gradients still
        in `.grad`: accumulation; or set to None by zero_grad(): a skipped step, which
        the backward applied all the same, found from outside)."""
        if any(ref() is not None for ref in self._pending):
            self._pending = []
            raise GradientConsumedError(
                "a second training forward began while the output of the one before it "
                "waits for its backward: with the optimizer stepped inside the backward, "
                "that backward would update the parameters this forward saves, and each "
                "backward would step on part of the gradient (gradient accumulation, a "
                "loss summed over several forwards). Pass step_in_backward=False to "
                "memopt.compile, or run backward before the next forward (or drop an output "
                "that will never be differentiated before the next forward).")
        if self._hook is not None:  # a step pre-hook added since runs before it
            step_pre_hook_last(self.optimizer, self._hook)
        marked = [ref() for ref in self._marked]
        if any(isinstance(getattr(p, "grad", None), ConsumedGradient) for p in marked):
            raise GradientConsumedError(
                "a training forward began while the parameters memopt stepped inside the "
                "last backward still hold their consumed gradients: no optimizer.step() or "
                "zero_grad(set_to_none=True) since that backward. Gradient accumulation "
                "cannot step in the backward (the first micro-step's update was applied): "
                "pass step_in_backward=False to memopt.compile, or call optimizer.step() and "
                "zero_grad() after every backward.")
        self._marked = []
        if any(p is not None for p in marked):  # their markers set to None: zero_grad()
            raise GradientConsumedError(
                "a training forward began with no optimizer.step() since the last backward, "
                "which memopt stepped the optimizer inside: that update was applied as the "
                "gradients completed, so a step the loop skips (a guard against a NaN or a "
                "loss spike: zero_grad() and continue) was not skipped. Pass "
                "step_in_backward=False to memopt.compile, or call optimizer.step() after "
                "every backward.")

    def _step_one(self, param: torch.Tensor, group: dict, grad: torch.Tensor) -> None:
        param.grad = grad
        self._norms.append(torch.linalg.vector_norm(grad))
        try:
            self._subset(group, [param])
        finally:
            param.grad = self._marker(param)
        self._marked.append(weakref.ref(param))
        self.stepped += 1

    def _marker(self, param: torch.Tensor) -> ConsumedGradient:
        marker = self._markers.get(id(param))
        if marker is None or marker.shape != param.shape or marker.dtype != param.dtype \
                or marker.device != param.device:
            marker = self._markers[id(param)] = ConsumedGradient.like(param)
        return marker

    def _group_of(self, param: torch.Tensor) -> dict | None:
        groups = self.optimizer.param_groups
        listed, count, of = self._groups
        if listed is not groups or count != len(groups):
            of = {id(p): g for g in groups for p in g["params"]}
            self._groups = (groups, len(groups), of)
        return of.get(id(param))

    def _clear(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        """Before the user's optimizer.step(): the consumed gradients become None, so that
        the step skips these parameters (already stepped in the backward). A step pre-hook
        runs before it (moved last at each training forward), where reading a consumed
        gradient raises; one registered since the forward would run after it and find
        no gradient (a hook scaling them was skipped, silently; found from outside)."""
        if step_pre_hooks_after(self.optimizer, self._hook):
            raise GradientConsumedError(
                "a step pre-hook was registered on the optimizer after this step's forward "
                "began, and memopt stepped the optimizer inside the backward: the hook would "
                "find no gradient to act on. Register it before the forward (it then sees "
                "the consumed gradients, and raises if it reads them), or pass "
                "step_in_backward=False to memopt.compile.")
        for ref in self._marked:
            p = ref()
            if p is not None and isinstance(p.grad, ConsumedGradient):
                p.grad = None
        self._marked = []

    def _left_to_autograd(self, grad: torch.Tensor) -> None:
        self.returned += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                "memopt planned to step the optimizer inside the backward, but a parameter's "
                "gradient goes to autograd instead (its .grad already holds a tensor, it has "
                "gradient hooks, or it is not the optimizer's): optimizer.step() steps it, "
                f"and this step can exceed the plan by its gradient's bytes "
                f"({grad.untyped_storage().nbytes()} B for this one).", stacklevel=2)



def can_step_in_backward(optimizer: Any, asked: bool = False) -> str | None:
    """Why `optimizer` cannot be stepped one parameter at a time inside the backward, or
    None where it can (memopt.optimizer_step.in_parts). A class that is not one of
    torch.optim's elementwise optimizers is stepped there only where the user asks by
    name (`asked`: step_in_backward=True), with a warning saying what its step must do."""
    reason = in_parts(optimizer)
    if reason is None or not asked or isinstance(
            optimizer, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        return reason
    warnings.warn(
        f"memopt steps {type(optimizer).__name__} one parameter at a time inside the "
        f"backward, as step_in_backward=True asks: its step must update each parameter from "
        f"its own gradient and state alone (no global gradient norm, no counter kept in the "
        f"parameter group), or the parameters will differ from eager's.", stacklevel=2)
    return None


@dataclass(frozen=True)
class Stepping:
    """What the planner needs to plan a graph with the optimizer stepped in its backward:
    the runtime stepper, the parameters it steps (ExistingGrads with `step_bytes`), and
    whether it steps every parameter of the optimizer on the device (then the user's
    `optimizer.step()` allocates nothing after the backward)."""

    stepper: ParamStepper
    grads: ExistingGrads
    all_stepped: bool


def stepping_for(optimizer: torch.optim.Optimizer, counted: OptimizerBytes,
                 kinds: dict[str, str], inputs: Sequence[Any], *, alone: bool,
                 ddp: bool, kernels_inductor: bool, asked: bool = False) -> Stepping | str:
    """The Stepping of a captured graph whose primal `primals_{i+1}` is `inputs[i]`
    (`kinds`: parameter / buffer / input), or why its optimizer cannot step inside its
    backward (`asked`: step_in_backward=True)."""
    reason = can_step_in_backward(optimizer, asked)
    if reason is not None:
        return reason
    if not alone:
        return ("the forward has graph breaks (a parameter's gradient may be summed over "
                "several graphs)")
    if ddp:
        return "DistributedDataParallel all-reduces the gradients after the backward"
    if kernels_inductor:
        return 'kernels="inductor" cannot call the optimizer from its generated code'
    if any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.float16
           for d in ("cpu", "cuda")):
        return "fp16 autocast needs GradScaler, which decides to skip a step after the backward"
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    slots = parameter_slots(kinds, inputs, lambda p: id(p) in owned and not p._backward_hooks
                            and not getattr(p, "_post_accumulate_grad_hooks", None))
    if not slots:
        return "no parameter of this graph is the optimizer's"
    nbytes = {name: inputs[i].untyped_storage().nbytes() for name, i in slots.items()}
    device = inputs[next(iter(slots.values()))].device
    mine = {id(inputs[i]) for i in slots.values()}
    all_stepped = all(id(p) in mine for g in optimizer.param_groups for p in g["params"]
                      if p.requires_grad and p.device == device)
    stepper = ParamStepper(slots, optimizer)
    grads = ExistingGrads(nbytes=nbytes, add=stepper.add,
                          step_bytes={n: counted.alone_bytes(b) for n, b in nbytes.items()})
    return Stepping(stepper, grads, all_stepped)


def last_grad_norm(module: Any) -> torch.Tensor | None:
    """The global 2-norm of the gradients the last backward of a memopt module stepped the
    optimizer with inside the backward (what a loop logs as its gradient norm; memopt
    computes it as each gradient completes, since the gradients are freed), or None where
    its last step did not step in the backward."""
    backend = getattr(module, "_memopt_backend", None)
    if backend is None:
        raise TypeError(f"last_grad_norm expects a memopt module, got {type(module).__name__}")
    norms = [g.stepping.stepper.grad_norm() for g in backend.plan_log.last_runs
             if g.steps_in_backward]
    norms = [n for n in norms if n is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else None
