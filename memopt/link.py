"""The host link and the device's rate that the offload planner schedules copies with
(memopt.allocator.offload.Link, memopt.passes.offload.ComputeModel): measured once
per machine and device, then read from a small JSON cache.

    measured(device) -> (Link, ComputeModel)

A GPU's link is measured with pinned host buffers (the copies memopt.offload makes),
64 MiB each way, its rate with a 4096^2 matmul and a 256 MiB copy. On CPU there is no
separate host memory (offload is off there unless asked for): the "link" is a memory
copy and the rate a 512^2 matmul, which is what the planner's tests schedule with.
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


def cache_path() -> Path:
    root = os.environ.get("MEMOPT_CACHE_DIR") or Path.home() / ".cache" / "memopt"
    return Path(root) / "link.json"


def _key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{os.cpu_count()}"


def _median_of(fn, repeats: int = 5) -> float:
    """The median of `repeats` timed calls (after one warm-up), in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _measure(device: torch.device) -> tuple[Link, ComputeModel]:
    with real_tensors():  # planning runs inside AOTAutograd's FakeTensorMode
        return _measure_real(device)


def _measure_real(device: torch.device) -> tuple[Link, ComputeModel]:
    cuda = device.type == "cuda"
    n = (64 << 20) // 4 if cuda else (16 << 20) // 4
    src = torch.empty(n, device=device)
    host = torch.empty(n, pin_memory=cuda)
    d2h = _median_of(lambda: host.copy_(src, non_blocking=cuda))
    h2d = _median_of(lambda: src.copy_(host, non_blocking=cuda))
    m = 4096 if cuda else 512
    a = torch.randn(m, m, device=device)
    mm = _median_of(lambda: a @ a)
    big = torch.empty(4 * n, device=device)
    other = torch.empty_like(big)
    copy = _median_of(lambda: other.copy_(big))
    nbytes = n * 4
    return (Link(d2h_bytes_per_s=nbytes / d2h, h2d_bytes_per_s=nbytes / h2d),
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
