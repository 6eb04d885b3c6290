"""The chain as two opaque operators in the captured graph: ``memopt::chain_fwd`` and
``memopt::chain_bwd``.

Dynamo and AOTAutograd see one forward op (outputs, final state, and a one-element
``handle`` tensor) and one backward op (reading the handle). What the policy stores
between them (hidden states, kept step graphs) lives in a side table keyed by the
handle, so the planner can change the policy after capture by rewriting the
node's arguments (chunk, m and strategy: ``"hsm"``, ``"ism"`` or
``"msm:ALPHA:BETA"``, see ``_policy``), and memopt's liveness analysis charges the
stored bytes to the handle's storage (``passes.chain_policy``). A handle that is never
backpropagated (no backward call) releases its entry when it is garbage collected.

A chain's step function is registered once per module (``register``); the ops
take its id. The chain's inputs ``xs`` are split along ``time_dim`` into chunks of
``chunk`` time steps, each chunk one step of the chain (Gruslys et al. 2016's RNN
core; one fast library call for nn.LSTM / nn.GRU / nn.RNN). A ``reverse`` chain (a
bidirectional RNN's reverse direction) takes its chunks from the end of ``xs``, the
remainder chunk last in time, and writes each chunk's output and input gradient back
at its place in time. A chain over a PackedSequence's rows (``ChainSpec.rows``) takes
each chunk's rows as its steps' batch sizes lay them out. A step that enters autocast
(``ChainSpec.autocast``) may return other dtypes than its inputs: the fake kernel finds
them by running it once.
"""

from __future__ import annotations

import contextlib
import sys
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from memopt.passes.meta import laid_like
from memopt.passes.runtime import RUNTIMES
from memopt.passes._torch_compat import own_fake_mode, real_tensors, rng_kept, storage_key
from memopt.allocator.gruslys import chunk_sizes, parse_strategy, solve, useful_m

from .executor import ChainRun, ChainStats, Step


@contextlib.contextmanager
def chunk_autocast(cast: tuple[str, torch.dtype]) -> Iterator[None]:
    """The autocast state a chunk's step enters (ChainSpec.autocast), its cast cache
    emptied as it leaves. autocast caches the cast of every leaf that needs grad until the
    outermost region exits, and each chunk's parameters are new leaves: in a loop whose
    backward runs inside the user's `torch.autocast` (its forward and backward in one
    `with`), the casts of every chunk run and recomputation stayed alive to the step's
    end (an nn.LSTM at a 0.4 budget under bf16: 1.17x the budget, found from outside).
    Emptied, the casts a chunk's graph saves live as long as it does. The compiled graph
    reads no cache (its casts are explicit ops); eager code in the user's region casts
    again."""
    with torch.autocast(cast[0], dtype=cast[1]):
        try:
            yield
        finally:
            torch.clear_autocast_cache()


@dataclass(frozen=True)
class ChainSpec:
    """What the ops need to know about one registered chain."""

    name: str                    # for plans: the module path or a description
    module_type: str
    step: Step                   # step(params, state, x_chunk) -> (y_chunk, new_state)
    time_dim: int
    #: output_like(state, xs) -> an empty tensor shaped like the chain's output
    output_like: Callable[[tuple[Tensor, ...], Tensor], Tensor]
    preserve_rng: bool = True
    #: True: the whole sequence must be one chunk
    unsplittable: bool = False
    #: True: the chain runs from the last time step to the first (the reverse direction
    #: of a bidirectional RNN): its first chunk is the end of ``xs``; the step gets each
    #: chunk in time order (and flips it itself)
    reverse: bool = False
    #: (device type, dtype) of the autocast state the step enters, or None: its outputs'
    #: dtypes are then found by running it once on one time step (``_outputs_like``)
    autocast: tuple[str, torch.dtype] | None = None
    #: False: a kept chunk holds only its output's gradient edge, not the output (the
    #: packed RNN step, whose graph does not save it; executor._Internal)
    keep_output: bool = True
    #: The time dim of each of the last ``len(sliced)`` params: per-step inputs each
    #: chunk reads a slice of, in place (a detected loop's ``dA[:, :, t]``; no packed
    #: copy). The step then gets ``(x_chunk, *their slices)`` as its x (``chunk_input``)
    sliced: tuple[int, ...] = ()
    #: True: ``xs`` are a PackedSequence's rows, (R, features), time-major in the packed
    #: order and zero past the batch's live rows (R: a capacity, memopt.recurrent.packed),
    #: and the last param is the (T, B) bool ``ended`` (sequence b has ended by step t).
    #: A chunk of steps [t0, t1) reads the rows those steps' batch sizes lay out (the last
    #: chunk also the zero rows after them) and the step gets ``(rows, ended[t0:t1])``
    #: (``chunk_input``): T is ``ended``'s length, not a dim of ``xs``.
    rows: bool = False

    def __post_init__(self) -> None:
        if self.sliced and self.reverse:
            raise ValueError("a reverse chain cannot slice per-step inputs from its params")
        if self.rows and (self.sliced or self.reverse or self.time_dim):
            raise ValueError("a chain over packed rows runs forward along dim 0, unsliced")


def steps_of(spec: ChainSpec, xs: Tensor, params: list[Tensor] | tuple[Tensor, ...]) -> int:
    """The chain's length T: its inputs' length along time, or ``ended``'s (``rows``)."""
    return params[-1].shape[0] if spec.rows else xs.shape[spec.time_dim]


def _row_counts(ended: Tensor) -> list[int] | None:
    """The live rows at each step (the packed batch sizes) from ``ended``; None on a
    FakeTensor (while planning: its values are unknown)."""
    if own_fake_mode([ended]) is not None:
        return None
    return (ended.shape[1] - ended.sum(1)).tolist()


def spans(spec: ChainSpec, xs: Tensor, params: list[Tensor] | tuple[Tensor, ...],
          bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, length) along ``xs``'s ``time_dim`` of each chunk of time ``bounds``: the
    bounds themselves, or for a chain over packed rows (``rows``) the rows the chunk's
    steps lay out, the last chunk to the end of ``xs``. Planning (FakeTensors) prices
    every sequence live at every step: B rows a step, the upper bound."""
    if not spec.rows:
        return bounds
    counts = _row_counts(params[-1])
    if counts is None:
        counts = [params[-1].shape[1]] * params[-1].shape[0]
    starts = list(itertools.accumulate(counts, initial=0))
    return [(starts[t], starts[t + n] - starts[t] if t + n < len(counts)
             else max(starts[-1], xs.shape[0]) - starts[t]) for t, n in bounds]


def chunk_input(spec: ChainSpec, xs: Tensor, params: list[Tensor] | tuple[Tensor, ...],
                start: int, n: int) -> tuple[Tensor | tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(x, params) a chunk of ``n`` steps from ``start`` runs its step on: the chunk of
    ``xs``, and with ``spec.sliced`` the tuple of it and the sliced params' chunks (views:
    nothing is copied), the other params as they are; with ``spec.rows``, ``(rows,
    ended[start:start + n])`` (``spans``) and the params before ``ended``."""
    if spec.rows:
        ended = params[-1]
        (first, count), = spans(spec, xs, params, [(start, n)])
        # planning prices B rows a step, more than a small capacity may hold
        x = xs.narrow(0, first, count) if first + count <= xs.shape[0] else \
            xs.new_zeros((count, *xs.shape[1:]))
        return (x, ended.narrow(0, start, n)), tuple(params[:-1])
    x = xs.narrow(spec.time_dim, start, n)
    if not spec.sliced:
        return x, tuple(params)
    k = len(params) - len(spec.sliced)
    parts = tuple(p.narrow(d, start, n) for p, d in zip(params[k:], spec.sliced))
    return (x, *parts), tuple(params[:k])


_SPECS: dict[int, ChainSpec] = {}
_IDS = itertools.count(1)
_STASH: dict[int, ChainRun] = {}
_HANDLES = itertools.count(1)
#: Filled by every chain execution, for tests and benchmarks: the last run's stats.
LAST_STATS: dict[int, ChainStats] = {}


def register(spec: ChainSpec) -> int:
    """Register a step function; returns the id the ops take."""
    key = next(_IDS)
    _SPECS[key] = spec
    return key


def spec_of(chain: int) -> ChainSpec:
    return _SPECS[chain]


def _policy(t: int, m: int, strategy: str):
    """The policy the ops run: ``strategy`` is ``"hsm"``, ``"ism"`` or ``"msm:ALPHA:BETA"``
    (memopt.allocator.gruslys.strategy_text), m capped where more stops helping."""
    name, alpha, beta = parse_strategy(strategy)
    return solve(t, useful_m(t, m, name, alpha), name, alpha, beta)


def _bounds(spec: ChainSpec, sizes: list[int]) -> list[tuple[int, int]]:
    """(start, length) along time of each chunk, in chain order, for chunks of
    ``sizes`` in chain order: from the start of ``xs``, or from its end (``reverse``)."""
    ends = list(itertools.accumulate(sizes))
    if not spec.reverse:
        return [(end - n, n) for end, n in zip(ends, sizes)]
    total = ends[-1] if ends else 0
    return [(total - end, n) for end, n in zip(ends, sizes)]


_DTYPES: dict[tuple, tuple[torch.dtype, ...]] = {}


def _step_on_zeros(spec: ChainSpec, state: list[Tensor], xs: Tensor, params: list[Tensor],
                   steps: int) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The chain's step run once on real zeros shaped as its first `steps` time steps
    (at most): what a fake kernel learns from (dtypes under autocast, layouts). The RNG
    state is left as it was: a step with dropout draws nothing eager's steps would."""
    def zeros(t: Tensor) -> Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)

    with real_tensors(), rng_kept(xs.device), torch.no_grad():
        x1, p1 = chunk_input(spec, xs, params, 0, min(steps, steps_of(spec, xs, params)))
        x1 = tuple(map(zeros, x1)) if isinstance(x1, tuple) else zeros(x1)
        return spec.step(tuple(map(zeros, p1)), tuple(zeros(s) for s in state), x1)


def _outputs_like(spec: ChainSpec, state: list[Tensor], xs: Tensor, params: list[Tensor]
                  ) -> tuple[Tensor, list[Tensor]]:
    """Empty tensors like the chain's output and final state. Without autocast they
    have the input's and the state's dtypes; under it, the ones the step gives, found by
    running it once on zeros of one time step (real tensors, cached)."""
    y = spec.output_like(tuple(state), xs)
    final = [torch.empty_like(s) for s in state]
    if spec.autocast is None:
        return y, final
    key = (id(spec), xs.device, xs.dtype, *(s.dtype for s in state),
           *(p.dtype for p in params))
    if key not in _DTYPES:
        y1, new = _step_on_zeros(spec, state, xs, params, 1)
        _DTYPES[key] = (y1.dtype, *(s.dtype for s in new))
    dtypes = _DTYPES[key]
    return y.to(dtypes[0]), [f.to(d) for f, d in zip(final, dtypes[1:])]


def _unaliased(outs: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    """``outs`` with a copy in place of each that shares storage with an input or an
    earlier output: a custom op may not return aliases, and a state carried through a
    step unchanged, or a gradient a step passes straight through, would be one."""
    seen = {storage_key(t) for t in inputs}
    fresh = []
    for t in outs:
        fresh.append(t.clone() if storage_key(t) in seen else t)
        seen.add(storage_key(fresh[-1]))
    return fresh


def _start(chain: int, chunk: int, m: int, strategy: str, state: list[Tensor], xs: Tensor,
           params: list[Tensor]) -> tuple[ChainRun, list[Tensor]]:
    spec = _SPECS[chain]
    td = spec.time_dim
    bounds = _bounds(spec, chunk_sizes(steps_of(spec, xs, params), chunk))
    split = [chunk_input(spec, xs, params, start, n) for start, n in bounds]
    places = spans(spec, xs, params, bounds)
    chunks = [x for x, _ in split]
    plain = split[0][1] if split else tuple(params)
    stats = ChainStats()
    LAST_STATS[chain] = stats
    run = ChainRun(spec.step, _policy(len(chunks), m, strategy), plain, chunks,
                   tuple(s.detach() for s in state), spec.preserve_rng, x_grad=True,
                   stats=stats, keep_output=spec.keep_output and len(chunks) > 1)
    # One chunk's output is the op's own output: the graph frees it where its plan says
    # (after `y + x * D` in a Mamba, which saves nothing of it), so the core holds only
    # its gradient edge (executor._Internal), not the tensor
    # One chunk: the output is the step's own (kept for backward anyway), not a copy.
    box: list[Tensor] = []

    def emit(i: int, y: Tensor) -> None:
        if len(chunks) == 1:
            box.append(y)
            return
        if not box:
            box.append(spec.output_like(tuple(state), xs))
            if box[0].dtype != y.dtype:  # the step's dtype (under autocast)
                shape = box.pop().shape
                box.append(torch.empty(shape, dtype=y.dtype, device=y.device))
        box[0].narrow(td, *places[i]).copy_(y)

    run.on_output = emit
    return run, box


def _time_length(spec: ChainSpec, x: Tensor | tuple[Tensor, ...]) -> int:
    if spec.rows:  # (rows, ended): the steps are ended's
        return x[1].shape[0]
    return (x[0] if isinstance(x, tuple) else x).shape[spec.time_dim]


@torch.library.custom_op("memopt::chain_fwd", mutates_args=())
def chain_fwd(chain: int, chunk: int, m: int, strategy: str, keep: bool,
              state: list[Tensor], xs: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Run the chain forward. Returns [outputs, *final_state, handle]. With ``keep``
    (a training graph) the policy's stores stay in the side table under the handle."""
    spec = _SPECS[chain]
    if not keep:  # inference: nothing is kept
        with torch.no_grad():
            x, plain = chunk_input(spec, xs, params, 0, steps_of(spec, xs, params))
            y, final = spec.step(plain, tuple(state), x)
        final = [laid_like(f, s) for f, s in zip(final, state)]
        handle = torch.zeros((), dtype=torch.int64)
        return _unaliased([y, *final], [*state, xs, *params]) + [handle]
    run, box = _start(chain, chunk, m, strategy, state, xs, params)
    _, final = run.forward_phase()
    final = [laid_like(f, s) for f, s in zip(final, state)]
    # chain_bwd hands the initial state back: kept here, it would outlive the forward
    # graph where the plan frees it and makes it again in backward (a zeros h_0)
    run.state0 = ()
    if spec.sliced:
        # the sliced inputs' chunks are not held between the phases: one chunk (the core)
        # is never recomputed (its graph holds what its ops saved of them; chain_bwd may
        # get stand-ins: passes.chain_policy.apply); a split chain's steps read copies of
        # their chunks, and chain_bwd hands the inputs back for the chunks it recomputes
        run.xs = [x[:1] for x in run.xs]
    elif len(run.xs) == 1:  # nor one chunk's xs, beyond what its graph saved (its shape)
        x = run.xs[0]
        rows = x[0] if spec.rows else x
        rows = torch.empty_strided(rows.shape, [0] * rows.dim(), dtype=rows.dtype,
                                   device=rows.device)
        run.xs = [(rows, *x[1:]) if spec.rows else rows]
    out = box[0]
    run.on_output = None  # it holds the output: the handle must not keep it alive
    key = next(_HANDLES)
    handle = torch.tensor(key, dtype=torch.int64)
    _STASH[key] = run
    weakref.finalize(handle, _STASH.pop, key, None)
    return _unaliased([out, *final], [*state, xs, *params]) + [handle]


#: the stride orders of a step's output and of its input's gradient (_step_orders)
_ORDERS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _step_orders(spec: ChainSpec, state: list[Tensor], xs: Tensor, params: list[Tensor]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stride orders (outermost first) of the step's output and of its input's
    gradient, which the ops return as they are where the chain runs as one chunk:
    nn.LSTM, GRU and RNN with batch_first=True give a time-major buffer transposed, for
    both (inductor checks an op's strides against its fake's: an LSTM with batch_first
    failed there). The output's is learned once on real zeros of two steps, the RNG state
    left as it was; the gradient's is taken to be the same where the output is not laid
    out in its own order (a fake kernel runs below autograd: no backward to learn it)."""
    key = (id(spec), xs.device, xs.dtype, *(s.dtype for s in state), *(p.dtype for p in params))
    if key not in _ORDERS:
        out, _ = _step_on_zeros(spec, state, xs, params, 2)
        order = tuple(sorted(range(out.dim()), key=lambda d: -out.stride(d)))
        _ORDERS[key] = (order, order)
    return _ORDERS[key]


def _laid_out(y: Tensor, order: tuple[int, ...]) -> Tensor:
    """An empty tensor of `y`'s shape with strides in `order` (outermost first)."""
    if len(order) != y.dim() or order == tuple(range(y.dim())):
        return y
    laid = y.new_empty([y.shape[d] for d in order])
    return laid.permute(*sorted(range(y.dim()), key=order.__getitem__))


def _step_laid(spec: ChainSpec, chunk: int, xs: Tensor, params: list[Tensor]) -> bool:
    """Whether an op returns the step's own tensors (one chunk of a time-major-or-not
    tensor input), whose layout its fake must give (_step_orders)."""
    return bool(spec.time_dim) and not spec.rows and not spec.sliced and isinstance(
        xs, Tensor) and len(_bounds(spec, chunk_sizes(steps_of(spec, xs, params), chunk))) == 1


@chain_fwd.register_fake
def _(chain, chunk, m, strategy, keep, state, xs, params):
    spec = _SPECS[chain]
    y, final = _outputs_like(spec, state, xs, params)
    if _step_laid(spec, chunk if keep else sys.maxsize, xs, params):  # the step's output
        y = _laid_out(y, _step_orders(spec, state, xs, params)[0])
    return [y, *final, torch.empty((), dtype=torch.int64)]


@torch.library.custom_op("memopt::chain_bwd", mutates_args=())
def chain_bwd(chain: int, chunk: int, m: int, strategy: str, need_x: bool, handle: Tensor,
              grad_ys: Tensor, grad_state: list[Tensor], state: list[Tensor], xs: Tensor,
              params: list[Tensor]) -> list[Tensor]:
    """Backpropagate the chain: [*grad_state, *grad_params] (+ [grad_xs] if need_x)."""
    spec = _SPECS[chain]
    run = _STASH.pop(int(handle), None)
    if run is None:  # nothing kept (a graph without keep): run the forward phase again
        run, _ = _start(chain, chunk, m, strategy, state, xs, params)
        run.forward_phase()
    run.x_grad = need_x
    run.state0 = tuple(s.detach() for s in state)
    if spec.sliced and len(run.xs) > 1:  # chain_fwd dropped them: from the inputs given here
        run.xs = [chunk_input(spec, xs, params, start, n)[0]
                  for start, n in _bounds(spec, [_time_length(spec, c) for c in run.xs])]
    grad_x: Tensor | None = None  # a whole-length chunk's gradient is taken as is
    n_plain = len(params) - len(spec.sliced) - spec.rows  # ``rows``: ended is the last
    # the sliced inputs' gradients, chunk by chunk: a whole-length chunk's is taken as is
    sliced: list[Tensor | None] = [None] * len(spec.sliced)
    bounds = _bounds(spec, [_time_length(spec, c) for c in run.xs])
    places = spans(spec, xs, params, bounds)
    if need_x or sliced:
        def put(i: int, g: Tensor | tuple | None) -> None:
            nonlocal grad_x
            g_x, g_parts = (g[0], g[1:]) if isinstance(g, tuple) else (g, ())
            if g_x is not None and need_x:
                if grad_x is None and g_x.shape == xs.shape:
                    grad_x = g_x
                else:
                    if grad_x is None:
                        grad_x = torch.zeros_like(xs)
                    grad_x.narrow(spec.time_dim, *places[i]).copy_(g_x)
            for k, (p, d, g_p) in enumerate(zip(params[n_plain:], spec.sliced, g_parts)):
                if g_p is None:
                    continue
                if g_p.shape == p.shape and sliced[k] is None:
                    sliced[k] = g_p
                    continue
                if sliced[k] is None:
                    sliced[k] = torch.zeros_like(p)
                sliced[k].narrow(d, *bounds[i]).copy_(g_p)

        run.on_grad_x = put
    g_chunks = [grad_ys.narrow(spec.time_dim, *b) for b in places]
    g_state, _, g_params = run.backward_phase(g_chunks, tuple(grad_state))
    pairs = [*zip(g_state, state), *zip(g_params, params[:n_plain]),
             *zip(sliced, params[n_plain:])]
    grads = [torch.zeros_like(r) if g is None else laid_like(g, r) for g, r in pairs]
    if spec.rows:
        grads.append(torch.zeros_like(params[-1]))
    if need_x and grad_x is None:
        grad_x = torch.zeros_like(xs)
    elif need_x and not _step_laid(spec, chunk, xs, params):  # else laid as the step's
        grad_x = laid_like(grad_x, xs)
    return _unaliased(grads + ([grad_x] if need_x else []),
                      [handle, grad_ys, *grad_state, *state, xs, *params])


@chain_bwd.register_fake
def _(chain, chunk, m, strategy, need_x, handle, grad_ys, grad_state, state, xs, params):
    grads = [torch.empty_like(s) for s in state] + [torch.empty_like(p) for p in params]
    if need_x:
        spec = _SPECS[chain]
        grad_x = torch.empty_like(xs)
        if _step_laid(spec, chunk, xs, params):  # a whole-length chunk's, taken as is
            grad_x = _laid_out(grad_x, _step_orders(spec, state, xs, params)[1])
        grads.append(grad_x)
    return grads


def _setup_context(ctx, inputs, output) -> None:
    chain, chunk, m, strategy, keep, state, xs, params = inputs
    ctx.args = (chain, chunk, m, strategy)
    ctx.n = (len(state), len(params))
    ctx.save_for_backward(*state, xs, *params, output[-1])


def _backward(ctx, grads):
    n_state, n_params = ctx.n
    saved = ctx.saved_tensors
    state, xs, params, handle = (list(saved[:n_state]), saved[n_state],
                                 list(saved[n_state + 1:n_state + 1 + n_params]), saved[-1])
    if grads[0] is None or any(g is None for g in grads[1:1 + n_state]):
        y, final = _outputs_like(_SPECS[ctx.args[0]], state, xs, params)
        grads = [torch.zeros_like(y) if grads[0] is None else grads[0],
                 *(torch.zeros_like(f) if g is None else g
                   for g, f in zip(grads[1:1 + n_state], final))]
        del y, final
    grad_ys, grad_state = grads[0], list(grads[1:1 + n_state])
    need_x = bool(ctx.needs_input_grad[6])
    out = torch.ops.memopt.chain_bwd(*ctx.args, need_x, handle, grad_ys, grad_state, state, xs,
                                     params)
    g_state, g_params = out[:n_state], out[n_state:n_state + n_params]
    g_xs = out[-1] if need_x else None
    return None, None, None, None, None, list(g_state), g_xs, list(g_params)


chain_fwd.register_autograd(_backward, setup_context=_setup_context)


# passes.chain_policy / passes.reversible_stacks reach this runtime through the registry (imports run
# one way: memopt -> passes -> allocator)
RUNTIMES.chains = sys.modules[__name__]
