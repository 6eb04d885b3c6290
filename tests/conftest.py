"""Shared test setup, and a guard against global state leaking from one test into the next.

Dynamo caches compiled code per Python code object and stops recompiling a code
object after `recompile_limit` entries; the corpus compiles many instances of the
same model classes, so every test starts from a clean dynamo cache and a fixed seed.

The guard: a test that changes process-wide state and leaves it changed
makes every later test run under conditions its author never saw, and the failure
shows up far from its cause (a `monkeypatch.setattr` on `torch._dynamo.config` once
broke 115 later tests under a newer pytest). So each test is compared before and after
against a snapshot of dynamo's, functorch's and inductor's configs, the default dtype,
Python's recursion limit, the intra-op thread count, grad mode, deterministic
algorithms, anomaly mode and autocast; a test that leaves any of them changed fails
at teardown, naming what changed, and the state is put back so that the failure stays
with its cause instead of spreading to the tests after it. Change torch config only with its scoped
`config.patch(...)`. The global RNG is not compared (every test draws from it): it is
seeded before each test and restored after, so no test sees another's draws.

Python's cyclic garbage collector: after each test its garbage is collected and what
survives it is frozen (`gc.freeze()`), so that later collections walk only the objects
made since. Without this the objects alive in the test process (imports, caches) grow to
1.8 million, and every full collection walks all of them, about 1 s each on a 2-core
machine (`allocation_peak`'s `gc.collect()` before each measurement is one): 165 of them
took 166 s of the 660 s the default suite's tests ran. A test's own garbage is young and
collected as before; a cycle that a later test drops among frozen objects is never freed,
which the suite's peak memory did not show (2.0 GB either way).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memopt import caller_loss
from memopt.passes._torch_compat import saved_tensor_pack_hook_on_top

#: The repository root, so that tests import the benchmarks' workloads
#: (``benchmarks.zoo``, ``benchmarks.recurrent_workloads``) however pytest is started.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Under pytest-xdist (the README's `-n auto`) each worker takes its share of the cores
#: for torch's intra-op threads: two workers of two threads each on CI's 2 cores would
#: contend for them. Set once, before any test's state is snapshotted.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS)
                          if hasattr(os, "sched_getaffinity") else 1)


def _config_modules() -> dict[str, Any]:
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415
    import torch._functorch.config as functorch_config  # noqa: PLC0415

    modules = {"torch._dynamo.config": dynamo_config, "torch._functorch.config": functorch_config}
    inductor = sys.modules.get("torch._inductor.config")  # only once something imported it
    if inductor is not None:
        modules["torch._inductor.config"] = inductor
    return modules


def _configs() -> dict[str, dict[str, Any]]:
    return {name: module.get_config_copy() for name, module in _config_modules().items()}


def global_state() -> dict[str, Any]:
    """Process-wide settings a test must leave as it found them."""
    state: dict[str, Any] = {
        "torch.get_default_dtype()": torch.get_default_dtype(),
        "sys.getrecursionlimit()": sys.getrecursionlimit(),
        "torch.get_num_threads()": torch.get_num_threads(),
        "torch.is_grad_enabled()": torch.is_grad_enabled(),
        "torch.are_deterministic_algorithms_enabled()":
            torch.are_deterministic_algorithms_enabled(),
        "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
        "torch.is_autocast_enabled('cpu')": torch.is_autocast_enabled("cpu"),
        "saved-tensor hooks on the stack": saved_tensor_pack_hook_on_top() is not None,
    }
    for name, values in _configs().items():
        for key, value in values.items():
            state[f"{name}.{key}"] = value
    return state


def changed_state(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per setting that differs (or appeared, or vanished)."""
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "<absent>"), after.get(key, "<absent>")
        try:
            same = bool(old == new)
        except Exception:  # values whose == is not a bool (tensors): compare identity
            same = old is new
        if not same:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def _restore(before: dict[str, Any]) -> None:
    """Put back what a failing test changed, so that only that test fails."""
    for name, module in _config_modules().items():
        module.load_config({key: before[f"{name}.{key}"] for key, value
                            in module.get_config_copy().items()
                            if f"{name}.{key}" in before and before[f"{name}.{key}"] != value})
    torch.set_default_dtype(before["torch.get_default_dtype()"])
    sys.setrecursionlimit(before["sys.getrecursionlimit()"])
    torch.set_num_threads(before["torch.get_num_threads()"])
    torch.set_grad_enabled(before["torch.is_grad_enabled()"])
    torch.use_deterministic_algorithms(before["torch.are_deterministic_algorithms_enabled()"])
    torch.set_anomaly_enabled(before["torch.is_anomaly_enabled()"])
    torch.set_autocast_enabled("cpu", before["torch.is_autocast_enabled('cpu')"])


@pytest.fixture(autouse=True)
def _fresh_dynamo_seed_and_global_state_guard(request):
    before = global_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
    torch._dynamo.reset()
    caller_loss.stop()  # a loop's last step leaves its watch until the next call
    gc.collect()  # this test's garbage, while it is young
    gc.freeze()   # what outlives the test is never walked again
    changes = changed_state(before, global_state())
    if changes:
        _restore(before)
        pytest.fail(
            f"{request.node.nodeid} left global state changed (use the scoped "
            f"`config.patch(...)` / a context manager instead):\n  " + "\n  ".join(changes),
            pytrace=False,
        )


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: the reversible modules run many small ops per
    time step, which threads slow down on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
