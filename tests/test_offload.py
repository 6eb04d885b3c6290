"""Offload (memopt.allocator.offload, passes.offload, planner.offload_choice, memopt.offload):
the link's schedule on plain data, then whole steps on CPU, where the copy to host is a
no-op through the same calls, or (CPU_HOST_COPIES) a real copy into memory outside
PyTorch's allocator, so that the allocated bytes of a step are what a GPU would hold."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import memopt
import memopt.link
from memopt import offload as runtime
from memopt.allocator import Interval
from memopt.allocator.offload import Candidate, Link, choose, schedule
from memopt.errors import BudgetError
from memopt.measure import allocation_peak
from memopt.memory_plan import MemoryPlan
from support import OFFLOAD_LINK, offload_rates

FAST = OFFLOAD_LINK


# -- the schedule, on plain data ----------------------------------------------------

def _step(n_fw: int = 4, n_bw: int = 4, size: int = 100):
    """A chain: value i produced at step i, read by the backward at step 2n-1-i."""
    n = n_fw + n_bw
    ivs = [Interval(size, i, n - 1 - i) for i in range(n_fw)]
    cands = [Candidate(index=i, nbytes=size, start=i, fw_last=min(i + 1, n_fw - 1),
                       bw_first=n - 1 - i) for i in range(n_fw - 1)]
    return ivs, n, cands


def test_a_fast_link_frees_a_value_between_its_reads():
    ivs, n, cands = _step()
    fast = Link(1e12, 1e12, latency_s=0.0)
    out = schedule(ivs, n, cands, frozenset({0}), [1.0] * n, fast, num_forward=4)
    t, = out.transfers
    # freed after its last forward read; issued as the step before its first backward
    # read starts, so that the copy back is done when that read starts
    assert (t.freed_after, t.prefetch_at) == (1, 6)
    assert out.intervals[0] == Interval(100, 0, 1) and out.intervals[-1] == Interval(100, 6, 7)
    assert out.wait_s == 0 and t.d2h_start_s == pytest.approx(1.0)


def test_a_slow_link_holds_the_bytes_until_the_copy_ends_and_the_backward_waits():
    ivs, n, cands = _step()
    slow = Link(100 / 2.5, 100 / 3.0, latency_s=0.0)  # 2.5 s out, 3 s back
    out = schedule(ivs, n, cands, frozenset({1}), [1.0] * n, slow, num_forward=4)
    t, = out.transfers
    assert t.d2h_end_s == pytest.approx(4.5) and t.freed_after == 4  # held past its last read
    # back by step 6 (starts at 6 s): issued at step 4 at the earliest (the backward's first)
    assert t.prefetch_at == 4 and t.h2d_start_s == pytest.approx(4.5)
    assert t.wait_s == pytest.approx(1.5) and out.seconds == pytest.approx(9.5)
    assert out.intervals[1] == Interval(100, 1, 6)  # never freed: nothing gained


def test_choose_offloads_until_the_target_and_stops_where_nothing_lowers_the_peak():
    ivs, n, cands = _step()
    fast = Link(1e12, 1e12, latency_s=0.0)
    base = schedule(ivs, n, cands, frozenset(), [1.0] * n, fast, num_forward=4)
    assert base.peak_bytes == 400
    one = choose(ivs, n, cands, [1.0] * n, fast, target=300, num_forward=4)
    assert one.peak_bytes <= 300 and len(one.transfers) == 1
    floor = choose(ivs, n, cands, [1.0] * n, fast, target=0, num_forward=4)
    assert 0 < floor.peak_bytes < 300  # the last value is read where it is made


def test_bad_links_and_candidates_are_refused():
    with pytest.raises(ValueError, match="bandwidths"):
        Link(0, 1)
    with pytest.raises(ValueError, match="fw_last < bw_first"):
        Candidate(index=0, nbytes=1, start=3, fw_last=3, bw_first=3)


# -- whole steps on CPU -------------------------------------------------------------

@pytest.fixture
def cpu_rates(monkeypatch):
    """A fixed device rate, so that the choice does not depend on this machine's timing."""
    monkeypatch.setitem(memopt.link._measured, *offload_rates())


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1))
                           for _ in range(6)], nn.Linear(128, 1))


def _grads(model, x, seed=1):
    torch.manual_seed(seed)
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_offload_gives_eagers_gradients_with_dropout_and_leaves_nothing_behind(cpu_rates):
    model, x = _mlp(), torch.randn(256, 128)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7, offload=FAST)
    got = _grads(compiled, x)
    want = _grads(copy.deepcopy(model), x)
    plan = compiled.memopt_plan
    assert plan.offloaded and not plan.recomputed  # offloading beat recomputing here
    assert {s.name for s in plan.saved if s.decision == "offloaded"} \
        == {o.name for o in plan.offloaded}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert runtime.pending() == 0 and runtime.host_bytes() == 0
    text = plan.summary()
    assert "offloaded" in text and "host link" in text
    assert MemoryPlan.from_json(plan.to_json()) == plan
    # a second step into the kept .grad (accumulation): eager's sums
    torch.manual_seed(2)
    compiled(x).sum().backward()
    ref = copy.deepcopy(model)
    _grads(ref, x)
    torch.manual_seed(2)
    ref(x).sum().backward()
    for a, b in zip(compiled.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def _allocated(compiled, x) -> int:
    compiled.zero_grad(set_to_none=True)
    resident = sum(t.untyped_storage().nbytes() for t in (*compiled.parameters(), x))
    with allocation_peak("cpu") as seen:
        compiled(x).sum().backward()
    return seen.peak + resident


def test_offloaded_bytes_leave_the_allocator_as_planned(cpu_rates, monkeypatch):
    """With real copies to memory outside PyTorch's allocator, the step's allocated peak is
    the plan's within 1%, under the budget, and so is a second step into the kept .grad;
    a budget recomputation alone cannot reach is accepted and held."""
    monkeypatch.setattr(runtime, "CPU_HOST_COPIES", True)
    model, x = _mlp(), torch.randn(256, 128)
    for budget in (0.7, 0.53):
        compiled = memopt.compile(copy.deepcopy(model), budget=budget, offload=FAST)
        compiled(x).sum().backward()
        plan = compiled.memopt_plan
        measured = _allocated(compiled, x)
        assert plan.offloaded
        assert measured <= plan.budget_bytes
        assert abs(measured - plan.predicted_peak_bytes) <= 0.01 * plan.predicted_peak_bytes
    # a second step into the kept .grad (gradient accumulation): its own plan, measured
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*compiled.parameters(), *(p.grad for p in compiled.parameters()), x))
    with allocation_peak("cpu") as seen:
        compiled(x).sum().backward()
    kept = compiled.memopt_plan
    assert kept.existing_grad_bytes > 0 and kept.offloaded
    assert seen.peak + resident <= kept.budget_bytes
    assert abs(seen.peak + resident - kept.predicted_peak_bytes) \
        <= 0.01 * kept.predicted_peak_bytes
    with pytest.raises(BudgetError):  # 0.53: below what recomputation alone reaches (0.56)
        memopt.compile(copy.deepcopy(model), budget=0.53, offload=False)(x).sum().backward()


def test_offload_is_off_by_default_on_cpu_and_below_a_slow_link(cpu_rates):
    model, x = _mlp(), torch.randn(256, 128)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7)
    compiled(x).sum().backward()
    assert compiled.memopt_plan.offloaded == () and compiled.memopt_plan.link is None
    slow = Link(d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6)  # seconds a copy: recompute wins
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7, offload=slow)
    compiled(x).sum().backward()
    assert compiled.memopt_plan.offloaded == () and compiled.memopt_plan.recomputed


def test_a_step_that_raises_or_never_runs_its_backward_frees_every_host_buffer(cpu_rates):
    model, x = _mlp(), torch.randn(256, 128)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7, offload=FAST)
    compiled(x).sum().backward()
    loss = compiled(x).sum()
    assert runtime.pending() > 0 and runtime.host_bytes() > 0  # on the host until backward
    del loss
    gc.collect()
    assert runtime.pending() == 0

    def fail(_grad):
        raise RuntimeError("a hook that fails")

    out = compiled(x)
    out.register_hook(fail)
    with pytest.raises(RuntimeError, match="a hook that fails"):
        out.sum().backward()
    del out
    gc.collect()
    assert runtime.pending() == 0 and runtime.host_bytes() == 0


def test_bad_offload_options_are_refused():
    with pytest.raises(ValueError, match="offload must be"):
        memopt.compile(nn.Linear(2, 2), offload="yes")
    with pytest.raises(ValueError, match='kernels="aten"'):
        memopt.compile(nn.Linear(2, 2), offload=True, kernels="inductor")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_measures_within_the_budget_and_the_prediction():
    model, x = _mlp().cuda(), torch.randn(4096, 128, device="cuda")
    compiled = memopt.compile(copy.deepcopy(model), budget=0.6, offload=True)
    compiled(x).sum().backward()
    torch.cuda.synchronize()
    compiled.zero_grad(set_to_none=True)
    # the step's rise over what was allocated before it, plus the parameters and input the
    # plan counts: a worker that ran other tests first still holds their leftovers (one
    # pytest-xdist worker on an H200 measured 185,641,472 bytes of max_memory_allocated
    # against this 19,761,868-byte budget)
    resident = sum(p.nbytes for p in compiled.parameters()) + x.nbytes
    with allocation_peak("cuda") as seen:
        compiled(x).sum().backward()
    peak, plan = seen.peak + resident, compiled.memopt_plan
    assert peak <= plan.budget_bytes
    assert abs(peak - plan.predicted_peak_bytes) <= 0.02 * plan.predicted_peak_bytes


def test_the_picture_shows_what_is_on_the_host(cpu_rates, tmp_path):
    pytest.importorskip("matplotlib")
    model, x = _mlp(), torch.randn(256, 128)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7, offload=FAST)
    compiled(x).sum().backward()
    plan = compiled.memopt_plan
    assert all(o.freed_step < o.prefetch_step for o in plan.offloaded)
    assert plan.plot(tmp_path / "memory.png").stat().st_size > 0


def test_a_value_whose_copy_frees_nothing_is_not_offloaded():
    """A link too slow for the copy out to end before the copy back must start: offloading
    that value frees no step's bytes, so `choose` keeps it on the device (and does not pay
    for its copies)."""
    ivs, n, cands = _step()
    crawl = Link(1.0, 1.0, latency_s=0.0)  # 100 s a copy
    out = choose(ivs, n, cands, [1.0] * n, crawl, target=0, num_forward=4)
    assert out.transfers == () and out.peak_bytes == 400
    slow = schedule(ivs, n, cands, frozenset({0}), [1.0] * n, crawl, num_forward=4)
    assert not slow.transfers[0].frees and slow.intervals == tuple(ivs)


class _Event:
    def __init__(self, streams):
        self.streams, self.position = streams, None

    def record(self, stream):
        self.position = len(stream.queue) if stream is self.streams.side else None
        self.streams.log.append(("record", stream.name, self))


class _Stream:
    def __init__(self, streams, name):
        self.streams, self.name, self.queue, self.ran = streams, name, [], 0

    def wait_event(self, event):
        self.streams.log.append(("wait", self.name, event))
        if self.name == "main" and event.position is not None:  # the side's work up to it
            side = self.streams.side
            while side.ran < event.position:
                side.queue[side.ran]()
                side.ran += 1


class AsyncStreams(runtime.Streams):
    """CUDA's ordering on CPU: the side stream's copies are queued and run only when the
    main stream waits for an event recorded after them, and every buffer starts as NaN. A
    copy read before its wait, or a missing wait, gives NaN gradients."""

    def __init__(self):
        self.cuda, self.device, self.log, self._side_now = False, torch.device("cpu"), [], False
        self.side, self.main = _Stream(self, "side"), _Stream(self, "main")

    def current(self):
        return self.side if self._side_now else self.main

    def event(self):
        return _Event(self)

    def on_side(self):
        import contextlib  # noqa: PLC0415

        @contextlib.contextmanager
        def side():
            self._side_now = True
            try:
                yield
            finally:
                self._side_now = False
        return side()

    def host_buffer(self, x):
        return torch.full_like(x, float("nan"))

    def device_buffer(self, host, device):
        return torch.full_like(host, float("nan"))

    def copy(self, dst, src):
        assert self._side_now, "a copy ran on the main stream"
        waited = [e for kind, name, e in self.log if kind == "wait" and name == "side"]
        recorded = [e for kind, name, e in self.log if kind == "record" and name == "main"]
        assert waited and recorded and waited[-1] is recorded[-1], \
            "the side stream copied without waiting for the main stream's last event"
        self.side.queue.append(lambda: dst.copy_(src))


def test_the_copies_are_fenced_as_on_a_gpu(cpu_rates, monkeypatch):
    """The CUDA path's order of streams and events, run on CPU with copies that happen only
    when the main stream waits for them: eager's gradients (a read before its copy back
    would see NaN), every copy on the side stream after it waited for the main stream."""
    fake = AsyncStreams()
    monkeypatch.setitem(runtime._streams, torch.device("cpu"), fake)
    model, x = _mlp(), torch.randn(256, 128)
    compiled = memopt.compile(copy.deepcopy(model), budget=0.7, offload=FAST)
    got = _grads(compiled, x)
    want = _grads(copy.deepcopy(model), x)
    assert compiled.memopt_plan.offloaded
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    copies = len(fake.side.queue)
    assert copies == 2 * len(compiled.memopt_plan.offloaded)  # one out, one back each
    assert fake.side.ran == copies  # every copy was waited for
