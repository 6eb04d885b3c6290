"""The whole training step a loop runs, optimizer included: eager with AdamW, HF gradient
checkpointing, and memopt with `optimizer=` (its state and step in the budget), in float32
and under bf16 autocast, side by side in one process.

    python -m benchmarks.whole_step                      # gpt2-small-vocab32k and llama
    python -m benchmarks.whole_step --models llama --rounds 5

For each configuration, after two warm-up steps (memopt plans at the first): the step's
allocated peak measured with memopt.measure.allocation_peak around forward, backward,
`optimizer.step()` and `zero_grad()`, plus what lives before it (parameters, inputs and the
optimizer's state): the memory the GPU would need. Beside it memopt's predicted peak and the
budget. Then `--rounds` rounds of one timed step per configuration, configurations
interleaved; the table gives each one's median step time over eager float32's.

memopt runs with `drop_outputs=True` and `skip_logits=True`, as this loop keeps only the
loss past the forward and never reads the logits (`model(**batch).loss`, as the HF Trainer
does): a head whose loss is computed inside the model then never forms its logits. memopt's budgets: "min" is the smallest byte budget memopt accepts for the float32 step with
the optimizer counted (from memopt.compile's BudgetError at budget=1, with
`step_in_backward=False`), and one halfway between it and the baseline; "step in backward"
is the smallest with the optimizer stepped inside the backward (memopt.stepper:
`step_in_backward=True`, each gradient freed as its parameter steps). The bf16 row without
it is planned at float32's minimum (issue 26: under bf16 autocast a model accepts a budget
no higher than float32's minimum); the bf16 row with it at its own minimum. Absolute times are not reported (a shared 2-core CPU unless a GPU is
named).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import memopt
from memopt.budget import format_bytes
from memopt.errors import BudgetError
from memopt.measure import allocation_peak


def _gpt2_config(device: str, layers: int, width: int, heads: int, vocab: int, batch: int,
                 seq: int) -> tuple[torch.nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                        n_positions=seq, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(config).to(device).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, {"input_ids": ids, "labels": ids}


def _gpt2(device: str) -> tuple[torch.nn.Module, dict]:
    """HF GPT-2, 4 layers, d 256, vocabulary 32,000, batch 4x256 (issue 26's autocast case)."""
    return _gpt2_config(device, 4, 256, 4, 32000, 4, 256)


def _tiny(device: str) -> tuple[torch.nn.Module, dict]:
    """A 2-layer GPT-2 (d 64, vocabulary 2,000, batch 2x64), for the benchmark's test."""
    return _gpt2_config(device, 2, 64, 2, 2000, 2, 64)


def _llama(device: str) -> tuple[torch.nn.Module, dict]:
    from benchmarks.workloads import llama

    w = llama(device)
    return w.model, dict(w.kwargs)


MODELS: dict[str, Callable[[str], tuple[torch.nn.Module, dict]]] = {
    "gpt2": _gpt2, "llama": _llama, "tiny": _tiny}


#: the smallest budgets found for a model: fp32 without and with the step in the backward,
#: then bf16 without and with (by id of the model given to _configs)
SMALLEST: dict[int, tuple[int, int, int, int]] = {}


@dataclass
class Config:
    """One row: a model copy, its optimizer, and how its step runs."""

    name: str
    module: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool = False
    plan: Any = None
    times: list[float] = field(default_factory=list)
    peak: int = 0

    def step(self, kwargs: dict) -> None:
        ctx = torch.autocast(kwargs["input_ids"].device.type, dtype=torch.bfloat16) \
            if self.autocast else nullcontext()
        with ctx:
            loss = self.module(**kwargs).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _resident(config: Config, kwargs: dict) -> int:
    tensors = [*config.model.parameters(), *config.model.buffers(), *kwargs.values()]
    tensors += [t for s in config.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _configs(model: torch.nn.Module, kwargs: dict) -> list[Config]:
    def fresh(name: str, wrap: Callable | None = None, autocast: bool = False,
              checkpointing: bool = False) -> Config:
        m = copy.deepcopy(model)
        if checkpointing:
            m.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        return Config(name, wrap(m, opt) if wrap else m, m, opt, autocast)

    def smallest(stepping: bool, autocast: bool = False) -> BudgetError:
        """The smallest budget memopt.compile accepts for this step (its trace's count),
        with or without the optimizer stepped inside the backward."""
        probe = copy.deepcopy(model)
        device = kwargs["input_ids"].device.type
        try:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                memopt.compile(probe, budget=1, optimizer=torch.optim.AdamW(probe.parameters()),
                               drop_outputs=True, skip_logits=True,
                               step_in_backward=stepping)(**kwargs)
        except BudgetError as err:
            return err
        raise RuntimeError("budget=1 byte was accepted")

    err = smallest(False)
    minimum, middle = err.minimum_bytes, (err.minimum_bytes + err.baseline_bytes) // 2
    lowest = smallest(True).minimum_bytes
    lowest_bf16 = smallest(True, autocast=True).minimum_bytes
    SMALLEST[id(model)] = (minimum, lowest, smallest(False, autocast=True).minimum_bytes,
                           lowest_bf16)

    def at(budget: object, stepping: bool = False) -> Callable:
        return lambda m, opt: memopt.compile(m, budget=budget, optimizer=opt,
                                             drop_outputs=True, skip_logits=True,
                                             step_in_backward=stepping)

    return [
        fresh("eager fp32"),
        fresh("HF checkpointing fp32", checkpointing=True),
        fresh("memopt none, optimizer= fp32", at(None)),
        fresh(f"memopt {format_bytes(middle)}, optimizer= fp32", at(middle)),
        fresh(f"memopt min {format_bytes(minimum)} fp32", at(minimum)),
        fresh(f"memopt min {format_bytes(lowest)}, step in backward fp32", at(lowest, True)),
        fresh("eager bf16", autocast=True),
        fresh(f"memopt {format_bytes(minimum)} bf16", at(minimum), autocast=True),
        fresh(f"memopt min {format_bytes(lowest_bf16)}, step in backward bf16",
              at(lowest_bf16, True), autocast=True),
    ]


def run(name: str, device: str, rounds: int) -> list[Config]:
    model, kwargs = MODELS[name](device)
    configs = _configs(model, kwargs)
    f32, f32_in, bf16, bf16_in = SMALLEST[id(model)]
    print(f"{name}: smallest budgets, without / with the optimizer step in the backward: "
          f"fp32 {format_bytes(f32)} / {format_bytes(f32_in)}, bf16 {format_bytes(bf16)} / "
          f"{format_bytes(bf16_in)}", flush=True)
    for c in configs:  # warm-up: memopt plans at the first step; the state then exists
        for _ in range(2):
            c.step(kwargs)
        c.plan = getattr(c.module, "memopt_plan", None)
        resident = _resident(c, kwargs)
        with allocation_peak(device) as seen:
            c.step(kwargs)
        c.peak = resident + seen.peak
    for _ in range(rounds):
        for c in configs:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            c.step(kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            c.times.append(time.perf_counter() - t0)
    return configs


def table(name: str, configs: list[Config]) -> str:
    base = statistics.median(configs[0].times)
    eager_peak = configs[0].peak
    rows = [f"{name}: the whole step (forward, backward, AdamW step, state resident)",
            "| configuration | step / eager | peak | peak / eager | predicted | budget |",
            "|---|---|---|---|---|---|"]
    for c in configs:
        plan = c.plan
        predicted = format_bytes(plan.predicted_peak_bytes) if plan is not None else "-"
        budget = format_bytes(plan.budget_bytes) if plan is not None and plan.budget_bytes \
            else "-"
        rows.append(f"| {c.name} | {statistics.median(c.times) / base:.2f} | "
                    f"{format_bytes(c.peak)} | {c.peak / eager_peak:.2f} | {predicted} | "
                    f"{budget} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, list[Config]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results = {}
    for name in args.models:
        results[name] = run(name, args.device, args.rounds)
        print(table(name, results[name]), flush=True)
    return results


if __name__ == "__main__":
    main()
