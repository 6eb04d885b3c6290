"""The picture of a plan's memory (memopt.report): the timeline a plan records is the
liveness behind its predicted peak, survives JSON, and draws; the report directory and
its command line; the errors without matplotlib or without a timeline."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from memopt.allocator.timeline import KINDS, downsample, live_by_kind
from models import MLP, ConvBN
from pydantic import ValidationError
from torch import nn

import memopt
from memopt.memory_plan import MemoryPlan, StepPlan, Timeline
from memopt.report import REPORT_FILES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plan(make: type, shape: tuple[int, ...], budget: float | None) -> MemoryPlan:
    torch.manual_seed(0)
    return memopt.plan(make(), torch.randn(*shape), budget=budget)


@pytest.fixture(scope="module")
def binding() -> MemoryPlan:
    """A CNN planned under a budget that makes memopt recompute (workspaces measured)."""
    plan = _plan(ConvBN, (32, 3, 16, 16), 0.9)
    assert plan.recomputed and plan.budget_bytes is not None
    return plan


@pytest.fixture(scope="module")
def unbudgeted() -> MemoryPlan:
    return _plan(MLP, (64, 32), None)


@pytest.fixture
def needs_matplotlib() -> None:
    pytest.importorskip("matplotlib", reason="plotting needs the [plot] extra")


# The timeline is the predicted peak's liveness ------------------------------------------

@pytest.mark.parametrize("which", ["binding", "unbudgeted"])
def test_timeline_peaks_are_the_plans_peaks(which: str, request: pytest.FixtureRequest) -> None:
    plan: MemoryPlan = request.getfixturevalue(which)
    assert plan.timeline.peak_bytes == plan.predicted_peak_bytes
    assert plan.baseline_timeline.peak_bytes == plan.baseline_peak_bytes
    assert plan.timeline.peak_step == plan.peak_step
    for t in (plan.timeline, plan.baseline_timeline):
        assert set(t.kinds) <= set(KINDS) and t.peak_module  # the peak op's module is known
        assert list(t.steps) == sorted(set(t.steps)) and t.steps[-1] < t.num_steps
    assert plan.timeline.num_steps == plan.num_forward_steps + plan.num_backward_steps
    assert plan.timeline.num_forward_steps == plan.num_forward_steps


def test_memopt_timeline_within_budget_baseline_above(binding: MemoryPlan) -> None:
    assert max(binding.timeline.totals) <= binding.budget_bytes - binding.headroom_bytes
    assert max(binding.baseline_timeline.totals) > binding.budget_bytes
    assert "recomputed" in binding.timeline.kinds
    assert "recomputed" not in binding.baseline_timeline.kinds


def test_timeline_matches_the_plans_storages(binding: MemoryPlan) -> None:
    """Each point's total, and its parameters, gradients and saved activations, against
    the plan's own storage records (a count written apart from allocator.timeline)."""
    t = binding.timeline
    column = dict(zip(t.kinds, t.live))
    kinds = {"parameters": ("parameter", "buffer"), "gradients": ("gradient", "existing_grad"),
             "saved": ("saved",)}
    for p, step in enumerate(t.steps):
        live = [s for s in binding.storages if max(s.start, 0) <= step <= s.end]
        assert t.totals[p] == sum(s.nbytes for s in live)
        for kind, storage_kinds in kinds.items():
            expected = sum(s.nbytes for s in live if s.kind in storage_kinds)
            assert column.get(kind, (0,) * len(t.steps))[p] == expected, (kind, step)


def test_kinds_add_up_at_every_point(binding: MemoryPlan) -> None:
    for t in (binding.timeline, binding.baseline_timeline):
        assert len(t.live) == len(t.kinds)
        assert t.totals == tuple(sum(t.live[k][p] for k in range(len(t.kinds)))
                                 for p in range(len(t.steps)))


def test_downsampling_keeps_each_buckets_highest_step() -> None:
    rng = random.Random(0)
    n = 5000
    intervals = []
    for _ in range(3000):
        start = rng.randrange(-1, n)
        intervals.append((rng.randrange(1, 10_000), start, rng.randrange(max(start, 0), n)))
    kinds = [rng.choice(KINDS) for _ in intervals]
    profiles = live_by_kind(intervals, kinds, n, granularity=512)
    totals = [sum(c) for c in zip(*profiles.values())]
    steps, columns = downsample(profiles, n, max_points=300)
    assert len(steps) <= 300 and max(totals) in {totals[s] for s in steps}
    assert all(sum(columns[k][p] for k in columns) == totals[s] for p, s in enumerate(steps))
    width = -(-n // 300)
    assert all(totals[s] == max(totals[s - s % width:s - s % width + width]) for s in steps)
    assert downsample(profiles, n, max_points=n)[0] == tuple(range(n))  # few enough: all


def test_a_timeline_with_ragged_columns_is_refused() -> None:
    with pytest.raises(ValidationError):
        Timeline(num_steps=3, num_forward_steps=1, steps=(0, 1, 2), kinds=("saved",),
                 live=((1, 2),))


# JSON ----------------------------------------------------------------------------------

def test_json_round_trip_keeps_the_timelines(binding: MemoryPlan) -> None:
    again = MemoryPlan.from_json(binding.to_json())
    assert again == binding and again.timeline == binding.timeline
    assert len(binding.timeline.model_dump_json()) < 20_000  # compact beside the plan


def test_a_plan_written_before_timelines_loads_and_says_how_to_plot(
        unbudgeted: MemoryPlan, tmp_path: Path) -> None:
    data = json.loads(unbudgeted.to_json())
    del data["timeline"], data["baseline_timeline"]
    old = MemoryPlan.from_json(json.dumps(data))
    assert old.timeline is None
    with pytest.raises(memopt.NoTimelineError, match="Plan the step again") as caught:
        old.plot(tmp_path / "old.png")
    assert isinstance(caught.value, ValueError) and not (tmp_path / "old.png").exists()


# Pictures and reports ------------------------------------------------------------------

def test_plot_writes_a_png(binding: MemoryPlan, tmp_path: Path, needs_matplotlib: None) -> None:
    path = binding.plot(tmp_path / "memory.png")
    data = path.read_bytes()
    assert path == tmp_path / "memory.png" and data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_leaves_pyplot_alone(unbudgeted: MemoryPlan, tmp_path: Path,
                                  needs_matplotlib: None) -> None:
    """No pyplot, so no global backend chosen or switched (in a fresh process: another
    test may have imported pyplot here)."""
    saved = tmp_path / "plan.json"
    saved.write_text(unbudgeted.to_json())
    code = ("import sys; from memopt.report import load_plan; from pathlib import Path; "
            f"load_plan(Path({str(saved)!r}).read_text()).plot({str(tmp_path / 'p.png')!r}); "
            "print('matplotlib.pyplot' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]  # nor torch: a plan is plain data


def test_save_report_writes_three_files(binding: MemoryPlan, tmp_path: Path,
                                        needs_matplotlib: None) -> None:
    paths = binding.save_report(tmp_path / "report")
    assert [p.name for p in paths] == list(REPORT_FILES)
    png, summary, data = paths
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert summary.read_text() == binding.summary() + "\n"
    assert MemoryPlan.from_json(data.read_text()) == binding


def test_report_command_line(unbudgeted: MemoryPlan, tmp_path: Path,
                             needs_matplotlib: None) -> None:
    saved = tmp_path / "plan.json"
    saved.write_text(unbudgeted.to_json())
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "memopt.report", str(saved), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES)
    assert (out / "memory.png").read_bytes().startswith(PNG_MAGIC)
    missing = subprocess.run([sys.executable, "-m", "memopt.report", str(tmp_path / "no.json")],
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "bad.json").write_text('{"device": "cpu"}')
    bad = subprocess.run([sys.executable, "-m", "memopt.report", str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "is not a memopt plan" in bad.stderr


def test_without_matplotlib_a_typed_error_names_the_extra(
        binding: MemoryPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(memopt.OptionalDependencyError, match=r'pip install "memopt\[plot\]"') \
            as caught:
        binding.save_report(tmp_path / "report")
    assert isinstance(caught.value, ImportError) and caught.value.extra == "plot"
    # the summary and the JSON are written before the picture is tried
    assert (tmp_path / "report" / "summary.txt").exists()
    assert (tmp_path / "report" / "plan.json").exists()


# Graph breaks --------------------------------------------------------------------------

class Branches(nn.Module):
    """A branch on a value between two stacks: dynamo splits the step into two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.mean().item() > -1e9:
            h = h * 2
        return self.b(h)


def test_a_step_plan_of_several_graphs_plots_every_graph(tmp_path: Path,
                                                         needs_matplotlib: None) -> None:
    torch.manual_seed(0)
    compiled = memopt.compile(Branches())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's graph-break warning
        compiled(torch.randn(64, 32)).square().mean().backward()
    plan = compiled.memopt_plan
    assert isinstance(plan, StepPlan) and len(plan.graphs) == 2
    for g in plan.graphs:
        assert g.timeline.peak_bytes == g.predicted_peak_bytes
        assert g.baseline_timeline.peak_bytes == g.baseline_peak_bytes
        assert "other_graphs" in g.timeline.kinds  # what the other graph holds around it
    png, _, data = plan.save_report(tmp_path)
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert StepPlan.from_json(data.read_text()) == plan
