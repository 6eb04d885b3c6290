"""drop_outputs=True: the forward's outputs the plan frees as the forward ends, watched so
that the backward can say when the training loop still holds one (its bytes then come on
top of the predicted peak: passes.liveness)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memopt.passes._torch_compat import pytree
from .budget import format_bytes
from .storages import holds_memory


class DroppedOutputs:
    """drop_outputs=True: the forward's non-scalar outputs, watched by storage, so that
    the backward can say when the loop still holds one that the plan freed as the
    forward ended (passes.liveness: its bytes then come on top of the predicted peak)."""

    def __init__(self) -> None:
        #: (weak reference, data pointer, bytes, shape) of each watched output's storage
        self.refs: list[tuple[StorageWeakRef, int, int, tuple[int, ...]]] = []

    def watch(self, out: Any) -> None:
        self.refs = [(StorageWeakRef(t.untyped_storage()), t.untyped_storage().data_ptr(),
                      t.untyped_storage().nbytes(), tuple(t.shape))
                     for t in pytree.tree_leaves(out)
                     if holds_memory(t) and t.dim() > 0]

    def check(self, backward_inputs: list[Any]) -> None:
        """At the backward's start: outputs still alive that backward does not read
        (Python's warning filter shows the same warning once)."""
        read = {t.untyped_storage().data_ptr() for t in backward_inputs
                if isinstance(t, torch.Tensor)}
        alive = [(n, shape) for ref, ptr, n, shape in self.refs
                 if not ref.expired() and ptr not in read]
        self.refs = []
        if alive:
            shapes = ", ".join(str(list(shape)) for _, shape in alive)
            warnings.warn(
                f"memopt planned this step with drop_outputs=True, but "
                f"{format_bytes(sum(n for n, _ in alive))} of the forward's outputs (shapes "
                f"{shapes}) are still alive as its backward starts: this step can exceed the "
                f"plan's predicted peak by that much. Drop every output but the loss before "
                f"calling backward (loss = model(**batch).loss), or compile without "
                f"drop_outputs.", stacklevel=2)
