"""The text of `MemoryPlan.summary()`: the headline numbers, then the largest saved
tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .budget import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .memory_plan import MemoryPlan


def _ddp_line(plan: MemoryPlan) -> str:
    """The summary's line on DDP's gradient buckets."""
    b = format_bytes
    line = f"  DDP gradient buckets: {b(plan.ddp_bucket_bytes)} (counted"
    in_grads = plan.ddp_bucket_bytes - plan.ddp_bucket_counted_bytes
    if in_grads:
        line += (f": {b(plan.ddp_bucket_counted_bytes)} held outside, {b(in_grads)} are "
                 f"the kept .grad tensors (gradient_as_bucket_view=True)")
    return line + ")"

def _offload_lines(plan: MemoryPlan, max_rows: int) -> list[str]:
    """The summary's lines on offloaded values and the link (memopt.offload)."""
    b, link = format_bytes, plan.link
    total = sum(o.nbytes for o in plan.offloaded)
    lines = [f"  offloaded        {b(total):>12}   in {len(plan.offloaded)} saved values, "
             f"copied to host memory between their forward and backward reads"]
    if link is not None:
        lines.append(
            f"  host link        {link.d2h_bytes_per_s / 1e9:.1f} GB/s out, "
            f"{link.h2d_bytes_per_s / 1e9:.1f} GB/s back; busy {link.busy_s * 1e3:.2f} ms "
            f"of the step's predicted {(link.compute_s + link.wait_s) * 1e3:.2f} ms "
            f"({link.occupancy:.0%}); the backward waits {link.wait_s * 1e3:.2f} ms for it")
    for o in sorted(plan.offloaded, key=lambda o: -o.nbytes)[:max_rows]:
        lines.append(f"    {o.name[:28]:<28} {b(o.nbytes):>10}  off the device after "
                     f"{o.freed_after}, back from {o.prefetch_at}, read at {o.first_read}")
    if len(plan.offloaded) > max_rows:
        lines.append(f"    ... {len(plan.offloaded) - max_rows} more")
    return lines


def plan_summary(plan: MemoryPlan, max_rows: int = 20) -> str:
    """A readable report: the headline numbers, then the largest saved tensors."""
    b = format_bytes
    budget = b(plan.budget_bytes) if plan.budget_bytes is not None else "none"
    if plan.headroom_bytes:
        budget += f", {b(plan.headroom_bytes)} of it headroom"
    lines = [
        f"memopt plan ({plan.device}): {plan.num_forward_steps} forward + "
        f"{plan.num_backward_steps} backward ops",
        f"  predicted peak   {b(plan.predicted_peak_bytes):>12}   (budget {budget})",
        f"  baseline peak    {b(plan.baseline_peak_bytes):>12}   (no memopt passes)",
        f"  lower bound      {b(plan.lower_bound_bytes):>12}   (max live bytes)",
        f"  arena            {b(plan.arena_bytes):>12}   (offsets: {plan.arena_layout})",
        f"  tag sharing      {b(plan.sharing_bytes):>12}   (Chen Sec. 3)",
        f"  no reuse         {b(plan.no_reuse_bytes):>12}   (every storage separate)",
        f"  resident         {b(plan.resident_bytes):>12}   (parameters, buffers, inputs"
        f"{', existing .grad' if plan.existing_grad_bytes else ''})",
        f"  peak at          {plan.peak_step}",
        f"  time             {plan.plan_seconds:.2f} s planning, {plan.capture_seconds:.2f} s "
        f"capture (dynamo + AOTAutograd)",
        f"  in-place rewrites {len(plan.inplace)}, sharing groups {len(plan.sharing)}, "
        f"saved tensors {len(plan.saved)} ({b(plan.saved_bytes)})",
    ]
    if plan.device.startswith("cuda") or plan.reserved_bounded:  # what a GPU runs out of
        counts = "reserved bytes too" if plan.reserved_bounded else "allocated bytes"
        lines.insert(2, f"  reserved (model) {b(plan.cuda_reserved_bytes()):>12}   (CUDA's caching "
                        f"allocator for this step; the budget counts {counts})")
    if plan.kernels != "aten" or plan.kernels_note:
        inductor = " (TorchInductor generates them; memopt.kernels)" \
            if plan.kernels == "inductor" else ""
        excess = f"; its schedule holds {format_bytes(plan.schedule_excess_bytes)} " \
            f"above the plan" if plan.schedule_excess_bytes else ""
        lines.append(f"  kernels          {plan.kernels_note or plan.kernels}{inductor}{excess}")
    if plan.outside_forward_bytes or plan.outside_backward_bytes:
        lines.append(
            f"  held outside     {b(plan.outside_forward_bytes):>12}   during its forward, "
            f"{b(plan.outside_backward_bytes)} during its backward (other graphs of the "
            f"step, parameters and inputs it does not take, gradients of later graphs"
            f"{', DDP gradient buckets' if plan.ddp_bucket_counted_bytes else ''}"
            f"{', optimizer state' if plan.optimizer_state_bytes else ''})")
    if plan.outside_after_backward_bytes:
        what = [w for w, on in (("FSDP2's reduce-scatter", plan.fsdp is not None),
                                ("the optimizer's step", plan.optimizer_step_bytes > 0),
                                ("the backward of the eager code before the graph",
                                 plan.eager_tail_bytes > 0))
                if on] or ["FSDP2's reduce-scatter"]
        lines.append(
            f"  after backward   {b(plan.outside_after_backward_bytes):>12}   allocated as "
            f"the backward ends, outside the graph ({' and '.join(what)})")
    if plan.outside_before_backward_bytes:
        lines.append(
            f"  before backward  {b(plan.outside_before_backward_bytes):>12}   held as the "
            + (f"caller's loss ({_caller_loss(plan)}) and, where there is any, the eager "
               f"code after the graph runs its backward, before the graph's"
               if plan.caller_loss_bytes else "eager code after the graph runs its "
               "backward, before the graph's (estimated)"))
    if plan.optimizer:
        step = (f"{plan.steps_in_backward} parameters stepped inside the backward as each "
                f"gradient completes, which is then freed" if plan.steps_in_backward else
                f"its step() allocates {b(plan.optimizer_step_bytes)} more"
                + (f", run in chunks of at most {b(plan.optimizer_step_chunk_bytes)} of "
                   f"parameters" if plan.optimizer_step_chunk_bytes else ""))
        lines.append(
            f"  optimizer        {b(plan.optimizer_state_bytes):>12}   {plan.optimizer} state, "
            f"held through the step; {step} (both in the predicted peak)")
    if plan.graph_break is not None:
        lines.append(f"  ends at break    {plan.graph_break.where()}")
    if plan.ddp_bucket_bytes:
        lines.append(_ddp_line(plan))
    if plan.fsdp is not None:
        lines.append(plan.fsdp.summary_line())
    if plan.existing_grad_bytes:
        lines.append(
            f"  existing .grad   {b(plan.existing_grad_bytes):>12}   (kept from earlier "
            f"steps; {plan.grads_added_in_place} new gradients added into them in place "
            f"as each completes)")
    if plan.recomputed:
        extra = plan.recompute_flops / plan.forward_flops if plan.forward_flops else 0.0
        lines.append(
            f"  recomputed ops   {len(plan.recomputed)} ({b(sum(r.nbytes for r in plan.recomputed))} "
            f"not kept), +{extra:.0%} of a forward pass; search tried {len(plan.search)} budgets"
        )
        twice = sum(1 for r in plan.recomputed if r.times > 1)
        if twice:
            lines.append(f"  recomputed twice {twice} (Chen Sec. 4.4 recursion)")
    if plan.offloaded:
        lines += _offload_lines(plan, max_rows)
    for c in plan.chains:
        lines.append(
            f"  chain {c.module} ({c.module_type}): T={c.steps} as t={c.t} chunks of "
            f"{c.chunk}, BPTT-{c.strategy.upper()} m={c.m}"
            f"{f' (alpha={c.alpha}, beta={c.beta})' if c.alpha is not None else ''}, "
            f"C(t,m)={c.cost} chunk "
            f"forwards ({c.recompute_steps} steps recomputed, about "
            f"{c.estimated_seconds * 1e3:.0f} ms forward + backward), holds {b(c.held_bytes)} "
            f"(+ {b(c.forward_workspace_bytes)} while its forward runs, "
            f"+ {b(c.workspace_bytes)} while its backward runs); {c.reason}")
    for h in plan.heads:
        lines.append(
            f"  head {h.module}: {h.tokens} tokens x vocabulary {h.vocab} in {h.chunks} "
            f"chunk(s) of {h.chunk}, "
            f"{'its logits formed whole for the caller' if h.returns_logits else 'no logits formed'}"
            f", holds {b(h.held_bytes)} (+ "
            f"{b(h.forward_workspace_bytes)} while its forward runs, + "
            f"{b(h.workspace_bytes)} while its backward runs); {h.reason}")
    for r in plan.reversible:
        cap = r.max_forget_bits if r.max_forget_bits is not None else "none"
        lines.append(
            f"  reversible {r.module} ({r.module_type}): T={r.steps}, {r.layers} layer(s), "
            f"no hidden-state slots (plain BPTT would store {b(r.stored_state_bytes)}); "
            f"holds {b(r.held_bytes)}: information buffers at most "
            f"{b(r.buffer_bound_bytes)} (forgetting cap {cap} bits) and the final state "
            f"(+ {b(r.forward_workspace_bytes)} while its forward runs, "
            f"+ {b(r.workspace_bytes)} while its backward runs)"
            + (f"; dropout {r.dropout:g} between layers, masks rebuilt from seeds, not "
               f"held" if r.dropout else ""))
    if plan.saved:
        lines.append("")
        header = f"  {'saved tensor':<28} {'op':<26} {'module':<32} {'shape':<20} {'bytes':>10}  decision"
        lines.append(header)
        rows = sorted(plan.saved, key=lambda s: -s.nbytes)
        for s in rows[:max_rows]:
            module = f"{s.module} ({s.module_type})" if s.module else "(root)"
            lines.append(
                f"  {s.name[:28]:<28} {s.op[:26]:<26} {module[:32]:<32} "
                f"{str(list(s.shape))[:20]:<20} {b(s.nbytes):>10}  {s.decision}"
            )
        if len(rows) > max_rows:
            lines.append(f"  ... {len(rows) - max_rows} more")
    return "\n".join(lines)


def _caller_loss(plan: MemoryPlan) -> str:
    """What the plan holds for the caller's loss, and where it comes from
    (memopt.caller_loss)."""
    held, measured = format_bytes(plan.caller_loss_bytes), plan.caller_loss_measured_bytes
    if measured is None:
        return f"{held} assumed from the largest output, until measured"
    if measured >= plan.caller_loss_bytes:
        return f"{held} measured"
    return f"{held} assumed, {format_bytes(measured)} measured"
