"""Repeated blocks: the layers of a model that are copies of one another, each run as its
own graph so that dynamo captures one graph for all of them and memopt plans it once.

A transformer is a stack of identical layers in an `nn.ModuleList`; captured whole, its
forward is one graph as long as every layer put together, and dynamo and AOTAutograd
take time in proportion (regional compilation, torch.compile's recipe for this, compiles
one layer and reuses it). `memopt.compile(model, blocks=True)` ends a graph before and
after each instance of a repeated block (a forward pre-hook and hook that call
`torch._dynamo.graph_break()`, which does nothing outside dynamo). Dynamo then captures
the block's forward once and runs that graph for every instance (with
`inline_inbuilt_nn_modules`, on by default, the parameters are the graph's inputs, not
constants), and the graphs of a forward split at breaks are planned together under the
one budget (memopt.graph_breaks: what the earlier blocks saved is held while the later
ones run, and every instance runs the same plan, which must fit at the last one).

Because each block's forward runs as its own frame, FSDP2's hooks on a block
(`fully_shard(block)`) run between the graphs, as they do in eager: each block's
parameters are gathered only while its graph runs, and its recomputation in the
backward runs inside its own graph, while they are gathered again (memopt.fsdp).

What counts as repeated: two or more children of one `nn.ModuleList` or `nn.Sequential`
of the same class with the same parameter and buffer names, shapes and dtypes (the first
block of a ResNet stage, which has a downsampling branch, is not one of the rest). Lists
inside a repeated block are not searched again: the outer block is the unit.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from memopt.passes._torch_compat import graph_break, set_frame_skipped


def _signature(module: nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def find_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The model's repeated blocks, grouped by kind: each group two or more children of one
    container with the same class, parameter and buffer shapes (module docstring), in the
    order `model.modules()` meets them. A block inside another block is not listed."""
    groups: list[list[nn.Module]] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kinds: dict[tuple, list[nn.Module]] = {}
        for child in module.children():
            if next(child.parameters(), None) is not None:
                kinds.setdefault(_signature(child), []).append(child)
        for same in kinds.values():
            if len(same) < 2:
                continue
            groups.append(same)
            for block in same:
                inside.update(id(m) for m in block.modules())
    return groups


def loop_codes(model: nn.Module, groups: list[list[nn.Module]]) -> tuple[Any, ...]:
    """The code objects of the forwards that loop over the blocks of `groups`: those of the
    modules holding each group's container (a `ModuleList` is iterated by its owner).

    Dynamo cannot resume inside a loop, so a graph break there (a block's boundary) makes
    it run that frame eagerly, and it marks the frame's code as skipped for good, for every
    module of the class (torch 2.13). A memopt.compile of another copy of the model without
    blocks, or the user's torch.compile of it, would then be captured block by block.
    `capturing` marks these codes skipped only while a blocks=True step runs."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    codes: dict[int, Any] = {}
    for group in groups:
        container = parents.get(id(group[0]))
        owner = parents.get(id(container)) if container is not None else None
        code = getattr(getattr(type(owner), "forward", None), "__code__", None)
        if code is not None:
            codes[id(code)] = code
    return tuple(codes.values())


#: True while a blocks=True step of memopt runs: the boundaries break only its capture,
#: not a torch.compile of the same model elsewhere, nor memopt.plan or a memopt.compile
#: without blocks of a model whose blocks another memopt.compile marked (dynamo guards on
#: this value)
_capturing = False


class capturing:
    """`with capturing(blocks, loops):` around memopt's compiled step: with `blocks` the
    blocks' boundaries break its graphs; without, they do nothing there. `loops`
    (loop_codes) are run eagerly inside, as dynamo would after failing at the loop's first
    break, and compiled as usual again after."""

    def __init__(self, blocks: bool, loops: tuple[Any, ...] = ()) -> None:
        self.blocks, self.loops = blocks, loops if blocks else ()

    def __enter__(self) -> None:
        global _capturing
        self.before, _capturing = _capturing, self.blocks
        for code in self.loops:
            set_frame_skipped(code, True)

    def __exit__(self, *exc: object) -> None:
        global _capturing
        _capturing = self.before
        for code in self.loops:
            set_frame_skipped(code, False)


def _boundary(module: nn.Module, *args: Any) -> None:
    """A forward pre-hook and hook: dynamo ends memopt's graph here; eager does nothing."""
    if _capturing:
        graph_break()


def mark_blocks(groups: list[list[nn.Module]]) -> list[RemovableHandle]:
    """End a graph before and after each block of `groups` (find_blocks); the handles
    remove the boundaries again."""
    handles = []
    for group in groups:
        for block in group:
            if any(h is _boundary for h in block._forward_pre_hooks.values()):
                continue  # a deep copy of a model whose blocks were marked
            handles.append(block.register_forward_pre_hook(_boundary))
            handles.append(block.register_forward_hook(_boundary))
    return handles
