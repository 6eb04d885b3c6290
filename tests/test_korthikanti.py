"""Korthikanti et al. 2022's activation bytes per transformer layer as a check on memopt's
plan (benchmarks/korthikanti.py): with no budget memopt keeps exactly their sbh(34 + 5as/h)
bytes per layer plus the LayerNorms' float32 statistics, tensor by tensor; at a budget
recomputing no more FLOPs than their selective recomputation it keeps no more than their
34sbh plus the attention dropout mask (as^2 b bytes: memopt stores dropout masks, Megatron
replays the RNG)."""

import warnings

import pytest
import torch

import memopt
from benchmarks.korthikanti import GPTStack, formula_bytes, measure


def test_no_budget_keeps_their_bytes_per_layer():
    s, b, h, a = 128, 2, 64, 4
    with torch.device("meta"):
        model = GPTStack(3, h, a).to(torch.bfloat16)
    x = torch.empty(s, b, h, dtype=torch.bfloat16, device="meta")
    plan = memopt.plan(model, x)
    middle = [t for t in plan.saved if t.decision == "saved"
              and (t.module == "layers.1" or t.module.startswith("layers.1."))]
    stats = 2 * 2 * s * b * 4  # two LayerNorms' mean and rstd, float32 per token
    assert sum(t.nbytes for t in middle) == formula_bytes(s, b, h, a)[0] + stats
    # the attention's three (b, a, s, s) tensors: softmax output, dropout mask and output
    square = sorted(t.nbytes for t in middle if t.shape[-2:] == (s, s))
    assert square == [a * s * s * b, 2 * a * s * s * b, 2 * a * s * s * b]


@pytest.mark.slow
def test_at_their_flops_memopt_keeps_their_selective_bytes_and_the_mask():
    s, b, h, a = 512, 8, 256, 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = measure("small", layers=6, seq=s, batch=b, steps=7, shape=(h, a))
    assert row.share_at <= row.selective_share
    assert abs(row.memopt_none - row.formula_none) <= 0.01 * row.formula_none
    assert row.memopt_at <= row.formula_selective + a * s * s * b, row
