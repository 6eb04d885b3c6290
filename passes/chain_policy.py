"""Recurrent chains in the joint graph: find them, price their policies, apply one.

A chain is a ``memopt::chain_fwd`` node (an nn.LSTM / nn.GRU / nn.RNN or a marked
cell loop, see memopt.recurrent.modules) and the ``memopt::chain_bwd`` node(s)
reading its handle. Its policy has three knobs the planner chooses after capture:
the chunk length L (t = ceil(T / L) chunks form the chain; each chunk is one call
of the step; the first chunk takes the remainder, so the last one, the core that is
never recomputed, is full), the strategy of Gruslys et al. 2016 (BPTT-HSM, Sec. 3.1:
store hidden states; BPTT-ISM, Sec. 3.2: store chunks' internal states, whose backward
then needs no recomputation; BPTT-MSM, Sec. 3.3-3.4: either) and its m (HSM: hidden-
state slots; ISM: internal-state slots, the core's included; MSM: hidden-state units,
an internal state costing alpha = ceil(I(L) / H) of them, or beta = ceil((I(L) - H) / H)
when its input state is stored already, from the chunk's measured bytes). Nothing else
in the graph changes with them, only what the chain holds between its forward and
backward ops and what its backward op allocates. The planner (memopt.planner) prices
a grid of (L, strategy, m) (``configurations``), then bisects L where HSM keeps every
chunk boundary (``longest_fitting_chunk``): there the recomputed steps are exactly
T - L and the calls 3t - 1, so the longest chunk that fits is the fastest. It takes
the fitting policy of least estimated time: each chunk's forward runs (Gruslys et al.
2016's C(t, m) in all, a stored internal state's first run included) and its backward,
at the per-call and per-step costs measured on a real chunk (ChunkCosts).

Requires: FakeTensors on the joint graph. Ensures: ``apply`` rewrites the two
ops' policy arguments (chunk, m, strategy: memopt.allocator.gruslys.strategy_text) and
records the bytes (passes.meta.HELD_BYTES on the forward op's handle, WORKSPACE_BYTES
on the backward op) that liveness charges.

Memory model of one configuration of chunks of L steps (H: the state's bytes; P: the
step's parameters; I(L), F(L), B(L): a chunk's saved bytes (its graph's saved tensors,
its input and final states), its forward's and its backward's transients, measured on
real tensors at two lengths, see ChunkCosts; Y(L): a chunk's output when the chain is
split, else 0; an upper bound for the packed RNN step, whose kept chunks hold only their
output's gradient edge: ChainSpec.keep_output). S(a) is the bytes the policy's stores hold after action a of its
schedule, walked with the real sizes (``_stored_bytes``): H a stored hidden state,
I(L) + Y(L) a stored internal state (a chunk's graph and its output), H less where its
input state is held anyway (h_0, a stored hidden state, the previous chunk's stored
internal state); an internal state backpropagated as soon as it is stored is the core's.
    held         = S(end of the forward phase) + I(L) + Y(L) (the last chunk's graph and
                   output, kept for backward: the core)
    forward op   = F(L) + Y(L) (a chunk's kernel temporaries, and a chunk's output
                   before it is copied into the chain's output)
    backward op  = max S - S(end of the forward phase) (what backward stores beyond
                   that: hidden states, and ISM's and MSM's internal states) + B(L) (a
                   chunk's backward, its parameter and input gradients included), or
                   F(L) when split and that is larger (a chunk recomputed with
                   autograd). Beside them live the op's inputs and outputs, which
                   liveness charges at the op: the gradient carried into a chunk (H) is
                   the op's input for the core and, for the others, the size of its
                   output state gradient (made only by the first chunk's backward); the
                   running sum of the parameter gradients (P) is the size of its output
                   parameter gradients (the last sum is them). One chunk graph is live
                   in the core at a time: a recomputed chunk's I(L) + Y(L) takes the
                   place of the core's, freed after its backward, which ``held`` counts
                   until the op ends
    RNG states   = where the chain replays random ops (ChainSpec.preserve_rng), the
                   executor keeps the RNG state before each chunk's first run, one per
                   chunk when a chunk draws random numbers, else one shared by all:
                   R x (t or 1) more held, and R more in the backward op (the caller's
                   state, restored when it ends); R is 5056 bytes on CPU, 0 on CUDA (the
                   states are host tensors). See ChunkCosts.rng_bytes
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import fx

from ._torch_compat import autograd_inside_op, detect_fake_mode, real_tensors, storage_key
from .allocated import can_track, maybe_allocation_peak
from .runtime import runtime
from memopt.allocator.gruslys import Policy, chunk_sizes, solve, strategy_text, useful_m

from .meta import KEPT_ARGS, OpBytes, fake_value, handle_readers, record_op_bytes

log = logging.getLogger("memopt")

#: Positions of the ops' arguments (memopt.recurrent.ops schemas).
_CHAIN, _CHUNK, _M, _STRATEGY = 0, 1, 2, 3
_FWD_STATE, _FWD_XS, _FWD_PARAMS = 5, 6, 7
_BWD_NEED_X, _BWD_HANDLE = 4, 5


def _ops():
    return runtime("chains"), torch.ops.memopt.chain_fwd.default, \
        torch.ops.memopt.chain_bwd.default


@dataclass(frozen=True)
class ChainSite:
    """One chain of the joint graph."""

    fwd: str                   # the chain_fwd node's name
    bwds: tuple[str, ...]      # the chain_bwd nodes reading its handle
    chain: int                 # the registered step's id
    name: str                  # the user's module path
    module_type: str
    steps: int                 # T: time steps of the sequence
    hidden_bytes: int          # H: the state carried between steps
    step_flops: int            # forward FLOPs of one time step (0 when not countable)
    output_bytes_per_step: int
    param_bytes: int           # the step's parameters (their gradients are summed per chunk)
    unsplittable: bool
    x_grad: bool = True        # whether backward computes the inputs' gradient
    #: where the forward op returns its handle, which holds what the op keeps for backward
    #: (its last output; -1 for a site made by hand)
    handle: int = -1
    #: bytes of the floating per-step inputs the chain slices from its params
    #: (ChainSpec.sliced): one chunk's backward returns their gradients as it makes them
    sliced_bytes: int = 0


@dataclass(frozen=True)
class ChainConfig:
    """One (chunk length, strategy, m) choice for a chain, with its policy (its strategy,
    and MSM's alpha and beta) and bytes."""

    chunk: int
    t: int
    m: int
    policy: Policy
    internal_bytes: int
    held_bytes: int
    forward_workspace_bytes: int
    workspace_bytes: int       # the backward op's
    recompute_steps: int       # time steps run again in backward, over all chunks
    seconds: float             # estimated time of the chain's forward and backward
    #: the params (by index) the backward op gets a stand-in for (``apply``): sliced
    #: per-step inputs one chunk neither saves nor recomputes from (ChunkCosts.unsaved)
    stand_ins: tuple[int, ...] = ()
    #: False: the graph is not told (meta KEPT_ARGS) that one chunk's graph holds the sliced
    #: inputs it saves views of, so the step model made on it counts their recomputation
    #: as possible (a split chain's choice allows it); ChainFamily.choose says it again
    #: where one chunk stays
    holds_sliced: bool = True


def find_chains(joint: fx.GraphModule) -> list[ChainSite]:
    """Every chain_fwd node and its backward nodes (none in an inference graph)."""
    ops, fwd_op, bwd_op = _ops()
    nodes = list(joint.graph.nodes)
    sites = []
    for node in nodes:
        if node.target is not fwd_op:
            continue
        bwd_nodes = handle_readers(nodes, node, bwd_op, _BWD_HANDLE)
        spec = ops.spec_of(node.args[_CHAIN])
        xs = fake_value(node.args[_FWD_XS])
        state = [fake_value(s) for s in node.args[_FWD_STATE]]
        steps = int(xs.shape[spec.time_dim])
        sites.append(ChainSite(
            fwd=node.name, bwds=tuple(n.name for n in bwd_nodes), chain=node.args[_CHAIN],
            name=spec.name, x_grad=any(n.args[_BWD_NEED_X] for n in bwd_nodes),
            module_type=spec.module_type, steps=steps, handle=len(fake_value(node)) - 1,
            hidden_bytes=sum(s.untyped_storage().nbytes() for s in state),
            step_flops=_step_flops(node, spec), unsplittable=spec.unsplittable,
            output_bytes_per_step=fake_value(node)[0].untyped_storage().nbytes() // max(1, steps),
            param_bytes=sum(fake_value(p).untyped_storage().nbytes()
                            for p in node.args[_FWD_PARAMS]),
            sliced_bytes=sum(fake_value(p).nbytes for p in _sliced(node, spec)
                             if fake_value(p).is_floating_point()),
        ))
    return sites


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
    x, params = _ops()[0].chunk_input(spec, xs, params, 0, min(chunk, xs.shape[spec.time_dim]))
    return state, x, params


def _fake_mode(node: fx.Node):

    return detect_fake_mode([fake_value(node.args[_FWD_XS])])


def _step_flops(node: fx.Node, spec) -> int:
    """Forward FLOPs of one time step, counted on FakeTensors."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415

    state, x, params = _inputs(node, 1, spec)
    try:
        with _fake_mode(node), torch.no_grad(), FlopCounterMode(display=False) as counter:
            spec.step(params, state, x)
        return int(counter.get_total_flops())
    except Exception:  # an op without a FLOP formula or meta kernel: unknown cost
        return 0


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


def chunk_costs(joint: fx.GraphModule, site: ChainSite) -> ChunkCosts:
    """Measured at two chunk lengths, 2 and 16 steps (fewer when T is shorter), on zeros
    of the real shapes on the real device; long chunks are not run (on FakeTensors the
    fused RNN op decomposes into per-step ops: slow to trace, and the wrong bytes).

    Step 1: a chunk of each length, its inputs zeros of the real shapes.
    Step 2: bytes: each chunk run once, forward then backward, under allocation
        tracking; the saved bytes read from the autograd graph between them. Where
        allocations cannot be tracked (another profiler is recording on CPU) the
        transients are taken as zero, and a warning says the plan may undercount.
    Step 3: time: both chunks run TIMED_RUNS more times, interleaved; the fastest
        forward and backward of each count (the first runs were the warm-up).
    Step 4: RNG states: where the chain replays random ops, the bytes of one state on
        the device, and whether the runs of Step 2 moved the state (a chunk draws)."""
    long = min(16, site.steps)
    lengths = (min(2, long - 1) if long > 1 else 1, long)
    device = fake_value(_fwd_node(joint, site).args[_FWD_XS]).device
    tracked = can_track(device)
    if not tracked:
        log.warning("memopt: cannot track allocations while planning chain %s (a profiler "
                    "is recording); its kernels' temporaries are not counted", site.name)
    with real_tensors():
        runs = [_chunk_run(joint, site, n) for n in lengths]                 # Step 1
        rng_before = _rng_state(device)
        measured = [_chunk_bytes(run, device, tracked) for run in runs]     # Step 2
        n_params = len(_fwd_node(joint, site).args[_FWD_PARAMS])
        sliced = [_saved_sliced(run, n_params) for run in runs]
        random = not _same_rng(rng_before, _rng_state(device))
        for values, times in zip(measured, _chunk_times(runs, device)):     # Step 3
            values.extend(times)
    short, long = measured
    replays = _ops()[0].spec_of(site.chain).preserve_rng                    # Step 4
    state_bytes = sum(s.untyped_storage().nbytes() for s in rng_before
                      if s is not None and s.device.type == device.type) if replays else 0
    return ChunkCosts(*(Linear.through((lengths[0], a), (lengths[1], b))
                        for a, b in zip(short, long)),
                      rng_state_bytes=state_bytes, random=replays and random,
                      unsaved=sliced[-1][0],
                      sliced_saved=Linear.through((lengths[0], sliced[0][1]),
                                                  (lengths[1], sliced[1][1])))


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

    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device).requires_grad_(
            t.is_floating_point())

    x = tuple(map(real, fake_x)) if isinstance(fake_x, tuple) else real(fake_x)
    return _ChunkRun(spec.step, tuple(real(p) for p in fake_params),
                     tuple(real(s) for s in fake_state), x, site.x_grad)


def _chunk_bytes(run: _ChunkRun, device: torch.device, tracked: bool) -> list[int]:
    """[saved, forward transient, backward transient] bytes (see ChunkCosts); the
    parameters, the inputs and the output sequence are the graph's own and not counted
    in ``saved``."""
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
    return [sum(seen.values()), fwd.peak - fwd.end, bwd.peak]


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


def _runs(policy: Policy) -> list[int]:
    """How many times the policy runs each chain step forward (first pass included):
    each ``advance`` and ``store_internal`` runs its steps, and a ``backward`` of a
    step with no stored internal state runs it once more (Gruslys et al. 2016, Sec. 3.1)."""
    runs = [0] * policy.t
    stored: set[int] = set()
    for op, i, j in policy.schedule:
        if op == "advance":
            for k in range(i, j):
                runs[k] += 1
        elif op == "store_internal":
            runs[i] += 1
            stored.add(i)
        elif op == "backward":
            if i in stored:
                stored.discard(i)
            else:
                runs[i] += 1
    return runs


@dataclass(frozen=True)
class _Stored:
    """The bytes a policy's stores hold (the core excluded), see ``_stored_bytes``."""

    at_backward: int  # when the forward phase ends
    peak: int         # the most at once, over the whole schedule


def _stored_bytes(policy: Policy, hidden: int, internal: int) -> _Stored:
    """Walk the schedule as memopt.recurrent.executor.ChainRun keeps tensors: a stored
    hidden state holds ``hidden`` bytes (H); a stored internal state (a chunk's graph
    with its input and output states, and its output when split: I(L)) holds
    ``internal``, or ``internal - hidden`` where its input state is held anyway (h_0, a
    stored hidden state, or the previous chunk's stored internal state, whose output it
    is: Gruslys et al. 2016's beta, eq. 10). An internal state stored and backpropagated
    at once is the core's (its own slot, counted by the caller)."""
    sched = policy.schedule
    hidden_at: set[int] = set()
    internal_at: dict[int, int] = {}
    live = peak = 0
    at_backward = None
    for n, (op, i, _) in enumerate(sched):
        if op == "store_hidden":
            hidden_at.add(i)
            live += hidden
        elif op == "free":
            hidden_at.discard(i)
            live -= hidden
        elif op == "store_internal" and sched[n + 1:n + 2] != (("backward", i, i + 1),):
            held = i == 0 or i in hidden_at or i - 1 in internal_at
            internal_at[i] = max(0, internal - hidden) if held else internal
            live += internal_at[i]
        elif op == "backward":
            if at_backward is None:
                at_backward = live
            live -= internal_at.pop(i, 0)
        peak = max(peak, live)
    return _Stored(at_backward or 0, peak)


def _m_values(top: int, ratio: float = math.sqrt(2)) -> list[int]:
    """m = 1, then on a geometric grid of ``ratio`` (sqrt 2: 1, 2, 3, 4, 6, 8, 11, 16,
    ...) up to ``top``, ``top`` included."""
    values, m = {1, top}, 1.0
    while m < top:
        values.add(int(m))
        m *= ratio
    return sorted(v for v in values if 1 <= v <= top)


def msm_units(hidden: int, internal: int) -> tuple[int, int]:
    """(alpha, beta) of BPTT-MSM (Gruslys et al. 2016, Sec. 3.3-3.4) from a chunk's real
    sizes, as the paper's Fig. 6 does: alpha = ceil(I / H), a stored internal state in
    hidden-state units (I counts its input state), at least 2; beta = ceil((I - H) / H),
    one whose input state is stored already (eq. 10), in [1, alpha]."""
    hidden = max(1, hidden)
    alpha = max(2, -(-internal // hidden))
    beta = min(alpha, max(1, -(-(internal - hidden) // hidden)))
    return alpha, beta


def configure(site: ChainSite, costs: ChunkCosts, chunk: int, m: int,
              strategy: str = "hsm") -> ChainConfig:
    """The Gruslys et al. 2016 policy for chunks of ``chunk`` steps: ``strategy`` "hsm"
    (m hidden-state slots, h_0 included), "ism" (m internal-state slots, the core
    included) or "msm" (m hidden-state units; alpha and beta from the chunk's bytes,
    ``msm_units``), m capped where more stops helping (``useful_m``), with its bytes
    (see the module docstring's memory model)."""
    chunk = max(1, min(chunk, site.steps))
    t = math.ceil(site.steps / chunk)
    H, split = site.hidden_bytes, t > 1
    out = site.output_bytes_per_step * chunk if split else 0
    # a split chain keeps its last chunk's output inside the core, beside the copy in
    # the chain's output (one chunk: the output is the core's own)
    kept = costs.saved(chunk) + out + (costs.sliced_saved(chunk) if split else 0)
    alpha, beta = msm_units(H, kept) if strategy == "msm" else (None, None)
    m = useful_m(t, m, strategy, alpha)
    policy = solve(t, m, strategy, alpha, beta)
    stored = _stored_bytes(policy, H, kept)
    sizes, runs = chunk_sizes(site.steps, chunk), _runs(policy)
    return ChainConfig(
        chunk=chunk, t=t, m=m, policy=policy, internal_bytes=kept,
        recompute_steps=sum((n - 1) * size for n, size in zip(runs, sizes)),
        seconds=costs.seconds(runs, sizes),
        held_bytes=stored.at_backward + kept + costs.rng_bytes(t),
        # a split chain's step copies its chunk of each sliced input (executor._Sliced)
        forward_workspace_bytes=costs.forward(chunk) + out
        + (site.sliced_bytes * chunk // site.steps if split else 0),
        # one chunk's sliced-input gradients are the op's outputs, which liveness counts
        workspace_bytes=stored.peak - stored.at_backward + costs.rng_state_bytes
        + max(costs.backward(chunk) - (0 if split else site.sliced_bytes),
              costs.forward(chunk) if split else 0),
    )


#: BPTT-MSM's table for t chunks has a column for every m up to the largest priced; its
#: grid stops where t x m would pass this many entries (about 0.5 s of the DP each).
MSM_TABLE_ENTRIES = 200_000


def _grid(site: ChainSite, costs: ChunkCosts, chunk: int) -> list[ChainConfig]:
    """One chunk length's policies: HSM with m on a sqrt 2 grid up to t, then ISM
    (m up to t) on a grid of 2, and MSM with m - beta on a grid of 4, m up to alpha t
    (or MSM_TABLE_ENTRIES / t)."""
    t = math.ceil(site.steps / chunk)
    configs = [configure(site, costs, chunk, m) for m in _m_values(t)]
    if t == 1:  # one chunk: nothing to store, every strategy is the same
        return configs
    configs += [configure(site, costs, chunk, m, "ism") for m in _m_values(t, 2)]
    split = site.output_bytes_per_step * chunk
    alpha, beta = msm_units(site.hidden_bytes, costs.saved(chunk) + split)
    top = min(alpha * t, max(alpha + 1, MSM_TABLE_ENTRIES // t))
    # m <= beta stores no internal state but the core (HSM's policy, priced above): the
    # grid is of the units beyond beta
    return configs + [configure(site, costs, chunk, beta + v, "msm")
                      for v in _m_values(top - beta, 4)] if top > beta else configs


def configurations(site: ChainSite, costs: ChunkCosts) -> list[ChainConfig]:
    """The policies the planner prices first, t = 1 first (one chunk, nothing
    recomputed: eager's memory), then, unless the chain cannot be split (a
    bidirectional RNN), t = 2, 3, ..., 8 and 16, 32, ... chunks up to T, each with
    BPTT-HSM, ISM and MSM on grids of m (``_grid``). ``longest_fitting_chunk`` then
    refines between them."""
    if site.unsplittable:
        return [configure(site, costs, site.steps, 1)]
    chunks = sorted({math.ceil(site.steps / t) for t in range(1, min(8, site.steps) + 1)} | {
        math.ceil(site.steps / (1 << k)) for k in range(4, site.steps.bit_length())},
        reverse=True)
    return [c for chunk in chunks for c in _grid(site, costs, chunk)]


def longest_fitting_chunk(site: ChainSite, costs: ChunkCosts, fits, lo: int, hi: int
                          ) -> ChainConfig | None:
    """With every chunk-boundary state kept (m = t: each chunk recomputed once, T - L
    steps in all for chunks of L), the longest chunk L in [lo, hi) whose policy
    ``fits(config)``, by bisection: a longer chunk holds more, so fitting is monotone
    in L. ``lo`` must fit; None if nothing in (lo, hi) does."""
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        config = configure(site, costs, mid, site.steps)
        if fits(config):
            lo, best = mid, config
        else:
            hi = mid
    return best


def op_bytes(site: ChainSite, config: ChainConfig) -> dict[str, OpBytes]:
    """What ``config`` makes the site's ops hold and allocate, by node name: the handle
    (the forward op's last output) holds the stored states."""
    return {site.fwd: OpBytes(((site.handle, config.held_bytes),),
                              config.forward_workspace_bytes),
            **{b: OpBytes((), config.workspace_bytes) for b in site.bwds}}


def apply(graphs: list[fx.GraphModule], site: ChainSite, config: ChainConfig) -> None:
    """Rewrite the site's ops in ``graphs`` (the joint graph, or a partition's forward
    and backward) to run ``config``, and record its bytes for liveness (op_bytes)."""
    _, fwd_op, bwd_op = _ops()
    nbytes = op_bytes(site, config)
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target is fwd_op and node.name == site.fwd:
                _set_policy_args(node, config)
                record_op_bytes(node, nbytes[node.name])
                # the core's graph reads its chunk of xs; one chunk's graph holds the
                # sliced per-step inputs it saves views of (a split chain's, copies)
                n_params = len(node.args[_FWD_PARAMS])
                sliced = range(n_params - len(_ops()[0].spec_of(site.chain).sliced), n_params)
                node.meta[KEPT_ARGS] = (_FWD_XS, *((_FWD_PARAMS, k) for k in sliced
                                                   if config.t == 1 and config.holds_sliced
                                                   and k not in config.stand_ins))
            elif node.target is bwd_op and node.name in site.bwds:
                _set_policy_args(node, config)
                record_op_bytes(node, nbytes[node.name])
                _stand_in(gm.graph, node, config.stand_ins)


#: chain_bwd's params argument, and the meta key of the params it had before stand-ins
_BWD_PARAMS, _ORIGINAL_PARAMS = 10, "memopt.chain_params"


def _stand_in(graph: fx.Graph, node: fx.Node, which: tuple[int, ...]) -> None:
    """Give the backward op ``node`` a stand-in for each param in ``which``: a tensor of
    its shape, dtype and device with every stride 0 (one element), so that liveness and the
    partitioner do not keep the real one for backward; the others as they were. The op
    reads a stand-in's shape only (memopt.recurrent.ops.chain_bwd: a chunk that is never
    recomputed). Done before the joint graph is partitioned (ChainFamily.initial); an
    ``apply`` without stand-ins puts the real params back."""
    params = list(node.args[_BWD_PARAMS])
    original = node.meta.setdefault(_ORIGINAL_PARAMS, list(params))
    wanted = []
    for k, real in enumerate(original):
        if k not in which:
            wanted.append(real)
            continue
        if params[k] is not real:  # a stand-in already
            wanted.append(params[k])
            continue
        value = fake_value(real)
        with graph.inserting_before(node), _fake_mode(node):
            stand = graph.call_function(torch.ops.aten.empty_strided.default, (
                list(value.shape), [0] * value.dim()),
                {"dtype": value.dtype, "device": value.device})
            stand.meta["val"] = torch.empty_strided(value.shape, [0] * value.dim(),
                                                    dtype=value.dtype, device=value.device)
        for key in ("partitioner_tag", "seq_nr", "stack_trace"):
            if key in node.meta:
                stand.meta[key] = node.meta[key]
        wanted.append(stand)
    if wanted == params:
        return
    args = list(node.args)
    args[_BWD_PARAMS] = wanted
    node.args = tuple(args)
    for old in params:
        if old not in wanted and old.op == "call_function" and not old.users \
                and old.target is torch.ops.aten.empty_strided.default:
            graph.erase_node(old)


def _set_policy_args(node: fx.Node, config: ChainConfig) -> None:
    args = list(node.args)
    p = config.policy
    args[_CHUNK], args[_M] = config.chunk, config.m
    args[_STRATEGY] = strategy_text(p.strategy, p.alpha, p.beta)
    node.args = tuple(args)
