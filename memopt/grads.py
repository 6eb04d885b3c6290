"""Adding parameter gradients into existing `.grad` tensors inside the compiled backward.

A compiled backward returns every gradient at once, and autograd's AccumulateGrad then
adds each into its parameter's `.grad`. When `.grad` already holds a tensor
(`optimizer.zero_grad(set_to_none=False)`, every micro-step after the first of gradient
accumulation, DDP's `no_sync`), the step holds two full copies of the gradients for a
moment: the ones in `.grad` and the ones just returned (issue 13 measured a vision
transformer 1.17x over its budget this way). memopt plans that step separately
(`existing_grads=True`): its backward graph adds each parameter's gradient into `.grad`
the moment the gradient is complete (passes.gradients places the node), so only one
parameter's new gradient exists at a time, less than eager's own AccumulateGrad holds.

`GradSink` is the runtime side: the backward's `add` nodes receive each gradient with
the parameter it belongs to (the forward saves the parameter for backward, which costs
no memory: it is resident), and the sink finds the real parameter by its storage among
those the forward calls were given (a graph may run more than once in a forward, on other
parameters each time: a graph break inside a repeated layer). It falls back to returning
the gradient to autograd, exactly as a plain compiled backward does, whenever writing it
itself could differ from what AccumulateGrad would do:

- the parameter has no `.grad` at backward time (AccumulateGrad steals the new tensor);
- autograd does not run the parameter's AccumulateGrad in this backward
  (`torch.autograd.grad(...)`, `backward(inputs=...)` without it);
- a higher-order backward (`create_graph=True`: grad mode is on in backward);
- the parameter has tensor hooks (`register_hook`, `register_post_accumulate_grad_hook`),
  which must see the new gradient; hooks on the AccumulateGrad node itself (DDP's
  reducer) still run, after `.grad` is updated, as they do in eager;
- `.grad` and the new gradient differ in shape, dtype, device or layout.
"""

from __future__ import annotations

import weakref
from operator import is_
from typing import Any, Callable, Sequence

import torch

from memopt.passes._torch_compat import engine_will_accumulate

from .storages import storage_id


def parameter_slots(kinds: dict[str, str], inputs: Sequence[Any],
                    keep: Callable[[torch.Tensor], bool] = lambda p: True) -> dict[str, int]:
    """{joint-graph primal name: index among `inputs`} of the parameters that require grad
    (primal `primals_{i+1}` is `inputs[i]`, its kind in `kinds`), those `keep` accepts."""
    return {name: i for i, (name, kind) in enumerate(kinds.items())
            if kind == "parameter" and i < len(inputs)
            and isinstance(inputs[i], torch.Tensor) and inputs[i].requires_grad
            and keep(inputs[i])}


def _primal_index(name: str) -> int | None:
    """The joint graph's index of primal `name` ("primals_3" -> 2), None for another."""
    head, _, number = name.rpartition("_")
    return int(number) - 1 if head == "primals" and number.isdigit() else None


class GradSink:
    """The parameters the forward calls of a compiled graph were given, by storage, for
    the backward's `add` nodes.

    `slots` maps a joint-graph primal name ("primals_3") to its index among the
    compiled function's flat inputs. The sink holds weak references: a compiled graph
    outlives nothing of the user's model.
    """

    def __init__(self, slots: dict[str, int]) -> None:
        self.slots = dict(slots)
        self._params: dict[tuple[torch.device, int], weakref.ref] = {}
        #: the last call's parameters (weak references) and data pointers: a call with
        #: the same ones binds nothing new
        self._bound: tuple[tuple[weakref.ref, ...], tuple[int, ...]] = ((), ())
        self.added = 0       # gradients added in place (for tests and the plan's evidence)
        self.returned = 0    # gradients handed back to autograd instead
        #: ids of the bound parameters whose gradient this backward drops: reached only
        #: through outputs the loss did not use (memopt.unused_outputs)
        self.unreached: set[int] = set()

    def drop(self, primals: frozenset[int]) -> None:
        """The bound parameters at joint primal indices `primals` (``primals_{i+1}``) get
        no gradient in the backward starting now (memopt.unused_outputs); empty: all do."""
        refs = self._bound[0]
        names = list(self.slots) if len(refs) == len(self.slots) else []
        self.unreached = {id(p) for name, ref in zip(names, refs)
                          if _primal_index(name) in primals and (p := ref()) is not None}

    def bind(self, flat_inputs: Sequence[Any]) -> None:
        """Remember the parameter tensors of this forward call (beside earlier calls').

        A call given the same parameter objects at the same data pointers as the call
        before it has nothing to remember: that is checked at C level (`weakref.ref` of a
        live object is its one reference object, and `Tensor.data_ptr` through `map`), so
        a steady training step does no Python work per parameter here."""
        params = [flat_inputs[i] for i in self.slots.values() if i < len(flat_inputs)]
        try:
            refs = tuple(map(weakref.ref, params))
            bound = (refs, tuple(map(torch.Tensor.data_ptr, params)))
        except TypeError:  # not all tensors: bind them one by one
            bound = ((), ())
        last = self._bound
        if bound[0] and len(refs) == len(last[0]) and all(map(is_, refs, last[0])) \
                and bound[1] == last[1]:
            return
        self._bound = bound
        for p in params:
            if isinstance(p, torch.Tensor):
                self._params[storage_id(p)] = weakref.ref(p)

    def _param(self, saved: torch.Tensor) -> torch.Tensor | None:
        """The live parameter `saved` is (or aliases), among those bound, or None."""
        ref = self._params.get(storage_id(saved))
        return ref() if ref is not None else None

    def add(self, grad: torch.Tensor | None, saved: torch.Tensor) -> torch.Tensor | None:
        """Add `grad` into the `.grad` of the parameter `saved` is (or aliases: what the
        forward saved of it) and return None, or return `grad` for autograd to accumulate
        (see the module docstring for when)."""
        param = self._param(saved)
        if grad is None or param is None or not _can_add(param, grad):
            self.returned += grad is not None
            return grad
        param.grad.add_(grad)  # grad mode is off: _can_add checked it
        self.added += 1
        return None


def _can_add(param: torch.Tensor, grad: torch.Tensor) -> bool:
    existing = param.grad
    if existing is None or torch.is_grad_enabled():
        return False
    if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
        return False
    if (existing.shape != grad.shape or existing.dtype != grad.dtype
            or existing.device != grad.device or existing.layout != torch.strided
            or grad.layout != torch.strided or existing.requires_grad):
        return False
    return engine_will_accumulate(param)
