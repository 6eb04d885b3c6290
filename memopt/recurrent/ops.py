"""The chain as two opaque operators in the captured graph: ``memopt::chain_fwd`` and
``memopt::chain_bwd``.

Dynamo and AOTAutograd see one forward op (outputs, final state, and a one-element
``handle`` tensor) and one backward op (reading the handle). What the policy stores
between them (hidden states, kept step graphs) lives in a side table keyed by the
handle, so the planner can change the policy (chunk length, m) after capture by
rewriting the node's integer arguments, and memopt's liveness analysis charges the
stored bytes to the handle's storage (``passes.chains``). A handle that is never
backpropagated (no backward call) releases its entry when it is garbage collected.

A chain's step function is registered once per module (``register``); the ops
take its id. The chain's inputs ``xs`` are split along ``time_dim`` into chunks of
``chunk`` time steps, each chunk one step of the chain (Gruslys et al. 2016's RNN
core; one fast library call for nn.LSTM / nn.GRU / nn.RNN).
"""

from __future__ import annotations

import sys
import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from memopt.passes.runtime import RUNTIMES
from memopt.passes._torch_compat import storage_key
from memopt.allocator.chain import chunk_sizes, solve

from .executor import ChainRun, ChainStats, Step


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
    #: True: the whole sequence must be one chunk (a bidirectional RNN)
    unsplittable: bool = False


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
    return solve(t, max(1, min(m, t)), strategy)


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
    chunks = list(xs.split(chunk_sizes(xs.shape[spec.time_dim], chunk), dim=spec.time_dim))
    stats = ChainStats()
    LAST_STATS[chain] = stats
    run = ChainRun(spec.step, _policy(len(chunks), m, strategy), tuple(params), chunks,
                   tuple(s.detach() for s in state), spec.preserve_rng, x_grad=True,
                   stats=stats)
    offsets = list(itertools.accumulate([0] + [c.shape[spec.time_dim] for c in chunks]))
    # One chunk: the output is the step's own (kept for backward anyway), not a copy.
    box: list[Tensor] = [] if len(chunks) == 1 else [spec.output_like(tuple(state), xs)]

    def emit(i: int, y: Tensor) -> None:
        if len(chunks) == 1:
            box.append(y)
        else:
            box[0].narrow(spec.time_dim, offsets[i], offsets[i + 1] - offsets[i]).copy_(y)

    run.on_output = emit
    return run, box


@torch.library.custom_op("memopt::chain_fwd", mutates_args=())
def chain_fwd(chain: int, chunk: int, m: int, strategy: str, keep: bool,
              state: list[Tensor], xs: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Run the chain forward. Returns [outputs, *final_state, handle]. With ``keep``
    (a training graph) the policy's stores stay in the side table under the handle."""
    spec = _SPECS[chain]
    if not keep:  # inference: nothing is kept
        with torch.no_grad():
            y, final = spec.step(tuple(params), tuple(state), xs)
        handle = torch.zeros((), dtype=torch.int64)
        return _unaliased([y, *final], [*state, xs, *params]) + [handle]
    run, box = _start(chain, chunk, m, strategy, state, xs, params)
    _, final = run.forward_phase()
    # chain_bwd hands the initial state back: kept here, it would outlive the forward
    # graph where the plan frees it and makes it again in backward (a zeros h_0)
    run.state0 = ()
    out = box[0]
    run.on_output = None  # it holds the output: the handle must not keep it alive
    key = next(_HANDLES)
    handle = torch.tensor(key, dtype=torch.int64)
    _STASH[key] = run
    weakref.finalize(handle, _STASH.pop, key, None)
    return _unaliased([out, *final], [*state, xs, *params]) + [handle]


@chain_fwd.register_fake
def _(chain, chunk, m, strategy, keep, state, xs, params):
    spec = _SPECS[chain]
    return [spec.output_like(tuple(state), xs), *(torch.empty_like(s) for s in state),
            torch.empty((), dtype=torch.int64)]


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
    grad_x = torch.zeros_like(xs) if need_x else None
    if need_x:
        offsets = list(itertools.accumulate([0] + [c.shape[spec.time_dim] for c in run.xs]))

        def put(i: int, g: Tensor | None) -> None:
            if g is not None:
                grad_x.narrow(spec.time_dim, offsets[i], offsets[i + 1] - offsets[i]).copy_(g)

        run.on_grad_x = put
    g_chunks = list(grad_ys.split([c.shape[spec.time_dim] for c in run.xs], dim=spec.time_dim))
    g_state, _, g_params = run.backward_phase(g_chunks, tuple(grad_state))
    grads = [g if g is not None else torch.zeros_like(s) for g, s in zip(g_state, state)]
    grads += [g if g is not None else torch.zeros_like(p) for g, p in zip(g_params, params)]
    return _unaliased(grads + ([grad_x] if need_x else []),
                      [handle, grad_ys, *grad_state, *state, xs, *params])


@chain_bwd.register_fake
def _(chain, chunk, m, strategy, need_x, handle, grad_ys, grad_state, state, xs, params):
    grads = [torch.empty_like(s) for s in state] + [torch.empty_like(p) for p in params]
    if need_x:
        grads.append(torch.empty_like(xs))
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
    grad_ys = grads[0] if grads[0] is not None else torch.zeros_like(
        _SPECS[ctx.args[0]].output_like(tuple(state), xs))
    grad_state = [g if g is not None else torch.zeros_like(s)
                  for g, s in zip(grads[1:1 + n_state], state)]
    need_x = bool(ctx.needs_input_grad[6])
    out = torch.ops.memopt.chain_bwd(*ctx.args, need_x, handle, grad_ys, grad_state, state, xs,
                                     params)
    g_state, g_params = out[:n_state], out[n_state:n_state + n_params]
    g_xs = out[-1] if need_x else None
    return None, None, None, None, None, list(g_state), g_xs, list(g_params)


chain_fwd.register_autograd(_backward, setup_context=_setup_context)


# passes.chains / passes.reversible reach this runtime through the registry (imports run
# one way: memopt -> passes -> allocator)
RUNTIMES.chains = sys.modules[__name__]
