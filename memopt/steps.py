"""What the other graphs of a training step hold while one graph runs (graph breaks).

When the forward does not trace as one graph (a `.item()` branch, a third-party hook),
dynamo splits it into graphs that run one after another with eager code between them;
memopt's backend plans each graph's joint forward+backward. A graph's plan must count
what the rest of the step holds while it runs:

- forward of graph k: the parameters, buffers and inputs it does not take itself, and
  what the graphs that ran before it hold: their saved tensors, those of their outputs
  still referenced, and the inputs their backward reads that eager code made (a Linear's
  output between two graphs: the next graph keeps it as an input, not as a tensor it
  saved; HF Autoformer's plans missed 65,248 such bytes, 3.2% of its step, found from
  outside);
- backward of graph k (backward runs in reverse): the same, plus the parameter gradients
  the later graphs' backward produced, and the outputs of later graphs the caller still
  holds (the step's return value: logits beside a loss, say).

`ForwardTrace` records one forward of a compiled module as it runs: the resident
storages, and for each graph run its inputs' storages, what its plan saves, and weak
references to its outputs. `outside(...)` turns that into the two byte counts the
pipeline charges (memopt.planner.StepContext): while graph k's forward runs, and while
its backward runs. At a graph's first run only what came before it is known, so the
backward count there is a lower estimate of what later graphs' outputs add; when the
forward ends, `ForwardTrace.end()` gives every run's counts with the whole forward known,
and the backend re-plans the graphs whose plan assumed less (memopt.backend). A forward
that is one graph whose plan has settled runs without a trace (memopt.settled).

Storages are identified by (device, data pointer) of real tensors: what runs, not what
was traced. Meta tensors hold nothing, except while `meta_counted()` is entered
(memopt.plan(blocks=True) runs a meta model's step: shapes alone); a meta storage is then
identified by its StorageImpl, as all have data pointer 0.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from torch import fx

from memopt.passes._torch_compat import dynamo_frames_converted, pytree, storage_key, storage_ref

from .eager_reads import (eager_nodes, eager_reads, gradient_bytes, made_by_eager_autograd,
                          made_by_planned_function, node_bytes, nodes_below)
from .fsdp import local_tensor
from .pending import compiled_nodes
from .storages import StorageId, holds_memory, storage_id


#: The key of DDP's gradient buckets among a trace's resident storages: memopt does not
#: see their tensors (they live in DDP's C++ reducer), only their bytes.
DDP_BUCKETS: StorageId = ("ddp buckets", 0)
#: the optimizer's state (memopt.optimizer), held for the whole step like DDP's buckets
OPTIMIZER_STATE: StorageId = ("optimizer state", 0)


#: dynamo's frame count when compile_garbage_collected last collected
_collected_at: list[int] = [-2]


def compile_garbage_collected() -> None:
    """Collect Python's cyclic garbage where dynamo has compiled since the last look. Its
    compile (a backend failure it recovers from, a graph break it restarts at) leaves
    reference cycles through the frames it converted, and those frames' locals keep the
    tensors they held, an earlier graph's outputs among them, until a collection happens
    to run: a trace that read them alive counted them, one after a collection did not.
    HF Longformer (global attention, six graphs): a (2, 128, 2, 16) output of its third
    graph held by a dead `_compute_attn_output_with_global_indices` frame at the fourth's
    start in one process and not in another, so the first forward named 1,484,333 bytes
    in one and 1,517,600 in the other, and 1,484,333 was refused when passed back. Steps
    that compile nothing never collect here."""
    frames = dynamo_frames_converted()
    if frames != _collected_at[0]:
        gc.collect()
        _collected_at[0] = frames


def aliased_output_grad_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the output gradients autograd forms outside the compiled backward.

    AOTAutograd returns one tensor per storage and regenerates outputs that alias another
    output (`return h, h`, a slice of an output, HF's hidden-states tuple holding the last
    hidden state twice) or a graph input as views outside the compiled graph, so the loss's
    gradients for those outputs are summed by autograd before the compiled backward runs
    (and those of an input's view flow to the input outside it). While autograd sums k
    gradients of one storage it holds up to k + 1 storage-sized buffers (the contributions,
    a slice's gradient expanded to its base, the running sum), one of which becomes the
    tangent the plan counts: k more, every one for an input's storage. The fuzzer
    (tests/test_fuzz.py) measured a model returning `{"a": h[:, :1], "b": h}` 1.10x its
    budget when the plan left them out. Dynamo hands memopt the same tensor returned
    twice as one output, so `return h, h` is not seen here: memopt.backend counts it from
    the returned value (repeated_output_grad_bytes)."""
    placeholders = {storage_key(v): True for v in
                    (n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
                    if isinstance(v, torch.Tensor)}
    output = next(iter(gm.graph.find_nodes(op="output")))
    uses: dict[Any, list[int]] = {}
    for node in pytree.tree_leaves(output.args):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.requires_grad:
            storage = value.untyped_storage()
            uses.setdefault(storage_key(value), []).append(storage.nbytes())
    return sum(sizes[0] * len(sizes) for key, sizes in uses.items()
               if len(sizes) > 1 or key in placeholders)


def repeated_output_grad_bytes(returned: Any) -> int:
    """Bytes of the output gradients autograd sums outside the compiled backward for a
    tensor the forward returns more than once (`return h, h`, `{"a": h, "b": h}`): dynamo
    hands the backend such a tensor as one graph output, so only the returned value shows
    it. As for outputs that alias each other (aliased_output_grad_bytes), autograd holds up to k + 1 buffers of the tensor's bytes
    while it sums k returns' gradients (the contributions and the running sum, where it
    cannot add in place), one of which becomes the tangent the plan counts: k more. (A
    model returning `{"a": h, "b": h}` measured one more than its plan under inductor,
    32% above it; another, with the sum out of place, 944 bytes more than one: found by
    the fuzzer.)"""
    seen: dict[int, list[torch.Tensor]] = {}
    for leaf in pytree.tree_leaves(returned):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            seen.setdefault(id(leaf), []).append(leaf)
    return sum(len(uses) * uses[0].untyped_storage().nbytes()
               for uses in seen.values() if len(uses) > 1)


def reachable_tensors(value: Any, depth: int = 3) -> list[Any]:
    """The leaves of `value` (nested containers flattened), with the tensors a leaf that is
    neither a tensor nor a container holds in its attributes, `depth` objects deep: a
    transformers cache (`EncoderDecoderCache`, not a pytree node) returned in a model's
    output holds every layer's keys and values, which the caller keeps with the output
    (HF SpeechT5 measured 1.39% over its named minimum while they went uncounted)."""
    found = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif depth > 0 and hasattr(leaf, "__dict__") and not isinstance(
                leaf, (type, torch.nn.Module)) and not callable(leaf):
            found.extend(reachable_tensors(list(vars(leaf).values()), depth - 1))
    return found


def storages(values: Iterable[Any]) -> dict[StorageId, int]:
    """{storage: bytes} of the tensors among `values` (nested containers flattened)."""
    found: dict[StorageId, int] = {}
    for leaf in pytree.tree_leaves(list(values)):
        leaf = local_tensor(leaf)  # FSDP2's sharded parameters: their shard's storage
        if holds_memory(leaf):
            found[storage_id(leaf)] = leaf.untyped_storage().nbytes()
    return found


@dataclass(frozen=True)
class Outside:
    """Bytes the rest of the step holds while one graph's forward, and its backward, run;
    `after_backward`: bytes allocated as its backward ends, on top of what the step still
    holds then (FSDP2's reduce-scatter of the gradients, memopt.fsdp); `before_backward`:
    bytes held as its backward starts, on top of the rest, while the eager code after it
    runs its backward (ForwardTrace.eager_backward)."""

    forward: int = 0
    backward: int = 0
    after_backward: int = 0
    #: a graph that runs several times in the forward (a repeated block, memopt.blocks):
    #: for each of its runs, (n, forward, backward): its n own runs before it, and what
    #: the rest of the step holds around it besides them. The planner counts each with
    #: the saved bytes of the plan it weighs (`around`)
    own: tuple[tuple[int, int, int], ...] = ()
    before_backward: int = 0
    #: positions of the runs before it whose autograd node was freed (nothing the loss can
    #: reach depends on them: HF Encodec's encoder, quantized to integer codes) before its
    #: forward ran / by the time the forward ended: they hold nothing for it
    #: (graph_breaks.need_of leaves their saved bytes out)
    dead_forward: frozenset[int] = field(default=frozenset(), compare=False)
    dead_backward: frozenset[int] = field(default=frozenset(), compare=False)

    @property
    def repeats(self) -> int:
        """The most own runs before one of its runs (0: it runs once)."""
        return max((n for n, _, _ in self.own), default=0)

    def around(self, saved: int) -> tuple[int, int]:
        """(forward, backward) held around the graph's runs when its plan saves `saved`."""
        return (max([self.forward] + [f + n * saved for n, f, _ in self.own]),
                max([self.backward] + [b + n * saved for n, _, b in self.own]))

    def covers(self, other: "Outside") -> bool:
        """It holds at least `other` around every run, whatever the plan saves (a graph
        that runs once is a run with no own runs before it)."""
        mine = ((0, self.forward, self.backward), *self.own)
        return self.after_backward >= other.after_backward \
            and self.before_backward >= other.before_backward and all(
            any(m >= n and g >= f and c >= b for m, g, c in mine)
            for n, f, b in ((0, other.forward, other.backward), *other.own))

    def max(self, other: "Outside") -> "Outside":
        own = {n: (f, b) for n, f, b in self.own}
        for n, f, b in other.own:
            own[n] = (max(f, own[n][0]), max(b, own[n][1])) if n in own else (f, b)
        return Outside(max(self.forward, other.forward), max(self.backward, other.backward),
                       max(self.after_backward, other.after_backward),
                       tuple((n, f, b) for n, (f, b) in sorted(own.items())),
                       max(self.before_backward, other.before_backward))

    def plus(self, nbytes: int, backward: int | None = None) -> "Outside":
        """`nbytes` more held around its forward, and `backward` (default: the same)
        around its backward."""
        back = nbytes if backward is None else backward
        return Outside(self.forward + nbytes, self.backward + back, self.after_backward,
                       tuple((n, f + nbytes, b + back) for n, f, b in self.own),
                       self.before_backward)

    def bytes(self) -> tuple:
        """(forward, backward, after_backward, own, before_backward): what passes.liveness
        and passes.simulate take as `outside_bytes` (allocator.lifetimes.held_outside)."""
        return self.forward, self.backward, self.after_backward, self.own, self.before_backward


@dataclass
class GraphRun:
    """One run of a compiled graph within a forward. `base`: what the rest of the step
    holds around it besides the saved tensors of the runs before it (forward: as it was
    when it ran)."""

    graph: Any                           # the backend's entry for the graph (its identity)
    inputs: dict[StorageId, int]         # storages of its inputs
    held_bytes: int                      # what its plan holds for backward (not outputs)
    base: Outside = Outside()
    outputs: list[tuple[Any, StorageId, int]] = field(default_factory=list)
    #: what eager code between the previous run and this one reads and saves
    #: (memopt.eager_reads): the parameters, whose gradients are made between this run's
    #: backward and the previous run's, and the tensors autograd saved, held until then
    eager: dict[StorageId, int] = field(default_factory=dict)
    eager_saved: dict[StorageId, int] = field(default_factory=dict)
    #: bytes of the gradients its backward returns into that eager code (its inputs that
    #: eager autograd made): alive while that code's backward runs
    eager_grads: int = 0
    #: the parameter storages whose gradient it returns as a view (CompiledGraph.view_grads)
    views: set[StorageId] = field(default_factory=set)
    #: storages of the inputs its backward reads (kept_input_positions): held until then
    kept_inputs: dict[StorageId, int] = field(default_factory=dict)
    #: weak references to its compiled autograd nodes (CompiledFunctionBackward)
    nodes: list[Any] = field(default_factory=list)
    #: positions of the earlier runs whose node was freed before it ran
    dead_before: frozenset[int] = frozenset()
    #: weak references to its inputs' storages: dynamo's resume frames hold a graph's
    #: inputs until the whole forward returns, so the graphs after it see them alive
    input_refs: list[tuple[Any, StorageId, int]] = field(default_factory=list)

    def alive(self) -> bool:
        """Its backward can still run: one of its autograd nodes is alive, or none was
        found (not known: counted alive). Freed, its saved tensors and kept inputs are
        freed with it."""
        return not self.nodes or any(ref() is not None for ref in self.nodes)

    def alive_outputs(self) -> dict[StorageId, int]:
        """The storages of its outputs that something still holds: a Python reference, a
        view, or autograd (a saved output)."""
        return {sid: n for ref, sid, n in self.outputs if not ref.expired()}

    def record_outputs(self, outputs: Any) -> None:
        for t in pytree.tree_leaves(outputs):
            if holds_memory(t):
                storage = t.untyped_storage()
                self.outputs.append((storage_ref(storage), storage_id(t), storage.nbytes()))
        self.nodes.extend(weakref.ref(n) for n in compiled_nodes(outputs, levels=5))


@dataclass
class ForwardTrace:
    """One forward of a compiled module (see the module docstring)."""

    resident: dict[StorageId, int]       # parameters, buffers, inputs, kept .grad
    grads: dict[StorageId, int]          # parameter storage -> bytes of its coming gradient
    kept_grads: dict[StorageId, StorageId]  # parameter storage -> its kept .grad's storage
    runs: list[GraphRun] = field(default_factory=list)
    returned: dict[StorageId, int] | None = None  # the step's return value, once it ended

    #: bytes held for the whole step that are no tensor of the model's (DDP's gradient
    #: buckets, memopt.ddp), in `resident` under the key DDP_BUCKETS
    ddp_bucket_bytes: int = 0
    #: bytes allocated as the step's backward ends, outside every graph (FSDP2's
    #: reduce-scatter, memopt.fsdp): charged at the last step of each graph's backward
    after_backward: int = 0
    #: FSDP2 on the repeated blocks and the root (memopt.fsdp_blocks.BlockShards): what
    #: its hooks hold between the graphs
    shards: Any = None
    _root_counted: bool = False
    #: runs so far of each captured graph (by id of its CompiledGraph.primary)
    _runs_of: dict[int, int] = field(default_factory=dict)
    #: autograd nodes walked by memopt.eager_reads in this forward
    _walked: set[int] = field(default_factory=set)
    #: parameters eager code read after the last graph run (`end`); what it saved is
    #: freed by its backward, which runs before every graph's
    _eager_after: dict[StorageId, int] = field(default_factory=dict)
    #: what the eager code after the last run saved that no plan counts, and the ids of
    #: its autograd nodes (eager_head): the caller's loss is on top (memopt.caller_loss)
    head_saved: set[StorageId] = field(default_factory=set)
    head_nodes: set[int] = field(default_factory=set)
    head_flowing: int = 0
    #: Python autograd.Functions eager code ran, whose backward no plan counts
    #: (memopt.eager_reads.opaque_function)
    opaque: set[str] = field(default_factory=set)

    @classmethod
    def begin(cls, params: list[torch.nn.Parameter], buffers: list[torch.Tensor], args: tuple,
              kwargs: dict, ddp_bucket_bytes: int = 0, held: Iterable[torch.Tensor] = (),
              after_backward: int = 0, optimizer_state_bytes: int = 0,
              shards: Any = None) -> "ForwardTrace":
        """Start the trace of a forward of a model with these parameters and buffers.
        `ddp_bucket_bytes`: what the DDP around it holds besides the model's tensors
        (memopt.ddp.DDPBuckets.counted_bytes), counted like a resident storage that no graph
        takes; `held`: tensors resident for the whole step besides the model's and the inputs
        (FSDP2's parameter shards and all-gather output); `after_backward`: bytes allocated as
        the backward ends (FSDP2's reduce-scatter, the optimizer's step);
        `optimizer_state_bytes`: the optimizer's state (memopt.optimizer), held like DDP's
        buckets; `shards`: FSDP2 on the blocks and the root (memopt.fsdp_blocks)."""
        resident = storages([*params, *buffers, args, kwargs, list(held)])
        local = [(local_tensor(p), p.grad is not None and local_tensor(p.grad))
                 for p in params if p.requires_grad]  # FSDP2's shards, gradients sharded too
        grads = {storage_id(p): p.untyped_storage().nbytes() for p, g in local if g is False}
        kept = {storage_id(p): storage_id(g) for p, g in local if g is not False}
        resident.update(storages(p.grad for p in params if p.grad is not None))  # frozen too
        if ddp_bucket_bytes:
            resident[DDP_BUCKETS] = ddp_bucket_bytes
        if optimizer_state_bytes:
            resident[OPTIMIZER_STATE] = optimizer_state_bytes
        return cls(resident, grads, kept, ddp_bucket_bytes=ddp_bucket_bytes,
                   after_backward=after_backward + (shards.after_backward if shards else 0),
                   shards=shards)

    def start_run(self, graph: Any, inputs: Iterable[Any], held_bytes: int,
                  views: Iterable[Any] = (), kept: Iterable[int] = ()) -> GraphRun:
        """A graph is about to run: record it, with what the rest holds now. `views`: the
        inputs whose gradient it returns as a view of another tensor (CompiledGraph);
        `kept`: the positions of the inputs its backward reads (kept_input_positions)."""
        compile_garbage_collected()
        if self.shards is not None and not self._root_counted:  # gathered by now
            self.resident.update(storages(self.shards.gathered_root()))
            self._root_counted = True
        key = id(getattr(graph, "primary", graph))
        self._runs_of[key] = self._runs_of.get(key, 0) + 1
        inputs = list(inputs)
        run = GraphRun(graph, storages(inputs), held_bytes)
        run.input_refs = [(storage_ref(t.untyped_storage()), storage_id(t),
                           t.untyped_storage().nbytes())
                          for t in inputs if holds_memory(t) and storage_id(t) not in self.resident]
        reads = eager_reads(inputs, self._walked)
        self.opaque |= reads.opaque
        run.eager = {s: n for s, n in reads.params.items()
                     if s in self.grads and s not in run.inputs}
        run.eager_saved = {s: n for s, n in reads.saved.items() if s not in self.resident}
        run.eager_grads = sum(t.numel() * t.element_size() for t in inputs
                              if isinstance(t, torch.Tensor) and t.requires_grad
                              and made_by_eager_autograd(t))
        run.views = set(storages(views))
        run.kept_inputs = storages(inputs[i] for i in kept)
        self.runs.append(run)
        run.dead_before = self.dead(len(self.runs) - 1)
        run.base = self._base(len(self.runs) - 1, run.inputs, run.dead_before)
        return run

    def runs_of(self, graph: Any) -> int:
        """How many times `graph`'s captured graph has run in this forward so far."""
        return self._runs_of.get(id(graph), 0)

    def outside_of(self, position: int, inputs: Iterable[Any]) -> Outside:
        """What the rest of the step holds around a graph that would run at `position`
        with these inputs, as far as the trace knows now."""
        dead = self.dead(position)
        base = self._base(position, storages(inputs), dead).plus(self.held_before(position, dead))
        return dataclasses.replace(base, after_backward=self.after_backward)

    def dead(self, position: int, alive: list[bool] | None = None) -> frozenset[int]:
        """Positions of the runs before `position` whose autograd node is freed now
        (`alive`: each run's `GraphRun.alive()`, where the caller has them)."""
        if alive is None:
            alive = [run.alive() for run in self.runs[:position]]
        return frozenset(i for i, a in enumerate(alive[:position]) if not a)

    def held_before(self, position: int, dead: frozenset[int] | None = None) -> int:
        dead = self.dead(position) if dead is None else dead
        return sum(run.held_bytes for i, run in enumerate(self.runs[:position])
                   if i not in dead)

    def _base(self, position: int, own: dict[StorageId, int],
              dead: frozenset[int] | None = None) -> Outside:
        """What the step holds outside run `position` (inputs `own`), less the saved
        tensors of the runs before it: while its forward runs (now, if the forward has
        not ended), and while its backward runs (a lower estimate until the forward
        ends: what later runs return is not known)."""
        own_grads = {self.kept_grads[s] for s in own if s in self.kept_grads}
        held = {s: n for s, n in self.resident.items() if s not in own and s not in own_grads}
        dead = self.dead(position) if dead is None else dead
        for i, run in enumerate(self.runs[:position]):
            held.update({s: n for s, n in run.alive_outputs().items() if s not in own})
            held.update({s: n for ref, s, n in run.input_refs
                         if s not in own and not ref.expired()})
            if i not in dead:  # a freed node no longer keeps its inputs
                held.update({s: n for s, n in run.kept_inputs.items() if s not in own})
        for run in self.runs[:position + 1]:  # saved by eager code before it ran
            held.update({s: n for s, n in run.eager_saved.items() if s not in own})
        forward = sum(held.values())
        returned = self.returned or {}
        later = {s: n for run in self.runs[position + 1:] for s, n in run.alive_outputs().items()
                 if s in returned and s not in own and s not in held}
        if self.returned is None:  # later graphs unknown: every gradient not yet planned
            planned = set(own).union(*(run.inputs for run in self.runs[:position]))
            other_grads = sum(n for s, n in self.grads.items() if s not in planned)
        else:  # the gradients the later graphs' backward produced before this one's
            later_inputs = set().union(*(run.inputs for run in self.runs[position + 1:]))
            other_grads = sum(n for s, n in self.grads.items()
                              if s in later_inputs and s not in own)
            other_grads += sum(self._eager_grads(position, own, set(own) | later_inputs).values())
        backward = forward + other_grads + sum(later.values())
        if self.shards is not None:  # what FSDP2's hooks hold between the graphs
            kept = position * self.shards.per_earlier_run
            forward += self.shards.forward_extra + kept
            backward += self.shards.backward_extra + kept
        return Outside(forward, backward, before_backward=self.eager_backward(position))

    def eager_backward(self, position: int) -> int:
        """Bytes held, on top of what run `position`'s backward holds around it, while the
        eager code between it and the next run runs its backward (just before the run's
        own): what that code saved, the gradients the next run's backward returned into
        it, and as much again as the largest tensor it saved, for its kernels' work
        buffers (measured on HF BatchNorm with momentum=None, which dynamo runs eagerly:
        native_batch_norm_backward allocates an input-sized buffer beside its gradient;
        the step measured 1.23x a budget memopt had named, found from outside). The
        eager code's own gradients are the run's output gradients, which its plan counts."""
        if position + 1 >= len(self.runs):
            return 0
        later = self.runs[position + 1]
        saved = {s: n for s, n in later.eager_saved.items() if s not in later.inputs}
        if not saved and not later.eager_grads:
            return 0
        return sum(saved.values()) + later.eager_grads + max(saved.values(), default=0)

    def _eager_grads(self, position: int, own: dict[StorageId, int],
                     counted: set[StorageId]) -> dict[StorageId, int]:
        """Gradients of parameters read by eager code (memopt.eager_reads) that exist while
        run `position`'s backward runs and are not in `counted` (its own inputs', and the
        later runs'): those read after it in the forward. For the first run, also those
        read before it: the step's last gradients, made after every graph's backward (on
        top of what the first graph's backward leaves: counted there, a little early),
        each a fresh tensor even where a graph's backward already made that parameter's
        `.grad` (a tied embedding, whose head is a graph's), which it is then added into
        (out of place where that gradient is a view: one more such tensor)."""
        eager = dict(self._eager_after)
        for run in self.runs[position + 1:]:
            eager.update(run.eager)
        found = {s: n for s, n in eager.items() if s not in counted}
        if position == 0 and self.runs:
            # autograd adds the two in place into the first to arrive, unless it is a view
            # (F.linear's weight gradient, a transposed product), whose base holds its
            # storage: then the sum is a third tensor (eager PyTorch's tied embedding:
            # three (V, d) at its end)
            views = set().union(*(run.views for run in self.runs))
            found.update({s: n * (2 if s in views else 1)
                          for s, n in self.runs[0].eager.items() if s not in own})
        return found

    def end(self, returned: Any) -> list[Outside]:
        """The forward returned `returned`: every run's base with the whole forward known
        (forward: as when it ran; backward: the outputs alive now, the return value, the
        gradients of the graphs after it). Add `saved_before(i)` (or the saved bytes of
        new plans of the graphs before run i) for what the run's plan must count."""
        compile_garbage_collected()
        self.returned = storages(reachable_tensors(returned))
        reads = eager_reads(returned, self._walked)
        self.opaque |= reads.opaque
        self._eager_after = {s: n for s, n in reads.params.items() if s in self.grads}
        alive = [run.alive() for run in self.runs]  # once: each run's dead set from it
        dead = [self.dead(i, alive) for i in range(len(self.runs))]
        bases = [dataclasses.replace(self._base(i, run.inputs, dead[i]), forward=run.base.forward,
                                     dead_forward=run.dead_before, dead_backward=dead[i])
                 for i, run in enumerate(self.runs)]
        if bases:
            head = self.eager_head(reads.saved, returned)
            bases[-1] = dataclasses.replace(
                bases[-1], before_backward=bases[-1].before_backward + head)
        return bases

    def eager_tail(self) -> int:
        """Bytes the eager code before the first run (the *tail*: the start of an
        ``nn.Sequential`` before a graph break inside it) allocates as its backward, the
        step's last, runs on top of what the first run's backward leaves: the gradients
        that backward returns into it, and the most gradients one of its nodes holds at
        once (eager_reads.gradient_bytes; its saved tensors themselves are in every run's
        base; without the first, a Sequential with dropout before the break measured 2%
        over the minimum named at its first step). An estimate made as the forward ends,
        so that the first step's plan holds it; memopt.eager_tail measures the backward at
        that step and holds more from the next where it finds more (a CNN of three
        BatchNorm2d(momentum=None): estimated 1,048,896 bytes, measured 1,036,295; twice
        the largest saved tensor instead, a Sequential with wide dropout layers before
        the break was named 1.8x eager's peak, found from outside)."""
        first = self.runs[0] if self.runs else None
        if first is None or not (first.eager_saved or first.eager_grads):
            return 0
        compiled = [node for node in (ref() for ref in first.nodes) if node is not None]
        return first.eager_grads + max(map(gradient_bytes, nodes_below(compiled)), default=0)

    def counted(self) -> set[StorageId]:
        """The storages the plans count as the forward ends: the resident tensors, the
        runs' inputs and outputs still alive, what eager code between them saved, and
        what the code after the last run saved and returned (eager_head, once `end`)."""
        return self._counted_by_runs() | self.head_saved | set(self.returned or ())

    def _counted_by_runs(self) -> set[StorageId]:
        counted = set(self.resident)
        for run in self.runs:
            counted.update(run.inputs, run.eager_saved, run.alive_outputs())
        return counted

    def eager_head(self, saved: dict[StorageId, int], returned: Any) -> int:
        """Bytes held, on top of what the last run's backward holds around it, while the
        eager code after the last run (the forward's *head*: the rest of an
        ``nn.Sequential`` after a graph break inside it, which dynamo runs eagerly) runs
        its backward, the first of the step, from the forward's end: what that code
        `saved` and what the forward `returned` that no plan counts (not the model's
        tensors, nor a run's inputs or outputs, nor what eager code before a run saved),
        and the most gradients one of its nodes holds at once, handed and returned
        (eager_reads.gradient_bytes; the output's gradient is the first node's). A
        Sequential MLP with its break first measured 23.6 MB against a 9.1 MB budget
        memopt had accepted without any of it; a head that saved nothing of its own
        (an Upsample after the break) 2.5x its budget with only the saved tensors counted
        (both found from outside)."""
        counted = self._counted_by_runs()
        leaves = [t for t in pytree.tree_leaves(returned) if isinstance(t, torch.Tensor)]
        counted.update(storages(t for t in leaves if made_by_planned_function(t)))
        held = {s: n for s, n in saved.items() if s not in counted}
        held.update({s: n for s, n in (self.returned or {}).items() if s not in counted})
        roots = [t.grad_fn for t in leaves if t.requires_grad and made_by_eager_autograd(t)
                 and not made_by_planned_function(t)]
        flowing = max(map(node_bytes, eager_nodes(roots, self.head_nodes)), default=0)
        self.head_saved = set(held) if flowing else set()
        self.head_flowing = flowing
        return sum(held.values()) + flowing if flowing else 0


_PRIMAL = re.compile(r"^fw\.primals_(\d+)$")


def kept_input_positions(plan: Any) -> tuple[int, ...]:
    """Positions of a graph's inputs (its primals, in the order it is called with) whose
    storage its backward reads (a MemoryPlan's input storages with a backward node): the
    graph's autograd node holds them until its backward, whoever made them."""
    kept = []
    for record in plan.storages:
        match = _PRIMAL.match(record.name)
        if record.kind == "input" and match and any(n.startswith("bw.") for n in record.nodes):
            kept.append(int(match.group(1)) - 1)
    return tuple(kept)
