"""Random draws whose values nothing uses, kept as eager draws them.

Eager runs every op of a forward, used or not, and each random op draws from the
generator. AOTAutograd's dead-code elimination removes random ops whose values reach no
output (it follows inductor's `fallback_random`, off by default), so every random op
after such a one drew other numbers than eager's. HF CANINE for sequence classification
computes a character-level branch its classifier never reads, with four dropouts: with
dropout on, its loss (1.0990626 against eager's 1.1059788) and 52 gradients differed at
every budget, as under `torch.compile(backend="aot_eager")` (found from outside).

memopt captures with those ops kept (fallback_random on at capture), and this pass
replaces each unused one by its bare draw on a fresh buffer of its input's layout, in
place (an in-place op: every later dead-code elimination keeps it), so the computation
feeding it is no longer read and is removed, and the draw is a node the planner counts.

Requires: a joint graph captured with unused random ops kept, FakeTensors in
`node.meta['val']`. Ensures: each random op no output or side effect depends on, of a kind
whose draw is known, is replaced by that draw; returns the others (left as they are,
for a warning): CUDA's fused dropout (`native_dropout` draws with Philox offsets of its
own, which no in-place op reproduces) and ops not listed below.

The draws (ATen, CPU and CUDA): `bernoulli.p(x, p)` is `empty_like(x).bernoulli_(p)`,
`bernoulli(x)` is `empty_like(x).bernoulli_(x)` (it still reads `x`),
`rand_like` and `randn_like` are `empty_like(x).uniform_()` / `.normal_()`; CPU's
dropout kernel draws `empty_like(x).bernoulli_(1 - p)` (none when p == 1).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import fx

from ._torch_compat import random_ops_kept
from .meta import tensor_value

aten = torch.ops.aten

#: op -> (the in-place draw, its arguments after the buffer from the op's arguments)
_DRAWS = {
    aten.bernoulli.p: (aten.bernoulli_.float, lambda args: (args[1],)),
    aten.bernoulli.default: (aten.bernoulli_.Tensor, lambda args: (args[0],)),
    aten.rand_like.default: (aten.uniform_.default, lambda args: ()),
    aten.randn_like.default: (aten.normal_.default, lambda args: ()),
}


def _random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def _needed(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes an output or a side effect (a mutation, an assertion; not a random
    draw) depends on."""
    stack = [n for n in gm.graph.nodes if n.is_impure(impure_random=False)]
    needed: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return needed


def _source(node: fx.Node) -> torch.Tensor | None:
    """The value of the random op's first argument (the tensor it draws like)."""
    arg = node.args[0] if node.args else None
    return tensor_value(arg) if isinstance(arg, fx.Node) else None


def _draw(node: fx.Node) -> tuple | None:
    """(in-place op, its arguments after the buffer) eager's draw for `node`, or None
    where no such draw is known; () where eager draws nothing."""
    if node.target in _DRAWS:
        op, rest = _DRAWS[node.target]
        return op, rest(node.args)
    source = _source(node)
    if node.target is aten.native_dropout.default and source is not None \
            and source.device.type == "cpu":
        p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
        if not train or p >= 1:
            return ()
        return aten.bernoulli_.float, (1 - p,)
    return None


def keep_dead_draws(gm: fx.GraphModule) -> list[str]:
    """Replace each unused random op of `gm` by eager's draw (the module docstring) and
    remove what no output, side effect or draw needs; return the names of the unused random
    ops no draw replaced (removed as AOTAutograd would: later draws differ from eager's)."""
    needed = _needed(gm)
    dead = [n for n in gm.graph.nodes if _random(n) and n not in needed]
    if not dead:
        return []
    left = []
    for node in dead:
        draw, source = _draw(node), _source(node)
        if draw is None or source is None:
            left.append(node.name)
        elif draw:
            op, rest = draw
            with gm.graph.inserting_before(node):
                buffer = gm.graph.call_function(
                    aten.empty_strided.default, (list(source.shape), list(source.stride())),
                    {"dtype": source.dtype, "device": source.device})
                with source.fake_mode:
                    buffer.meta["val"] = torch.empty_strided(
                        source.shape, source.stride(), dtype=source.dtype, device=source.device)
                drawn = gm.graph.call_function(op, (buffer, *rest))
                drawn.meta["val"] = buffer.meta["val"]
    needed = _needed(gm)  # the draws now among them
    for node in reversed(list(gm.graph.nodes)):
        if node.op not in ("placeholder", "output") and node not in needed:
            gm.graph.erase_node(node)
    gm.recompile()
    return left


def with_dead_draws(partition_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`partition_fn` (memopt's, handed to AOTAutograd) run on the joint graph after
    keep_dead_draws, with unused random ops no longer kept (random_ops_kept(False): a
    recomputed region's random ops the plan replaces, a dropout replayed from its kept
    mask, must not be drawn again in backward). Capture with random_ops_kept(True)."""

    def partition(joint: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        left = keep_dead_draws(joint)
        if left:
            warnings.warn(
                f"memopt: random ops whose values nothing uses ({', '.join(left[:4])}) are "
                f"removed, as torch.compile removes them, and eager draws for them: the "
                f"random numbers drawn after them (dropout masks) differ from eager's. "
                f"Remove the unused computation from the model.", UserWarning, stacklevel=2)
        with random_ops_kept(False):
            return partition_fn(joint, *args, **kwargs)

    return partition
