"""How long memopt takes to plan a large language model, on the meta device (no weights,
nothing runs): Llama shapes at d 4096, 2,048 tokens, batch 1, float32, by depth.

    python -m benchmarks.scale                        # 8, 16, 32 and 80 layers
    python -m benchmarks.scale --layers 8 32

For each depth, in a fresh process each (dynamo's caches and the allocator start empty):
`memopt.plan` with no budget (capture seconds: dynamo + AOTAutograd; plan seconds:
memopt's own passes), its predicted peak, and the smallest budget memopt accepts
(`memopt.plan(budget=1)`'s BudgetError, one more capture) with the seconds that took;
then the same with `blocks=True` (each repeated layer captured once and planned under the
step's budget, the forward run on shapes: memopt.plan_blocks), seconds in all.
The model is transformers' LlamaForCausalLM (32 heads, MLP 11,008, vocabulary 32,000;
`use_cache=False`: a training step never reads a key/value cache). The 32-layer row is
the Llama-7B shape of issue 27, whose goal is <= 15 s for capture and plan. Needs
transformers 5: 4.x's Llama does not trace on the meta device (its rotary embedding enters
autocast on "meta").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings

#: The depths of the table (issue 27: 8 / 16 / 32 / 80 at d 4096).
DEPTHS = (8, 16, 32, 80)


def measure(layers: int, hidden: int = 4096, seq: int = 2048) -> dict:
    """One depth's row, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import memopt
    import memopt.api  # noqa: F401  (imported before the clock starts)

    config = LlamaConfig(hidden_size=hidden, intermediate_size=11008 * hidden // 4096,
                         num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000,
                         max_position_embeddings=seq, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (1, seq), device="meta")
    kwargs = {"input_ids": ids, "labels": ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        plan = memopt.plan(model, example_kwargs=kwargs)
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            memopt.plan(model, example_kwargs=kwargs, budget=1)
            smallest = None
        except memopt.BudgetError as err:
            smallest = err.minimum_bytes
        refused = time.perf_counter() - t0
        blocks = _blocks(model, kwargs)
    return {"layers": layers, "total_s": total, "capture_s": plan.capture_seconds,
            "plan_s": plan.plan_seconds, "peak": plan.predicted_peak_bytes,
            "smallest": smallest, "smallest_s": refused, **blocks}


def _blocks(model, kwargs: dict) -> dict:
    """The blocks=True plan's seconds and peak, and its smallest budget with its seconds."""
    import memopt

    t0 = time.perf_counter()
    plan = memopt.plan(model, example_kwargs=kwargs, blocks=True)
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        memopt.plan(model, example_kwargs=kwargs, budget=1, blocks=True)
        smallest = None
    except memopt.BudgetError as err:
        smallest = err.minimum_bytes
    return {"blocks_s": total, "blocks_peak": plan.predicted_peak_bytes,
            "blocks_smallest": smallest, "blocks_smallest_s": time.perf_counter() - t0}


def table(rows: list[dict]) -> str:
    gb = lambda n: "-" if n is None else f"{n / 1e9:.2f} GB"  # noqa: E731
    out = ["| layers (d 4096, 2,048 tokens) | capture s | plan s | memopt.plan s in all | "
           "predicted peak | smallest budget (its s) | blocks=True s | its predicted peak | "
           "its smallest budget (its s) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['layers']} | {r['capture_s']:.1f} | {r['plan_s']:.1f} | "
                   f"{r['total_s']:.1f} | {gb(r['peak'])} | {gb(r['smallest'])} "
                   f"({r['smallest_s']:.1f}) | {r['blocks_s']:.1f} | {gb(r['blocks_peak'])} | "
                   f"{gb(r['blocks_smallest'])} ({r['blocks_smallest_s']:.1f}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=list(DEPTHS))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process's row
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.hidden)))
        return []
    rows = []
    for layers in args.layers:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--one", str(layers),
                               "--hidden", str(args.hidden)],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{layers} layers: {rows[-1]['total_s']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
