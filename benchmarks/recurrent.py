"""Recurrent benchmarks: Gruslys et al. 2016's LSTM, the forum's word LM, reversible RNNs.

    python -m benchmarks.recurrent                 # all parts, T in 128 256 512 1000 2000
    python -m benchmarks.recurrent --quick         # T=128, the LM's main rows, reversible T=100
    python -m benchmarks.recurrent --parts reversible
    python -m benchmarks.recurrent --T 1000 --parts gruslys

Every cell is one training step measured in a fresh process (``memopt.measure``,
``isolate=True``): peak = parameters + buffers + inputs + everything the step allocates.
The peak every column compares is the *allocated* peak (``allocated_peak_bytes``: on
CUDA ``max_memory_allocated``, on CPU the allocator's live bytes from the profiler's
allocation events), which is what a memopt budget counts and what a GPU charges. On CPU
the table also shows the RSS peak (the VmHWM rise plus the resident tensors): it is lower
for LSTMs, because oneDNN's LSTM writes only part of the workspace it allocates for
backward, and untouched pages take no RAM. Times are ratios to eager measured in the
same run; on a shared 2-core CPU read them as rough.

Part 1, Gruslys et al. 2016 Sec. 4: ``nn.LSTM(256, 256)``, batch 64, sequence length T,
loss = MSE of the output sequence to a random target, computed inside the model so that
memopt plans the whole step (the inputs need no grad). The fixed part of the peak is
what no plan removes: the resident bytes (parameters, buffers, the input and the target)
plus the parameter gradients. Eager's activation memory is its peak minus the
fixed part; memopt runs with no budget, at budgets of 25%, 20%, 15%, 10% and 5% of it
(budget = fixed + f x activation memory), and at its minimum when a budget raises
BudgetError. "activation memory saved" is ``1 - (peak - fixed) / (eager peak - fixed)``.
The paper's claim to compare with: T=1000, 95% of the memory saved for 33% more time; it
counts the RNN's own states (inputs excluded). Here the chain's whole output sequence
exists in forward (the loss reads it) and its gradient in backward: two T x 64 x 256
tensors, 8% of eager's allocated activation memory, which no plan of the model removes.
The column "RNN states held in backward" is the paper's measure: memopt's plan of what
the chain holds (stored hidden states plus one chunk's internal states), saved against
the unsplit chain of the budget=None plan.

Part 2, the forum's word language model (benchmarks/recurrent_workloads.py): BPTT 512,
batch 20, pytorch/examples' defaults (2-layer LSTM, 200 units, dropout 0.2) on the
WikiText-2 slice (vocabulary 5,508). Rows: eager full BPTT; the forum's two-chunk BPTT
(``ChunkedBPTT``: the same gradients with one 256-step chunk's graph at a time); memopt
with no budget, at the two-chunk method's measured peak, at 90%, 85%, 50% and 30% of it,
and at its minimum.

Timed steps: each cell runs one warm-up step (memopt compiles there), the measured step
and ``--timed-steps`` more (default 3); the time is the median.

memopt's minimum is found by planning alone (``memopt.plan(..., budget=1)`` raises
``BudgetError`` with ``minimum_bytes``). At its minimum the Gruslys DP may keep one hidden
state (m = 1) and recompute O(t^2) steps; such a plan is run only if it recomputes at most
``--max-extra`` forward passes of the sequence (default 10), otherwise the row shows its
predicted peak and chain and says "not run". A cell that takes longer than
``--cell-timeout`` seconds (default 900) is reported as timed out.

Part 2b, packed sequences (``--parts packed``): ``PackedTagger`` of
benchmarks/recurrent_workloads.py, a 2-layer LSTM(128, 256) tagger, uni- and bidirectional,
over a PackedSequence of 32 sequences whose lengths spread 4x (64 to 256): eager, memopt
with no budget, at 90%, 80% and 70% of eager's peak.

Part 2c, state-space scans (``--parts scan``): transformers' Mamba of
benchmarks/recurrent_workloads.py (``mamba_scan``: its sequential scan, which memopt runs as
a Gruslys chain; ``mamba_parallel``: the parallel scan torch.compile takes by default),
batch 4 x 256 tokens: eager, memopt with no budget, at 90%, 70% and 50% of eager's peak.

Part 3, MacKay et al. 2018's reversible RNNs (benchmarks/reversible.py, also runnable
alone as ``python -m benchmarks.reversible``): ``memopt.nn.RevGRU`` / ``RevLSTM`` with the
paper's forgetting cap of 3 bits against nn.GRU / nn.LSTM and against the same module under
plain autograd, T in 100, 500, 1000 and hidden 256 to 1024 (``--quick``: T=100, hidden 256):
the allocated bytes held for backward, the allocated peak of forward + backward, time ratios,
and the information buffer's size and bits forgotten per unit per step (eq. 17). It runs
on CPU whatever ``--device`` says, and ``--timed-steps`` sets its number of timed steps.

The children run with ``OMP_WAIT_POLICY=PASSIVE`` (unless the environment sets it): on
this shared 2-core machine, with one other busy process, OpenMP's default spin-waiting made
an eager LM step take 19-20 s instead of 2.4 s (with PASSIVE, or with one thread), which
makes a time column meaningless. Still, run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memopt.budget import format_bytes
from memopt.measure import Measurement, measure_step

from benchmarks.reversible import run_reversible
from benchmarks.run import rss_cell

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = "benchmarks.recurrent_workloads"
DEFAULT_T = (128, 256, 512, 1000, 2000)
QUICK_T = (128,)
FRACTIONS = (0.25, 0.20, 0.15, 0.11, 0.10, 0.05)
"""Budgets of Part 1, as fractions of eager's activation memory."""
LM_FRACTIONS = (0.90, 0.85, 0.50, 0.30)
"""Budgets of Part 2 below the two-chunk method's peak, as fractions of that peak."""
PARTS = ("gruslys", "lm", "packed", "scan", "reversible")


# --------------------------------------------------------------------------
# Cells
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One measured configuration, or why it has no measurement."""

    label: str
    budget: int | None
    result: Measurement | None = None
    error: str | None = None  # "BudgetError", "CaptureError", ... (the child's exception type)
    detail: str = ""          # the child's last stderr lines
    skipped: Minimum | None = None  # not run: the plan recomputes too much (see --max-extra)

    @property
    def ok(self) -> bool:
        return self.result is not None


def _error_kind(text: str) -> str:
    """The memopt exception named in a child's stderr (the child raised it; we only report)."""
    for kind in ("BudgetError", "CaptureError", "PassError", "OutOfMemoryError", "timed out"):
        if kind in text:
            return kind
    return "failed"


def measure(spec: str, label: str, *, mode: str, budget: int | None, device: str,
            timed_steps: int, timeout: float = 1800) -> Cell:
    t0 = time.perf_counter()
    try:
        m = measure_step(f"{WORKLOADS}:{spec}", mode=mode, budget=budget, device=device,
                         timed_steps=timed_steps, isolate=True, timeout=timeout)
    except RuntimeError as err:
        text = str(err)
        cell = Cell(label, budget, error=_error_kind(text), detail=_last_lines(text))
    else:
        cell = Cell(label, budget, result=m)
    print(f"# {spec} {label}: {cell.error or format_bytes(cell.result.budget_peak_bytes)} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return cell


def _last_lines(text: str, lines: int = 1) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@dataclass(frozen=True)
class Minimum:
    """memopt's smallest accepted budget for a workload and its plan there (not run)."""

    budget: int | None = None        # BudgetError.minimum_bytes of a 1-byte budget
    predicted: int | None = None     # the plan at that budget: predicted peak
    chains: tuple[dict, ...] = ()    # ... and its chains (scalar fields)
    heads: tuple[dict, ...] = ()     # ... and its language-model heads
    error: str | None = None         # why there is no minimum

    def extra_forwards(self) -> float:
        """Recomputed time steps over the sequence length, summed over the chains."""
        return sum(c.get("recompute_steps", 0) / max(1, c.get("steps", 1)) for c in self.chains)


def minimum_budget(spec: str, device: str, timeout: float = 1800) -> Minimum:
    """Plan ``spec`` in a fresh process (nothing runs): ``BudgetError.minimum_bytes`` of
    ``memopt.plan(..., budget=1)``, then the plan at that budget."""
    cmd = [sys.executable, "-m", "benchmarks.recurrent", "--minimum-of", spec,
           "--device", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return Minimum(error=f"planning timed out after {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            answer = json.loads(line)
            return Minimum(budget=answer.get("minimum_bytes"), predicted=answer.get("predicted"),
                           chains=tuple(answer.get("chains", ())),
                           heads=tuple(answer.get("heads", ())), error=answer.get("error"))
    return Minimum(error=f"failed: {_last_lines(proc.stderr)}")


def _print_minimum(spec: str, device: str) -> int:
    """The child of :func:`minimum_budget`: print one JSON line."""
    import memopt
    from memopt.measure.inprocess import scalar_fields

    from benchmarks import recurrent_workloads

    wl = getattr(recurrent_workloads, spec)(device)
    answer: dict[str, Any] = {}
    try:
        memopt.plan(wl.model, *wl.args, example_kwargs=wl.kwargs, budget=1)
        answer["error"] = "a 1-byte budget was met"
    except memopt.BudgetError as err:
        answer["minimum_bytes"] = err.minimum_bytes
        plan = memopt.plan(wl.model, *wl.args, example_kwargs=wl.kwargs,
                           budget=err.minimum_bytes)
        answer["predicted"] = plan.predicted_peak_bytes
        answer["chains"] = [scalar_fields(c) for c in getattr(plan, "chains", ())]
        answer["heads"] = [scalar_fields(h) for h in getattr(plan, "heads", ())]
    except Exception as err:  # report any failure as data; the parent prints it
        answer["error"] = f"{type(err).__name__}: {err}"[:2000]
    print(json.dumps(answer))
    return 0


def measure_minimum(spec: str, minimum: Minimum, *, device: str, timed_steps: int,
                    timeout: float, max_extra: float) -> Cell:
    """memopt at its minimum budget, unless that plan recomputes more than ``max_extra``
    forward passes of the sequence (at m = 1 the Gruslys DP recomputes O(t^2) steps)."""
    if minimum.extra_forwards() > max_extra:
        print(f"# {spec} memopt minimum: not run ({minimum.extra_forwards():.0f} extra "
              f"forward passes > {max_extra:g})", file=sys.stderr, flush=True)
        return Cell("memopt minimum", minimum.budget, skipped=minimum)
    return measure(spec, "memopt minimum", mode="memopt", budget=minimum.budget, device=device,
                   timed_steps=timed_steps, timeout=timeout)


def fixed_bytes(spec: str, resident: int) -> int:
    """Resident bytes plus the parameter gradients: the part of the peak no plan removes."""
    from benchmarks import recurrent_workloads

    wl = getattr(recurrent_workloads, spec)("meta")
    grads = sum(p.numel() * p.element_size() for p in wl.model.parameters() if p.requires_grad)
    return resident + grads


# --------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r + ["-"] * (len(header) - len(r))) + " |" for r in rows]
    return "\n".join(lines)


def chain_cells(chains: Sequence[dict] | None) -> list[str]:
    """Each chain of memopt's plan: t chunks x chunk length, m, strategy (MSM's alpha and
    beta with it), the DP's cost C(t, m) (chunk forwards, the first pass included) and
    the time steps recomputed."""
    if not chains:
        return ["-"] * len(CHAIN_HEADER)
    cells: list[list[str]] = [[] for _ in CHAIN_HEADER]
    for chain in chains:
        strategy = chain.get("strategy")
        if chain.get("alpha") is not None:  # MSM: an internal state's units
            strategy = f"{strategy} (alpha={chain['alpha']}, beta={chain.get('beta')})"
        values = (f"{chain.get('t')} x {chain.get('chunk')}", chain.get("m"),
                  strategy, chain.get("cost"), chain.get("recompute_steps"))
        for column, value in zip(cells, values):
            column.append(str(value))
    return ["; ".join(c) for c in cells]


CHAIN_HEADER = ["chain t x chunk", "m", "strategy", "C(t, m)", "recomputed steps"]


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n else "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


# --------------------------------------------------------------------------
# Part 1: Gruslys et al. 2016
# --------------------------------------------------------------------------

GRUSLYS_HEADER = ["T", "config", "budget", "predicted", "measured peak", "RSS peak (CPU)",
                  "activation memory saved", "RNN states held in backward (saved)",
                  "time / eager", *CHAIN_HEADER]


def _held(chains: Sequence[dict] | None) -> int | None:
    """Bytes the plan's chains hold in backward: stored states + one chunk's internal states."""
    if not chains or any(c.get("held_bytes") is None for c in chains):
        return None
    return sum(c["held_bytes"] for c in chains)


def run_gruslys(lengths: Sequence[int], device: str, timed_steps: int,
                failures: list[tuple[str, str]], notes: list[str], *, cell_timeout: float,
                max_extra: float) -> list[list[str]]:
    rows = []
    for T in lengths:
        spec = f"lstm_T{T}"
        eager = measure(spec, "eager", mode="eager", budget=None, device=device,
                        timed_steps=timed_steps, timeout=cell_timeout)
        if not eager.ok:
            failures.append((f"T={T} eager", eager.detail))
            rows.append([str(T), "eager", "-", "-", eager.error])
            continue
        e = eager.result
        fixed = fixed_bytes(spec, e.resident_bytes)
        activation = e.budget_peak_bytes - fixed
        floor = 2 * T * 64 * 256 * 4  # the output sequence and its gradient (float32)
        notes.append(f"T={T}: fixed {format_bytes(fixed)} (resident "
                     f"{format_bytes(e.resident_bytes)} + parameter gradients), eager's "
                     f"activation memory {format_bytes(activation)}, of which the output and "
                     f"its gradient {format_bytes(floor)} ({floor / activation:.0%})")
        rows.append([str(T), "eager", "-", "-", format_bytes(e.budget_peak_bytes), rss_cell(e),
                     "0%", "-",
                     f"1.00x ({e.step_seconds:.1f} s)"])
        held_all: int | None = None  # the unsplit chain's (budget=None)

        def row(cell: Cell, budget_text: str) -> list[str]:
            if cell.skipped is not None:
                low = cell.skipped
                return [str(T), cell.label, budget_text, _bytes(low.predicted),
                        f"not run: {low.extra_forwards():.0f} extra forward passes", "-", "-",
                        held_text(_held(low.chains)), "-", *chain_cells(low.chains)]
            if not cell.ok:
                failures.append((f"T={T} {cell.label}", cell.detail))
                return [str(T), cell.label, budget_text, "-", cell.error]
            m = cell.result
            saved = 1 - (m.budget_peak_bytes - fixed) / activation
            over = "" if cell.budget is None or m.budget_peak_bytes <= cell.budget else " (over)"
            return [str(T), cell.label, budget_text, _bytes(m.predicted_peak_bytes),
                    format_bytes(m.budget_peak_bytes) + over, rss_cell(m), f"{saved:.1%}",
                    held_text(_held(m.chains)), _ratio(m.step_seconds, e.step_seconds),
                    *chain_cells(m.chains)]

        def held_text(held: int | None) -> str:
            if held is None:
                return "-"
            if not held_all:
                return format_bytes(held)
            return f"{format_bytes(held)} ({1 - held / held_all:.1%})"

        cell = measure(spec, "memopt budget=None", mode="memopt", budget=None, device=device,
                       timed_steps=timed_steps, timeout=cell_timeout)
        held_all = _held(cell.result.chains) if cell.ok else None
        rows.append(row(cell, "-"))
        minimum: Minimum | None = None
        for f in FRACTIONS:
            budget = fixed + int(f * activation)
            cell = measure(spec, f"memopt {f:.0%}", mode="memopt", budget=budget,
                           device=device, timed_steps=timed_steps, timeout=cell_timeout)
            text = format_bytes(budget)
            if cell.error == "BudgetError":
                if minimum is None:
                    minimum = minimum_budget(spec, device)
                rows.append([str(T), cell.label, text, "-",
                             f"BudgetError (min {_bytes(minimum.budget)})"])
                continue
            rows.append(row(cell, text))
        if minimum is not None and minimum.budget:
            cell = measure_minimum(spec, minimum, device=device, timed_steps=timed_steps,
                                   timeout=cell_timeout, max_extra=max_extra)
            rows.append(row(cell, format_bytes(minimum.budget)))
        elif minimum is not None:
            failures.append((f"T={T} memopt minimum", minimum.error or "failed"))
        print(f"# T={T}: done", file=sys.stderr, flush=True)
    return rows


def _group(failures: list[tuple[str, str]]) -> dict[str, list[str]]:
    """The cells of each distinct error, in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for where, error in failures:
        groups.setdefault(error, []).append(where)
    return groups


# --------------------------------------------------------------------------
# Part 2: the forum's word language model, BPTT 512
# --------------------------------------------------------------------------

LM_HEADER = ["config", "budget", "predicted", "measured peak", "measured / eager",
             "measured / two-chunk", "measured <= budget", "RSS peak (CPU)",
             "RSS / two-chunk", "time / eager", "time / two-chunk", *CHAIN_HEADER,
             "decoder chunks x tokens"]


def head_cell(heads: Sequence[dict] | None) -> str:
    """Each language-model head of memopt's plan: chunks x tokens per chunk."""
    return "; ".join(f"{h.get('chunks')} x {h.get('chunk')}" for h in heads) if heads else "-"


def run_lm(device: str, timed_steps: int, quick: bool, failures: list[tuple[str, str]], *,
           cell_timeout: float, max_extra: float) -> list[list[str]]:
    eager = measure("wlm", "eager (full BPTT 512)", mode="eager", budget=None, device=device,
                    timed_steps=timed_steps, timeout=cell_timeout)
    chunked = measure("wlm_two_chunk", "forum two-chunk (2 x 256)", mode="eager", budget=None,
                      device=device, timed_steps=timed_steps, timeout=cell_timeout)
    for cell in (eager, chunked):
        if not cell.ok:
            failures.append((f"LM {cell.label}", cell.detail))
    if not (eager.ok and chunked.ok):
        return [[c.label, "-", "-", c.error or format_bytes(c.result.budget_peak_bytes)]
                for c in (eager, chunked)]
    e, two = eager.result, chunked.result

    def row(cell: Cell) -> list[str]:
        budget = _bytes(cell.budget)
        if cell.skipped is not None:
            low = cell.skipped
            return [cell.label, budget, _bytes(low.predicted),
                    f"not run: {low.extra_forwards():.0f} extra forward passes", "-", "-", "-",
                    "-", "-", "-", "-", *chain_cells(low.chains), head_cell(low.heads)]
        if cell.error == "BudgetError":
            return [cell.label, budget, "-", f"BudgetError (min {_bytes(minimum.budget)})"]
        if not cell.ok:
            failures.append((f"LM {cell.label}", cell.detail))
            return [cell.label, budget, "-", cell.error]
        m = cell.result
        peak = m.budget_peak_bytes
        fits = "-" if cell.budget is None else ("yes" if peak <= cell.budget else "**no**")
        seconds = f" ({m.step_seconds:.1f} s)" if m is e else ""
        rss_ratio = _ratio(m.peak_bytes, two.peak_bytes) if m.device == "cpu" else "-"
        return [cell.label, budget, _bytes(m.predicted_peak_bytes), format_bytes(peak),
                _ratio(peak, e.budget_peak_bytes), _ratio(peak, two.budget_peak_bytes), fits,
                rss_cell(m), rss_ratio, _ratio(m.step_seconds, e.step_seconds) + seconds,
                _ratio(m.step_seconds, two.step_seconds), *chain_cells(m.chains),
                head_cell(m.heads)]

    minimum = minimum_budget("wlm", device)
    rows = [row(eager), row(chunked)]
    configs: list[tuple[str, int | None]] = [
        ("memopt at the two-chunk peak", two.budget_peak_bytes)]
    if not quick:
        configs.insert(0, ("memopt budget=None", None))
        configs += [(f"memopt {f:.0%} of the two-chunk peak", int(f * two.budget_peak_bytes))
                    for f in LM_FRACTIONS]
    for label, budget in configs:
        rows.append(row(measure("wlm", label, mode="memopt", budget=budget, device=device,
                                timed_steps=timed_steps, timeout=cell_timeout)))
    if minimum.budget:
        rows.append(row(measure_minimum("wlm", minimum, device=device, timed_steps=timed_steps,
                                        timeout=cell_timeout, max_extra=max_extra)))
    else:
        failures.append(("LM memopt minimum", minimum.error or "failed"))
        rows.append(["memopt minimum", "-", "-", "failed"])
    print("# LM: done", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------
# Part 2b: packed sequences
# --------------------------------------------------------------------------

PACKED_HEADER = ["model", "config", "budget", "predicted", "measured peak",
                 "measured / eager", "within budget", "time / eager", *CHAIN_HEADER]
PACKED_FRACTIONS = (0.9, 0.8, 0.7)
SCAN_FRACTIONS = (0.9, 0.7, 0.5, 0.25)
"""Budgets of Part 2c, as fractions of eager's measured peak."""
"""Budgets of Part 2b, as fractions of eager's measured peak."""


def run_budgets(specs: Sequence[str], fractions: Sequence[float], part: str, device: str,
                timed_steps: int, failures: list[tuple[str, str]], *, cell_timeout: float
                ) -> list[list[str]]:
    """Each workload of ``specs``: eager, memopt with no budget and at each fraction of
    eager's measured peak, one fresh process per cell (Parts 2b and 2c)."""
    rows = []
    for spec in specs:
        eager = measure(spec, "eager", mode="eager", budget=None, device=device,
                        timed_steps=timed_steps, timeout=cell_timeout)
        if not eager.ok:
            failures.append((f"{spec} eager", eager.detail))
            rows.append([spec, "eager", "-", "-", eager.error])
            continue
        e = eager.result
        rows.append([spec, "eager", "-", "-", format_bytes(e.budget_peak_bytes), "1.00x", "-",
                     f"1.00x ({e.step_seconds:.2f} s)"])
        configs = [("memopt budget=None", None)] + [
            (f"memopt {f:.0%} of eager", int(f * e.budget_peak_bytes)) for f in fractions]
        for label, budget in configs:
            cell = measure(spec, label, mode="memopt", budget=budget, device=device,
                           timed_steps=timed_steps, timeout=cell_timeout)
            if not cell.ok:
                failures.append((f"{spec} {label}", cell.detail))
                rows.append([spec, label, _bytes(budget), "-", cell.error])
                continue
            m = cell.result
            peak = m.budget_peak_bytes
            fits = "-" if budget is None else ("yes" if peak <= budget else "**no**")
            rows.append([spec, label, _bytes(budget), _bytes(m.predicted_peak_bytes),
                         format_bytes(peak), _ratio(peak, e.budget_peak_bytes), fits,
                         _ratio(m.step_seconds, e.step_seconds), *chain_cells(m.chains)])
    print(f"# {part}: done", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=None,
                        help="sequence lengths of Part 1 (default "
                             f"{' '.join(map(str, DEFAULT_T))})")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--quick", action="store_true",
                        help=f"T={' '.join(map(str, QUICK_T))}, the LM's eager, two-chunk, "
                             "at-two-chunk-peak and minimum rows, and the reversible RNNs at "
                             "T=100, hidden 256")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timed-steps", type=int, default=3,
                        help="extra timed steps per cell (default 3)")
    parser.add_argument("--max-extra", type=float, default=10,
                        help="run memopt's minimum only if its plan recomputes at most this "
                             "many forward passes of the sequence (default 10)")
    parser.add_argument("--cell-timeout", type=float, default=900,
                        help="seconds before one measurement is given up (default 900)")
    parser.add_argument("--minimum-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.minimum_of:
        return _print_minimum(args.minimum_of, args.device)

    # Children inherit it: OpenMP threads that sleep rather than spin when they wait, so
    # that another process on the machine does not slow every kernel down many times over.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    lengths = args.T or (QUICK_T if args.quick else DEFAULT_T)
    failures: list[tuple[str, str]] = []
    notes: list[str] = []
    start = time.perf_counter()
    out = []
    if "gruslys" in args.parts:
        rows = run_gruslys(lengths, args.device, args.timed_steps, failures, notes,
                           cell_timeout=args.cell_timeout, max_extra=args.max_extra)
        out += [f"\nGruslys et al. 2016 Sec. 4: nn.LSTM(256, 256), batch 64, MSE loss, "
                f"device={args.device} (one fresh process per cell, "
                f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})\n",
                markdown(rows, GRUSLYS_HEADER), "", *[f"- {n}" for n in notes]]
    if "lm" in args.parts:
        rows = run_lm(args.device, args.timed_steps, args.quick, failures,
                      cell_timeout=args.cell_timeout, max_extra=args.max_extra)
        out += [f"\nForum word LM: 2-layer LSTM 200, vocabulary 5,508, batch 20, BPTT 512, "
                f"device={args.device} (one fresh process per cell, "
                f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})\n",
                markdown(rows, LM_HEADER)]
    if "packed" in args.parts:
        rows = run_budgets(("packed_tagger", "packed_tagger_bi"), PACKED_FRACTIONS, "packed",
                           args.device, args.timed_steps, failures,
                           cell_timeout=args.cell_timeout)
        out += [f"\nPacked sequences: 2-layer LSTM(128, 256) tagger, 32 sequences of 64 to 256 "
                f"steps, device={args.device} (one fresh process per cell)\n",
                markdown(rows, PACKED_HEADER)]
    if "scan" in args.parts:
        rows = run_budgets(("mamba_scan", "mamba_parallel"), SCAN_FRACTIONS, "scan",
                           args.device, args.timed_steps, failures,
                           cell_timeout=args.cell_timeout)
        out += [f"\nState-space scans: transformers' Mamba (2 layers, hidden 128, state 16), "
                f"batch 4 x 256 tokens, its sequential and its parallel scan, "
                f"device={args.device} (one fresh process per cell)\n",
                markdown(rows, PACKED_HEADER)]
    if "reversible" in args.parts:
        out.append(run_reversible(quick=args.quick, repeats=args.timed_steps,
                                  cell_timeout=args.cell_timeout))
    print("\n".join(out))
    if failures:
        print("\nFailures (each child's last stderr line):\n")
        for error, where in _group(failures).items():
            print(f"- {', '.join(where)}:\n  {error}")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
