"""TorchInductor's private pieces memopt depends on (memopt.kernels): the settings under
which memopt's plan is what runs, the decompositions of the graph it plans, the compile
call with memopt's partitioner in place of inductor's, and what memopt reads of inductor's
schedule after fusion. The rest of torch's private names are in passes._torch_compat; a
torch upgrade should touch these two files only.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from torch import fx

from memopt.passes._torch_compat import loss_decompositions


#: Inductor settings under which memopt's plan is what runs (memopt.kernels explains each).
INDUCTOR_SETTINGS: dict[str, Any] = {
    "fallback_random": True,        # eager's RNG draws, kept masks replayed (passes.twins)
    "layout_optimization": False,   # channels-last copies the plan does not hold
    "shape_padding": False,         # padded matmul operands the plan does not hold
    "comprehensive_padding": False,  # padded strides: bigger buffers than planned
    "reorder_for_peak_memory": False,  # memopt ordered the graphs (Chen Alg. 2 placement)
    "freezing": False,
    "triton.cudagraphs": False,     # a static pool that outlives the step
}


def inductor_decompositions() -> dict[Any, Callable]:
    """The decompositions inductor applies at capture with `fallback_random` (random ops
    kept whole), plus memopt's loss decompositions: the graph memopt plans is the one
    inductor compiles."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415
    from torch._inductor.decomposition import select_decomp_table  # noqa: PLC0415

    with inductor_config.patch(fallback_random=True):
        table = dict(select_decomp_table())
    table.update(loss_decompositions())
    return table


def _schedule_peak(nodes: list[Any], resident: set[str]) -> int:
    """Inductor's own estimate (torch/_inductor/memory.py) of the most bytes the graph it is
    scheduling holds at once, of what it allocates and of its inputs that it frees at their
    last use: every input but the primals (parameters, buffers and the step's inputs, which
    the caller holds for the whole step) and the inputs in `resident` (a backward's saved
    views of them, `W.t()`), i.e. a backward's saved tensors and tangents."""
    from torch._inductor import memory  # noqa: PLC0415
    from torch._inductor.virtualized import V  # noqa: PLC0415
    from torch.utils._ordered_set import OrderedSet  # noqa: PLC0415

    graph = V.graph
    freeable = OrderedSet(name for name in graph.graph_inputs
                          if not name.startswith("primals") and name not in resident)
    buffers = {buf.get_name(): buf for node in nodes for buf in node.get_outputs()}
    fused = {inner.get_name(): node for node in nodes for inner in node.get_nodes()}
    peak, _ = memory.prepare_planning_info(nodes, buffers, fused, freeable,
                                           OrderedSet(graph.get_output_names()))
    return int(peak)


def _schedule_order(nodes: list[Any]) -> list[tuple[str, ...]]:
    """The fx nodes of the graph inductor is scheduling, by name, in the order its kernels
    run (after fusion: a fused kernel runs where its first node would): per kernel, its
    nodes and the nodes computed inside them (inductor's `origins`), unordered."""
    return [tuple(o.name for o in (getattr(getattr(inner, "node", None), "origins", None)
                                   or ()))
            for node in nodes for inner in node.get_nodes()]


def _schedule_kernels(nodes: list[Any]) -> list[tuple[int, str | None]]:
    """For each entry of _schedule_order: the index of the generated kernel it runs in
    (a fused node's inner nodes share one) and the fx node whose buffer it writes
    (inductor's origin node; None where it names none). On CPU one C++ kernel runs every
    scheduler node between two extern or template kernels (codegen/cpp.py's kernel group,
    flushed by the scheduler at those), on other devices each fused node is a kernel."""
    found = []
    k, after_alone = -1, True  # a kernel of its own: an extern, a template, not on CPU
    for node in nodes:
        device = node.get_device()
        if device is not None:  # (a no-op node has none: it joins the current kernel)
            alone = node.is_extern() or node.is_template() or device.type != "cpu"
            k += int(alone or after_alone)
            after_alone = alone
        for inner in node.get_nodes():
            ir_node = getattr(inner, "node", None)
            origin = ir_node.get_origin_node() if ir_node is not None \
                and hasattr(ir_node, "get_origin_node") else None
            found.append((k, origin.name if origin is not None else None))
    return found


def _extern_layouts(nodes: list[Any], ops: frozenset[Any]) -> dict[str, tuple]:
    """The sizes and strides of the tensors inductor hands each extern kernel of `ops`
    (by the fx node it computes): the layouts it chose for their arguments."""
    from torch._inductor import ir  # noqa: PLC0415
    from torch._inductor.virtualized import V  # noqa: PLC0415

    sizevars = V.graph.sizevars  # torch 2.13 names it optimization_hints, 2.11 size_hints
    hint = getattr(sizevars, "optimization_hints", None) or sizevars.size_hints
    found: dict[str, tuple] = {}
    for node in nodes:
        kernel = getattr(node, "node", None)
        if not isinstance(kernel, ir.FallbackKernel) or kernel.op_overload not in ops:
            continue
        origin = kernel.get_origin_node() or next(
            (o for o in kernel.origins if o.target is kernel.op_overload), None)
        if origin is None:
            continue
        try:
            found[origin.name] = tuple((tuple(hint(x.get_size())), tuple(hint(x.get_stride())))
                                       for x in kernel.inputs)
        except Exception:  # noqa: BLE001 (a layout inductor has not fixed: not recorded)
            continue
    return found


def inductor_compile(gm: fx.GraphModule, example_inputs: list[Any],
                     partition_fn: Callable[..., Any], version: str,
                     schedule_peaks: dict[str, int] | None = None,
                     resident: set[str] | None = None,
                     schedule_orders: dict[str, list[tuple[str, ...]]] | None = None,
                     extern_layouts: dict[str, dict[str, tuple]] | None = None,
                     relaid_ops: frozenset[Any] = frozenset(),
                     schedule_kernels: dict[str, list[tuple[int, str | None]]] | None = None
                     ) -> Callable:
    """Compile a dynamo graph with TorchInductor (`compile_fx`), `partition_fn` in place
    of its min-cut partitioner (`config.custom_partitioner_fn`, run after inductor's
    joint-graph passes), under INDUCTOR_SETTINGS. AOTAutograd's cache is off for the call:
    a cache hit would skip the partitioner, and the plan with it. The backward is compiled
    with the forward (not at its first run), so both are known when this returns.

    `schedule_peaks`, when given, receives inductor's estimate of each graph's peak as it
    schedules it ("forward", "backward": _schedule_peak, less the inputs named in
    `resident`, which `partition_fn` may fill), read right after fusion; inductor's
    graph cache is then off (a hit would skip the scheduler), its compiled-kernel cache
    stays on (keyed by the kernels' source). `schedule_orders`, when given, receives
    the order of each graph's nodes as inductor's kernels run them (_schedule_order);
    `extern_layouts` the layouts of the arguments inductor hands its extern kernels of
    `relaid_ops` (_extern_layouts); `schedule_kernels` the generated kernel of each entry of
    the order (_schedule_kernels)."""
    from torch._functorch import config as functorch_cfg  # noqa: PLC0415
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: PLC0415
    from torch._inductor.custom_graph_pass import CustomPartitionerFn  # noqa: PLC0415

    from torch._inductor import config as inductor_config  # noqa: PLC0415

    class _Partitioner(CustomPartitionerFn):
        def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            kwargs.pop("compiler", None)
            kwargs.pop("static_lifetime_input_indices", None)
            # Partition as the aten path does: fx's dead-code elimination follows
            # `fallback_random` inside a compilation, and with it on it would keep the
            # random ops of a recomputed region whose values the plan replaces (dropout
            # from its kept mask, passes.twins): re-drawn in backward, they move the
            # user's RNG and hold their outputs (_torch_compat.extract_fwd_bwd).
            with inductor_config.patch(fallback_random=False):
                return partition_fn(joint, joint_inputs, **kwargs)

        def uuid(self) -> Any:
            return version

    def inner_compile(*args: Any, **kwargs: Any) -> Any:
        # inductor raises the recursion limit for its code generation, for the forward
        # now and for the backward at its first run; the user's setting stays theirs
        limit = sys.getrecursionlimit()
        try:
            return compile_fx_inner(*args, **kwargs)
        finally:
            sys.setrecursionlimit(limit)

    patches = {**INDUCTOR_SETTINGS, "custom_partitioner_fn": _Partitioner()}
    if schedule_peaks is not None:
        def after_fusion(nodes: list[Any]) -> list[Any]:
            from torch._inductor.virtualized import V  # noqa: PLC0415

            kind = "backward" if V.graph.is_backward else "forward"
            schedule_peaks[kind] = _schedule_peak(nodes, resident or set())
            if schedule_orders is not None:
                schedule_orders[kind] = _schedule_order(nodes)
            if extern_layouts is not None:
                extern_layouts[kind] = _extern_layouts(nodes, relaid_ops)
            if schedule_kernels is not None:
                schedule_kernels[kind] = _schedule_kernels(nodes)
            return nodes

        patches |= {"_post_fusion_custom_pass": after_fusion, "fx_graph_cache": False}
    with functorch_cfg.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches=patches, decompositions=inductor_decompositions())
