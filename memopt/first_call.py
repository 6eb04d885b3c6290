"""What a refused first call puts back: the running statistics and the random state.

With graph breaks a forward's graphs are planned as the forward runs, and the whole step
is checked against the budget as it ends (memopt.backend.forward_ends): a budget the step
cannot fit is refused there, after the graphs ran. Their BatchNorm layers had updated
their running statistics and their dropouts had drawn from the generator: a Segformer
refused at its first call came back with ``num_batches_tracked`` 1 and the generator
moved, and trained with the budget named it updated its statistics twice for that step
(found from outside). A refused call must leave the model as it was (docs/errors.md), so
the first training call of a module under a budget keeps a copy of its normalization
layers' running statistics (a few floats a channel) and of the generators' states, and
puts them back where memopt refuses the call (`MemoptError`). Buffers other code mutates
in its forward (a queue of keys) are not copied: they can be large, and the copy would
be held through the first step.
"""

from __future__ import annotations

import torch
from torch import nn

from memopt.passes._torch_compat import norm_with_running_stats


class FirstCall:
    """The state a refused first call of `model` puts back (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = [(b, b.clone()) for m in model.modules() if norm_with_running_stats(m)
                        for b in m.buffers(recurse=False) if b is not None]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
