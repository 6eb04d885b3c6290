"""Gradient accumulation under DistributedDataParallel on 2 gloo ranks (issue 13, item 0).

`DDP(memopt.compile(model))` (the other order, `memopt.compile(DDP(model))`, is refused
with an InputError naming this one): each rank accumulates two micro-batches, with DDP's
`no_sync()` on the first (the usual way: one all-reduce per optimizer step) or without
it (an all-reduce after every micro-batch). The parameters after two optimizer steps
equal single-process eager's on the whole batch, and each rank's allocated peak in its
second micro-step (the one that adds into kept `.grad` tensors) is within its budget and
within 10% of its plan. The budget is per rank. DDP runs with
`gradient_as_bucket_view=True`, so the gradients are views of DDP's buckets and the
buckets hold no second copy; with the default (also tested: eager's parameters), DDP's
buckets are allocated when DDP is built, before the measured step, and the plan does not
count them yet (issue 16).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
MICRO = 2
STEPS = 2
BATCH = 256  # per rank and micro-batch


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


def _rank(rank: int, port: int, use_no_sync: bool, bucket_view: bool, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import memopt  # noqa: PLC0415
    from memopt.allocation import allocation_peak  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        model = _model()
        x0 = _batch(0, 0, rank)
        baseline = memopt.plan(model, x0, existing_grads=True).baseline_peak_bytes
        budget = int(0.8 * baseline)
        try:  # the other wrapping order is refused, naming this one (issue 14, item 5)
            memopt.compile(DDP(model))
            refused = None
        except memopt.InputError as err:
            refused = type(err).__name__
        ddp = DDP(memopt.compile(model, budget=budget), gradient_as_bucket_view=bucket_view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        measured, plan = None, None
        for step in range(STEPS):
            opt.zero_grad(set_to_none=False)
            for micro in range(MICRO):
                x = _batch(step, micro, rank)
                last = micro == MICRO - 1

                def run() -> None:
                    if use_no_sync and not last:
                        with ddp.no_sync():
                            _loss(ddp(x)).backward()
                    else:
                        _loss(ddp(x)).backward()

                if step == 1 and micro == 1:
                    resident = list(model.parameters()) + [x] + [
                        p.grad for p in model.parameters() if p.grad is not None]
                    before = _storage_bytes(resident)
                    with allocation_peak("cpu") as seen:
                        run()
                    measured = seen.peak + before
                    plan = ddp.module.memopt_plan
                else:
                    run()
            opt.step()
        result = {
            "params": [p.detach().tolist() for p in model.parameters()],
            "measured": measured, "predicted": plan.predicted_peak_bytes,
            "budget": plan.budget_bytes, "existing_grad_bytes": plan.existing_grad_bytes,
            "added": plan.grads_added_in_place, "refused": refused,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eager_reference() -> list[torch.Tensor]:
    """One process, the whole batch: DDP averages the ranks' gradients."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            for rank in range(WORLD):
                (_loss(model(_batch(step, micro, rank))) / WORLD).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("use_no_sync, bucket_view", [(True, True), (False, True), (True, False)],
                         ids=["no_sync", "sync_every_micro", "no_sync-default_buckets"])
def test_ddp_accumulation_matches_eager_within_budget(use_no_sync: bool, bucket_view: bool,
                                                      tmp_path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    env = {"OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(_rank, args=(_free_port(), use_no_sync, bucket_view, str(tmp_path)),
                           nprocs=WORLD, join=True, start_method="spawn")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    reference = _eager_reference()
    for rank in range(WORLD):
        got = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        for p, q in zip(got["params"], reference):
            torch.testing.assert_close(torch.tensor(p), q, rtol=1e-4, atol=1e-5)
        assert got["existing_grad_bytes"] > 0 and got["added"] == len(reference)
        assert got["refused"] == "InputError"  # memopt.compile(DDP(model))
        assert got["measured"] <= got["budget"], got
        assert abs(got["measured"] - got["predicted"]) <= 0.10 * got["predicted"], got
