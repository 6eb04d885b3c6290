"""memopt's typed errors. Callers match on the type and its fields, never on the message."""

from __future__ import annotations

from .budget import format_bytes


class MemoptError(Exception):
    """Base class of every error memopt raises on purpose."""


class BudgetError(MemoptError):
    """The requested budget is below the smallest peak memopt can reach for this step."""

    def __init__(self, *, budget_bytes: int, minimum_bytes: int, baseline_bytes: int,
                 budget: str = "", headroom: float = 0.0) -> None:
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes  # the smallest budget memopt accepts
        self.baseline_bytes = baseline_bytes
        asked = f"{budget} = " if budget and not budget.startswith(str(budget_bytes)) else ""
        kept = f", with {headroom:.0%} of it kept free as headroom" if headroom else ""
        super().__init__(
            f"memory budget {asked}{format_bytes(budget_bytes)} ({budget_bytes} bytes) is below "
            f"the minimum memopt can reach for this training step, "
            f"{format_bytes(minimum_bytes)} ({minimum_bytes} bytes{kept}); the baseline peak without "
            f"memopt is {format_bytes(baseline_bytes)} ({baseline_bytes} bytes). Raise the "
            f"budget, or reduce the batch size or sequence length."
        )


class PassError(MemoptError):
    """A memopt pass failed; names the pass and the passes that ran before it."""

    def __init__(self, stage: str, before: tuple[str, ...], cause: BaseException) -> None:
        self.stage = stage
        self.before = before
        self.cause = cause
        ran = ", ".join(before) if before else "none"
        super().__init__(
            f"memopt pass '{stage}' failed (passes run before it: {ran}): "
            f"{type(cause).__name__}: {cause}"
        )


class CaptureError(MemoptError):
    """The model could not be captured as one training graph."""
