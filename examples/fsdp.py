"""memopt under FSDP2: compile the model, then shard the compiled module; or, per block,
shard each repeated block and the root, then compile with blocks=True.

    torchrun --nproc_per_node 2 examples/fsdp.py                # CPU, gloo
    torchrun --nproc_per_node 2 examples/fsdp.py --per-block    # FSDP2 units per block

Each rank compiles the same MLP with memopt under a budget (a fraction of its own step),
makes the compiled module one FSDP2 unit with `fully_shard`, and trains a few steps on
its half of the batch. FSDP all-gathers the parameters before memopt's compiled step and
reduce-scatters its gradients after; rank 0 checks the parameters against eager PyTorch
on the whole batch in one process and prints the plan (its `FSDP2 shards` line: what
FSDP holds around the graph). The other order, memopt.compile(fully_shard(model)), is
refused with a memopt.InputError that names this one (dynamo does not trace FSDP2's hooks
on torch 2.13).

`--per-block` is torchtitan's pattern: `fully_shard` on each of the model's six identical
blocks and on the root, then `memopt.compile(model, budget=..., blocks=True)`. Each block
runs as one planned graph between FSDP2's hooks, so only the block that runs (and the one
FSDP prefetches) is gathered; recomputation runs inside its block's backward, while the
block is gathered. The budget is 85% of the step memopt plans with no budget (a first
step with budget=None measures it); rank 0 prints the plan's graphs and runs.
"""

from __future__ import annotations

import sys

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


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(128), nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """Six identical blocks between an input layer and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.head = nn.Linear(128, 128), nn.Linear(128, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, 128, generator=torch.Generator().manual_seed(100 * step + rank))


def eager_parameters(world: int, make=make_model) -> list[torch.Tensor]:
    """One process, the whole batch (FSDP averages the ranks' gradients)."""
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(world):
            (model(batch(step, rank)).square().mean() / world).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def shard_per_block(mesh) -> nn.Module:
    model = Stack()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def per_block(rank: int, world: int, mesh) -> None:
    probe = memopt.compile(shard_per_block(mesh), blocks=True)
    probe(batch(0, rank)).square().mean().backward()
    budget = int(0.85 * probe.memopt_plan.predicted_peak_bytes)
    model = memopt.compile(shard_per_block(mesh), budget=budget, blocks=True)
    same = train_and_compare(model, rank, world, Stack)
    if rank == 0:
        plan = model.memopt_plan
        print(f"budget {budget} bytes per rank; predicted peak {plan.predicted_peak_bytes}; "
              f"{len(plan.graphs)} graph(s), runs {plan.runs} (the block graph once per block)")
        print(f"parameters after {STEPS} steps equal eager's on the whole batch: {same}")


def train_and_compare(model: nn.Module, rank: int, world: int, make=make_model) -> bool:
    """STEPS SGD steps on this rank's batches; whether the parameters equal eager's on the
    whole batch in one process (computed on rank 0; every rank gathers them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(batch(step, rank)).square().mean().backward()
        optimizer.step()
    trained = [p.full_tensor() for p in model.parameters()]  # a collective: every rank
    return rank == 0 and all(torch.allclose(p, q, rtol=1e-4, atol=1e-5)
                             for p, q in zip(trained, eager_parameters(world, make)))


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE and the store
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (world,))
        if "--per-block" in sys.argv[1:]:
            per_block(rank, world, mesh)
            return
        try:
            memopt.compile(fully_shard(make_model(), mesh=mesh))
        except memopt.InputError as err:
            if rank == 0:
                print(f"memopt.compile(fully_shard(model)) refused: {str(err)[:120]}...")
        model = fully_shard(memopt.compile(make_model(), budget=0.85), mesh=mesh)
        same = train_and_compare(model, rank, world)
        if rank == 0:
            print(model.memopt_plan.summary(max_rows=0))
            print(f"parameters after {STEPS} steps equal eager's on the whole batch: {same}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
