"""Run a chain under a Gruslys policy: forward storing only what the policy keeps,
backward by recomputation in the policy's order (Gruslys et al. 2016, Sec. 3).

A chain is ``step(params, state, x) -> (y, new_state)`` applied to the inputs
``xs[0..t-1]`` from ``state`` (a tuple of tensors). ``forward_phase`` runs the
policy's actions up to its first backward: every step once, which produces every
output; it keeps the stored hidden states, the stored internal states (a step run
under autograd and held) and the last step's graph (the core). ``backward_phase``
runs the rest: each ``backward`` action backpropagates one step, from its stored
internal state or by recomputing it from a stored hidden state, carrying the
gradient of the hidden state from step to step and summing parameter gradients.

Random ops inside a step (dropout) draw the same numbers when recomputed: the RNG
state before each step's first run is kept and restored around every rerun, and
the caller's RNG state is left as it was. A step that draws nothing leaves the state
as it found it, so the next step's state equals it and is kept as the same tensors:
a chain of steps without random ops holds one RNG state (5056 bytes on CPU), not one
a step (passes.chain_policy.ChunkCosts.rng_bytes counts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from memopt.passes._torch_compat import autograd_inside_op
from memopt.allocator.gruslys import Policy

Tensors = tuple[torch.Tensor, ...]
Step = Callable[[Tensors, Tensors, torch.Tensor], tuple[torch.Tensor, Tensors]]


@dataclass
class ChainStats:
    """What one execution did, for tests and reports."""

    forward_steps: int = 0          # steps run (first pass + recomputation): C(t, m)
    peak_units: int = 0             # the most of the policy's memory units in use
    peak_stored_bytes: int = 0      # the most bytes held in stored states (h_0 excluded)


@dataclass
class _Internal:
    """A step run under autograd and kept: its leaf inputs, its output and its output
    state. With ``ChainRun.keep_output`` off, ``y`` is the output's gradient edge, not
    the tensor (backward needs where the output's gradient enters, not its values; None
    when it needs no gradient): a step whose graph does not save its output then does
    not hold it (the packed RNN step, memopt.recurrent.modules)."""

    state_in: Tensors
    x_in: torch.Tensor | Tensors    # a tuple: the chunk's xs, then its sliced inputs
    params_in: Tensors
    y: torch.Tensor | GradientEdge | None
    state_out: Tensors
    y_bytes: int = 0
    #: a tuple x_in: each sliced input's gradient box (_Sliced), None for the chunk's xs
    boxes: tuple[list | None, ...] = ()


@dataclass
class ChainRun:
    """One chain execution between its forward and backward phases."""

    step: Step
    policy: Policy
    params: Tensors
    xs: Sequence[torch.Tensor]
    state0: Tensors
    preserve_rng: bool
    x_grad: bool = False            # whether the inputs need gradients
    param_grad: tuple[bool, ...] = ()  # which parameters need gradients (default: all)
    stats: ChainStats = field(default_factory=ChainStats)
    hidden: dict[int, Tensors] = field(default_factory=dict)
    internal: dict[int, _Internal] = field(default_factory=dict)
    rng: dict[int, object] = field(default_factory=dict)
    cursor: int = 0                 # the next action of the schedule
    current: tuple[int, Tensors] | None = None
    core: int | None = None         # the last step, whose graph the forward phase keeps
    #: on_output(i, y): receives each step's output in the forward phase (default: a list)
    on_output: Callable[[int, torch.Tensor], None] | None = None
    #: on_grad_x(i, g): receives each step's input gradient in backward (default: a list)
    on_grad_x: Callable[[int, torch.Tensor | None], None] | None = None
    units: int = 0
    stored_bytes: int = 0
    last_rng: object = None         # the RNG state kept last (shared while it is unchanged)
    #: False: a kept step holds its output's gradient edge only (see _Internal)
    keep_output: bool = True
    #: the sliced per-step inputs' chunks of a split chain are dropped after the forward
    #: phase and handed back for backward (memopt.recurrent.ops): see ``_Sliced``

    # -- state ---------------------------------------------------------------

    def __post_init__(self) -> None:
        if len(self.param_grad) != len(self.params):
            self.param_grad = tuple(p.is_floating_point() for p in self.params)

    def available(self, pos: int) -> Tensors:
        """Hidden state ``pos``: the input, a stored hidden state, a stored internal
        state's output, or what the previous advance produced."""
        if pos == 0:
            return self.state0
        if pos in self.hidden:
            return self.hidden[pos]
        if pos - 1 in self.internal:
            return tuple(s.detach() for s in self.internal[pos - 1].state_out)
        if self.current is not None and self.current[0] == pos:
            return self.current[1]
        raise RuntimeError(f"memopt chain executor: hidden state {pos} is not available "
                           f"(policy {self.policy.describe()}); this is a memopt bug")

    def _run(self, i: int, state: Tensors, *, grad: bool, first: bool
             ) -> tuple[torch.Tensor, Tensors, _Internal | None]:
        """Run step i once (under autograd when ``grad``), replaying its RNG state."""
        self.stats.forward_steps += 1
        if self.preserve_rng:
            if first:
                self.rng[i] = self._keep_rng(_device(self.xs[i]))
            else:
                _set_rng(_device(self.xs[i]), self.rng[i])
        if not grad:
            with torch.no_grad():
                y, out = self.step(self.params, state, self.xs[i])
            return y, tuple(out), None
        state_in = tuple(s.detach().requires_grad_(s.is_floating_point()) for s in state)
        # requires grad even when unneeded: whether it is needed is known in backward
        params = tuple(p.detach().requires_grad_(g) for p, g in zip(self.params, self.param_grad))
        with autograd_inside_op():
            x, targets, boxes = _inputs(self.xs[i], copy=len(self.xs) > 1,
                                        sink=len(self.xs) == 1)
            y, out = self.step(params, state_in, x)
        del x  # a sliced input's values: the graph holds them only where it saved them
        out = tuple(out)
        kept = y if self.keep_output else get_gradient_edge(y) if y.requires_grad else None
        return y, out, _Internal(state_in, targets, params, kept, out, y.untyped_storage().nbytes(),
                                 boxes)

    def _keep_rng(self, device: torch.device) -> object:
        """The RNG state now, as the tensors of the state kept last when it is the same
        (the steps between drew nothing), so that it is held once."""
        state = _get_rng(device)
        if self.last_rng is not None and _same_rng(state, self.last_rng):
            return self.last_rng
        self.last_rng = state
        return state

    def _account(self, units: int, nbytes: int) -> None:
        self.units += units
        self.stored_bytes += nbytes
        self.stats.peak_units = max(self.stats.peak_units, self.units)
        self.stats.peak_stored_bytes = max(self.stats.peak_stored_bytes, self.stored_bytes)

    # -- phases --------------------------------------------------------------

    def forward_phase(self) -> tuple[list[torch.Tensor], Tensors]:
        """Every step once, storing what the policy keeps; returns the outputs (no
        graph; None entries when ``on_output`` takes them) and the final state. Stops at
        the first backward action, whose step (the chain's last) stays as the core's
        graph."""
        t = self.policy.t
        ys: list[torch.Tensor | None] = [None] * t
        self.units = 0 if self.policy.strategy == "ism" else 1
        self._account(0, 0)
        schedule = self.policy.schedule
        while True:
            op, i, j = schedule[self.cursor]
            if op == "backward":
                if i not in self.internal:  # the core: the last step, kept for backward
                    y, out, node = self._run(i, self.available(i), grad=True, first=True)
                    self.internal[i] = node
                    self.core = i
                    self._emit(ys, i, y.detach())
                final = tuple(s.detach() for s in self.internal[i].state_out)
                return ys, final  # the cursor stays at this backward
            self._act(op, i, j, ys)
            self.cursor += 1

    def backward_phase(self, grad_ys: Sequence[torch.Tensor | None], grad_final: Tensors
                       ) -> tuple[Tensors, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The rest of the schedule; returns the gradients of the initial state, of
        each step's input and of the parameters."""
        grad_h: list[torch.Tensor | None] = list(grad_final)
        grad_xs: list[torch.Tensor | None] = [None] * self.policy.t
        grad_params: list[torch.Tensor | None] = [None] * len(self.params)
        schedule = self.policy.schedule
        with _fork_rng(_device(self.xs[0]), self.preserve_rng):
            while self.cursor < len(schedule):
                op, i, j = schedule[self.cursor]
                if op == "backward":
                    grad_h = self._backward(i, grad_ys[i], grad_h, grad_xs, grad_params)
                else:
                    self._act(op, i, j, None)
                self.cursor += 1
        return tuple(grad_h), grad_xs, [None if s is None else s[0] for s in grad_params]

    def _emit(self, ys: list, i: int, y: torch.Tensor) -> None:
        if self.on_output is not None:
            self.on_output(i, y)
        else:
            ys[i] = y

    def _act(self, op: str, i: int, j: int, ys: list | None) -> None:
        """One non-backward action. ``ys`` is given in the forward phase (first runs)."""
        if op == "advance":
            state = self.available(i)
            for k in range(i, j):
                y, state, _ = self._run(k, state, grad=False, first=ys is not None)
                if ys is not None:
                    self._emit(ys, k, y)
            self.current = (j, state)
        elif op == "store_hidden":
            self.hidden[i] = self.available(i)
            self._account(1, _nbytes(self.hidden[i]))
        elif op == "free":
            self._account(-1, -_nbytes(self.hidden.pop(i)))
        elif op == "store_internal":
            y, _, node = self._run(i, self.available(i), grad=True, first=ys is not None)
            if ys is not None:
                self._emit(ys, i, y.detach())
            self.internal[i] = node
            self._account(self.policy.internal_units.get(i, 1), _graph_bytes(node))
        else:
            raise ValueError(f"unknown chain action {op!r}")

    def _backward(self, i: int, grad_y: torch.Tensor | None, grad_h: list,
                  grad_xs: list, grad_params: list) -> list:
        node = self.internal.pop(i, None)
        stored = node is not None and self.core != i
        if node is None:  # recompute step i in the core
            _, _, node = self._run(i, self.available(i), grad=True, first=False)
            self._account(1 if self.policy.strategy == "ism" else 0, 0)
        outputs, grads = [], []
        if grad_y is not None and node.y is not None and (
                isinstance(node.y, GradientEdge) or node.y.requires_grad):
            outputs.append(node.y)
            grads.append(grad_y)
        for out, g in zip(node.state_out, grad_h):
            if g is not None and out.requires_grad:
                outputs.append(out)
                grads.append(g)
        x_in = node.x_in if isinstance(node.x_in, tuple) else (node.x_in,)
        inputs = (*node.state_in, *x_in, *node.params_in)
        x_index = len(node.state_in)  # the chunk's xs; a tuple's others are sliced inputs
        wants = [k for k, v in enumerate(inputs)
                 if v.requires_grad and (k != x_index or self.x_grad)]
        with autograd_inside_op():
            got = torch.autograd.grad(outputs, [inputs[k] for k in wants], grads,
                                      allow_unused=True) if outputs and wants else []
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for k, g in zip(wants, got):
            result[k] = g
        n_state, n_x = len(node.state_in), len(x_in)
        grad_x = result[n_state]
        if node.boxes and not isinstance(node.x_in, tuple):  # through _Sliced (``sink``)
            grad_x = node.boxes[0][0]
        elif isinstance(node.x_in, tuple):  # the sliced inputs' gradients from their boxes
            grad_x = (grad_x, *(box[0] if box is not None else g
                                for box, g in zip(node.boxes[1:], result[n_state + 1:n_state + n_x])))
        if self.on_grad_x is not None:
            self.on_grad_x(i, grad_x)
        else:
            grad_xs[i] = grad_x
        boxed = [box[0] for box in node.boxes or () if box is not None]
        _add_param_grads(grad_params, result[n_state + n_x:], (*got, *grads, *boxed))
        if stored:
            self._account(-self.policy.internal_units.get(i, 1), -_graph_bytes(node))
        elif self.policy.strategy == "ism":
            self._account(-1, 0)
        return result[:n_state]


def _add_param_grads(total: list, chunk: Sequence[torch.Tensor | None],
                     others: Sequence[torch.Tensor]) -> None:
    """Adds one chunk's parameter gradients into the running sums ``total``, in place where
    a sum is this op's own: out of place, each ``sum + g`` made a new sum beside the old one
    and the chunk's gradient, one parameter gradient more than the plan counts (a
    bidirectional GRU measured 1.49% over its named minimum). A chunk's gradient becomes a
    sum as it is when it shares no storage with the other tensors of its backward (autograd
    hands an incoming gradient through unchanged, e.g. to both inputs of an add) and has
    no overlapping elements; otherwise the first addition makes a new sum. ``total`` holds,
    per parameter, ``(sum, owned)`` until the op ends."""
    for k, g in enumerate(chunk):
        if g is None:
            continue
        if total[k] is None:
            total[k] = (g, _exclusive(g, others))
        elif total[k][1]:
            total[k][0].add_(g)
        else:
            total[k] = (total[k][0] + g, True)


def _exclusive(g: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether ``g`` may be written in place: dense, and no other tensor in ``others``
    shares its storage."""
    by_stride = sorted(range(g.dim()), key=lambda d: -g.stride(d))
    if not g.permute(by_stride).is_contiguous():  # overlapping (expanded) or with gaps
        return False
    key = g.untyped_storage().data_ptr()
    return sum(o is not None and o.untyped_storage().data_ptr() == key for o in others) == 1


class _Sliced(torch.autograd.Function):
    """A sliced per-step input as a step reads it: its values, its gradient caught in
    ``box`` in backward (summed). The graph holds no reference to the input itself, only
    what its ops save: a leaf made of the slice would keep the whole input's storage alive
    through its AccumulateGrad node as long as a kept step graph lives, where eager frees
    an input nothing saves (Mamba's ``deltaB_u``) after the forward. ``anchor``, an empty
    tensor that requires grad, is what backward differentiates for. ``copy`` (a split
    chain): the step reads a copy of its chunk, so that what its graph saves holds the
    chunk, not the whole input, which the planner may then free or recompute for backward
    (Chen et al. 2016) while the chain holds its stored chunks."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor, box: list, copy: bool
                ) -> torch.Tensor:
        ctx.box = box
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box = ctx.box
        box[0] = grad if box[0] is None else box[0] + grad
        return None, None, None, None


def _inputs(x: torch.Tensor | Tensors, copy: bool = False, sink: bool = False):
    """(what the step reads, what backward differentiates for, gradient boxes) of a
    chunk's input: one tensor as a leaf that requires grad (a floating one), or the tuple
    of a chain with sliced per-step inputs (memopt.recurrent.ops.ChainSpec.sliced): its
    xs so, and each floating sliced input through ``_Sliced`` (``copy``: see there).
    ``sink`` (one chunk: never recomputed): one floating tensor through ``_Sliced`` too,
    so that the chunk holds of it only what its graph saves (a step that saves a copy of
    its input, not the input)."""
    if not isinstance(x, tuple):
        if sink and x.is_floating_point():
            anchor, box = x.new_empty(0).requires_grad_(), [None]
            return _Sliced.apply(anchor, x.detach(), box, False), anchor, (box,)
        leaf = x.detach().requires_grad_(x.is_floating_point())
        return leaf, leaf, ()
    first = x[0].detach().requires_grad_(x[0].is_floating_point())
    reads, targets, boxes = [first], [first], [None]
    for part in x[1:]:
        if not part.is_floating_point():
            reads.append(part.clone() if copy else part.detach())
            targets.append(reads[-1])
            boxes.append(None)
            continue
        anchor, box = part.new_empty(0).requires_grad_(), [None]
        reads.append(_Sliced.apply(anchor, part.detach(), box, copy))
        targets.append(anchor)
        boxes.append(box)
    return tuple(reads), tuple(targets), tuple(boxes)


def _device(x: torch.Tensor | Tensors) -> torch.device:
    return (x[0] if isinstance(x, tuple) else x).device


def _nbytes(state: Tensors) -> int:
    return sum(s.untyped_storage().nbytes() for s in state)


def _graph_bytes(node: _Internal) -> int:
    """Bytes a kept step holds beyond its inputs: its outputs (its saved tensors are
    not reachable from Python; the outputs stand for them in the stats)."""
    return node.y_bytes + _nbytes(node.state_out)


def _get_rng(device: torch.device) -> object:
    cpu = torch.get_rng_state()
    return (cpu, torch.cuda.get_rng_state(device)) if device.type == "cuda" else (cpu, None)


def _same_rng(a: object, b: object) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _set_rng(device: torch.device, state: object) -> None:
    cpu, dev = state
    torch.set_rng_state(cpu)
    if dev is not None:
        torch.cuda.set_rng_state(dev, device)


class _fork_rng:
    """Leave the caller's RNG state as it was after the recomputations."""

    def __init__(self, device: torch.device, active: bool) -> None:
        self.device, self.active = device, active

    def __enter__(self) -> None:
        if self.active:
            self.saved = _get_rng(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.active:
            _set_rng(self.device, self.saved)


class _ChainFunction(torch.autograd.Function):
    """Eager autograd wrapper: inputs are (state..., xs..., params...)."""

    @staticmethod
    def forward(ctx, step, policy, n_state, n_xs, preserve_rng, stats, *flat):
        state0 = tuple(t.detach() for t in flat[:n_state])
        xs = [t.detach() for t in flat[n_state:n_state + n_xs]]
        params = tuple(flat[n_state + n_xs:])
        x_grad = any(t.requires_grad for t in flat[n_state:n_state + n_xs])
        run = ChainRun(step, policy, params, xs, state0, preserve_rng, x_grad,
                       tuple(p.requires_grad for p in params),
                       stats=stats if stats is not None else ChainStats())
        ys, final = run.forward_phase()
        ctx.run = run
        ctx.n = (n_state, n_xs, len(params))
        return (*ys, *final)

    @staticmethod
    def backward(ctx, *grads):
        n_state, n_xs, n_params = ctx.n
        run: ChainRun = ctx.run
        t = run.policy.t
        grad_state, grad_xs, grad_params = run.backward_phase(grads[:t], grads[t:])
        ctx.run = None
        return (None,) * 6 + (*grad_state, *grad_xs, *grad_params)


def run_chain(step: Step, state: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
              policy: Policy, *, params: Sequence[torch.Tensor] = (),
              preserve_rng: bool = True, stats: ChainStats | None = None
              ) -> tuple[list[torch.Tensor], Tensors]:
    """Run ``step`` over ``xs`` from ``state`` under ``policy``; differentiable.

    ``step(params, state, x) -> (y, new_state)`` must use the ``params`` it is given
    (they are re-bound to fresh leaves when a step is recomputed). Returns the list of
    outputs and the final state. Gradients flow to ``state``, ``xs`` and ``params``
    and equal full BPTT's; memory holds only what the policy stores. ``stats``
    (a ChainStats) is filled in as the chain runs.
    """
    state, xs, params = tuple(state), list(xs), tuple(params)
    if len(xs) != policy.t:
        raise ValueError(f"the policy is for {policy.t} steps, got {len(xs)} inputs")
    if not state:
        raise ValueError("run_chain needs a state: a non-empty tuple of tensors")
    out = _ChainFunction.apply(step, policy, len(state), len(xs), preserve_rng, stats,
                               *state, *xs, *params)
    return list(out[:policy.t]), tuple(out[policy.t:])
