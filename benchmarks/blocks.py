"""The block path against the flat one: `memopt.compile(model, blocks=True)` (each repeated
layer its own graph, captured once, memopt.blocks) beside `memopt.compile(model)` (the
model as one graph), at equal budgets, on the zoo's transformers and a deeper Llama.

    python -m benchmarks.blocks                       # every model, both budgets
    python -m benchmarks.blocks --models llama16 --rounds 1

For each model: eager's step first (its gradients), then for each budget (none, and a
binding byte budget: BINDING of the flat plan's predicted peak with no budget) the flat
and the block path, interleaved, each in a fresh process (dynamo's caches empty, so the
first step's seconds are capture + plan + the step). Columns: the first step's seconds,
the steady step's, memopt's predicted peak, the measured allocated peak of a later step
(CPU, resident bytes included, memopt.measure), the recomputed forward FLOPs per step
(every run of a graph counted) and the largest gradient difference from eager relative to
that gradient's largest value (gradients whose largest value is below 1e-6 of the
model's largest are float32 noise and left out: an attention key's bias).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
import warnings

#: the binding budget: this fraction of the flat plan's predicted peak with no budget
BINDING = 0.8

MODELS = ("llama", "gpt2", "bert", "vit", "llama16")


def _case(name: str):
    from benchmarks.zoo import ZooCase, build

    if name != "llama16":
        return build(name)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(config).train()
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 8000, (2, 256))
    return ZooCase("llama16", model, kwargs={"input_ids": ids, "labels": ids.clone()},
                   loss=lambda out: out.loss)


def _step(case, module, seed: int = 1) -> None:
    import torch

    for p in case.model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    case.run_step(module)


def measure(name: str, path: str, budget: int | None) -> dict:
    """One row, in this process: eager's gradients, then memopt's first step (timed),
    a steady step (timed), the measured peak."""
    import torch

    import memopt
    from benchmarks.zoo import ZooCase, allocated_peak

    warnings.simplefilter("ignore")
    eager = _case(name)
    case = ZooCase(name, copy.deepcopy(eager.model), eager.args, eager.kwargs, eager.loss)
    _step(eager, None)
    compiled = memopt.compile(case.model, budget=budget, blocks=path == "blocks")
    t0 = time.perf_counter()
    _step(case, compiled)
    first = time.perf_counter() - t0
    floor = 1e-6 * max(float(p.grad.abs().max()) for p in eager.model.parameters()
                       if p.grad is not None)
    error = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                for p, q in zip(case.model.parameters(), eager.model.parameters())
                if q.grad is not None and float(q.grad.abs().max()) > floor)
    _step(case, compiled)
    t0 = time.perf_counter()
    _step(case, compiled)
    steady = time.perf_counter() - t0
    plan = compiled.memopt_plan
    graphs, runs = getattr(plan, "graphs", (plan,)), getattr(plan, "runs", (0,))
    return {"model": name, "path": path, "budget": budget, "first_s": first,
            "step_s": steady, "predicted": plan.predicted_peak_bytes,
            "measured": allocated_peak(compiled, case),
            "recompute_flops": sum(graphs[i].recompute_flops for i in runs),
            "graphs": len(graphs), "runs": len(runs), "grad_error": error,
            "no_budget_peak": plan.predicted_peak_bytes if budget is None else None,
            "torch_threads": torch.get_num_threads()}


def _child(name: str, path: str, budget: int | None) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.blocks", "--one", name, path,
                           str(budget)], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"model": name, "path": path, "budget": budget, "error": last}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    out = ["| model | budget | path | first step s | step s | predicted MiB | measured MiB "
           "| recomputed GFLOP/step | graphs (runs) | gradient error |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "none" if r["budget"] is None else f"{mib(r['budget'])} MiB"
        if "error" in r:
            out.append(f"| {r['model']} | {budget} | {r['path']} | {r['error'][:80]} |"
                       " | | | | | |")
            continue
        out.append(f"| {r['model']} | {budget} | {r['path']} | {r['first_s']:.1f} | "
                   f"{r['step_s']:.2f} | {mib(r['predicted'])} | {mib(r['measured'])} | "
                   f"{r['recompute_flops'] / 1e9:.3f} | {r['graphs']} ({r['runs']}) | "
                   f"{r['grad_error']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # a child's row
    args = parser.parse_args(argv)
    if args.one is not None:
        name, path, budget = args.one
        print(json.dumps(measure(name, path, None if budget == "None" else int(budget))))
        return []
    rows: list[dict] = []
    for name in args.models:
        flat = _child(name, "flat", None)
        rows += [flat, _child(name, "blocks", None)]
        if "error" not in flat:
            budget = int(BINDING * flat["predicted"])
            rows += [_child(name, "flat", budget), _child(name, "blocks", budget)]
        print(f"{name} done", file=sys.stderr, flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
