"""memopt under DistributedDataParallel: 2 ranks on CPU (gloo), a budget per rank.

    torchrun --nproc_per_node 2 examples/ddp.py
    python examples/ddp.py                # starts the 2 ranks itself

Wrap in this order: `DDP(memopt.compile(model, budget=...))`. The budget is one rank's,
and it counts DDP's gradient buckets, which DDP allocates when it is built and keeps
through every step (with the default `gradient_as_bucket_view=False`, a second copy of
the gradients). Each rank trains a small MLP for a few steps, accumulating two
micro-batches per step with `no_sync()` on the first, measures the allocated peak of a
micro-step that adds into kept `.grad` tensors, and checks the gradients after DDP's
all-reduce against eager PyTorch on the whole batch (every rank's micro-batches).
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import memopt
from memopt.measure import allocation_peak

BUDGET = "2.5MB"  # per rank: parameters, gradients, DDP's buckets, activations
MICRO, STEPS, BATCH = 2, 3, 256


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)],
                         nn.Linear(128, 4))


def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, 128, generator=torch.Generator().manual_seed(
        1000 * step + 10 * micro + rank))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def eager_gradients(step: int, world: int) -> list[torch.Tensor]:
    """Eager PyTorch on the whole batch of `step` (after the steps before it): what DDP's
    averaged gradients must equal."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(step + 1):
        opt.zero_grad()
        for micro in range(MICRO):
            for rank in range(world):
                (loss_of(model(micro_batch(s, micro, rank))) / world).backward()
        if s < step:
            opt.step()
    return [p.grad for p in model.parameters()]


def train(rank: int, world: int) -> None:
    """One rank's training loop: DDP(memopt.compile(model)), no_sync accumulation."""
    torch.set_num_threads(1)
    model = make_model()
    ddp = DDP(memopt.compile(model, budget=BUDGET))
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())  # DDP syncs all
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    measured = None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for micro in range(MICRO):
            x = micro_batch(step, micro, rank)
            if micro < MICRO - 1:
                with ddp.no_sync():                  # accumulate locally, no all-reduce
                    loss_of(ddp(x)).backward()
            elif step == STEPS - 1:                  # measure: kept .grad, then all-reduce
                before = resident_bytes([*model.parameters(), x,
                                         *(p.grad for p in model.parameters())]) + buckets
                with allocation_peak("cpu") as seen:
                    loss_of(ddp(x)).backward()
                measured = seen.peak + before
            else:
                loss_of(ddp(x)).backward()
        if step == STEPS - 1:
            equal = all(torch.allclose(p.grad, q, rtol=1e-4, atol=1e-6) for p, q in
                        zip(model.parameters(), eager_gradients(step, world)))
        opt.step()
    plan = ddp.module.memopt_plan
    mib = memopt.format_bytes
    # one write per line: the ranks share torchrun's stdout, and print() writes its end
    # apart, so two ranks' lines could run together
    sys.stdout.write(
        f"rank {rank}: budget {mib(plan.budget_bytes)} ({plan.budget_bytes} B), predicted "
        f"peak {plan.predicted_peak_bytes} B, measured peak {measured} B, DDP buckets "
        f"{plan.ddp_bucket_bytes} B counted; within budget: {measured <= plan.budget_bytes}; "
        f"gradients equal eager's: {equal}\n")
    sys.stdout.flush()
    if rank == 0:
        print(plan.summary(max_rows=0), flush=True)


def run_rank(rank: int, world: int, port: int | None) -> None:
    """Join the gloo process group (torchrun's environment, or `port` on this host)."""
    if port is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    try:
        train(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if "RANK" in os.environ:                         # started by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run_rank, args=(2, free_port()), nprocs=2, join=True,
                       start_method="spawn")


if __name__ == "__main__":
    main()
