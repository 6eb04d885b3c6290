"""A training step without the forward's trace, once its one graph has settled.

Every training forward of a memopt module used to build a `ForwardTrace` (memopt.steps):
the storage of every parameter, buffer, input and kept `.grad` as the forward starts, and
of every input of every graph as it runs. That is Python work per parameter at every step
(1.4x `torch.compile(backend="aot_eager")`'s step on a model of 800 small parameter
tensors, benchmarks/overhead.py), and in the usual step, one graph that is the whole
forward ("alone") planned GREEDY, all it decides is that the graph's plan already counts
what the rest of the step holds (`Outside`), so nothing is planned again.

Here the trace is built only when something needs it (`StepCall.trace`):

1. A graph whose step ran alone and found its plan covering the step is *settled*
   (`settle`): it records what that count was made of, `Settled`: the model's tensors its
   forward did not take (parameters and buffers it does not use, `.grad` of parameters that
   do not require grad; usually none), which of the call's argument leaves it took, and
   what keys those hold: the module tree's listing (`ModelTensors.version`) and every
   parameter's `.grad` and `requires_grad` (`ModelTensors.grad_state`).
2. At a later step, the settled graph runs without the trace when that key is unchanged and
   its plan covers the step's count made again from the record, in O(arguments + tensors
   not taken): the bytes of the model's tensors it does not take, of the call's argument
   tensors it does not take, and of DDP's gradient buckets (`StepCall.admits`). A step that fails the check (a kwarg the
   graph does not read grew, a frozen parameter got a `.grad`, a parameter was added) is
   traced as before, from the state it started with, and planned again if it must be.
3. Anything else that needs the trace (dynamo compiles a graph during the call, another
   graph runs) builds it from the state the call started with, replaying the runs let
   through so far (`StepCall.trace`). Where no graph the last forward ran has settled
   (graph breaks, FSDP2, the first step), the trace is built as the forward starts, as it
   always was (MemoptBackend.forward_begins).

What stays per parameter at every step makes no Python call per parameter, like dynamo's
own guards (C++): one list comprehension reading each parameter's `.grad` and
`requires_grad` (which the choice between the step with and without kept gradients needs
anyway, memopt.grads), and a C-level comparison of the module tree's entries with those
listed (`ModelTensors.refresh`); together about 0.2 ms at 800 parameters on this
project's CPU, against a 24 ms step. FSDP2 units (memopt.fsdp) and graphs split by graph
breaks keep the full trace at every step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import chain
from operator import is_not
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memopt.passes._torch_compat import pytree

from .graph_breaks import ReplanPolicy
from .steps import (ForwardTrace, GraphRun, Outside, StorageId, holds_memory, storage_id,
                    storages)

if TYPE_CHECKING:  # pragma: no cover
    from .compiled_graph import CompiledGraph


class ModelTensors:
    """A model's parameters and buffers, listed once (`model.parameters()` walks the module
    tree in Python, ~0.5 ms for 400 modules) and listed again when the tree changes.

    `refresh()` compares the identities of every entry of every module's `_parameters`,
    `_buffers` and `_modules` with those listed (C-level iteration; the listed objects are
    held, so no identity is reused while they are compared). `version` counts the listings."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.version = 0
        self.params: list[nn.Parameter] = []
        self.buffers: list[torch.Tensor] = []
        self._dicts: list[dict] = []
        self._entries: tuple[Any, ...] = ()
        #: weak references to the parameters and buffers listed before and replaced since
        self._displaced: dict[int, weakref.ref] = {}
        self._list()

    def _list(self) -> None:
        before = [*self.params, *self.buffers]
        modules = list(self.model.modules())
        self._dicts = [d for m in modules for d in (m._parameters, m._buffers, m._modules)]
        self._entries = self._current()
        self.params = list(self.model.parameters())
        self.buffers = list(self.model.buffers())
        listed = {id(t) for t in (*self.params, *self.buffers)}
        self._displaced = {i: ref for i, ref in self._displaced.items()
                           if i not in listed and ref() is not None}
        self._displaced.update((id(t), weakref.ref(t)) for t in before if id(t) not in listed)
        self.version += 1

    def displaced(self) -> list[torch.Tensor]:
        """The parameters and buffers the module held before and no longer lists that are
        still alive: the module's own while ``torch.func.functional_call`` runs it with
        others (it keeps them aside and puts them back after), held through the step. A
        step under functional_call measured 1.23x its budget with them uncounted (found
        from outside)."""
        alive = (ref() for ref in self._displaced.values())
        return [t for t in alive if t is not None and type(t).__name__ != "DTensor"]  # FSDP2's

    def _current(self) -> tuple[Any, ...]:
        return tuple(chain.from_iterable(map(dict.values, self._dicts)))

    def refresh(self) -> None:
        """List again if a parameter, buffer or submodule was added, removed or replaced."""
        now = self._current()
        if len(now) != len(self._entries) or any(map(is_not, now, self._entries)):
            self._list()

    def hooked_grad_bytes(self) -> int:
        """Bytes of the largest gradient of a parameter with a tensor hook
        (``register_hook``): such a gradient goes back to autograd (memopt.grads), whose
        AccumulateGrad runs the hook on it as the backward ends, and a hook that returns a
        new tensor (``g * 2``, added noise) holds it beside the gradient, one parameter at
        a time: an MLP at its minimum measured 1.032x its budget with ``g * 2`` on every
        parameter (found from outside). What a hook allocates beyond that one tensor is
        not counted (said once per module: memopt.api)."""
        return max((p.numel() * p.element_size() for p in self.params
                    if p.requires_grad and p._backward_hooks), default=0)

    def grad_state(self) -> list[int]:
        """Per parameter: 1 if it holds a `.grad`, plus 2 if it requires grad (3: a kept
        gradient, what makes a step run with existing gradients, memopt.grads)."""
        return [(p.grad is not None) + 2 * p.requires_grad for p in self.params]


@dataclass(frozen=True)
class Settled:
    """What a settled graph's last traced step counted outside it (see the module
    docstring): the model's tensors it did not take (`model`, weak references: parameters
    and buffers it does not read, `.grad` of parameters that do not require grad; their
    bytes are counted again at every step), under the module listing `version` and the
    parameters' `grads` (ModelTensors.grad_state); the argument tree `spec` of the call and
    the leaves it took, by position (`taken`)."""

    version: int
    grads: list[int]
    spec: Any
    taken: frozenset[int]
    model: tuple[weakref.ref, ...]

    def model_bytes(self) -> int | None:
        """Bytes of the storages of `model` now (None: one of them is gone)."""
        tensors = [ref() for ref in self.model]
        if any(t is None for t in tensors):
            return None
        return sum(storages(tensors).values())


def call_bytes(leaves: list[Any], taken: frozenset[int]) -> int:
    """Bytes of the storages of the argument tensors among `leaves` that a graph does not
    take (by position, `taken`) and that share no storage with one it takes."""
    own = {storage_id(leaves[i]) for i in taken}
    found: dict[StorageId, int] = {}
    for i, leaf in enumerate(leaves):
        if i in taken or not holds_memory(leaf):
            continue
        sid = storage_id(leaf)
        if sid not in own:
            found[sid] = leaf.untyped_storage().nbytes()
    return sum(found.values())


@dataclass
class StepCall:
    """A training forward of a memopt module, from its start: what the trace of it
    (ForwardTrace.begin) is made from, the trace once something needed it, and the runs of
    settled graphs let through without it (graph, flat inputs, outputs)."""

    tensors: ModelTensors
    grads: list[int]
    args: tuple
    kwargs: dict
    ddp_bucket_bytes: int = 0
    held: tuple[torch.Tensor, ...] = ()
    after_backward: int = 0
    #: the optimizer's state and step (memopt.optimizer): constants of the module
    optimizer_state_bytes: int = 0
    optimizer_step_bytes: int = 0
    shards: Any = None  # FSDP2 on the blocks (memopt.fsdp_blocks.BlockShards)
    #: earlier calls whose backward has not run, and the bytes of their outputs still
    #: alive and of those outputs' gradients (memopt.pending): their graphs' runs come
    #: before this call's
    pending_calls: int = 0
    pending_bytes: tuple[int, int] = (0, 0)
    traced: ForwardTrace | None = None
    skipped: list[tuple[CompiledGraph, list[Any], Any]] = field(default_factory=list)
    _flat: tuple[list[Any], Any] | None = None

    def position(self) -> int:
        """How many graph runs this forward has had so far."""
        return len(self.traced.runs) if self.traced is not None else len(self.skipped)

    def trace(self) -> ForwardTrace:
        """The forward's trace, built now if nothing needed it before, from the state the
        call started with (the parameters' `.grad` and the arguments do not change while
        a forward runs), with the runs let through so far replayed."""
        if self.traced is None:
            t = self.tensors
            self.traced = ForwardTrace.begin(
                t.params, t.buffers, self.args, self.kwargs, self.ddp_bucket_bytes, self.held,
                self.after_backward + self.optimizer_step_bytes, self.optimizer_state_bytes,
                self.shards)
            for graph, flat, out in self.skipped:
                self.traced.start_run(graph, flat, graph.plan.held_bytes,
                                     kept=graph.kept_inputs()).record_outputs(out)
            self.skipped = []
        return self.traced

    def flat(self) -> tuple[list[Any], Any]:
        """The leaves and tree spec of (args, kwargs)."""
        if self._flat is None:
            self._flat = pytree.tree_flatten((self.args, self.kwargs))
        return self._flat

    def admits(self, graph: CompiledGraph) -> bool:
        """Whether `graph` may run without the trace: it settled, nothing ran before it in
        this forward, the record's key holds, and its plan covers what the step holds
        outside it, counted again from the record."""
        s = graph.settled
        if s is None or self.traced is not None or self.skipped or self.held \
                or self.pending_calls \
                or s.version != self.tensors.version or s.grads != self.grads \
                or graph.policy != ReplanPolicy.GREEDY or graph.provisional:
            return False
        leaves, spec = self.flat()
        model = s.model_bytes()
        if spec != s.spec or model is None:
            return False
        held = model + call_bytes(leaves, s.taken) + self.ddp_bucket_bytes \
            + self.optimizer_state_bytes
        return graph.outside.covers(Outside(held, held, self.optimizer_step_bytes))


def settle(call: StepCall, run: GraphRun, base: Outside) -> Settled | None:
    """The record that lets `run`'s graph run without a trace at the next steps (it was the
    forward's only run, and its plan covers `base`), or None where this step's count is not
    one the record can make again: FSDP's held tensors, or an argument tensor that shares
    a storage with the model's tensors."""
    if call.held or call.after_backward:
        return None
    trace, t = call.trace(), call.tensors
    model = [*t.params, *t.buffers, *(p.grad for p in t.params if p.grad is not None)]
    model = [m for m in model if holds_memory(m)]
    ids = {storage_id(m) for m in model}
    leaves, spec = call.flat()
    tensors = [i for i, leaf in enumerate(leaves)
               if holds_memory(leaf)]
    if any(storage_id(leaves[i]) in ids for i in tensors):
        return None
    own = run.inputs
    own_grads = {trace.kept_grads[s] for s in own if s in trace.kept_grads}
    outside = tuple(m for m in model if storage_id(m) not in own
                    and storage_id(m) not in own_grads)
    taken = frozenset(i for i in tensors if storage_id(leaves[i]) in own)
    record = Settled(t.version, list(call.grads), spec, taken, tuple(map(weakref.ref, outside)))
    if record.model_bytes() + call_bytes(leaves, taken) + call.ddp_bucket_bytes \
            + call.optimizer_state_bytes != base.forward:
        return None  # an aliasing the record would not see again: keep tracing
    return record
