"""A picture of a plan's memory, and a report directory: `plan.plot(path)` and
`plan.save_report(dir)` (DIR/memory.png, DIR/summary.txt, DIR/plan.json); memopt.report
does the same from the command line for a plan saved with `plan.to_json()`.

The picture: bytes live over the training step (x: every forward op, then every backward
op, as memopt runs them), stacked by kind, for the baseline (memopt's predicted step with
no recomputation and no in-place rewrites, what a fraction budget is of) beside the step
as memopt runs it, sharing the y axis; the budget and the lower bound as horizontal
lines, the peak op labelled with the user's module it came from. The data is the plan's
own (MemoryPlan.timeline, MemoryPlan.baseline_timeline), recorded by memopt.planner
from the same liveness that gives the predicted peak, so a plan read back from JSON
plots the same picture.

matplotlib is an optional dependency (`pip install "memopt[plot]"`). It is drawn on a
`matplotlib.figure.Figure` with the Agg canvas: pyplot's global state and backend are
left as they are. This module does not import torch, nor memopt.memory_plan (whose
plans call it): a plan is a MemoryPlan, or a StepPlan whose `graphs` are MemoryPlans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memopt.allocator.timeline import KIND_LABELS, KINDS
from memopt.allocator.units import format_bytes

from .errors import NoTimelineError, OptionalDependencyError

#: Fill colour of each kind (allocator.timeline.KINDS).
KIND_COLORS = {
    "parameters": "#4c72b0",
    "inputs": "#8172b3",
    "gradients": "#64b5cd",
    "chain_states": "#8c564b",
    "saved": "#dd8452",
    "recomputed": "#55a868",
    "temporaries": "#c7c7c7",
    "workspace": "#7f7f7f",
    "other_graphs": "#e7a9cf",
}
BUDGET_COLOR = "#c44e52"
BOUND_COLOR = "#222222"
OFFLOAD_COLOR = "#937860"

#: The report's files, in `save_report`'s order.
REPORT_FILES = ("memory.png", "summary.txt", "plan.json")

#: A MemoryPlan, or a StepPlan (`graphs`: one MemoryPlan per graph of the step).
Plan = Any
Timeline = Any
MemoryPlan = Any


def graphs_of(plan: Plan) -> tuple[MemoryPlan, ...]:
    """The MemoryPlans of `plan`: a StepPlan's `graphs`, or the plan itself."""
    graphs = getattr(plan, "graphs", None)
    return tuple(graphs) if graphs is not None else (plan,)


def plot(plan: Plan, path: str | Path) -> Path:
    """Draw `plan` (see the module docstring) to `path`; return it. One row of two panels
    (baseline, memopt) per graph. Raises OptionalDependencyError without matplotlib,
    NoTimelineError for a plan that has no timeline."""
    graphs = graphs_of(plan)
    for i, g in enumerate(graphs):
        if g.timeline is None or g.baseline_timeline is None:
            raise NoTimelineError(i)
    figure_class, canvas_class = _matplotlib()
    unit, unit_name = _unit(max(max(g.timeline.peak_bytes, g.baseline_timeline.peak_bytes,
                                    g.budget_bytes or 0) for g in graphs))
    fig = figure_class(figsize=(11, 1.6 + 3.4 * len(graphs)), dpi=100, layout="constrained")
    canvas_class(fig)
    axes = fig.subplots(len(graphs), 2, sharey=True, squeeze=False)
    for row, g in zip(axes, graphs):
        where = f"graph {g.graph_index + 1}: " if len(graphs) > 1 else ""
        _panel(row[0], g.baseline_timeline, f"{where}baseline (no recomputation, no in-place)",
               g.budget_bytes, None, unit)
        _panel(row[1], g.timeline, f"{where}memopt", g.budget_bytes, g.lower_bound_bytes, unit)
        _offloaded(row[1], g)
        row[0].set_ylabel(f"{unit_name} live")
    axes[0][0].set_ylim(bottom=0)
    _legend(fig, axes, graphs)
    fig.suptitle(_title(plan), fontsize=12)
    path = Path(path)
    fig.savefig(path)
    return path


def save_report(plan: Plan, directory: str | Path) -> tuple[Path, Path, Path]:
    """Write REPORT_FILES into `directory` (created if missing): the picture (`plot`), the
    plan's `summary()` and its JSON. Returns their paths in that order. The summary and
    the JSON are written first, so they are there even when the picture cannot be drawn
    (no matplotlib: OptionalDependencyError; no timeline: NoTimelineError)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    png, summary, data = (directory / name for name in REPORT_FILES)
    summary.write_text(plan.summary() + "\n", encoding="utf-8")
    data.write_text(plan.to_json(), encoding="utf-8")
    plot(plan, png)
    return png, summary, data


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), imported without touching pyplot or its backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise OptionalDependencyError("matplotlib", "plot", "plotting a memory plan") from err
    return Figure, FigureCanvasAgg


def _unit(nbytes: int) -> tuple[int, str]:
    """The largest binary unit (bytes, KiB, ..., TiB) that `nbytes` is at least one of, so
    that the y axis reads in plain numbers of it (format_bytes's units)."""
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if nbytes >= 1024 ** power:
            return 1024 ** power, name
    return 1, "bytes"


def _panel(ax: Any, timeline: Timeline, title: str, budget: int | None,
           lower_bound: int | None, unit: int) -> None:
    """One timeline as stacked areas, a step per op, in `unit`s of bytes; the
    forward/backward boundary, the budget, the lower bound (where given) and the peak."""
    x = list(timeline.steps) + [timeline.num_steps]  # each point holds until the next
    ys = [[b / unit for b in column] + [column[-1] / unit if column else 0]
          for column in timeline.live]
    ax.stackplot(x, *ys, colors=[KIND_COLORS.get(k, "#bbbbbb") for k in timeline.kinds],
                 step="post", linewidth=0)
    ax.set_xlim(0, max(timeline.num_steps, 1))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("op of the step (forward, then backward)")
    if 0 < timeline.num_forward_steps < timeline.num_steps:
        ax.axvline(timeline.num_forward_steps, color="#555555", linewidth=0.8, linestyle=":")
        ax.text(timeline.num_forward_steps, 1.0, " backward", transform=ax.get_xaxis_transform(),
                va="top", ha="left", fontsize=8, color="#555555")
        ax.text(timeline.num_forward_steps, 1.0, "forward ", transform=ax.get_xaxis_transform(),
                va="top", ha="right", fontsize=8, color="#555555")
    if budget is not None:
        ax.axhline(budget / unit, color=BUDGET_COLOR, linewidth=1.2, linestyle="--")
    if lower_bound is not None:
        ax.axhline(lower_bound / unit, color=BOUND_COLOR, linewidth=0.9, linestyle=":")
    _label_peak(ax, timeline, unit)


def _offloaded(ax: Any, plan: MemoryPlan) -> None:
    """Where the plan offloads (memopt.offload): a bar along the panel's top for each
    offloaded value, from the op after which it leaves the device to the op its copy
    back is issued at, and the link's share of the step's time."""
    records = getattr(plan, "offloaded", ())
    if not records:
        return
    band = ax.get_xaxis_transform()  # x in ops, y in the panel's height
    for k, o in enumerate(sorted(records, key=lambda o: o.freed_step)):
        y = 0.93 - 0.025 * (k % 8)
        ax.plot([o.freed_step + 1, o.prefetch_step], [y, y], transform=band,
                color=OFFLOAD_COLOR, linewidth=2, solid_capstyle="butt")
    total = format_bytes(sum(o.nbytes for o in records))
    busy = f", link busy {plan.link.occupancy:.0%} of the step" if plan.link else ""
    ax.text(0.01, 0.965, f"on host: {len(records)} values, {total}{busy}", transform=ax.transAxes,
            fontsize=8, color=OFFLOAD_COLOR, va="bottom")


def _label_peak(ax: Any, timeline: Timeline, unit: int) -> None:
    """A marker at the peak and its bytes, op and module."""
    totals = timeline.totals
    if not totals:
        return
    point = totals.index(max(totals))
    step, peak = timeline.steps[point], totals[point]
    words = [f"peak {format_bytes(peak)}"]
    if timeline.peak_step:
        words.append(f"at {timeline.peak_step}")
    if timeline.peak_module:
        words.append(timeline.peak_module)
    ax.plot([step + 0.5], [peak / unit], marker="v", color="black", markersize=5)
    right = step > 0.6 * timeline.num_steps  # keep the label inside the panel
    ax.annotate("\n".join(words), (step + 0.5, peak / unit), xytext=(-8 if right else 8, -6),
                textcoords="offset points", ha="right" if right else "left", va="top",
                fontsize=8, bbox={"boxstyle": "round,pad=0.25", "facecolor": "white",
                                  "edgecolor": "#999999", "alpha": 0.9})


def _legend(fig: Any, axes: Any, graphs: tuple[MemoryPlan, ...]) -> None:
    """One legend for every panel: the kinds present anywhere, then the lines drawn."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    present = {k for g in graphs for t in (g.timeline, g.baseline_timeline) for k in t.kinds}
    handles = [Patch(color=KIND_COLORS.get(k, "#bbbbbb"), label=KIND_LABELS.get(k, k))
               for k in sorted(present, key=lambda k: KINDS.index(k) if k in KINDS else 99)]
    if any(g.budget_bytes is not None for g in graphs):
        budgets = {format_bytes(g.budget_bytes) for g in graphs if g.budget_bytes is not None}
        handles.append(Line2D([], [], color=BUDGET_COLOR, linestyle="--",
                              label=f"budget {', '.join(sorted(budgets))}"))
    bounds = {format_bytes(g.lower_bound_bytes) for g in graphs}
    handles.append(Line2D([], [], color=BOUND_COLOR, linestyle=":",
                          label=f"lower bound {', '.join(sorted(bounds))} (memopt's schedule)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5),
               fontsize=8, frameon=False)


def _title(plan: Plan) -> str:
    b = format_bytes
    budget = f", budget {b(plan.budget_bytes)}" if plan.budget_bytes is not None else ""
    count = len(graphs_of(plan))
    graphs = f" ({count} graphs)" if getattr(plan, "graphs", None) is not None else ""
    return (f"memopt{graphs}: predicted peak {b(plan.predicted_peak_bytes)} vs baseline "
            f"{b(plan.baseline_peak_bytes)}{budget}")
