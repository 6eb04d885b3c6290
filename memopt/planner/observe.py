"""Hooks for tests and the oracle: see each graph the planner plans, check the simulator.

    with observing() as seen: ...   # an Observed record per graph planned in the block
    with verifying(): ...           # every simulated candidate also built and compared
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import fx

from memopt.passes.simulate import Simulated, StepModel

from ..errors import PassError
from .build import Built, Mirror, as_simulated
from .request import Options


@dataclass(frozen=True)
class Observed:
    """What `observing()` hands its sink for each graph the pipeline plans: the step
    model the budget search scores candidates on, and what built it (the oracle of
    memopt.oracle plans the same step exactly)."""

    model: StepModel
    joint: fx.GraphModule
    num_fwd_outputs: int
    primal_kinds: dict[str, str]
    options: Options


_OBSERVERS: contextvars.ContextVar[tuple[Callable[[Observed], None], ...]] = \
    contextvars.ContextVar("memopt_observers", default=())


@contextmanager
def observing() -> Iterator[list[Observed]]:
    """Collect an `Observed` record for every graph planned inside the block."""
    seen: list[Observed] = []
    token = _OBSERVERS.set(_OBSERVERS.get() + (seen.append,))
    try:
        yield seen
    finally:
        _OBSERVERS.reset(token)


def notify(observed: Observed) -> None:
    """Hand `observed` to every `observing()` block around this call."""
    for sink in _OBSERVERS.get():
        sink(observed)


#: Tests set this (`verifying()`): every candidate the planner simulates is also built
#: exactly, and a disagreement raises.
_VERIFY: contextvars.ContextVar[bool] = contextvars.ContextVar("memopt_verify", default=False)


@contextmanager
def verifying() -> Iterator[None]:
    """Check every simulated candidate against its exact build (slow: tests only)."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def is_verifying() -> bool:
    return _VERIFY.get()


def verify(simulated: Simulated, built: Built, mirror: Mirror) -> None:
    """Raise PassError where the simulator's step differs from the exact build's."""
    exact = as_simulated(built)
    mine, theirs = set(zip(simulated.intervals, simulated.kinds)), \
        set(zip(exact.intervals, exact.kinds))
    if (sorted(zip(simulated.intervals, simulated.kinds))
            != sorted(zip(exact.intervals, exact.kinds))
            or (simulated.num_steps, simulated.peak_bytes, simulated.recompute_flops,
                simulated.saved_bytes) != (exact.num_steps, exact.peak_bytes,
                                           exact.recompute_flops, exact.saved_bytes)):
        raise PassError("step simulator", ("exact build",), AssertionError(
            f"step simulator disagrees with the exact build for {len(mirror.names)} mirrored "
            f"({len(mirror.twice)} twice): peak {simulated.peak_bytes} vs {exact.peak_bytes}, "
            f"steps {simulated.num_steps} vs {exact.num_steps}, flops "
            f"{simulated.recompute_flops} vs {exact.recompute_flops}, saved "
            f"{simulated.saved_bytes} vs {exact.saved_bytes}, intervals by kind differing "
            f"(one side only) {sorted(mine ^ theirs)[:4]}"))
