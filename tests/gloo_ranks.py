"""A test's function on 2 CPU ranks (gloo), each in a fresh process, for the distributed
tests (tests/test_ddp_accumulation.py, tests/test_fsdp.py).

`run_on_ranks(results, world, out_dir)` spawns `world` processes, each with one intra-op
thread and a gloo process group on a free local port, calls the module-level function
`results(rank)` in each and returns what each returned (JSON-able), rank by rank. It
skips the test where this torch build has no gloo.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(results: Callable[[int], Any], world: int, out_dir: str | Path) -> list[Any]:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.start_processes(_rank, args=(results, world, free_port(), str(out_dir)),
                           nprocs=world, join=True, start_method="spawn")
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _rank(rank: int, results: Callable[[int], Any], world: int, port: int,
          out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results(rank)))
    finally:
        dist.destroy_process_group()
