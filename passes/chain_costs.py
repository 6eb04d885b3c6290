"""What one chunk of a recurrent chain costs, measured on real tensors (Gruslys et al.
2016's internal state I(L), and the transients and times around it): the chunk_costs half
of passes.chain_policy, which prices a chain's policies with them.

A chunk of L steps is the chain's step function run once on zeros of the real shapes
(``_ChunkRun``), forward under autograd and backward, at two lengths; each quantity is
taken as linear in L through them (``Linear``). What a chunk's graph saves is read from
its autograd nodes (``_saved_by_graph``); the per-step inputs a chain slices from its
params (ChainSpec.sliced) are sorted by whether the graph saves them (``_saved_sliced``).

Requires: the joint graph's chain_fwd node with FakeTensors on its arguments. Ensures:
nothing in the graph changes; the chunks run inside real_tensors() and leave the RNG
state as the runs moved it (the caller's concern: chunk_costs says whether it moved).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx

from ._torch_compat import autograd_inside_op, real_tensors, storage_key
from .allocated import (can_track, maybe_allocation_peak, note_unmeasured,
                        say_untracked)
from .meta import fake_value
from .runtime import runtime

if TYPE_CHECKING:  # pragma: no cover
    from .chain_policy import ChainSite


#: Positions of the ops' arguments (memopt.recurrent.ops schemas).
_CHAIN, _CHUNK, _M, _STRATEGY = 0, 1, 2, 3
_FWD_STATE, _FWD_XS, _FWD_PARAMS = 5, 6, 7
_BWD_NEED_X, _BWD_HANDLE = 4, 5


def _ops():
    return runtime("chains"), torch.ops.memopt.chain_fwd.default, \
        torch.ops.memopt.chain_bwd.default


def _sliced(node: fx.Node, spec) -> list[fx.Node]:
    """The chain's params that are per-step inputs it slices (ChainSpec.sliced)."""
    params = node.args[_FWD_PARAMS]
    return list(params[len(params) - len(spec.sliced):]) if spec.sliced else []


def _inputs(node: fx.Node, chunk: int, spec):
    """(state, x, params) of the chain's first chunk of ``chunk`` steps, on FakeTensors
    (x a tuple where the chain slices per-step inputs from its params: ChainSpec.sliced)."""
    xs = fake_value(node.args[_FWD_XS])
    state = tuple(fake_value(s) for s in node.args[_FWD_STATE])
    params = tuple(fake_value(p) for p in node.args[_FWD_PARAMS])
    ops = _ops()[0]
    x, params = ops.chunk_input(spec, xs, params, 0, min(chunk, ops.steps_of(spec, xs, params)))
    return state, x, params


@dataclass(frozen=True)
class Linear:
    """Bytes linear in a chunk's length L: ``first`` at L = 1, ``per_step`` more for
    each further step."""

    first: int
    per_step: int

    def __call__(self, chunk: int) -> int:
        return max(0, self.first + (chunk - 1) * self.per_step)

    @classmethod
    def through(cls, a: tuple[int, int], b: tuple[int, int]) -> "Linear":
        """The line through (length, bytes) points ``a`` and ``b`` (a constant when
        the lengths are equal), its slope clamped at 0."""
        (la, va), (lb, vb) = sorted((a, b))
        per_step = max(0, (vb - va) // (lb - la)) if lb > la else 0
        return cls(va - (la - 1) * per_step, per_step)

    def at_least_proportional(self, length: int, value: int) -> "Linear":
        """This line, or where it says a chunk's fixed cost is negative (its value at L = 0
        below zero, so that L chunks of 1 step would cost less than one of L), the line
        through 0 and ``value`` at ``length``. For times: two timings a few steps apart
        extrapolated to a whole sequence made 128 chunks of one LSTM step 12-45% faster
        than one chunk of 128 in some processes and not in others, so a budget that did
        not bind chose one or the other at random (a packed tagger measured 0.98x or 1.02x
        eager's peak)."""
        if self.first >= self.per_step:
            return self
        return Linear(value // length, value // length)

    def above(self, length: int, value: int) -> "Linear":
        """This line raised, where it runs below ``value`` at ``length``, to pass through
        it: an upper bound through a third measured point."""
        raw = self.first + (length - 1) * self.per_step
        return Linear(self.first + max(0, value - raw), self.per_step)


@dataclass(frozen=True)
class ChunkCosts:
    """The bytes and time of one chunk of L steps, each linear in L, measured once per
    chain on real tensors (``chunk_costs``):

    - ``saved``: what autograd keeps for the chunk's backward, and its input and final
      states (the internal state of Gruslys et al. 2016, Sec. 3.2; fused RNN kernels keep
      workspaces, cuDNN's reserve or oneDNN's, that FakeTensors do not show);
    - ``forward``: the most its forward allocates beyond what it returns and saves
      (kernel temporaries, e.g. the input projection of every step);
    - ``backward``: the most its backward allocates beyond what was live when it
      started (the gradients of its inputs and parameters, and kernel temporaries);
    - ``forward_ns``, ``backward_ns``: the wall time of its forward (under autograd)
      and of its backward, in nanoseconds. A call has a fixed cost besides the steps
      (a fused kernel's setup, a launch, Python): on the CPU an nn.LSTM(256) chunk
      costs about 1 ms + 0.5 ms a step forward and 4.5 ms + 0.7 ms a step backward,
      so many short chunks cost more than their recomputed steps say.
    """

    saved: Linear
    forward: Linear
    backward: Linear
    forward_ns: Linear
    backward_ns: Linear
    #: one RNG state the executor keeps to replay a chunk's random ops, in bytes on the
    #: chain's device (the CPU generator's 5056; 0 on CUDA, whose states are host
    #: tensors, or where the chain replays nothing: ChainSpec.preserve_rng)
    rng_state_bytes: int = 0
    #: whether a chunk draws random numbers (its run moved the RNG state)
    random: bool = False
    #: the params (by index) that are sliced per-step inputs a chunk's graph saves nothing
    #: of (Mamba's ``deltaB_u``, read by an add): one chunk holds no reference to them
    unsaved: tuple[int, ...] = ()
    #: whether a chunk's graph saves nothing of its xs (a packed RNN step saves its own
    #: packed copy): one chunk holds no reference to it
    xs_unsaved: bool = False
    #: the bytes of a chunk's slices of the sliced per-step inputs its graph saves: a
    #: split chain's steps read copies of their chunks (memopt.recurrent.executor._Sliced),
    #: which its kept chunks hold
    sliced_saved: Linear = Linear(0, 0)

    def rng_bytes(self, t: int) -> int:
        """The RNG states a chain of ``t`` chunks holds from its forward to its backward
        (memopt.recurrent.executor: one per chunk when chunks draw random numbers, else
        one, shared)."""
        return self.rng_state_bytes * (t if self.random else 1)

    def seconds(self, runs: list[int], sizes: list[int]) -> float:
        """A chain's estimated time: chunk i run forward ``runs[i]`` times and
        backpropagated once."""
        return sum(n * self.forward_ns(s) + self.backward_ns(s)
                   for n, s in zip(runs, sizes)) / 1e9


@dataclass(frozen=True)
class FractionRoom:
    """The room a fraction budget leaves a chunk's measurement, before the step's baseline
    is known: the fraction of an estimate of that baseline, what is live as the first call
    plans (``live``) and the chain's steps, each holding what the 1-step chunk saved (with
    no budget one chunk holds every step; the 1-step chunk's states make it high, and
    ``_longest_within`` prices a step at the same bytes). A UT block applied 6 times
    measured its whole chain inside the first step at a 0.5 budget: 2.0x the budget."""

    fraction: float
    live: int

    def nbytes(self, steps: int, one: list[int]) -> int:
        return max(0, int(self.fraction * (self.live + steps * one[0])) - self.live)


def chunk_costs(joint: fx.GraphModule, site: ChainSite,
                room: int | FractionRoom | None = None) -> ChunkCosts:
    """Measured at two chunk lengths, 2 and 16 steps (fewer when T is shorter), on zeros
    of the real shapes on the real device; long chunks are not run (on FakeTensors the
    fused RNN op decomposes into per-step ops: slow to trace, and the wrong bytes).
    ``room``: the bytes the measurement may allocate (a byte budget less what is live as
    the first call plans; a fraction's ``FractionRoom``), None for any: the runs are
    inside the user's first step, and a chunk of 12 steps of an nn.LSTM, the whole
    chain, measured 1.68x the budget there (found from outside). The longer chunk is
    then the longest whose bytes, priced on the 1-step chunk measured first
    (``_longest_within``), fit in it, 2 steps at least.

    Step 1: a chunk of each length, its inputs zeros of the real shapes.
    Step 2: bytes: each chunk run once, forward then backward, under allocation
        tracking; the saved bytes read from the autograd graph between them. A chunk
        of 1 step is measured too, and each line of bytes raised to lie above it:
        oneDNN's LSTM allocates in blocks, and an nn.LSTM(8, 16) chunk of 1 step saved
        31,232 bytes where the line through 2 and 16 steps said 23,040 (its plans
        measured 6-9% over their budgets; found from outside). Where
        allocations cannot be tracked (another profiler is recording on CPU) the
        transients are taken as zero, a warning says the plan may undercount, and the
        step is planned again once they can be (passes.allocated.note_unmeasured).
    Step 3: time: both chunks run TIMED_RUNS more times, interleaved; the fastest
        forward and backward of each count (the first runs were the warm-up).
    Step 4: RNG states: where the chain replays random ops, the bytes of one state on
        the device, and whether the runs of Step 2 moved the state (a chunk draws)."""
    long = min(16, site.steps)
    device = fake_value(_fwd_node(joint, site).args[_FWD_XS]).device
    tracked = can_track(device)
    if not tracked:  # planned again, measured, once the profiler stops (memopt.backend)
        note_unmeasured()
        say_untracked("chains", " chain %s (a profiler is recording); its kernels' "
                      "temporaries are those last measured for the same chunk, or none",
                      site.name)
    key = (site.chain, site.steps, str(device), tracked)
    if key in _COSTS:
        return _COSTS[key]
    with real_tensors():
        rng_before = _rng_state(device)
        one = _chunk_bytes(_chunk_run(joint, site, 1), device, tracked) if long > 2 else None
        if one is not None and room is not None:
            if isinstance(room, FractionRoom):
                room = room.nbytes(site.steps, one)
            long = _longest_within(long, site.steps, one, room)
        lengths = (min(2, long - 1) if long > 1 else 1, long)
        if lengths[0] == 1:
            one = None  # one of the two lengths
        runs = [_chunk_run(joint, site, n) for n in lengths]                 # Step 1
        measured = [_chunk_bytes(run, device, tracked) for run in runs]     # Step 2
        n_params = len(_fwd_node(joint, site).args[_FWD_PARAMS])
        sliced = [_saved_sliced(run, n_params) for run in runs]
        xs_unsaved = _xs_unsaved(runs[-1])
        random = not _same_rng(rng_before, _rng_state(device))
        for values, times in zip(measured, _chunk_times(runs, device)):     # Step 3
            values.extend(times)
    short, long = measured
    replays = _ops()[0].spec_of(site.chain).preserve_rng                    # Step 4
    state_bytes = sum(s.untyped_storage().nbytes() for s in rng_before
                      if s is not None and s.device.type == device.type) if replays else 0
    lines = [Linear.through((lengths[0], a), (lengths[1], b)) for a, b in zip(short, long)]
    if one is not None:  # bytes: the lines raised to lie above the 1-step chunk's
        lines[:3] = [line.above(1, v) for line, v in zip(lines, one)]
    lines[3:] = [line.at_least_proportional(lengths[1], v) for line, v in zip(lines[3:], long[3:])]
    if len(_COSTS) >= _TRANSIENTS_KEPT:
        _COSTS.clear()
    _COSTS[key] = ChunkCosts(*lines,
                             rng_state_bytes=state_bytes, random=replays and random,
                             unsaved=sliced[-1][0], xs_unsaved=xs_unsaved,
                             sliced_saved=Linear.through((lengths[0], sliced[0][1]),
                                                         (lengths[1], sliced[1][1])))
    return _COSTS[key]


#: a chunk's bytes over what its 1-step measurement says per step, allowed for in
#: `_longest_within` (oneDNN's LSTM allocates in blocks: a 1-step chunk can say less per
#: step than a longer one holds)
_ROOM_MARGIN = 1.5


def _longest_within(longest: int, steps: int, one: list[int], room: int) -> int:
    """The longest chunk, up to `longest` steps, whose run fits in `room` bytes, priced at
    its steps times the 1-step chunk's saved bytes and larger transient (`one`), with
    `_ROOM_MARGIN`; a quarter of the chain's `steps` (2 at least) where none longer does,
    whatever the room: a budget far below reach (the probe for the minimum) measures
    what the minimum's own plan will, so the minimum it names is the one that plan
    accepts."""
    per_step = (one[0] + max(one[1], one[2])) * _ROOM_MARGIN
    fits = int(room // per_step) if per_step > 0 else longest
    return min(longest, max(2, steps // 4, fits))


def _rng_state(device: torch.device) -> tuple:
    """The RNG state the chain executor keeps before a chunk's first run (its
    ``_get_rng``): the CPU generator's, and the device's on CUDA."""
    cpu = torch.get_rng_state()
    return (cpu, torch.cuda.get_rng_state(device)) if device.type == "cuda" else (cpu, None)


def _same_rng(a: tuple, b: tuple) -> bool:
    return all((x is None) == (y is None) and (x is None or torch.equal(x, y))
               for x, y in zip(a, b))


#: Timed runs of each chunk while planning (after the untimed one); the fastest counts.
TIMED_RUNS = 3


@dataclass(frozen=True)
class _ChunkRun:
    """One chunk's forward under autograd and its backward to every input that needs
    it, inside a custom op's implementation (passes._torch_compat.autograd_inside_op).
    As in the executor (memopt.recurrent.executor.ChainRun._run), the input requires
    grad even where backward does not take its gradient (``x_grad`` False): the step
    then saves what that gradient would need (a dropout's noise on its input)."""

    step: object
    params: tuple[torch.Tensor, ...]
    state: tuple[torch.Tensor, ...]
    x: torch.Tensor | tuple[torch.Tensor, ...]
    x_grad: bool = True

    def forward(self):
        with autograd_inside_op():
            return self.step(self.params, self.state, self.x)

    @staticmethod
    def output_grads(y: torch.Tensor, out) -> list[torch.Tensor]:
        return [torch.zeros_like(t) for t in (y, *out) if t.requires_grad]

    def backward(self, y: torch.Tensor, out, grads: list[torch.Tensor]) -> None:
        outputs = [t for t in (y, *out) if t.requires_grad]
        xs = self.x if isinstance(self.x, tuple) else (self.x,)
        inputs = [t for t in (*self.state, *xs, *self.params)
                  if t.requires_grad and (t is not xs[0] or self.x_grad)]
        with autograd_inside_op():
            torch.autograd.grad(outputs, inputs, grads, allow_unused=True)


def _fwd_node(joint: fx.GraphModule, site: ChainSite) -> fx.Node:
    return next(n for n in joint.graph.nodes if n.name == site.fwd)


def _chunk_run(joint: fx.GraphModule, site: ChainSite, chunk: int) -> _ChunkRun:
    """A chunk of ``chunk`` steps on zeros of the real shapes (inside real_tensors)."""
    ops, _, _ = _ops()
    spec = ops.spec_of(site.chain)
    fake_state, fake_x, fake_params = _inputs(_fwd_node(joint, site), chunk, spec)

    def real(t: torch.Tensor, laid: bool = False) -> torch.Tensor:
        stride = _dense_stride(t) if laid else None
        made = torch.zeros(t.shape, dtype=t.dtype, device=t.device) if stride is None \
            else torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).zero_()
        return made.requires_grad_(t.is_floating_point())

    x = tuple(map(real, fake_x)) if isinstance(fake_x, tuple) else real(fake_x)
    return _ChunkRun(spec.step, tuple(real(p) for p in fake_params),
                     tuple(real(s, laid=True) for s in fake_state), x, site.x_grad)


def _dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s strides where they lay it out densely (a permutation of a contiguous
    layout), else None. A chain's state is measured in its own layout: a loop's state
    entering as a transposed view made each step copy it, which contiguous zeros did not
    measure (1.064x a 0.6 budget at every step, found from outside)."""
    expect = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), d)):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return None
        expect *= t.shape[d]
    return tuple(t.stride())


#: a chunk's measured transients, forward and backward, by what it runs (`_run_key`): a
#: chunk planned where allocations cannot be tracked takes them from here
_TRANSIENTS: dict[tuple, tuple[int, int]] = {}
#: A chain's costs by (its registered step, its length, the device, whether tracked),
#: measured once: a forward with graph breaks plans its graphs again as it ends, while its
#: tensors are live, and a chunk run there measured a hooked LSTM's first step at 2.4x
#: its budget (found from outside)
_COSTS: dict[tuple, ChunkCosts] = {}
_TRANSIENTS_KEPT = 512


def _run_key(run: _ChunkRun, device: torch.device) -> tuple:
    """What decides a chunk's transients: its step's code and every input's shape,
    layout and dtype, whether it takes the input's gradient, and the device."""
    step = run.step
    code = getattr(step, "code", None) or getattr(getattr(step, "func", step), "__qualname__",
                                                   type(step).__name__)
    xs = run.x if isinstance(run.x, tuple) else (run.x,)
    shapes = tuple((tuple(t.shape), t.stride(), t.dtype)
                   for t in (*run.params, *run.state, *xs))
    return code, shapes, run.x_grad, str(device)


def _chunk_bytes(run: _ChunkRun, device: torch.device, tracked: bool) -> list[int]:
    """[saved, forward transient, backward transient] bytes (see ChunkCosts); the
    parameters, the inputs and the output sequence are the graph's own and not counted
    in ``saved``. Where allocations cannot be tracked, the transients are the last ones
    measured for the same chunk (`_TRANSIENTS`; zero where none was): a seq2seq whose
    teacher forcing draws a new graph at each step planned each one inside the user's
    allocation_peak, its GRU's temporaries uncounted, and ran 1.12x its budget at every
    new pattern (found from outside, 2026-11-30)."""
    key = _run_key(run, device)
    with maybe_allocation_peak(device, tracked) as fwd:
        y, out = run.forward()
    if y.grad_fn is None:
        raise RuntimeError("memopt could not record autograd for a chain step while "
                           "planning; this is a memopt bug")
    # the output sequence is the chain's output (counted by liveness), not its state
    xs = run.x if isinstance(run.x, tuple) else (run.x,)
    resident = {storage_key(t) for t in (*xs, y, *run.params)}
    # a kept chunk holds its input and final states (the executor's _Internal), saved
    # by its graph or not
    seen = {storage_key(t): t.untyped_storage().nbytes() for t in (*run.state, *out)}
    for t in _saved_by_graph((y, *out)):
        if storage_key(t) not in resident:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    grads = run.output_grads(y, out)  # the backward op's inputs, not its allocations
    with maybe_allocation_peak(device, tracked) as bwd:
        run.backward(y, out, grads)
    if tracked:
        if len(_TRANSIENTS) >= _TRANSIENTS_KEPT:
            _TRANSIENTS.clear()
        _TRANSIENTS[key] = (fwd.peak - fwd.end, bwd.peak)
    return [sum(seen.values()), *_TRANSIENTS.get(key, (0, 0))]


def _saved_sliced(run: _ChunkRun, n_params: int) -> tuple[tuple[int, ...], int]:
    """(the param indices of the sliced per-step inputs whose storage no tensor the chunk's
    graph saves shares, the bytes of the chunks of those it saves): ChunkCosts.unsaved
    and sliced_saved."""
    if not isinstance(run.x, tuple):
        return (), 0
    y, out = run.forward()
    saved = {storage_key(t) for t in _saved_by_graph((y, *out))}
    first, unsaved, nbytes = n_params - (len(run.x) - 1), [], 0
    for k, part in enumerate(run.x[1:]):
        if storage_key(part) in saved:
            nbytes += part.untyped_storage().nbytes()
        elif part.is_floating_point():
            unsaved.append(first + k)
    return tuple(unsaved), nbytes


def _xs_unsaved(run: _ChunkRun) -> bool:
    """Whether no tensor the chunk's graph saves shares the storage of its floating xs."""
    x = run.x[0] if isinstance(run.x, tuple) else run.x
    if not x.is_floating_point() or x.numel() == 0:
        return False
    y, out = run.forward()
    return storage_key(x) not in {storage_key(t) for t in _saved_by_graph((y, *out))}


def _chunk_times(runs: list[_ChunkRun], device: torch.device) -> list[tuple[int, int]]:
    """(forward, backward) nanoseconds of each chunk: the fastest of TIMED_RUNS runs,
    the chunks interleaved so that a slow moment of the machine hits them alike."""
    best = [[1 << 62, 1 << 62] for _ in runs]
    for _ in range(TIMED_RUNS):
        for run, times in zip(runs, best):
            start = _clock(device)
            y, out = run.forward()
            forward = _clock(device) - start
            grads = run.output_grads(y, out)
            start = _clock(device)
            run.backward(y, out, grads)
            backward = _clock(device) - start
            times[0], times[1] = min(times[0], forward), min(times[1], backward)
    return [tuple(t) for t in best]


def _clock(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter_ns()


def _saved_by_graph(outputs) -> list[torch.Tensor]:
    """Every tensor the autograd graph behind ``outputs`` saved, read from its nodes'
    ``_saved_*`` attributes (saved-tensor hooks are off while AOTAutograd partitions)."""
    found, todo, visited = [], [o.grad_fn for o in outputs if o.grad_fn is not None], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        for attr in dir(fn):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, attr)
            except RuntimeError:  # already freed
                continue
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, torch.Tensor):
                    found.append(v)
        todo.extend(f for f, _ in fn.next_functions)
    return found
