"""A user's cell loop, found in the captured graph and run as a recurrent chain
(Gruslys et al. 2016, Sec. 3.1).

Dynamo unrolls ``for t in range(T): h, c = self.cell(xs[t], (h, c))`` into T copies
of the cell's ops. This pass finds such runs (memopt.allocator.repeats, on plain data)
and replaces each by one ``memopt::chain_fwd`` call, the op ``Recurrent`` and
``ChainedRNN`` emit (memopt.recurrent.ops), so the planner (passes.chain_policy) chooses its
chunk length and its BPTT-HSM, ISM or MSM policy under the budget like a marked loop's.

Requires: the torch-level FX graph dynamo hands a torch.compile backend (FakeTensors
in ``node.meta["example_value"]``), before AOTAutograd traces it; a graph that records
gradients (``keep``). Run it once per graph.

Ensures: every accepted loop's ops are erased and a ``chain_fwd`` node after them
computes the same values: its step function is one step's ops copied into a
GraphModule (the cell), run at every time step of a chunk; the per-step values
stacked after the loop are the chain's output, the last step's carried state its
final state. A loop with one per-step input gives it to the chain as ``xs``. Several
(``cell(xs[t] + emb[t], h)``, targets ``ys[t]`` of a per-step loss, a selective scan's
``dA[:, :, t]``, ``dBu[:, :, t]`` and ``C[:, t, :]``) are not copied: the chain takes them
whole among its params and each chunk reads its slices in place (ChainSpec.sliced), its
``xs`` an empty tensor giving its length. Several stacked values are packed into one
(T, M) output and split after it (``loop_packing.Packing``). The step need not read a
parameter: a scan carries its state through elementwise ops and matmuls over per-step
slices of tensors computed before the loop (Mamba's sequential path; Gruslys et al. 2016
is the tool for such a chain, and Gu and Dao 2023, Sec. 3.3.2, recompute a scan's states
in backward rather than store them).

Random ops draw the same numbers as the unrolled graph: the chain runs the steps in
order once in forward and replays each chunk's RNG state when it recomputes one. Gradients reach the parameters and every other value the cell
reads from before the loop (the chain's params), the initial state and the inputs.
Anything this cannot prove equal is left unrolled for the Chen planner, with one
``logging.debug`` line saying why: graphs that switch grad mode or autocast; loop
bodies that write in place (``h.mul_``, ``x += y``, ``out=``, ``inplace=True``; an
accumulator ``loss += step_loss`` that nothing else reads runs out of place instead),
update BatchNorm statistics, or contain a chain op; a last step that omits a random op (the chain would draw numbers the graph does not);
values the chain cannot carry (non-tensors, states whose initial value differs in
shape or dtype); per-step inputs on another device; stacked values of different dtypes.

Algorithm:
    Step 1: refuse a graph that switches grad mode or autocast.
    Step 2: a parallel scan's traced tree rewritten as its loop (passes.scans), elementwise
        producers of per-step inputs moved into the step (passes.scan_inputs: a selective
        scan's discretization); then the plain op list: indexing ops on a tensor
        (``xs[t]``, ``select``, ``unbind(...)[t]``) become references, every other node an Op.
    Step 3: find the loops (allocator.repeats.find_loops); an initial state the first step
        only promotes is cast to the carried dtype (passes.initial_states) and the loops
        are found again.
    Step 4: check each loop for what the chain cannot replay.
    Step 5: build the cell and register its ChainSpec.
    Step 6: rewrite: the chain op after the loop's last op, the stacked output and
        the final state rewired to it, the loop's ops and dead indexing ops erased.
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memopt.allocator.repeats import MIN_STEPS, Loop, Op, Ref, Slot, find_loops

from ._torch_compat import OpOverload, OpOverloadPacket
from .loop_packing import (EXAMPLE_VALUE, Packing, example_value, is_packed, packing_of,
                           slices_inputs, sliced_inputs, time_dim_of, unpack_outputs)
from .runtime import runtime
from .initial_states import widen_initial_states
from .scan_inputs import sink_into_steps
from .scans import sequential_scans

from .meta import NN_MODULE_STACK, _clean_path

log = logging.getLogger("memopt")

#: The key dynamo writes each node's FakeTensor value under.

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.imatmul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.setitem, operator.delitem,
})
#: Augmented assignments the chain runs out of place when they only rebind a carried
#: value (``loss += step_loss``: see ``_rebinds_state``).
_OUT_OF_PLACE = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
    operator.imod: operator.mod, operator.ipow: operator.pow, operator.imatmul: operator.matmul,
    operator.iand: operator.and_, operator.ior: operator.or_, operator.ixor: operator.xor,
    operator.ilshift: operator.lshift, operator.irshift: operator.rshift,
}
#: Words in the name of a function that draws random numbers.
_RANDOM = re.compile(r"dropout|rand|bernoulli|normal|multinomial|poisson|rrelu|gumbel|uniform|"
                     r"exponential|cauchy|geometric")
#: Words in the name of a function that switches grad mode or autocast.
_MODE_SWITCH = re.compile(r"grad_enabled|autocast|inference_mode")


@dataclass(frozen=True)
class ChainedLoop:
    """A loop the pass replaced by a chain."""

    name: str             # the cell's module path, or where the loop is
    module_type: str      # "detected loop of LSTMCell"
    steps: int            # T
    ops_per_step: int
    chain: int            # the registered ChainSpec's id


@dataclass(frozen=True)
class LoopsResult:
    loops: tuple[ChainedLoop, ...]
    refused: tuple[str, ...]   # why each candidate was left unrolled

    @property
    def modified(self) -> bool:
        return bool(self.loops)


def chain_loops(gm: fx.GraphModule, *, keep: bool = True,
                min_steps: int = MIN_STEPS, autocast: dict[str, torch.dtype] | None = None
                ) -> LoopsResult:
    """Replace every unrolled cell loop of ``gm`` by a chain op, in place (see the
    module docstring). ``keep``: the graph records gradients (the chain op keeps what
    its policy stores for backward). ``autocast``: {device type: dtype} of the autocast
    regions the graph is traced in (``torch.autocast`` around the forward): the chain's
    step enters that state, in the forward and when a chunk is recomputed in backward
    (which runs outside it), as eager's cell ran in it."""
    # Step 1: a graph that switches grad mode or autocast
    switch = next((n for n in gm.graph.nodes if _MODE_SWITCH.search(_target_name(n))), None)
    if switch is not None:
        reason = f"the graph switches grad mode or autocast ({switch.name}): loops left unrolled"
        log.debug("memopt loops: %s", reason)
        return LoopsResult((), (reason,))
    # Step 2, 3 (a parallel scan's tree first rewritten as its loop, elementwise producers
    # of per-step inputs moved into the reads)
    sequential_scans(gm, min_steps)
    sink_into_steps(gm, _index, _writes, min_steps)
    plain = _plain(gm)
    search = find_loops(plain.ops, min_steps)
    if widen_initial_states(gm, plain, search.loops):  # a bf16 zeros h_0 for float32 steps
        plain = _plain(gm)
        search = find_loops(plain.ops, min_steps)
    refused = [f"ops from {plain.nodes[s].name}, {length} per step: {why}"
               for s, length, why in search.refused]
    done = []
    for loop in reversed(search.loops):  # from the end: earlier loops' nodes stay valid
        # Step 4
        why = _refusal(plain, loop)
        if why is not None:
            refused.append(f"loop of {loop.steps} steps from {plain.nodes[loop.start].name}: {why}")
            continue
        # Step 5, 6
        done.append(_rewrite(gm, plain, loop, keep, autocast or {}))
    for line in refused:
        log.debug("memopt loops: left unrolled: %s", line)
    if done:
        gm.graph.lint()
        gm.recompile()
        log.info("memopt loops: %s", ", ".join(
            f"{c.name} ({c.steps} steps of {c.ops_per_step} ops) runs as a chain" for c in done))
    return LoopsResult(tuple(reversed(done)), tuple(refused))


# -- Step 2: the plain op list -----------------------------------------------------------


@dataclass(frozen=True)
class PlainGraph:
    ops: list[Op]
    nodes: list[fx.Node]            # nodes[j]: the node of op j
    by_name: dict[str, fx.Node]

    def node(self, ref: Ref) -> fx.Node:
        """The node a reference (see allocator.repeats) names."""
        return self.nodes[ref[1]] if ref[0] == "op" else self.by_name[ref[-1]]


def _plain(gm: fx.GraphModule) -> PlainGraph:
    refs: dict[fx.Node, Ref] = {}
    ops: list[Op] = []
    nodes: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            refs[node] = ("in", node.name)
            continue
        index = _index(node)
        # an indexed value that is stacked (``ys.append(out[:, :, 0])``) is a step's op
        stacked = any(_stack_dim(u) is not None for u in node.users)
        if index is not None and refs[index[0]][0] != "at" and not stacked:
            refs[node] = ("at", refs[index[0]], index[1], index[2], node.name)
            continue
        args = tuple(refs[n] for n in _inputs(node))
        refs[node] = ("op", len(ops))
        ops.append(Op(_key(node, refs), args, _stack_dim(node), node.name))
        nodes.append(node)
    return PlainGraph(ops, nodes, {n.name: n for n in gm.graph.nodes})


def _inputs(node: fx.Node) -> list[fx.Node]:
    """The node's inputs in the order ``Graph.node_copy`` maps them (one per use)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _key(node: fx.Node, refs: dict[fx.Node, Ref]) -> tuple:
    """Equal for nodes calling the same target with the same constants and parameters
    (the first step reads its initial state from a graph input where the others read an
    op: inputs and ops look alike here)."""
    def mark(n: fx.Node) -> str:
        ref = refs[n]
        if ref[0] == "at":
            return f"at:{ref[2]}"
        return f"param:{ref[1]}" if isinstance(example_value(n), nn.Parameter) else "#"

    target: Any = node.target if node.op == "call_function" else str(node.target)
    try:
        hash(target)
    except TypeError:
        target = repr(target)
    return node.op, target, repr(fx.node.map_arg((node.args, node.kwargs), mark))


def _is_unbind(node: Any) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == "unbind")
        or (node.op == "call_function" and node.target is torch.unbind))


def _at(base: Any, dim: Any, i: Any) -> tuple[fx.Node, int, int] | None:
    """(base, dim, i) normalized to non-negative, if ``base`` is a tensor that has them."""
    value = example_value(base)
    if not (isinstance(value, torch.Tensor) and type(dim) is int and type(i) is int
            and -value.dim() <= dim < value.dim()):
        return None
    dim %= value.dim()
    size = value.shape[dim]
    return (base, dim, i % size) if -size <= i < size else None


def _tuple_at(base: Any, idx: tuple) -> tuple[fx.Node, int, int] | None:
    """``base[idx]`` as (base, dim, i) when idx is full slices and one integer, with at
    most one ``...`` (``x[:, t]``, ``x[:, t, :]``, ``x[..., t]``)."""
    ints = [k for k, s in enumerate(idx) if type(s) is int]
    dots = [k for k, s in enumerate(idx) if s is Ellipsis]
    if len(ints) != 1 or len(dots) > 1 or not all(
            s == slice(None) for k, s in enumerate(idx) if k not in ints and k not in dots):
        return None
    k = ints[0]
    if dots and dots[0] < k:  # counted from the end
        value = example_value(base)
        if not isinstance(value, torch.Tensor):
            return None
        return _at(base, value.dim() - (len(idx) - k), idx[k])
    return _at(base, k, idx[k])


def _index(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(base, dim, i) when ``node`` is ``base`` indexed at the integer i along dim."""
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        base, idx = node.args
        if _is_unbind(base):
            return _at(base.args[0], base.args[1] if len(base.args) > 1
                       else base.kwargs.get("dim", 0), idx)
        if isinstance(idx, tuple):
            return _tuple_at(base, idx)
        return _at(base, 0, idx)
    if ((node.op == "call_method" and node.target == "select")
            or (node.op == "call_function" and node.target is torch.select)) \
            and len(node.args) == 3 and not node.kwargs:
        return _at(*node.args)
    return None


def _stack_dim(node: fx.Node) -> int | None:
    if node.op != "call_function" or node.target is not torch.stack:
        return None
    out = example_value(node)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(out, torch.Tensor) or type(dim) is not int:
        return None
    return dim % out.dim()


# -- Step 4: what the chain cannot replay ------------------------------------------------


def _target_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return str(getattr(node.target, "__name__", node.target))
    return str(node.target) if node.op in ("call_method", "call_module") else ""


def _bound_args(node: fx.Node) -> dict[str, Any]:
    try:
        return dict(inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments)
    except (TypeError, ValueError):  # a builtin without a signature
        return dict(node.kwargs)


def _writes(node: fx.Node) -> bool:
    """The node writes into a tensor (in place, ``out=``, running statistics)."""
    name = _target_name(node)
    if node.op not in ("call_method", "call_function"):
        return False
    if (name.endswith("_") and not name.endswith("__")) or node.target in _INPLACE_OPERATORS:
        return True  # torch's naming: relu_, add_, _foreach_mul_
    if node.op == "call_method":
        return False
    if isinstance(node.target, (OpOverload, OpOverloadPacket)):
        overloads = ([node.target] if isinstance(node.target, OpOverload)
                     else [getattr(node.target, o) for o in node.target.overloads()])
        if any(o._schema.is_mutable for o in overloads):
            return True
    bound = _bound_args(node)
    if bound.get("out") is not None or bound.get("inplace") is True:
        return True
    if "batch_norm" in name or "instance_norm" in name:
        # training-mode norms update the running statistics they are given
        stats = bound.get("running_mean", bound.get("running_var"))
        training = bound.get("training", bound.get("use_input_stats", True))
        return stats is not None and training is not False
    return False


def _rebinds_state(plain: PlainGraph, loop: Loop, k: int) -> bool:
    """Offset k is ``acc op= value`` on a carried accumulator that nothing else reads
    (``loss += F.cross_entropy(...)``): running it out of place computes the same values.
    The accumulator must be this offset's own value of the previous step, read only
    here, and start from a fresh tensor made before the loop (not a graph input or a
    view: writing into those would be visible outside the loop)."""
    node = plain.nodes[loop.ops[0][k]]
    if node.target not in _OUT_OF_PLACE or loop.slots[k][:1] != (("state", k),):
        return False
    init = loop.init[loop.state.index(k)]
    if init[0] != "op" or getattr(example_value(plain.nodes[init[1]]), "_base", None) is not None:
        return False
    written = [plain.nodes[init[1]]] + [plain.nodes[rep[k]] for rep in loop.ops[:-1]]
    readers = [plain.nodes[rep[k]] for rep in loop.ops]
    return all(set(w.users) == {r} for w, r in zip(written, readers) if r is not None)


def _refusal(plain: PlainGraph, loop: Loop) -> str | None:
    first = [plain.nodes[j] for j in loop.ops[0]]
    for k, node in enumerate(first):
        if _writes(node) and not _rebinds_state(plain, loop, k):
            return f"{node.name} ({_target_name(node)}) writes into a tensor"
        if isinstance(node.target, (OpOverload, OpOverloadPacket)) \
                and node.target.namespace == "memopt":
            return f"{node.name} is a recurrent chain already"
    for k, j in enumerate(loop.ops[-1]):
        if j is None and _RANDOM.search(_target_name(first[k])):
            return (f"the last step omits the random op {first[k].name}, which the chain "
                    "would run, drawing numbers the unrolled graph does not")
    outside = [plain.node(ref) for ref in _outside_refs(loop)]
    if not all(isinstance(example_value(n), torch.Tensor) for n in outside):
        return "the cell reads a value from before the loop that is not a tensor"
    for o, ref in zip(loop.state, loop.init):
        init, value = example_value(plain.node(ref)), example_value(first[o])
        if not (isinstance(init, torch.Tensor) and isinstance(value, torch.Tensor)
                and (init.shape, init.dtype, init.device)
                == (value.shape, value.dtype, value.device)):
            return (f"the carried value {first[o].name} is not a tensor of its initial "
                    "value's shape, dtype and device")
    device = example_value(first[loop.state[0]]).device
    if not any(example_value(first[o]).is_floating_point() for o in loop.state):
        return "no carried value is a floating-point tensor"
    for o, _ in loop.outputs:
        y = example_value(first[o])
        if not (isinstance(y, torch.Tensor) and y.is_floating_point() and y.device == device):
            return "a stacked per-step value is not a floating-point tensor on the state's device"
        if not is_packed(loop) and time_dim_of(loop) > y.dim():
            return "the per-step input's time dim is beyond the stacked value's dims"
    for base, dim, i0 in loop.step_inputs:
        xs = example_value(plain.node(base))
        if i0 + loop.steps > xs.shape[dim] or xs.device != device:
            return "a per-step input does not cover every step on the state's device"
    if len(loop.outputs) > 1:
        packing = packing_of(plain, loop)
        if isinstance(packing, str):
            return packing
    return None


def _outside_refs(loop: Loop) -> list[Ref]:
    """The values from before the loop the cell reads, in first-read order (the chain's
    params)."""
    refs: dict[Ref, None] = {}

    def visit(kind: Slot) -> None:
        if kind[0] == "out":
            refs.setdefault(kind[1])
        elif kind[0] == "at":
            visit(kind[1])

    for row in loop.slots:
        for kind in row:
            visit(kind)
    return list(refs)


def _cell(gm: fx.GraphModule, plain: PlainGraph, loop: Loop, params: list[Ref]) -> fx.GraphModule:
    """One step's ops as a GraphModule: (*params, *state, *xs) -> (ys, new state), one x
    per per-step input (none without), one y per stacked value."""
    graph = fx.Graph()
    param_of = {ref: graph.placeholder(f"param_{i}") for i, ref in enumerate(params)}
    state_of = {o: graph.placeholder(f"state_{q}") for q, o in enumerate(loop.state)}
    x_of = {inp: graph.placeholder(f"x_{i}") for i, inp in enumerate(loop.step_inputs)}
    env: dict[int, fx.Node] = {}

    def value(kind: Slot) -> fx.Node:
        tag = kind[0]
        if tag == "same":
            return env[kind[1]]
        if tag == "out":
            return param_of[kind[1]]
        if tag == "state":
            return state_of[kind[1]]
        if tag == "step":
            return x_of[kind[1:]]
        return graph.call_function(torch.select, (value(kind[1]), kind[2], kind[3]))

    for k, j in enumerate(loop.ops[0]):
        kinds = iter(loop.slots[k])
        env[k] = graph.node_copy(plain.nodes[j], lambda _n, kinds=kinds: value(next(kinds)))
        env[k].meta = {}  # the trace's FakeTensors: the cell runs on real tensors
        if env[k].target in _OUT_OF_PLACE:  # an accumulator's ``+=`` (_rebinds_state)
            env[k].target = _OUT_OF_PLACE[env[k].target]
    graph.output((tuple(env[o] for o, _ in loop.outputs), tuple(env[o] for o in loop.state)))
    return fx.GraphModule(gm, graph, class_name="LoopCell")


def _describe(nodes: list[fx.Node]) -> tuple[str, str]:
    """(name, module type) for the plan: the innermost module every op of the step ran
    in (the cell), else where the loop is in the source."""
    stacks = [[(_clean_path(str(p)), c) for p, c in n.meta[NN_MODULE_STACK].values()]
              for n in nodes if n.meta.get(NN_MODULE_STACK)]
    common = stacks[0] if stacks and len(stacks) == len(nodes) else []
    for s in stacks[1:]:
        n = 0
        while n < min(len(common), len(s)) and common[n][0] == s[n][0]:
            n += 1
        common = common[:n]
    if common and common[-1][0]:
        path, cls = common[-1]
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
        return path, f"detected loop of {name}"
    where = re.findall(r'File "([^"]*)", line (\d+)', nodes[0].meta.get("stack_trace", ""))
    if where:
        return f"loop at {where[-1][0].rsplit('/', 1)[-1]}:{where[-1][1]}", "detected loop"
    return "loop", "detected loop"


def _spec(gm: fx.GraphModule, plain: PlainGraph, loop: Loop, params: list[Ref],
          autocast: dict[str, torch.dtype]) -> tuple[int, Any]:
    """Register the loop's ChainSpec: the cell run at every time step of a chunk, the
    stacked values its output (an empty one when nothing is stacked), under the autocast
    state of the loop's device when there is one."""
    ops, loop_step = runtime("chains"), runtime("loop_step")

    cell = _cell(gm, plain, loop, params)
    time_dim = time_dim_of(loop)
    first = [plain.nodes[j] for j in loop.ops[0]]
    packing = packing_of(plain, loop) if len(loop.outputs) > 1 else None
    y_shape, y_dtype = (0,) * max(1, time_dim), None
    if isinstance(packing, Packing) and packing.outputs:
        y_shape = (sum(math.prod(shape) for shape in packing.outputs),)
        y_dtype = packing.out_dtype
    elif loop.outputs:
        y = example_value(first[loop.outputs[0][0]])
        y_shape, y_dtype = tuple(y.shape), y.dtype
    carried = next(q for q, o in enumerate(loop.state) if example_value(first[o]).is_floating_point())
    n_inputs = len(loop.step_inputs)

    def cell_step(p: tuple, state: tuple, xs: list[torch.Tensor]) -> tuple[torch.Tensor, tuple]:
        ys, new = cell(*p, *state, *xs)
        if not ys:  # nothing stacked: an empty output, still part of the step's graph
            out = new[carried].reshape(-1)[:0].clone().reshape(y_shape)
        elif isinstance(packing, Packing):
            out = packing.join_outputs(ys)
        else:
            out = ys[0]
        return out, tuple(new)

    def output_like(state: tuple, xs: torch.Tensor) -> torch.Tensor:
        shape = list(y_shape)
        shape.insert(time_dim, xs.shape[time_dim])
        return state[carried].new_empty(shape, dtype=y_dtype)

    name, module_type = _describe(first)
    kind = example_value(first[loop.state[carried]]).device.type
    cast = (kind, autocast[kind]) if kind in autocast else None
    sliced = tuple(dim for _, dim, _ in loop.step_inputs) if slices_inputs(loop) else ()
    if sliced:
        def step(p: tuple, state: tuple, x: tuple) -> tuple[torch.Tensor, tuple]:
            # x: the chunk's (T', 0) length tensor, then each per-step input's chunk
            # unbound once, not selected per step: the backward of a select is a
            # full-size zero tensor per step (eager's loop pays it T times over), an
            # unbind's one stack of the steps' gradients
            columns = [part.unbind(d) for part, d in zip(x[1:], sliced)]
            outs = []
            for k in range(x[0].shape[time_dim]):
                y, state = cell_step(p, state, [c[k] for c in columns])
                outs.append(y)
            return torch.stack(outs, time_dim), tuple(state)
    else:
        step = loop_step(lambda p, state, x: cell_step(p, state, [x][:n_inputs]), time_dim)
    if cast is not None:
        plain_step = step

        def step(p: tuple, state: tuple, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
            with ops.chunk_autocast(cast):
                return plain_step(p, state, x)

    # the RNG state is kept and replayed where the step may draw (a random op, or a module
    # call whose ops are not seen): no state held for a plain scan
    draws = any(n.op == "call_module" or _RANDOM.search(_target_name(n)) for n in first)
    spec = ops.ChainSpec(name=name, module_type=module_type, step=step, time_dim=time_dim,
                         output_like=output_like, preserve_rng=draws, autocast=cast,
                         sliced=sliced)
    return ops.register(spec), spec


# -- Step 6: the rewrite -----------------------------------------------------------------


def _keep_example(old: fx.Node, new: fx.Node) -> None:
    """`new`, the chain's value that replaces `old` (a stacked output, a final state),
    with `old`'s recorded FakeTensor: later passes read shapes from it (the language-model
    heads pass read None for a loop's stacked outputs under a Linear and cross-entropy:
    an AttributeError, found from outside)."""
    value = example_value(old)
    if value is not None and example_value(new) is None:
        new.meta[EXAMPLE_VALUE] = value


def _rewrite(gm: fx.GraphModule, plain: PlainGraph, loop: Loop, keep: bool,
             autocast: dict[str, torch.dtype]) -> ChainedLoop:
    params = _outside_refs(loop)
    chain_id, spec = _spec(gm, plain, loop, params, autocast)
    graph = gm.graph
    run = [plain.nodes[j] for rep in loop.ops for j in rep if j is not None]
    init = [plain.node(ref) for ref in loop.init]
    time_dim = time_dim_of(loop)
    packing = packing_of(plain, loop) if len(loop.outputs) > 1 else None
    with graph.inserting_before(plain.nodes[loop.end - 1].next):
        inputs = [plain.node(r) for r in params]
        if slices_inputs(loop):  # read in place by each chunk: ChainSpec.sliced
            inputs += sliced_inputs(graph, plain, loop)
        if slices_inputs(loop) or loop.step_input is None:
            # no per-step input, or sliced ones: an empty tensor gives the chain its length
            shape = [0] * (time_dim + 2)
            shape[time_dim] = loop.steps
            xs = graph.call_function(torch.empty, (shape,),
                                     {"device": example_value(init[0]).device})
        else:
            base, dim, i0 = loop.step_input
            xs = plain.node(base)
            if i0 != 0 or example_value(xs).shape[dim] != loop.steps:
                xs = graph.call_function(torch.narrow, (xs, dim, i0, loop.steps))
        chain = graph.call_function(torch.ops.memopt.chain_fwd, (
            chain_id, loop.steps, 1, "hsm", keep, init, xs, inputs))
        if "stack_trace" in run[0].meta:
            chain.meta["stack_trace"] = run[0].meta["stack_trace"]
        y = graph.call_function(operator.getitem, (chain, 0))
        finals = [graph.call_function(operator.getitem, (chain, 1 + q))
                  for q in range(len(loop.state))]
        if isinstance(packing, Packing):
            ys = unpack_outputs(graph, y, loop, packing)
        else:
            ys = [y]
        for k, (_, stack_dim) in enumerate(loop.outputs):
            if stack_dim != time_dim:
                ys[k] = graph.call_function(torch.movedim, (ys[k], time_dim, stack_dim))
    doomed = set(run)
    for u, k in zip(loop.stacks, loop.stacked):
        _keep_example(plain.nodes[u], ys[k])
        plain.nodes[u].replace_all_uses_with(ys[k])
        doomed.add(plain.nodes[u])
    for q, o in enumerate(loop.state):
        j = loop.ops[-1][o]
        if j is not None:
            _keep_example(plain.nodes[j], finals[q])
            plain.nodes[j].replace_all_uses_with(finals[q], delete_user_cb=lambda u: u not in doomed)
    for node in reversed(list(graph.nodes)):
        dead_view = (_index(node) is not None or _is_unbind(node)) and not node.users
        if node in doomed or dead_view:
            if node.users:
                raise RuntimeError(f"memopt loops: {node.name} of a chained loop is still read "
                                   f"by {list(node.users)}; this is a memopt bug")
            graph.erase_node(node)
    return ChainedLoop(name=spec.name, module_type=spec.module_type, steps=loop.steps,
                       ops_per_step=loop.length, chain=chain_id)
