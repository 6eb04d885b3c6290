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

A chunk's bytes and times are measured in passes.chain_costs (ChunkCosts).

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
from dataclasses import dataclass

import torch
from torch import fx

from ._torch_compat import detect_fake_mode
from memopt.allocator.gruslys import Policy, chunk_sizes, solve, strategy_text, useful_m

from .chain_costs import (_BWD_HANDLE, _BWD_NEED_X, _CHAIN, _CHUNK, _FWD_PARAMS, _FWD_STATE,
                          _FWD_XS, _M, _STRATEGY, TIMED_RUNS, ChunkCosts, Linear, _inputs, _ops,
                          _sliced, chunk_costs)
from .meta import KEPT_ARGS, OpBytes, fake_value, handle_readers, record_op_bytes

__all__ = ["ChainConfig", "ChainSite", "ChunkCosts", "Linear", "TIMED_RUNS", "apply",
           "chunk_costs", "configurations", "configure", "find_chains", "longest_fitting_chunk",
           "msm_units", "op_bytes"]

log = logging.getLogger("memopt")



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
    #: the backward op gets a stand-in for xs too (ChunkCosts.xs_unsaved)
    stand_in_xs: bool = False
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
        steps = int(ops.steps_of(spec, xs, [fake_value(p) for p in node.args[_FWD_PARAMS]]))
        sites.append(ChainSite(
            fwd=node.name, bwds=tuple(n.name for n in bwd_nodes), chain=node.args[_CHAIN],
            name=spec.name, x_grad=any(n.args[_BWD_NEED_X] for n in bwd_nodes),
            module_type=spec.module_type, steps=steps, handle=len(fake_value(node)) - 1,
            # what a step's state holds: its tensors' bytes, not the storage a view of a
            # larger state shares (a bidirectional RNN's chains get slices of h_0, 4x
            # their bytes: the beta correction took that off each stored internal state,
            # predicting a quarter of what 1-step chunks held)
            hidden_bytes=sum(s.numel() * s.element_size() for s in state),
            step_flops=_step_flops(node, spec), unsplittable=spec.unsplittable,
            output_bytes_per_step=fake_value(node)[0].untyped_storage().nbytes() // max(1, steps),
            param_bytes=sum(fake_value(p).untyped_storage().nbytes()
                            for p in node.args[_FWD_PARAMS]),
            sliced_bytes=sum(fake_value(p).nbytes for p in _sliced(node, spec)
                             if fake_value(p).is_floating_point()),
        ))
    return sites


def chain_spec(chain: int):
    """The registered ChainSpec of chain id ``chain`` (memopt.recurrent.ops)."""
    return _ops()[0].spec_of(chain)


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
                # sliced per-step inputs it saves views of (a split chain's, copies); the
                # run holds the initial state (its first step saves it, a split chain's
                # first checkpoint is it): mirrored, the copy would free nothing, and under
                # inductor the forward's buffer would be reused while the run still reads
                # it (a rewritten parallel scan's h_0, recomputed for the backward op, gave
                # wrong gradients there at no budget and split, 2026-11-28). The plain
                # params are not marked (docs/limits.md).
                n_params = len(node.args[_FWD_PARAMS])
                n_plain = n_params - len(_ops()[0].spec_of(site.chain).sliced)
                xs_kept = () if config.stand_in_xs else (_FWD_XS,)
                node.meta[KEPT_ARGS] = (*xs_kept,
                                        *((_FWD_STATE, k) for k in range(len(node.args[_FWD_STATE]))),
                                        *((_FWD_PARAMS, k) for k in range(n_plain, n_params)
                                          if config.t == 1 and config.holds_sliced
                                          and k not in config.stand_ins))
            elif node.target is bwd_op and node.name in site.bwds:
                _set_policy_args(node, config)
                record_op_bytes(node, nbytes[node.name])
                _stand_in(gm.graph, node, config.stand_ins, config.stand_in_xs)


#: chain_bwd's xs and params arguments, and the meta key of what they were before stand-ins
_BWD_XS, _BWD_PARAMS, _ORIGINAL_ARGS = 9, 10, "memopt.chain_args"


def _stand_in(graph: fx.Graph, node: fx.Node, which: tuple[int, ...], xs: bool) -> None:
    """Give the backward op ``node`` a stand-in for each param in ``which`` (and for xs
    with ``xs``): a tensor of its shape, dtype and device with every stride 0 (one
    element), so that liveness and the partitioner do not keep the real one for backward;
    the others as they were. The op reads a stand-in's shape only (memopt.recurrent.ops.
    chain_bwd: one chunk, never recomputed). Done before the joint graph is partitioned
    (ChainFamily.initial, no budget); an ``apply`` without stand-ins puts the real ones
    back."""
    original = node.meta.setdefault(_ORIGINAL_ARGS, (node.args[_BWD_XS],
                                                     list(node.args[_BWD_PARAMS])))
    now = [node.args[_BWD_XS], *node.args[_BWD_PARAMS]]
    real = [original[0], *original[1]]
    wanted = []
    for k, (value, current) in enumerate(zip(real, now)):
        if not (k == 0 and xs or k > 0 and k - 1 in which):
            wanted.append(value)
        elif current is not value:  # a stand-in already
            wanted.append(current)
        else:
            wanted.append(_zero_strided(graph, node, value))
    if wanted == now:
        return
    args = list(node.args)
    args[_BWD_XS], args[_BWD_PARAMS] = wanted[0], wanted[1:]
    node.args = tuple(args)
    for old in now:
        if old not in wanted and old.op == "call_function" and not old.users \
                and old.target is torch.ops.aten.empty_strided.default:
            graph.erase_node(old)


def _zero_strided(graph: fx.Graph, node: fx.Node, real: fx.Node) -> fx.Node:
    """A node before ``node`` making an empty tensor shaped like ``real``, strides 0."""
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
    return stand


def _set_policy_args(node: fx.Node, config: ChainConfig) -> None:
    args = list(node.args)
    p = config.policy
    args[_CHUNK], args[_M] = config.chunk, config.m
    args[_STRATEGY] = strategy_text(p.strategy, p.alpha, p.beta)
    node.args = tuple(args)
