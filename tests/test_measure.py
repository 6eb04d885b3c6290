"""Tests of memopt.measure: the real peak of one training step.

The workloads the child processes build are defined in this file and named
``"test_measure:<builder>"`` with this directory on the child's ``sys.path``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import memopt
from memopt.measure import (
    MALLOC_MMAP_THRESHOLD,
    Measurement,
    Workload,
    budget_from_arg,
    default_loss,
    measure_step,
)

HERE = str(Path(__file__).resolve().parent)
MODULE = Path(__file__).stem
MIB = 2**20
BIG_BYTES = 64 * MIB  # the known intermediate of BigIntermediate


# --------------------------------------------------------------------------
# Workloads built in the child process
# --------------------------------------------------------------------------


class BigIntermediate(nn.Module):
    """Forward makes one 64 MiB temporary; backward makes one 64 MiB gradient.

    ``w.expand(n) * 2.0`` allocates 64 MiB and saves nothing (the other factor
    is a Python scalar); ``sum`` saves nothing, so the temporary dies in
    forward. In backward, MulBackward materializes ``grad * 2.0`` (64 MiB)
    before ExpandBackward reduces it to one element. At no time are two
    64 MiB buffers alive, so the step's peak is 64 MiB over the resident
    tensors (plus a few small ones).
    """

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.lin = nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.w.expand(BIG_BYTES // 4) * 2.0
        return big.sum() + self.lin(x).sum()


def big_intermediate(device: str) -> Workload:
    torch.manual_seed(0)
    return Workload(model=BigIntermediate().to(device), args=(torch.randn(8, 128),))


class UntouchedScratch(nn.Module):
    """Forward allocates a 64 MiB buffer and writes only its first element (as a
    kernel workspace written in part): 64 MiB allocated, one page touched."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(BIG_BYTES // 4, device=x.device)
        return self.lin(x).sum() + scratch[:1].zero_().sum()


def untouched_scratch(device: str) -> Workload:
    torch.manual_seed(0)
    return Workload(model=UntouchedScratch().to(device), args=(torch.randn(8, 128),))


def mlp8(device: str) -> Workload:
    """8 x (Linear(256, 256) + GELU), batch 512: every buffer is >= 256 KiB."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.GELU()]
    return Workload(model=nn.Sequential(*layers).to(device), args=(torch.randn(512, 256),))


def broken(device: str) -> Workload:
    raise ValueError("deliberate failure in the builder: xyzzy-42")


def sleepy(device: str) -> Workload:
    time.sleep(120)
    raise AssertionError("not reached")


def _resident(wl: Workload) -> int:
    tensors = [*wl.model.parameters(), *wl.model.buffers(), *wl.args]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


# --------------------------------------------------------------------------
# Measurements in a child process
# --------------------------------------------------------------------------

# Each child process imports torch (seconds on a loaded 2-core machine), so the
# children run side by side. VmHWM and the malloc setting are per process, so
# running them together changes their times, not their peaks.
_CHILDREN = {
    "big": dict(timed_steps=0, timeout=120),
    "mlp8": dict(timed_steps=1, timeout=120),
    "untouched": dict(timed_steps=0, timeout=120),
    "broken": dict(timeout=120),
    "sleepy": dict(timeout=6),
}


def _run_child(name: str) -> tuple[Measurement | Exception, float]:
    builder = {"big": "big_intermediate", "untouched": "untouched_scratch"}.get(name, name)
    start = time.monotonic()
    try:
        result: Measurement | Exception = measure_step(
            f"{MODULE}:{builder}", path=[HERE], **_CHILDREN[name]
        )
    except Exception as exc:  # noqa: BLE001 (each test checks its own outcome)
        result = exc
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def children() -> dict[str, tuple[Measurement | Exception, float]]:
    with ThreadPoolExecutor(max_workers=len(_CHILDREN)) as pool:
        return dict(zip(_CHILDREN, pool.map(_run_child, _CHILDREN)))


def _measurement(children, name: str) -> Measurement:
    result, _ = children[name]
    if isinstance(result, Exception):
        raise result
    return result


def test_known_intermediate_is_measured_within_10_percent(children) -> None:
    m = _measurement(children, "big")
    resident = _resident(big_intermediate("cpu"))
    assert m.resident_bytes == resident
    expected = BIG_BYTES + resident
    assert abs(m.peak_bytes - expected) <= 0.10 * expected, (m.peak_bytes, expected)
    assert abs(m.allocated_peak_bytes - expected) <= 0.10 * expected, m
    assert m.device == "cpu"
    assert m.predicted_peak_bytes is None and m.plan_seconds is None
    assert m.step_seconds > 0


def test_mlp_peak_exceeds_resident_plus_gradients(children) -> None:
    m = _measurement(children, "mlp8")
    wl = mlp8("cpu")
    assert m.resident_bytes == _resident(wl)
    # The gradients outlive the step, so they are a lower bound on its peak;
    # the saved activations (16 x 512 KiB) come on top.
    grad_bytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    assert m.peak_bytes > m.resident_bytes + grad_bytes + 4 * MIB, m


def test_allocated_bytes_count_a_buffer_the_step_never_touches(children) -> None:
    """RSS sees one page of the 64 MiB scratch buffer; the allocator handed out all of
    it, and so would a CUDA allocator: allocated_peak_bytes counts it."""
    m = _measurement(children, "untouched")
    assert m.peak_bytes < m.resident_bytes + BIG_BYTES // 2, m
    assert BIG_BYTES + m.resident_bytes <= m.allocated_peak_bytes <= 1.1 * (
        BIG_BYTES + m.resident_bytes), m


def test_failing_child_raises_runtime_error_with_its_stderr(children) -> None:
    result, _ = children["broken"]
    assert isinstance(result, RuntimeError), result
    assert "xyzzy-42" in str(result) and "ValueError" in str(result)


def test_hung_child_is_killed_at_the_timeout(children) -> None:
    result, seconds = children["sleepy"]
    assert isinstance(result, RuntimeError), result
    assert "timed out" in str(result)
    assert seconds < 30


@pytest.mark.parametrize("bad", ["no_colon", "a:b:c", "mod:", ":fn", "1mod:fn", "a-b:fn", ""])
def test_bad_workload_name_raises_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="module:function"):
        measure_step(bad)


def test_bad_mode_and_device_raise_value_error() -> None:
    with pytest.raises(ValueError, match="mode"):
        measure_step(f"{MODULE}:mlp8", mode="lazy")
    with pytest.raises(ValueError, match="device"):
        measure_step(f"{MODULE}:mlp8", device="tpu")
    with pytest.raises(ValueError, match="warmup"):
        measure_step(f"{MODULE}:mlp8", mode="memopt", warmup=0)


# --------------------------------------------------------------------------
# In-process pieces
# --------------------------------------------------------------------------


class _FakePlan:
    predicted_peak_bytes = 123_456


class _FakeCompiled(nn.Module):
    """What memopt.compile returns: a module with a plan, slow on first call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.memopt_plan = None
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.memopt_plan is None:
            time.sleep(3.0)  # "compiling"
            self.memopt_plan = _FakePlan()
        return self.model(*args, **kwargs)


def test_memopt_mode_reads_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_compile(model, *, budget=None, **options):
        seen.update(budget=budget, options=options)
        seen["compiled"] = _FakeCompiled(model)
        return seen["compiled"]

    monkeypatch.setattr(memopt, "compile", fake_compile, raising=False)
    m = measure_step(
        f"{MODULE}:mlp8", mode="memopt", budget="1GB", options={"knob": 2},
        isolate=False, path=[HERE], warmup=2, timed_steps=1,
    )  # fmt: skip
    assert seen["budget"] == "1GB" and seen["options"] == {"knob": 2}
    # warm-up, the measured step, the allocation-counting step (CPU), the timed step
    assert seen["compiled"].calls == 2 + 1 + 1 + 1
    assert m.predicted_peak_bytes == 123_456
    # a 3 s sleep, less the step time it is measured against (0.6 s for this MLP on a
    # loaded 2-core machine)
    assert m.plan_seconds is not None and m.plan_seconds >= 2.0
    assert m.resident_bytes == _resident(mlp8("cpu"))


def test_budget_from_arg() -> None:
    assert budget_from_arg(None) is None
    assert budget_from_arg("1000000") == 1_000_000 and isinstance(budget_from_arg("7"), int)
    assert budget_from_arg("0.5") == 0.5 and budget_from_arg("1e9") == 1e9
    assert budget_from_arg("4GB") == "4GB" and budget_from_arg("nan") == "nan"


def test_default_loss() -> None:
    a = torch.ones(2, requires_grad=True)
    assert default_loss((a * 2, {"b": a * 3, "n": torch.arange(3)}, None)).item() == 10.0

    class Output(OrderedDict):  # like a HuggingFace ModelOutput
        def __init__(self, **kw):
            super().__init__(**kw)
            self.__dict__.update(kw)

    assert default_loss(Output(loss=a.sum(), logits=a * 100)).item() == 2.0
    assert default_loss(Output(loss=None, logits=a * 100)).item() == 200.0
    with pytest.raises(ValueError, match="loss"):
        default_loss((torch.arange(3),))


def test_measurement_json_round_trip() -> None:
    m = Measurement(
        peak_bytes=10, resident_bytes=4, step_seconds=0.5,
        predicted_peak_bytes=None, plan_seconds=1.5, device="cpu",
    )  # fmt: skip
    assert Measurement.from_json(m.to_json()) == m
    with pytest.raises(ValueError):
        Measurement.from_json('{"peak_bytes": 1}')


def test_timed_steps_leave_the_measuring_allocator():
    """The CPU child measures RSS with every page-sized buffer mmap'd; its timed steps
    run under glibc's steady state instead (memopt.measure.child.steady_allocator), and only
    in that child: a process not started so is left as it is."""
    code = "from memopt.measure.child import steady_allocator; print(steady_allocator())"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "True"
    env.pop("MALLOC_MMAP_THRESHOLD_")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "False"
