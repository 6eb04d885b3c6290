"""How fast at how much memory: ``python -m benchmarks.run --speed``.

Per model, one row per configuration: eager, ``torch.compile`` (inductor), inductor with
functorch's ``activation_memory_budget`` at 0.5 and 0.2, transformers' gradient
checkpointing where the model has it, and memopt with ``kernels="aten"`` and
``kernels="inductor"``, each with no budget and at two binding budgets: the peak the
inductor 0.5 knob measured (in bytes, so memopt is asked for what that knob reached) and
60% of eager's peak.

Timing is paired and interleaved: ``rounds`` rounds, each running every configuration
once, in a fresh child process each (memopt.measure.measure_step), in an order shuffled
per round; each configuration's step time is divided by the eager step of the same round,
and the table shows the median of those ratios (a slow patch of a shared machine hits a
round's eager run and the runs beside it alike). The budgets come from the first round,
whose eager and inductor-0.5 runs therefore go first; every other run of every round is
in shuffled order.

"first step" is the warm-up step's whole wall time (``Measurement.warmup_seconds``):
memopt's planning and inductor's compilation. Every child gets an empty inductor (and
Triton) cache, so that each configuration pays its own compilation, whatever ran before
it; ``cold_cache=False`` keeps the user's cache (faster, and order-dependent).

The peak is the allocated one (``Measurement.budget_peak_bytes``: what a budget counts).
A budget memopt refuses (BudgetError) shows as "refused".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from memopt.budget import format_bytes
from memopt.measure import Measurement, measure_step

#: Models measured by default (llama only where transformers has LlamaForCausalLM).
SPEED_MODELS = ("mlp64", "resnet50", "gpt2", "llama")
#: Models with transformers' ``gradient_checkpointing_enable``.
HF_CHECKPOINTING = ("gpt2", "llama")
#: functorch ``activation_memory_budget`` values measured (a fraction of activation memory).
KNOBS = (0.5, 0.2)
#: The knob whose measured peak is a memopt budget.
MATCHED_KNOB = 0.5
#: The other memopt budget: this fraction of eager's measured peak.
FRACTION = 0.6


@dataclass(frozen=True)
class Config:
    """One row: ``mode`` for measure_step; memopt rows also name ``kernels`` and a
    ``budget``: None, ``"peak:<label>"`` (that row's first-round peak) or
    ``"eager:<fraction>"`` (a fraction of the first-round eager peak)."""

    label: str
    mode: str
    kernels: str | None = None
    budget: str | None = None


def default_models() -> list[str]:
    from benchmarks.workloads import has_llama

    return [m for m in SPEED_MODELS if m != "llama" or has_llama()]


def configs(model: str) -> list[Config]:
    matched = f"inductor budget={MATCHED_KNOB}"
    rows = [Config("eager", "eager"), Config("torch.compile", "torch_compile")]
    rows += [Config(f"inductor budget={k}", f"inductor:{k}") for k in KNOBS]
    if model in HF_CHECKPOINTING:
        rows.append(Config("HF checkpointing", "hf_checkpointing"))
    for kernels in ("aten", "inductor"):
        rows += [Config(f"memopt {kernels}", "memopt", kernels),
                 Config(f"memopt {kernels} @ {matched} peak", "memopt", kernels,
                        f"peak:{matched}"),
                 Config(f"memopt {kernels} @ {FRACTION:.0%} eager", "memopt", kernels,
                        f"eager:{FRACTION}")]
    return rows


def describe_device(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's and its core count."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


@contextlib.contextmanager
def _fresh_caches(cold: bool) -> Iterator[None]:
    """An empty inductor and Triton cache for the children started inside (they copy
    this process's environment), removed afterwards."""
    if not cold:
        yield
        return
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    saved = {n: os.environ.get(n) for n in names}
    with tempfile.TemporaryDirectory(prefix="memopt-speed-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        try:
            yield
        finally:
            for n, v in saved.items():
                if v is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = v


def _reason(err: RuntimeError) -> str:
    return "refused" if "BudgetError" in str(err) else "failed"


def _resolve(config: Config, peaks: dict[str, int]) -> int | None | str:
    """The budget in bytes; a string says why there is none (its reference failed)."""
    if config.budget is None:
        return None
    kind, ref = config.budget.split(":", 1)
    if kind == "peak":
        return peaks.get(ref, f"no {ref} peak")
    if "eager" not in peaks:
        return "no eager peak"
    return int(float(ref) * peaks["eager"])


def measure_model(model: str, device: str, rounds: int, *, timed_steps: int = 2,
                  seed: int = 0, cold_cache: bool = True, only: tuple[str, ...] | None = None,
                  log: str | None = None) -> tuple[list[Config], dict[str, int | None | str],
                             list[dict[str, Measurement | str]]]:
    """The configurations, their budgets, and per round each one's Measurement (or
    "refused" / "failed" / why it did not run). ``only``: just the configurations with
    these labels (eager always; a budget whose reference is left out shows why). ``log``:
    a JSON-lines file each finished run is appended to at once (a run cut short by a
    time limit keeps what it measured)."""
    spec = f"benchmarks.workloads:{model}"
    cfgs = [c for c in configs(model) if only is None or c.label in only or c.mode == "eager"]
    rng = random.Random(f"{seed}:{model}")
    references = ("eager", f"inductor budget={MATCHED_KNOB}")
    budgets: dict[str, int | None | str] = {}
    peaks: dict[str, int] = {}
    per_round: list[dict[str, Measurement | str]] = []
    for r in range(rounds):
        order = list(cfgs)
        rng.shuffle(order)
        if r == 0:  # the budgets' references first
            order.sort(key=lambda c: c.label not in references)
        results: dict[str, Measurement | str] = {}
        for c in order:
            if r == 0:
                budgets[c.label] = _resolve(c, peaks)
            budget = budgets[c.label]
            if isinstance(budget, str):
                results[c.label] = budget
                continue
            options = {"kernels": c.kernels} if c.kernels else None
            t0 = time.perf_counter()
            try:
                with _fresh_caches(cold_cache):
                    m = measure_step(spec, mode=c.mode, budget=budget, device=device,
                                     timed_steps=timed_steps, options=options, isolate=True)
            except RuntimeError as err:
                results[c.label] = _reason(err)
                if results[c.label] == "failed":
                    print(f"# {model} / {c.label}: failed: {err}", file=sys.stderr, flush=True)
                continue
            results[c.label] = m
            _append(log, model=model, round=r + 1, config=c.label, budget=budget,
                    **dataclasses.asdict(m))
            if r == 0:
                peaks[c.label] = m.budget_peak_bytes
            print(f"# {model} round {r + 1}/{rounds} {c.label}: "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        per_round.append(results)
    return cfgs, budgets, per_round


def _append(log: str | None, **row: object) -> None:
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def _ratio(values: list[float]) -> str:
    """The median ratio, two decimals (three significant digits below 0.1: a tiny model's
    compiled step can be 100x faster than its eager one)."""
    if not values:
        return "-"
    value = statistics.median(values)
    return f"{value:.2f}x" if value >= 0.1 else f"{value:.3g}x"


def rows_for(model: str, cfgs: list[Config], budgets: dict[str, int | None | str],
             per_round: list[dict[str, Measurement | str]]) -> list[list[str]]:
    rows = []
    for c in cfgs:
        budget = budgets.get(c.label)
        budget_cell = format_bytes(budget) if isinstance(budget, int) else (budget or "-")
        runs = [r[c.label] for r in per_round]
        failed = [x for x in runs if isinstance(x, str)]
        if failed:  # a refusal is the same in every round (planning is deterministic)
            rows.append([model, c.label, budget_cell, failed[0], *["-"] * (len(SPEED_HEADER) - 4)])
            continue
        time_ratios, peak_ratios = [], []
        for r in per_round:
            eager, m = r.get("eager"), r[c.label]
            if isinstance(eager, Measurement) and isinstance(m, Measurement):
                time_ratios.append(m.step_seconds / eager.step_seconds)
                peak_ratios.append(m.budget_peak_bytes / eager.budget_peak_bytes)
        peaks = [m.budget_peak_bytes for m in runs]
        predicted = runs[0].predicted_peak_bytes
        first = [m.warmup_seconds for m in runs if m.warmup_seconds is not None]
        fits = "-" if budget is None else ("yes" if max(peaks) <= budget else "**no**")
        rows.append([
            model, c.label, budget_cell, _ratio(time_ratios), _ratio(peak_ratios),
            format_bytes(int(statistics.median(peaks))),
            format_bytes(predicted) if predicted else "-",
            f"{statistics.median(first):.2f}" if first else "-", fits,
        ])
    return rows


SPEED_HEADER = ["model", "config", "budget", "time / eager", "peak / eager", "measured peak",
                "predicted peak", "first step (s)", "peak <= budget"]


def run_speed(models: list[str], device: str, rounds: int, *, timed_steps: int = 5,
              seed: int = 0, cold_cache: bool = True,
              only: tuple[str, ...] | None = None, log: str | None = None,
              ) -> list[list[str]]:
    """The speed table's rows (``SPEED_HEADER``) for ``models``."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rows = []
    for model in models:
        t0 = time.perf_counter()
        cfgs, budgets, per_round = measure_model(model, device, rounds, timed_steps=timed_steps,
                                                 seed=seed, cold_cache=cold_cache, only=only,
                                                 log=log)
        rows += rows_for(model, cfgs, budgets, per_round)
        print(f"# {model}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    return rows
