"""memopt in the Hugging Face Trainer (needs `transformers` and `accelerate`).

    from memopt.integrations.hf import MemoptTrainer, PeakMemoryCallback
    trainer = MemoptTrainer(model=model, args=args, train_dataset=data,
                            memopt_budget="4GB", callbacks=[PeakMemoryCallback()])
    trainer.train()

`TrainingArguments(torch_compile_backend="memopt")` is not a way in: accelerate accepts
only the backends it knows. `MemoptTrainer` compiles `trainer.model` itself (or keeps a
model the caller compiled), and writes checkpoints with the original model's
`save_pretrained`, so `from_pretrained` loads them (a plain Trainer holding a memopt
module saves its state dict only: the same keys, no config). Gradient accumulation
(`gradient_accumulation_steps`) runs memopt's kept-gradient step after the first
micro-batch; `memopt_options={"drop_outputs": True}` plans for what the Trainer does (it
keeps only the loss past the forward, so a language model's logits are freed before
backward; not the default: see the README's Known limits); `gradient_checkpointing=True` is ignored with a warning (memopt plans
recomputation itself). The optimizer steps inside the backward (memopt.stepper) where the
budget needs it only when the Trainer's loop allows it: no gradient accumulation,
`max_grad_norm=0` (global-norm clipping reads every gradient after backward), no fp16.

`PeakMemoryCallback` measures the allocated peak of the forward and backward of chosen
steps (from the start of an optimizer step to just before `optimizer.step()`, so
without the optimizer's step, which a plan counting the optimizer adds) with
`memopt.measure.AllocationTracker`, adds the resident parameters, buffers and gradients, and
logs it beside the plan's prediction and the budget. On CPU it records allocations with the
profiler, which slows the measured steps: keep `every` large.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer, TrainerCallback

from memopt.api import CompiledModule
from memopt.api import compile as memopt_compile
from memopt.api import count_optimizer
from memopt.measure import AllocationTracker, can_track
from memopt.stepper import last_grad_norm

log = logging.getLogger("memopt")


def _no_step_in_backward(args: Any) -> str:
    """Why this Trainer's loop cannot step the optimizer inside the backward
    (memopt.stepper), or "": it accumulates gradients, clips their global norm, or scales
    the loss for fp16."""
    why = [w for w, on in (
        ("gradient_accumulation_steps > 1", getattr(args, "gradient_accumulation_steps", 1) > 1),
        ("max_grad_norm clips the global norm (set it to 0 to allow it)",
         bool(getattr(args, "max_grad_norm", 0))),
        ("fp16 uses a GradScaler", bool(getattr(args, "fp16", False)))) if on]
    return "; ".join(why)


class MemoptTrainer(Trainer):
    """A `transformers.Trainer` whose model memopt compiles under `memopt_budget` (with
    `memopt_options` for `memopt.compile`), and whose checkpoints are the original
    model's (`save_pretrained`). The optimizer the Trainer creates is counted in the
    budget (`optimizer=` of memopt.compile) unless `memopt_count_optimizer=False`."""

    def __init__(self, *args: Any, memopt_budget: object = None,
                 memopt_options: dict | None = None, memopt_count_optimizer: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(memopt_options or {})
        asked = options.pop("step_in_backward", None)  # the optimizer comes later
        if not isinstance(self.model, CompiledModule):
            self.model = memopt_compile(self.model, memopt_budget, **options)
        self.model_wrapped = self.model
        self.memopt_count_optimizer = memopt_count_optimizer
        backend = self.model._memopt_backend
        if asked is not None:
            backend.step_in_backward = bool(asked)
        refusal = _no_step_in_backward(self.args)
        if refusal and backend.step_in_backward is None:
            log.info("memopt: the optimizer does not step inside the backward: %s", refusal)
            backend.step_in_backward = False

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The gradient norm the Trainer logs: where memopt stepped the optimizer inside
        the backward, the gradients are gone, and memopt's norm of them is returned."""
        if grad_norm is None and isinstance(self.model, CompiledModule):
            norm = last_grad_norm(self.model)
            if norm is not None:
                return norm.item()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.memopt_count_optimizer and isinstance(self.model, CompiledModule):
            count_optimizer(self.model, self.optimizer)
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.model
        if not isinstance(model, CompiledModule):
            super()._save(output_dir, state_dict)
            return
        self.model = model.original_module  # a PreTrainedModel: save_pretrained, config
        try:
            super()._save(output_dir, state_dict)
        finally:
            self.model = model


class PeakMemoryCallback(TrainerCallback):
    """Measures the allocated peak of the forward and backward of every `every`-th
    optimizer step (the first at step `first`); `peaks` holds (step, measured, predicted,
    budget) with resident parameters, buffers and gradients included."""

    def __init__(self, every: int = 50, first: int = 2) -> None:
        self.every, self.first = every, first
        self.peaks: list[tuple[int, int, int | None, int | None]] = []
        self._tracker: AllocationTracker | None = None
        self._resident = 0

    def _measured(self, step: int) -> bool:
        return step >= self.first and (step - self.first) % self.every == 0

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                      **kwargs: Any) -> None:
        step = state.global_step + 1
        if model is None or not self._measured(step):
            return
        device = next(model.parameters()).device
        if not can_track(device):
            return
        tensors = [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        self._resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                              for t in tensors}.values())
        self._tracker = AllocationTracker(device)
        self._tracker.start()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                              **kwargs: Any) -> None:
        if self._tracker is None:
            return
        seen = self._tracker.stop()
        self._tracker = None
        plan = getattr(model, "memopt_plan", None)
        predicted = plan.predicted_peak_bytes if plan is not None else None
        budget = plan.budget_bytes if plan is not None else None
        measured = self._resident + seen.peak
        self.peaks.append((state.global_step + 1, measured, predicted, budget))
        log.info("memopt: step %d allocated peak %d bytes (predicted %s, budget %s)",
                 state.global_step + 1, measured, predicted, budget)

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        if self._tracker is not None:  # a measured step that never reached the optimizer
            self._tracker.stop()
            self._tracker = None
