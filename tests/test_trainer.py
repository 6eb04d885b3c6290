"""The Hugging Face Trainer trains a memopt module.

`Trainer(model=memopt.compile(model, budget=...))` keeps the dataset's columns (the
compiled forward has the model's signature) and trains; `MemoptTrainer` (with
`PeakMemoryCallback`) trains a small GPT-2 on the WikiText-2 slice with the loss going
down, every measured step's allocated peak within the budget, with and without gradient
accumulation, and saves a checkpoint `from_pretrained` loads back with the trained weights
(examples/hf_trainer.py, run here at fewer steps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import memopt

pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate (pip install -e .[dev])")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import hf_trainer  # noqa: E402


@pytest.mark.parametrize("accumulate", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_memopt_trainer_trains_within_budget_and_saves(accumulate: int) -> None:
    result = hf_trainer.main(["--steps", "8", "--accumulate", str(accumulate)])
    losses = result["losses"]
    assert result["steps"] == 8 and len(losses) >= 2
    assert losses[-1] < losses[0], losses
    assert result["peaks"], "no step was measured"
    for step, measured, predicted, budget in result["peaks"]:
        assert measured <= budget, (step, measured, budget)
        assert measured <= predicted, (step, measured, predicted)  # the plan is an upper bound
    assert result["reloaded"]
    # the Trainer's optimizer is in the budget (MemoptTrainer passes it: optimizer=)
    plan, opt = result["plan"], result["optimizer"]
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    assert plan.optimizer == "AdamW" and plan.optimizer_state_bytes == state > 0


def test_a_plain_trainer_keeps_the_columns_and_trains(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    ids, vocab = hf_trainer.load_corpus()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=64, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    compiled = memopt.compile(model, budget=0.9)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                             max_steps=3, report_to=[], save_strategy="no",
                             disable_tqdm=True)  # remove_unused_columns stays True
    trainer = Trainer(model=compiled, args=args, train_dataset=hf_trainer.Chunks(ids, 32))
    result = trainer.train()
    assert result.global_step == 3
    assert compiled.memopt_plan is not None and compiled.memopt_plan.budget_bytes


def test_memopt_trainer_steps_in_the_backward_where_its_loop_allows() -> None:
    """No clipping (max_grad_norm=0), no accumulation: the smallest budget with the
    optimizer stepped inside the backward is no higher than without it (lower where the
    peak is in the backward; this GPT-2's is at its logits in some transformers versions),
    and at it the optimizer steps inside the backward, the measured steps hold the budget,
    the loss goes down, and the Trainer logs memopt's gradient norm; with the Trainer's
    default clipping memopt does not step in the backward."""
    def smallest(*options: str) -> float:
        with pytest.raises(memopt.BudgetError) as refused:
            hf_trainer.main(["--steps", "1", "--budget", "0.01", *options])
        return refused.value.smallest_fraction

    clipped = smallest()
    stepping = smallest("--max-grad-norm", "0", "--step-in-backward")
    assert stepping <= clipped
    result = hf_trainer.main(["--steps", "4", "--budget", str(stepping), "--max-grad-norm", "0",
                              "--step-in-backward"])
    plan = result["plan"]
    assert plan.steps_in_backward > 0 and plan.optimizer == "AdamW"
    assert result["losses"][-1] < result["losses"][0]
    for step, measured, predicted, limit in result["peaks"]:
        assert measured <= min(predicted, limit), (step, measured, predicted, limit)
    assert all(h.get("grad_norm", 1.0) > 0 for h in result["history"])
    default = hf_trainer.main(["--steps", "1", "--budget", str(clipped)])
    assert default["plan"].steps_in_backward == 0


def test_memopt_trainer_skips_the_logits_it_never_reads() -> None:
    """memopt_options={"skip_logits": True}: the Trainer's loop reads only the loss, so the
    head (where memopt finds it: transformers versions whose GPT-2 computes its loss in the
    form memopt chunks) never forms the logits; the loss goes down and the measured steps
    hold the budget."""
    result = hf_trainer.main(["--steps", "4", "--budget", "0.75", "--skip-logits"])
    assert result["losses"][-1] < result["losses"][0]
    assert result["peaks"]
    for step, measured, predicted, limit in result["peaks"]:
        assert measured <= min(predicted, limit), (step, measured, predicted, limit)
    assert not any(h.returns_logits for h in result["plan"].heads)
