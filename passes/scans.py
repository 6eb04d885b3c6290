"""Parallel (associative) scans in a captured graph, and what a plan saves of them.

A state-space model's recurrence can be computed as a parallel scan: `torch._higher_order_ops
.associative_scan` builds a log-depth tree over the sequence (Blelloch's up-sweep and
down-sweep; on the CPU, combine_mode="generic", dynamo traces the tree as plain ops). Traced
for training, every level of the tree is kept for backward, where the sequential loop that
eager PyTorch runs keeps one state per step: transformers' Mamba takes the parallel path
under torch.compile by default (`config.use_associative_scan`), and memopt measured it at
1.57x eager's peak with no budget (issue 28). memopt does not rewrite the tree yet; it says
so (memopt.compiled_graph), with the bytes the plan saves of it.

Requires: fx graphs whose nodes carry dynamo's `stack_trace` (AOTAutograd copies it to the
joint graph's nodes). Ensures: nothing is changed.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

#: What names torch's associative scan: the higher-order op's target, and the call in the
#: stack trace dynamo records for each node traced inside it (the generic mode: its frames
#: inside torch are left out, the user's call `associative_scan(...)` is the last line).
SCAN_NAME = "associative_scan"


def from_scan(node: fx.Node) -> bool:
    """Whether `node` computes part of an associative scan."""
    target = getattr(node.target, "__name__", "") or str(node.target)
    return SCAN_NAME in target or SCAN_NAME in (node.meta.get("stack_trace") or "")


def scan_nodes(gm: fx.GraphModule) -> list[str]:
    """The names of the nodes of `gm` that compute part of an associative scan."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and from_scan(n)]


def scan_saved_bytes(fw: fx.GraphModule, saved: Iterable[tuple[str, int]]) -> int:
    """Of the saved tensors `saved` ((forward node name, bytes) pairs), the bytes of those
    the forward graph `fw` computes inside an associative scan."""
    nodes = {n.name: n for n in fw.graph.nodes}
    return sum(nbytes for name, nbytes in saved
               if name in nodes and from_scan(nodes[name]))
