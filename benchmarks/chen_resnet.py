"""Chen et al. 2016, Fig. 5: feature-map memory of deep ResNets, planned on meta tensors.

    python -m benchmarks.chen_resnet                     # depths 50 101 152 200 500 1000
    python -m benchmarks.chen_resnet --depths 50 200     # a subset

Nothing runs and no real memory is allocated: the model and the batch live on the
"meta" device and `memopt.plan` plans one training step on FakeTensors.

Models. Bottleneck ResNets for ImageNet (He et al. 2016): a 7x7/2 stem conv +
BatchNorm + ReLU, 3x3/2 max-pool, four stages of bottleneck blocks (1x1, 3x3, 1x1
convs, each followed by BatchNorm; ReLU after the first two and after the residual
add; a 1x1 projection shortcut in each stage's first block; stride 2 in stages 2-4),
global average pool and a 1000-way Linear. Batch 32 of 3x224x224, as in Chen Sec. 5.2.
Depth counts convs and the Linear: depth = 3 * sum(blocks) + 2. Blocks per stage:
He's configurations for 50 [3,4,6,3], 101 [3,4,23,3], 152 [3,8,36,3] and 200
[3,24,36,3] (the 200-layer one is also the net in Chen's mxnet-memonger example);
any other depth ("increasing the depth of each residual stage", Chen Sec. 5.2) takes
round((depth - 2) / 3) blocks spread over the stages in the 200-layer proportions
3:24:36:3, by largest remainder: 500 -> [8,60,91,7] (500 layers), 1000 ->
[15,121,182,15] (333 blocks, 1001 layers).

Feature-map memory (Chen Sec. 5.1: parameters are not part of it). From each plan's
`storages` drop the kinds parameter, buffer, input (the batch) and gradient
(parameter gradients); what is left is activations, saved tensors, temporaries, the
model output, its incoming gradient (tangent) and the backward's activation
gradients. The columns, in GB (10^9 bytes):
  - no optimization: every remaining storage its own memory (sum of sizes), with the
    in-place pass off (`inplace=False`, no recomputation).
  - in-place: the same sum with the in-place pass on (fewer storages).
  - in-place + sharing: the peak of live feature-map bytes over the step's schedule
    (`allocator.peak_live_bytes`), in-place pass on: what perfect sharing reaches, and
    what memopt's offset assignment reaches on these nets within a few percent.
  - sublinear plan: the same peak for the plan memopt makes at its minimum budget
    (Chen's Alg. 3 + grid search): plan with a 1-byte budget, read the minimum from
    the `BudgetError`, and plan again at that minimum.
"Fig. 2 tags" is the size of Chen's Fig. 2 tag-recycling allocation
(`allocator.share_by_tags`) of the same feature maps, for the sharing and sublinear
plans: a static allocation can lose to the live-bytes peak through fragmentation.
"total peak" is memopt's own predicted peak of the whole step (parameters, parameter
gradients and the batch included) for the sharing and sublinear plans.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import memopt
from memopt.allocator import Interval, peak_live_bytes, share_by_tags
from memopt.memory_plan import MemoryPlan

DEPTHS = (50, 101, 152, 200, 500, 1000)
BATCH, IMAGE = 32, (3, 224, 224)
#: He et al.'s ImageNet configurations: blocks per stage.
KNOWN_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}
#: Kinds that are not feature maps (Chen Sec. 5.1): parameters, buffers, the batch,
#: parameter gradients.
NOT_FEATURE_MAPS = frozenset({"parameter", "buffer", "input", "gradient"})
#: Chen et al. 2016 at 1000 layers (GB): no optimization read off Fig. 5's log-scale
#: plot; sublinear "less than 7GB" (Sec. 5.2 text).
CHEN_1000 = {"no optimization": "~48", "sublinear plan": "< 7"}
GB = 10**9
#: AOTAutograd compiles a generated Python wrapper whose nesting grows with the graph;
#: at 1000 layers it passes CPython's default compiler recursion limit (1000).
RECURSION_LIMIT = 20_000


def stage_blocks(depth: int) -> tuple[int, ...]:
    """Blocks per stage: He's table, else the 200-layer proportions by largest remainder."""
    if depth in KNOWN_BLOCKS:
        return KNOWN_BLOCKS[depth]
    total = round((depth - 2) / 3)
    shape = KNOWN_BLOCKS[200]
    exact = [total * s / sum(shape) for s in shape]
    blocks = [int(e) for e in exact]
    by_remainder = sorted(range(len(shape)), key=lambda i: (blocks[i] - exact[i], i))
    for i in by_remainder[: total - sum(blocks)]:
        blocks[i] += 1
    return tuple(blocks)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 (x4 channels), BatchNorm after each conv, ReLU after the add."""

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, out_ch, 1, bias=False), nn.BatchNorm2d(out_ch),
        )
        self.shortcut = nn.Identity() if in_ch == out_ch and stride == 1 else nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def resnet(blocks: tuple[int, ...], num_classes: int = 1000) -> nn.Sequential:
    """A bottleneck ImageNet ResNet with `blocks[i]` blocks in stage i."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    in_ch = 64
    for stage, n in enumerate(blocks):
        width = 64 * 2**stage
        for i in range(n):
            layers.append(Bottleneck(in_ch, width, stride=2 if stage > 0 and i == 0 else 1))
            in_ch = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)]
    return nn.Sequential(*layers)


def feature_map_intervals(plan: MemoryPlan) -> list[Interval]:
    return [Interval(s.nbytes, s.start, s.end) for s in plan.storages
            if s.kind not in NOT_FEATURE_MAPS]


def no_reuse(plan: MemoryPlan) -> int:
    """Feature-map bytes with every storage in its own memory."""
    return sum(iv.size for iv in feature_map_intervals(plan))


def live_peak(plan: MemoryPlan) -> int:
    """The peak of live feature-map bytes over the step (perfect sharing)."""
    steps = plan.num_forward_steps + plan.num_backward_steps
    return peak_live_bytes(feature_map_intervals(plan), steps).peak_bytes


def tags(plan: MemoryPlan) -> int:
    """Feature-map bytes under Chen's Fig. 2 tag recycling."""
    return share_by_tags(feature_map_intervals(plan)).total_bytes


@dataclass(frozen=True)
class Row:
    depth: int
    blocks: tuple[int, ...]
    no_opt: MemoryPlan
    inplace: MemoryPlan
    sublinear: MemoryPlan
    seconds: dict[str, float]  # memopt's own planning seconds of each plan, by column
    capture: dict[str, float]  # dynamo's and AOTAutograd's tracing before each

    @property
    def nodes(self) -> int:
        """Graph nodes of the step (forward + backward ops of the sublinear plan)."""
        return self.sublinear.num_forward_steps + self.sublinear.num_backward_steps

    @property
    def search_seconds(self) -> float:
        """The minimum search plus the sublinear plan (issue 15's measure)."""
        return self.seconds["minimum"] + self.seconds["sublinear"]

    def cells(self) -> list[str]:
        def gb(n: int) -> str:
            return f"{n / GB:.2f}"

        times = " / ".join(f"{s:.1f}" for s in self.seconds.values())
        return [
            f"{self.depth} ({3 * sum(self.blocks) + 2})", str(list(self.blocks)),
            gb(no_reuse(self.no_opt)), gb(no_reuse(self.inplace)),
            gb(live_peak(self.inplace)), gb(live_peak(self.sublinear)),
            f"{gb(tags(self.inplace))} / {gb(tags(self.sublinear))}",
            f"{gb(self.inplace.predicted_peak_bytes)} / {gb(self.sublinear.predicted_peak_bytes)}",
            f"{len(self.sublinear.recomputed)}",
            times,
            f"{self.search_seconds:.1f}",
            f"{sum(self.capture.values()) / len(self.capture):.0f}",
        ]


HEADER = ["depth (layers)", "blocks", "no optimization", "in-place", "in-place + sharing",
          "sublinear plan", "Fig. 2 tags: sharing / sublinear", "total peak: sharing / sublinear",
          "recomputed ops",
          "plan seconds: none / in-place / minimum search / sublinear",
          "minimum search + sublinear (s)", "capture per plan (s)"]


def _timed_plan(model: nn.Module, x: torch.Tensor, row: dict[str, dict[str, float]],
                label: str, **options) -> MemoryPlan:
    """memopt.plan, recording its planning and capture seconds (MemoryPlan's, or the
    BudgetError's)."""
    torch._dynamo.reset()
    try:
        plan = memopt.plan(model, x, **options)
    except memopt.BudgetError as err:
        row["seconds"][label], row["capture"][label] = err.plan_seconds, err.capture_seconds
        raise
    row["seconds"][label], row["capture"][label] = plan.plan_seconds, plan.capture_seconds
    print(f"#   {label}: {plan.plan_seconds:.1f} s planning, {plan.capture_seconds:.0f} s "
          f"capture", file=sys.stderr, flush=True)
    return plan


def minimum_bytes(model: nn.Module, x: torch.Tensor, row: dict[str, dict[str, float]]) -> int:
    """The smallest peak memopt's budget search reaches (from a 1-byte budget's BudgetError)."""
    try:
        _timed_plan(model, x, row, "minimum", budget=1)
    except memopt.BudgetError as err:
        return err.minimum_bytes
    raise AssertionError("a 1-byte budget was met")


def run_depth(depth: int) -> Row:
    blocks = stage_blocks(depth)
    with torch.device("meta"):
        model = resnet(blocks).train()
        x = torch.randn(BATCH, *IMAGE)
    row: dict[str, dict[str, float]] = {"seconds": {}, "capture": {}}
    no_opt = _timed_plan(model, x, row, "none", inplace=False, progress=False)
    inplace = _timed_plan(model, x, row, "inplace", progress=False)
    lowest = minimum_bytes(model, x, row)
    sublinear = _timed_plan(model, x, row, "sublinear", budget=lowest)
    return Row(depth, blocks, no_opt, inplace, sublinear, row["seconds"], row["capture"])


def slope(rows: list[Row]) -> tuple[float, float]:
    """Least-squares line of search seconds against graph nodes: (seconds per 1,000
    nodes, intercept in seconds)."""
    xs = [r.nodes / 1000 for r in rows]
    ys = [r.search_seconds for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return b, my - b * mx


SPEED_HEADER = ["depth", "graph nodes", "minimum search + sublinear (s)",
                "seconds per 1,000 nodes"]


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", nargs="+", type=int, default=list(DEPTHS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    rows = []
    for depth in args.depths:
        t0 = time.perf_counter()
        rows.append(run_depth(depth))
        print(f"# depth {depth}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    chen = ["1000 (Chen Fig. 5)", "-", CHEN_1000["no optimization"], "-", "-",
            CHEN_1000["sublinear plan"], "-", "-", "-", "-", "-", "-"]
    print(f"\nFeature-map memory (GB), batch {BATCH} of {'x'.join(map(str, IMAGE))}, planned "
          f"on meta tensors (Chen et al. 2016, Fig. 5)\n")
    print(markdown([r.cells() for r in rows] + [chen], HEADER))
    speed = [[str(r.depth), str(r.nodes), f"{r.search_seconds:.1f}",
              f"{1000 * r.search_seconds / r.nodes:.2f}"] for r in rows]
    print("\nPlanning time (memopt's passes; capture excluded) against graph size\n")
    print(markdown(speed, SPEED_HEADER))
    if len(rows) > 1:
        per_k, intercept = slope(rows)
        print(f"\nleast squares: {per_k:.2f} s per 1,000 nodes, intercept {intercept:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
