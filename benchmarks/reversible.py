"""Reversible RNNs (MacKay et al. 2018): memopt.nn.RevGRU / RevLSTM against nn.GRU / nn.LSTM.

    python -m benchmarks.reversible                # DEFAULT_GRID (8-11 min on CPU)
    python -m benchmarks.reversible --quick        # T=100, hidden 256, both cells (~30 s)
    python -m benchmarks.recurrent --parts reversible [--quick]

Each row is one cell (GRU or LSTM), one layer, sequence length T, hidden size H, input
size H, batch 16, float32, run three ways on the same input and output gradient:
the standard module (nn.GRU / nn.LSTM), the reversible one (``RevGRU`` / ``RevLSTM``,
whose backward reconstructs the hidden states from the final one and the information
buffer) and the reference (the same reversible module through ``.autograd_forward``:
the same fixed-point forward under ordinary autograd, every step's graph held). One
step is ``out, h_n = rnn(x); out.backward(grad)``: the input needs no gradient, and the
output gradient is a random tensor allocated beforehand. The forgetting cap is the
paper's ``max_forget_bits=3`` (Sec. 5.3; Table 1-2 use 2, 3, 5 and none); a row with
no cap says so.

What is counted (allocated bytes: on CPU the profiler's allocation events summed in
time order, ``memopt.measure.allocation_peak``; what a GPU allocator would charge):

- held: bytes allocated during the forward and still live after it, less the tensors
  the forward returns (the output sequence and the final state, which every variant
  returns and the caller keeps; counted once per storage). That is what the graph keeps
  for backward: the standard modules' per-step gates and states, the reference's every
  step, the reversible module's information buffer, its final state (int64) and its
  initial state (to check the reversal).
- peak: the most bytes live at once during forward + backward, over those live before
  the forward (parameters, the input and the output gradient, allocated beforehand):
  it includes the returned tensors and the parameter gradients, so at small T it is
  bounded below by them for every variant.
- time: forward + backward, median of ``repeats`` steps after one warm-up step, the three
  variants' steps interleaved, without the profiler (the allocations are measured in one
  more step each, profiled).
- buffer: the information buffer's bytes after the forward (int64 words per unit,
  ``BufferSize.nbytes``), the bits forgotten per unit per step (eq. 17, ideal:
  ``ideal_bits / (units x T)``), and "states / buffer": float32 hidden states of
  every step (32 bits per unit per step, eq. 16's naive cost) over the buffer's bytes,
  the measure of the paper's Table 1 (10-15x at 2-3 bits, 5-7x with no cap, for
  *trained* models), and "states / buffer bound", the same over the buffer's bound
  (``memopt.nn.ops.buffer_bound_bytes``: every step forgetting the cap's bits), the
  ratio no trained model goes below and what memopt.compile's planner charges. These
  models are untrained: their forget gates sit near 0.5, so they forget about 1 bit per
  unit per step (less under the cap, which lifts the gate to at least 1/8), while
  trained models forget more; the memory ratios here are those of untrained weights.

The weights differ between standard and reversible modules (eq. 4-5, 11-14: each half
of the state sees only the other half), so their times compare implementations, not
equal arithmetic. The reversible forward and backward are Python loops over time
steps with int64 arithmetic; MacKay et al. report 2-3x the computation of ordinary
backprop (Sec. 5.3, "Limitations") for a careful implementation.

Each row runs in a fresh process with ``OMP_WAIT_POLICY=PASSIVE`` (unless the
environment sets it), as benchmarks/recurrent.py does; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from memopt.budget import format_bytes
from memopt.measure import allocation_peak

ROOT = Path(__file__).resolve().parents[1]
Forward = Callable[[Tensor], tuple[Tensor, Any]]  # rnn(x) -> (output, h_n)
CELLS = ("gru", "lstm")


@dataclass(frozen=True)
class Config:
    """One row: cell ("gru" or "lstm"), sequence length, hidden size (= input size),
    forgetting cap (None: no cap), batch."""

    cell: str
    T: int
    hidden: int
    cap: int | None = 3
    batch: int = 16


def _grid(sizes: Sequence[tuple[int, int]], extra: Sequence[tuple[int, int, int | None]] = ()
          ) -> tuple[Config, ...]:
    """(T, hidden) pairs with the paper's cap of 3 bits, plus (T, hidden, cap) rows,
    for both cells."""
    rows = [(T, hidden, 3) for T, hidden in sizes] + list(extra)
    return tuple(Config(cell, T, hidden, cap) for cell in CELLS for T, hidden, cap in rows)


DEFAULT_GRID = _grid([(100, 256), (100, 1024), (500, 512), (1000, 256)], extra=[(100, 256, None)])
"""The default part: hidden 256 and 1024 at T=100, 512 at T=500, 256 at T=1000, and one row
without a cap. Not every (T, hidden) pair: the reversible and reference steps are Python
loops of many small ops per time step, ten times slower under the profiler, so a row
takes about 15 s at T=100, hidden 256, 40-60 s at T=100, hidden 1024, 60-100 s at T=500,
hidden 512 or at T=1000, hidden 256 (T=1000, hidden 512 would take about 3 min, by
extrapolation). The grid took 8 minutes on the 2-core CPU otherwise idle, 11 with another
job running."""
QUICK_GRID = _grid([(100, 256)])

HEADER = ["cell", "T", "hidden", "cap", "standard held", "reversible held",
          "standard / reversible", "reference held", "reference / reversible",
          "peak: standard / reversible", "peak: reference / reversible", "reversible peak",
          "time: reversible / standard", "time: reversible / reference", "standard time",
          "buffer", "bits forgotten / unit / step (eq. 17)", "states / buffer",
          "states / buffer bound"]


# --------------------------------------------------------------------------
# Measuring one row (in the child process)
# --------------------------------------------------------------------------


def _returned_bytes(out: Tensor, h_n: Tensor | tuple[Tensor, ...]) -> int:
    """Bytes of the returned tensors, once per storage (a view costs nothing extra)."""
    storages = {}
    for t in (out, *(h_n if isinstance(h_n, tuple) else (h_n,))):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _clear(params: Sequence[Tensor]) -> None:
    """Parameter gradients to None, as ``zero_grad(set_to_none=True)``; free the garbage."""
    for p in params:
        p.grad = None
    gc.collect()


def time_step(forward: Forward, params: Sequence[Tensor], x: Tensor, grad: Tensor) -> float:
    """Seconds of one forward + backward."""
    start = time.perf_counter()
    out, _ = forward(x)
    out.backward(grad)
    seconds = time.perf_counter() - start
    _clear(params)
    return seconds


def measure_allocations(forward: Forward, params: Sequence[Tensor], x: Tensor, grad: Tensor
                        ) -> tuple[int, int]:
    """Bytes held for backward and the peak of one profiled forward + backward (see the
    module docstring for what each counts)."""
    with allocation_peak("cpu") as fwd:
        out, h_n = forward(x)
    held = fwd.end - _returned_bytes(out, h_n)
    with allocation_peak("cpu") as bwd:
        out.backward(grad)
    del out, h_n
    _clear(params)
    return held, max(fwd.peak, fwd.end + bwd.peak)


def measure_config(config: Config, repeats: int = 3) -> dict[str, Any]:
    """Standard, reversible and reference steps of one row, in this process: one warm-up
    step each, ``repeats`` timed steps each, interleaved (so that a load that comes and
    goes slows the three alike), then one profiled step each; and the reversible module's
    buffer after its profiled forward. Returns plain data (JSON-able)."""
    from memopt.nn import RevGRU, RevLSTM, ops  # here: the parent never needs memopt.nn

    standard_type, reversible_type = {"gru": (nn.GRU, RevGRU), "lstm": (nn.LSTM, RevLSTM)}[
        config.cell]
    torch.manual_seed(0)
    standard = standard_type(config.hidden, config.hidden)
    reversible = reversible_type(config.hidden, config.hidden, max_forget_bits=config.cap)
    x = torch.randn(config.T, config.batch, config.hidden)
    grad = torch.randn(config.T, config.batch, config.hidden)
    variants = {"standard": (standard, list(standard.parameters())),
                "reversible": (reversible, list(reversible.parameters())),
                "reference": (reversible.autograd_forward, list(reversible.parameters()))}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for rounds in range(1 + repeats):  # round 0: warm-up, not recorded
        for name, (forward, params) in variants.items():
            elapsed = time_step(forward, params, x, grad)
            if rounds:
                seconds[name].append(elapsed)
    result: dict[str, Any] = {"config": asdict(config)}
    for name, (forward, params) in variants.items():
        held, peak = measure_allocations(forward, params, x, grad)
        result[name] = {"held": held, "peak": peak, "seconds": statistics.median(seconds[name])}
        if name == "reversible":
            size = reversible.buffer_size
            bound = ops.buffer_bound_bytes(ops.spec_of(reversible._stack), config.T,
                                           config.batch)
            result["buffer"] = {"nbytes": size.nbytes, "ideal_bits": size.ideal_bits,
                                "units": size.units, "bound": bound}
    return result


# --------------------------------------------------------------------------
# Running the grid (in the parent process)
# --------------------------------------------------------------------------


def _run_child(config: Config, repeats: int, timeout: float) -> dict[str, Any]:
    """``measure_config`` in a fresh process; {"error": ...} if it fails."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = [sys.executable, "-m", "benchmarks.reversible", "--child",
           json.dumps(asdict(config)), "--repeats", str(repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = proc.stderr.strip().splitlines()
    return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b else "-"


def _row(config: Config, result: dict[str, Any]) -> list[str]:
    head = [config.cell.upper(), str(config.T), str(config.hidden),
            "none" if config.cap is None else str(config.cap)]
    if "error" in result:
        return head + [f"failed: {result['error']}"] + ["-"] * (len(HEADER) - len(head) - 1)
    std, rev, ref, buf = (result[k] for k in ("standard", "reversible", "reference", "buffer"))
    steps = buf["units"] * config.T
    return head + [
        format_bytes(std["held"]), format_bytes(rev["held"]),
        _ratio(std["held"], rev["held"]), format_bytes(ref["held"]),
        _ratio(ref["held"], rev["held"]),
        _ratio(std["peak"], rev["peak"]), _ratio(ref["peak"], rev["peak"]),
        format_bytes(rev["peak"]),
        _ratio(rev["seconds"], std["seconds"]), _ratio(rev["seconds"], ref["seconds"]),
        _seconds(std["seconds"]),
        format_bytes(buf["nbytes"]), f"{buf['ideal_bits'] / steps:.2f}",
        _ratio(4 * steps, buf["nbytes"]), _ratio(4 * steps, buf["bound"])]


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def run_reversible(grid: Sequence[Config] | None = None, *, quick: bool = False,
                   repeats: int = 3, isolate: bool = True, cell_timeout: float = 900) -> str:
    """Measure every row of ``grid`` (default: ``QUICK_GRID`` if ``quick`` else
    ``DEFAULT_GRID``), each in a fresh process unless ``isolate`` is False; return a
    title and the markdown table (progress goes to stderr)."""
    grid = grid or (QUICK_GRID if quick else DEFAULT_GRID)
    rows = []
    for config in grid:
        start = time.perf_counter()
        result = (_run_child(config, repeats, cell_timeout) if isolate
                  else measure_config(config, repeats))
        print(f"# reversible {config.cell} T={config.T} hidden={config.hidden} "
              f"cap={config.cap}: {result.get('error', 'done')} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        rows.append(_row(config, result))
    where = (f"one fresh process per row, OMP_WAIT_POLICY="
             f"{os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')}" if isolate else "in-process")
    batch = ", ".join(sorted({str(c.batch) for c in grid}))
    return (f"\nReversible RNNs (MacKay et al. 2018): RevGRU / RevLSTM vs nn.GRU / nn.LSTM "
            f"and vs the same module under plain autograd; 1 layer, input size = hidden, "
            f"batch {batch}, float32, cpu, time = median of {repeats} steps ({where})\n\n"
            + markdown(rows, HEADER) + "\n\n" + NOTES)


NOTES = """\
- held: allocated bytes live after the forward, less the returned output and final state;
  the reversible module's is its information buffer, its final state (int64) and its
  initial state. peak: the most allocated during forward + backward over what was live
  before (parameters, input, output gradient), the output and the parameter gradients
  included.
- states / buffer: float32 hidden states of every step (32 bits per unit per step) over
  the buffer's bytes, the measure of MacKay et al. 2018's Table 1 (10-15x at 2-3 bits
  for trained language models). These weights are untrained: forget gates near 0.5, about
  1 bit forgotten per unit per step (eq. 17); trained models forget more, so their buffers
  grow faster and their ratio is lower. "states / buffer bound": the same over the most
  the buffer can take whatever the forget values (every step forgetting the cap's bits,
  memopt.nn.ops.buffer_bound_bytes): what memopt.compile's planner charges, and the
  ratio a trained model cannot go below (about 9x at the cap of 3 bits, 3x with none)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=100, hidden 256, both cells")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps per variant, after a warm-up step (default 3)")
    parser.add_argument("--cell-timeout", type=float, default=900,
                        help="seconds before one row is given up (default 900)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_config(Config(**json.loads(args.child)), args.repeats)))
        return 0
    start = time.perf_counter()
    print(run_reversible(quick=args.quick, repeats=args.repeats,
                         cell_timeout=args.cell_timeout))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
