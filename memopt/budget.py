"""Parse a memory budget at the API edge (STYLE.md, section 6).

What a budget counts: the peak of all tensor memory live during one training
step (forward, loss, backward), on the model's device: parameters and buffers,
the inputs, activations kept for backward, temporaries, and the parameter
gradients backward produces. It does not count optimizer state (e.g. Adam's
moments), memory the CUDA caching allocator reserves but has not handed out,
or the CUDA context.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from pydantic import ByteSize, TypeAdapter, ValidationError

from memopt.allocator.units import format_bytes

from .errors import BudgetFormatError

ACCEPTED = (
    'a size string such as "4GB", "4 GB", "4GiB", "512MB" or "1.5 GiB" (GB = 10^9 bytes, '
    "GiB = 2^30); an int number of bytes (> 0); or a float fraction in (0, 1] of memopt's "
    "predicted peak for the step with no recomputation and no in-place rewrites"
)

_BYTESIZE = TypeAdapter(ByteSize)
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*[a-zA-Z]*\s*$")


#: The fraction of every budget, in bytes or as a fraction, kept free for what a plan does
#: not model (allocations outside PyTorch's allocator, fragmentation, kernel workspaces
#: that depend on values), by device type: the worst excess of a measured peak over its
#: prediction on that device, rounded up (docs/budgets.md, "Headroom"). CPU: 1.1% (the
#: fuzzer's 200 models; the zoo's are within 8 bytes). CUDA (H100): 2.3% (a Llama
#: under a budget), 1.4% (EfficientNet under inductor). Other devices (meta: a plan of
#: shapes for any of them) take the largest.
HEADROOM = {"cpu": 0.015, "cuda": 0.03}
#: The same under `kernels="inductor"`, whose plan models inductor's fused kernels
#: (passes.fusion): CPU 2.0% (the zoo's ConvNeXt at a binding budget, inside a depthwise
#: convolution's backward; the Mamba's unrolled scan 1.52%); CUDA as op by op until it
#: is measured there.
INDUCTOR_HEADROOM = {"cpu": 0.025, "cuda": 0.03}


def default_headroom(device: str, fused: bool = False) -> float:
    """The headroom a budget keeps on `device` ("cpu", "cuda:0", "meta") by default, with
    inductor's fused kernels running the plan where `fused`."""
    table = INDUCTOR_HEADROOM if fused else HEADROOM
    return table.get(str(device).split(":")[0], max(table.values()))


@dataclass(frozen=True)
class Budget:
    """A parsed budget: absolute bytes, or a fraction of the baseline peak."""

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, baseline_bytes: int) -> int:
        """Bytes this budget allows for a step whose unoptimized peak is `baseline_bytes`."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(self.fraction * baseline_bytes)

    def __str__(self) -> str:
        if self.nbytes is not None:
            return f"{self.nbytes} bytes ({format_bytes(self.nbytes)})"
        return f"{self.fraction:g} of the predicted peak without recomputation or in-place rewrites"


def parse_budget(budget: object) -> Budget | None:
    """`None` -> None; "4GB" / "4 GB" / "4GiB" / int bytes -> absolute; float in (0, 1] ->
    a fraction. A space between number and unit is allowed ("4 GB" is 4 * 10^9 bytes).

    Raises memopt.BudgetFormatError (a ValueError) naming the value and the accepted forms
    for anything else: booleans, zero or negative sizes, unknown units ("4XB"), floats
    outside (0, 1] (1.5, nan, inf), the empty string, other types.
    """
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise BudgetFormatError(budget, "is a bool, not a memory budget", ACCEPTED)
    if not isinstance(budget, (int, float)) and isinstance(budget, numbers.Real):
        # a NumPy scalar (np.float32(0.5), np.int64(4e9)): its Python number
        budget = int(budget) if isinstance(budget, numbers.Integral) else float(budget)
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetFormatError(budget, "must be a positive number of bytes", ACCEPTED)
        return Budget(nbytes=budget)
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise BudgetFormatError(
                budget, "is a float, so a fraction of the predicted peak, and must be in (0, 1]",
                ACCEPTED)
        return Budget(fraction=budget)
    if isinstance(budget, str) and _SIZE.match(budget):
        try:
            size = _BYTESIZE.validate_python(budget.strip())
        except ValidationError:
            size = None
        number, unit = re.match(r"\s*([\d.]+)\s*([a-zA-Z]*)", budget).groups()
        if size is not None and unit.lower() in ("", "b") and "." in number \
                and float(number) != int(float(number)):  # "1.5B": not a whole byte
            raise BudgetFormatError(budget, "is not a whole number of bytes", ACCEPTED)
        if size:
            return Budget(nbytes=int(size))
    raise BudgetFormatError(budget, "is not understood", ACCEPTED)
