"""memopt under FSDP2: compile the model, then shard the compiled module.

    torchrun --nproc_per_node 2 examples/fsdp.py      # CPU, gloo

Each rank compiles the same MLP with memopt under a budget (a fraction of its own step),
makes the compiled module one FSDP2 unit with `fully_shard`, and trains a few steps on
its half of the batch. FSDP all-gathers the parameters before memopt's compiled step and
reduce-scatters its gradients after; rank 0 checks the parameters against eager PyTorch
on the whole batch in one process and prints the plan (its `FSDP2 shards` line: what
FSDP holds around the graph). The other order, memopt.compile(fully_shard(model)), is
refused with a memopt.InputError that names this one (dynamo does not trace FSDP2's hooks
on torch 2.13).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import memopt

STEPS = 3
BATCH = 512  # per rank


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(6)],
                         nn.Linear(128, 4))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, 128, generator=torch.Generator().manual_seed(100 * step + rank))


def eager_parameters(world: int) -> list[torch.Tensor]:
    """One process, the whole batch (FSDP averages the ranks' gradients)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(world):
            (model(batch(step, rank)).square().mean() / world).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE and the store
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (world,))
        try:
            memopt.compile(fully_shard(make_model(), mesh=mesh))
        except memopt.InputError as err:
            if rank == 0:
                print(f"memopt.compile(fully_shard(model)) refused: {str(err)[:120]}...")
        model = fully_shard(memopt.compile(make_model(), budget=0.85), mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            optimizer.zero_grad()
            model(batch(step, rank)).square().mean().backward()
            optimizer.step()
        trained = [p.full_tensor() for p in model.parameters()]  # a collective: every rank
        if rank == 0:
            same = all(torch.allclose(p, q, rtol=1e-4, atol=1e-5)
                       for p, q in zip(trained, eager_parameters(world)))
            print(model.memopt_plan.summary(max_rows=0))
            print(f"parameters after {STEPS} steps equal eager's on the whole batch: {same}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
