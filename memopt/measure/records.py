"""What a measurement runs and what it returns: the Workload and the Measurement.

A workload is named ``"package.module:function"``; the function is a builder
``build(device: str) -> Workload``. The measuring child process puts the caller's
working directory and any ``path`` entries on ``sys.path`` before importing it
(memopt.measure.child). The names and devices a caller passes are checked here, once,
and a bad one raises ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GRADS", "Measurement", "Workload", "check_device", "check_workload_name",
           "default_loss", "load_workload"]

_WORKLOAD_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

#: How a measured step finds the parameters' gradients: "none" (set to None, as after
#: ``zero_grad(set_to_none=True)``) or "kept" (allocated and zeroed in place, as after
#: ``zero_grad(set_to_none=False)`` and in every micro-step after the first of gradient
#: accumulation).
GRADS = ("none", "kept")


@dataclass(frozen=True)
class Measurement:
    """The result of measuring one training step (see memopt.measure's docstring)."""

    peak_bytes: int
    """Peak of all tensor memory during forward + loss + backward."""
    resident_bytes: int
    """Distinct storages of parameters, buffers and inputs before the step."""
    step_seconds: float
    """Median wall time of the measured step and the extra timed steps."""
    predicted_peak_bytes: int | None
    """``compiled.memopt_plan.predicted_peak_bytes`` if exposed, else None."""
    plan_seconds: float | None
    """First (compiling) step's time minus ``step_seconds``; None for eager."""
    device: str
    recompute_flops_ratio: float | None = None
    """memopt's recomputed FLOPs over one forward pass (its plan's cost model)."""
    chains: list | None = None
    """``compiled.memopt_plan.chains``, each chain as a JSON-able dict; None if the plan
    lists none (or is not a memopt plan)."""
    heads: list | None = None
    """``compiled.memopt_plan.heads`` (language-model heads and their chunks), alike."""
    allocated_peak_bytes: int | None = None
    """Peak of the bytes PyTorch's allocator handed out during the step, resident
    tensors included: on CUDA the rise of ``max_memory_allocated`` over what was
    allocated before the step, plus the resident tensors (``peak_bytes`` is the raw
    counter, which also holds the library workspaces allocated once per process); on CPU
    read from the profiler's allocation events (see memopt.measure's docstring)."""
    reserved_peak_bytes: int | None = None
    """On CUDA, the caching allocator's reserved peak during the step (the segments it
    holds from the driver, what a GPU runs out of) less what the process had allocated
    outside the counted tensors (the library workspaces), so that it compares with
    ``allocated_peak_bytes`` and a budget; None on CPU, which reserves nothing."""
    warmup_seconds: float | None = None
    """Wall time of the first warm-up step, whole: the step that compiles (memopt's plan,
    inductor's kernels) in any mode but eager; None when no warm-up step ran."""

    @property
    def budget_peak_bytes(self) -> int:
        """The peak a memopt budget counts: the allocated bytes (``peak_bytes`` for a
        measurement that did not record them)."""
        return self.peak_bytes if self.allocated_peak_bytes is None else self.allocated_peak_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING}
        if not isinstance(data, dict) or not required <= set(data) <= names:
            raise ValueError(f"not a Measurement: {text!r}")
        return cls(**data)


def default_loss(output: Any) -> torch.Tensor:
    """The loss of a model output when a workload names none.

    An object with a ``loss`` attribute that is not None (a HuggingFace
    ``ModelOutput`` called with labels) gives that loss. Otherwise the loss is
    the sum of every floating-point tensor leaf of the output (flattened with
    ``torch.utils._pytree``; mappings are flattened by value).
    """
    from ..passes._torch_compat import pytree  # noqa: PLC0415 (loads AOTAutograd: not at start)

    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and type(output) not in pytree.SUPPORTED_NODES:
        output = dict(output)  # e.g. a ModelOutput type that pytree does not know
    leaves = [
        leaf
        for leaf in pytree.tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    ]
    if not leaves:
        raise ValueError(
            f"default_loss: the model output ({type(output).__name__}) has no "
            "floating-point tensor; give the Workload a loss function"
        )
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total


@dataclass
class Workload:
    """A model and the inputs of one training step, built on a device."""

    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loss: Callable[[Any], torch.Tensor] = default_loss
    step: Callable[[Callable[..., Any], Workload], None] | None = None
    """A training step of the workload's own, ``step(module, workload)``, in place of
    ``loss(module(*args, **kwargs)).backward()`` (e.g. a hand-written chunked BPTT that
    calls backward several times). It must leave the parameter gradients as one step's
    and keep no tensor of the step alive after it returns. None: the standard step."""


def check_workload_name(workload: str) -> None:
    """Raise ValueError unless ``workload`` reads ``"package.module:function"``."""
    if not isinstance(workload, str) or not _WORKLOAD_RE.match(workload):
        raise ValueError(
            f"workload must be 'package.module:function' naming a builder "
            f"build(device) -> Workload, got {workload!r}"
        )


def check_device(device: str) -> torch.device:
    """The ``torch.device`` of ``"cpu"`` or ``"cuda[:N]"``; ValueError for anything else."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"bad device {device!r}: {exc}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def load_workload(workload: str) -> Callable[[str], Workload]:
    """Import the builder named by ``"package.module:function"``."""
    check_workload_name(workload)
    module_name, func_name = workload.split(":")
    module = importlib.import_module(module_name)
    try:
        builder = getattr(module, func_name)
    except AttributeError:
        raise ValueError(
            f"workload {workload!r}: module {module_name!r} has no {func_name!r}"
        ) from None
    if not callable(builder):
        raise ValueError(f"workload {workload!r}: {func_name!r} is not callable")
    return builder
