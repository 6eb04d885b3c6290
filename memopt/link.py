"""The host link and the device's rate that the offload planner schedules copies with
(memopt.allocator.offload.Link, memopt.passes.offload.ComputeModel): measured once
per machine and device, then read from a small JSON cache.

    measured(device) -> (Link, ComputeModel)

A GPU's link is measured with pinned host buffers (the copies memopt.offload makes),
32 MiB each way, its rate with a 2048^2 matmul and a 64 MiB copy (under 200 MiB of the
GPU in all, freed to the caching allocator, once per machine). On CPU there is no
separate host memory (offload is off there unless asked for): the link is SIMULATED_LINK
(a PCIe 4 x16) and the rate a 512^2 matmul's and a 16 MiB copy's.
The cache is `$MEMOPT_CACHE_DIR/link.json` (default `~/.cache/memopt`); delete it to
measure again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from memopt.allocator.offload import Link
from memopt.passes._torch_compat import real_tensors
from memopt.passes.offload import ComputeModel

_measured: dict[str, tuple[Link, ComputeModel]] = {}

#: The link offload=True plans with on CPU, which has none: a PCIe 4 x16's 25 GB/s each way.
SIMULATED_LINK = Link(d2h_bytes_per_s=25e9, h2d_bytes_per_s=25e9)


def cache_path() -> Path:
    root = os.environ.get("MEMOPT_CACHE_DIR") or Path.home() / ".cache" / "memopt"
    return Path(root) / "link.json"


def _key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{os.cpu_count()}"


def _median_of(fn, repeats: int = 5) -> float:
    """The median of `repeats` timed calls (after three warm-up calls), in seconds."""
    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(3):  # warm-up: the first calls of a process pay for its thread pool
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _measure(device: torch.device) -> tuple[Link, ComputeModel]:
    with real_tensors():  # planning runs inside AOTAutograd's FakeTensorMode
        return _measure_real(device)


def _measure_real(device: torch.device) -> tuple[Link, ComputeModel]:
    cuda = device.type == "cuda"
    n = (32 << 20) // 4 if cuda else (16 << 20) // 4  # 32 MiB: little of a full GPU
    nbytes = n * 4
    if cuda:
        src = torch.empty(n, device=device).fill_(1.0)
        host = torch.empty(n, pin_memory=True).fill_(1.0)
        link = Link(d2h_bytes_per_s=nbytes / _median_of(lambda: host.copy_(src, non_blocking=True)),
                    h2d_bytes_per_s=nbytes / _median_of(lambda: src.copy_(host, non_blocking=True)))
    else:
        link = SIMULATED_LINK
    m = 2048 if cuda else 512
    a = torch.full((m, m), 0.5, device=device)  # no random draw: the user's RNG stays
    mm = _median_of(lambda: a @ a)
    big = torch.empty(2 * n, device=device).fill_(1.0)
    other = torch.empty_like(big).fill_(1.0)
    copy = _median_of(lambda: other.copy_(big))
    return (link,
            ComputeModel(flops_per_s=2 * m ** 3 / mm, bytes_per_s=2 * big.numel() * 4 / copy,
                         launch_s=5e-6 if cuda else 2e-6))


def measured(device: torch.device | str) -> tuple[Link, ComputeModel]:
    """The link and rate of `device`'s machine: from the cache, else measured and cached."""
    device = torch.device(device)
    key = _key(device)
    if key in _measured:
        return _measured[key]
    path = cache_path()
    try:
        entry = json.loads(path.read_text())[key]
        found = (Link(**entry["link"]), ComputeModel(**entry["compute"]))
    except (OSError, ValueError, KeyError, TypeError):
        found = _measure(device)
        try:
            table = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            table = {}
        table[key] = {"link": dataclasses.asdict(found[0]),
                      "compute": dataclasses.asdict(found[1])}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1))
        except OSError:
            pass  # a read-only home: measured again next process
    _measured[key] = found
    return found
