"""DistributedDataParallel around a memopt module on 2 gloo ranks.

`DDP(memopt.compile(model))` (the other order, `memopt.compile(DDP(model))`, is refused
with an InputError naming this one). The budget is per rank, and it counts DDP's gradient
buckets (memopt.ddp): DDP allocates them when it is built and keeps them through every
step, a second copy of the gradients with the default `gradient_as_bucket_view=False`.

One spawn of 2 ranks runs two scenarios (each spawn costs seconds of start-up on a
2-core machine):

- "no_sync-default_buckets": DDP's defaults but `bucket_cap_mb=0.1` (several buckets after
  DDP's rebuild, and dynamo's DDPOptimizer, which refuses such a cap, kept off), two
  micro-batches per step with `no_sync()` on the first, `zero_grad(set_to_none=False)`;
  measured: the second micro-step (kept `.grad`, buckets beside them). Its budget fits
  only when the buckets are counted: 80% of the unoptimized peak with them.
- "sync_every_micro-bucket_view": `gradient_as_bucket_view=True`, an all-reduce after
  every micro-batch, `zero_grad(set_to_none=True)`; measured: the first micro-step (no
  `.grad`: the buckets are held beside the new gradients, all counted) and the second
  (the kept `.grad` are views of the buckets: counted once, as existing gradients).

- "no_sync-offload": as the first, with saved values offloaded to host memory
  (memopt.offload, real copies outside PyTorch's allocator) while DDP's all-reduce runs:
  measured at the second micro-step.

For each: the gradients after the last all-reduce and the parameters after two optimizer
steps equal single-process eager's on the whole batch; each measured step's allocated
peak (memopt.measure.allocation_peak, plus what was resident at its start: parameters,
input, `.grad` and DDP's buckets) is within the rank's budget and within 10% of its plan;
the plan's bucket bytes equal the parameters' bytes and what DDP's reducer holds.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import run_on_ranks
from support import offload_rates
from torch import nn

WORLD = 2
MICRO = 2
STEPS = 2
BATCH = 256  # per rank and micro-batch

#: name -> (no_sync on the first micro-batch, gradient_as_bucket_view, zero_grad's
#: set_to_none, the micro-steps of step 1 to measure, saved values offloaded to host
#: memory with real copies outside PyTorch's allocator: memopt.offload.CPU_HOST_COPIES)
SCENARIOS = {
    "no_sync-default_buckets": (True, False, False, (1,), False),
    "sync_every_micro-bucket_view": (False, True, True, (0, 1), False),
    "no_sync-offload": (True, False, False, (1,), True),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)],
                         nn.Linear(128, 4))


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, 128, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _reducer_bucket_bytes(ddp: nn.Module) -> int:
    """The bytes of DDP's buckets as its reducer holds them now (after its rebuild)."""
    return sum(b.buffer().untyped_storage().nbytes()
               for b in ddp.reducer._get_zeros_like_grad_buckets())


def _micro_step(ddp: nn.Module, x: torch.Tensor, sync: bool) -> None:
    """Forward and backward of one micro-batch, all-reducing its gradients if `sync`."""
    if sync:
        _loss(ddp(x)).backward()
    else:
        with ddp.no_sync():
            _loss(ddp(x)).backward()


def _run_scenario(rank: int, name: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    import memopt  # noqa: PLC0415
    from memopt.measure import allocation_peak  # noqa: PLC0415

    use_no_sync, bucket_view, set_to_none, measure, offload = SCENARIOS[name]
    if offload:  # a fixed link and rate (not this machine's timing), real copies
        from memopt import link, offload as runtime  # noqa: PLC0415
        runtime.CPU_HOST_COPIES = True
        link._measured.__setitem__(*offload_rates())
    model = _model()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())  # DDP's, all synced
    baseline = memopt.plan(model, _batch(0, 0, rank), existing_grads=True).baseline_peak_bytes
    budget = int(0.8 * (baseline + buckets))  # fits only if the buckets are counted
    refused = None
    try:  # the other wrapping order is refused, naming this one
        memopt.compile(DDP(model))
    except memopt.InputError as err:
        refused = type(err).__name__
    ddp = DDP(memopt.compile(model, budget=budget, offload=None if not offload else True),
              gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps, grads = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(MICRO):
            x = _batch(step, micro, rank)
            sync = not (use_no_sync and micro < MICRO - 1)
            if step == STEPS - 1 and micro in measure:
                kept = [p.grad for p in model.parameters() if p.grad is not None]
                in_grads = bucket_view and bool(kept)  # the kept .grad are the buckets
                before = _storage_bytes([*model.parameters(), x, *kept]) + (
                    0 if in_grads else buckets)
                with allocation_peak("cpu") as seen:
                    _micro_step(ddp, x, sync)
                plan = ddp.module.memopt_plan
                steps.append({"micro": micro, "measured": seen.peak + before,
                              "predicted": plan.predicted_peak_bytes,
                              "budget": plan.budget_bytes,
                              "ddp_bucket_bytes": plan.ddp_bucket_bytes,
                              "counted": plan.ddp_bucket_counted_bytes,
                              "expected_counted": 0 if in_grads else buckets,
                              "offloaded": len(plan.offloaded), "offload": offload,
                              "summary": plan.summary(0)})
            else:
                _micro_step(ddp, x, sync)
        grads = [p.grad.detach().tolist() for p in model.parameters()]
        opt.step()
    return {"params": [p.detach().tolist() for p in model.parameters()], "grads": grads,
            "steps": steps, "refused": refused, "param_bytes": buckets,
            "reducer": _reducer_bucket_bytes(ddp)}


def _results(rank: int) -> dict:
    return {name: _run_scenario(rank, name) for name in SCENARIOS}


def _eager_reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process, the whole batch (DDP averages the ranks' gradients): the gradients of
    the last step and the parameters after it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            for rank in range(WORLD):
                (_loss(model(_batch(step, micro, rank))) / WORLD).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return grads, [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both scenarios on 2 gloo ranks, in one spawn: each rank's results."""
    return run_on_ranks(_results, WORLD, tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ddp_matches_eager(ranks: list[dict], scenario: str) -> None:
    """Gradients after the all-reduce, and parameters after two steps, equal eager's."""
    grads, params = _eager_reference()
    for got in ranks:
        result = got[scenario]
        for g, q in zip(result["grads"], grads):
            torch.testing.assert_close(torch.tensor(g), q, rtol=1e-4, atol=1e-6)
        for p, q in zip(result["params"], params):
            torch.testing.assert_close(torch.tensor(p), q, rtol=1e-4, atol=1e-5)
        assert result["refused"] == "InputError"  # memopt.compile(DDP(model))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ddp_peak_within_budget_buckets_counted(ranks: list[dict], scenario: str) -> None:
    """Each rank's measured peak, DDP's buckets included, is within its budget and within
    10% of its plan, which counts the buckets (all, or none where they are the kept .grad)
    and knows their size: the parameters' bytes, what DDP's reducer holds."""
    for got in ranks:
        result = got[scenario]
        assert result["param_bytes"] == result["reducer"] > 0, result  # the parameters' bytes
        assert result["steps"], result
        for step in result["steps"]:
            assert step["ddp_bucket_bytes"] == result["param_bytes"], step
            assert step["counted"] == step["expected_counted"], step
            assert "DDP gradient buckets:" in step["summary"], step["summary"]
            assert bool(step["offloaded"]) == step["offload"], step  # the offload scenario's
            assert step["measured"] <= step["budget"], step
            assert abs(step["measured"] - step["predicted"]) <= 0.10 * step["predicted"], step
