"""A small GPT-2 trained by the Hugging Face Trainer under a memopt budget.

    python examples/hf_trainer.py                    # 2 layers, 60 steps: about a minute on 2 CPU cores
    python examples/hf_trainer.py --budget 0.6 --steps 200

The model is transformers' GPT2LMHeadModel from a small config (no download), trained on
a slice of WikiText-2 (examples/data/, CC BY-SA, see its README) split into words. The
training loop is the Trainer's own; `MemoptTrainer` (memopt.integrations.hf) compiles the
model under the budget (a plain `Trainer(model=memopt.compile(model, budget=...))` trains
too) and saves checkpoints `from_pretrained` loads. `PeakMemoryCallback` measures the
allocated peak of the forward and backward of some steps against the plan and the budget.

It prints the loss as the Trainer logs it, the measured peaks beside memopt's prediction
and budget, and checks that a saved checkpoint loads back with the trained weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see word_language_model.py

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from memopt.budget import format_bytes  # noqa: E402
from memopt.integrations.hf import MemoptTrainer, PeakMemoryCallback  # noqa: E402
from memopt.measure import budget_from_arg  # noqa: E402
from wikitext import load_corpus  # noqa: E402


class Chunks(Dataset):
    """Consecutive `length`-token pieces of the corpus; labels are the inputs (the model
    shifts them)."""

    def __init__(self, ids: torch.Tensor, length: int) -> None:
        self.ids, self.length = ids, length

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        piece = self.ids[i * self.length:(i + 1) * self.length]
        return {"input_ids": piece, "labels": piece.clone()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.75", help='"60MB", bytes, or a fraction')
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="0: no clipping, so the optimizer may step inside the backward "
                             "where the budget needs it")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="always step the optimizer inside the backward (needs "
                             "--max-grad-norm 0 and --accumulate 1)")
    parser.add_argument("--skip-logits", action="store_true",
                        help="the Trainer's loop never reads the logits in training: the "
                             "head computes its loss without forming them")
    args = parser.parse_args(argv)
    options = {"step_in_backward": True} if args.step_in_backward else {}
    if args.skip_logits:
        options["skip_logits"] = True

    ids, vocab = load_corpus()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=args.seq, n_embd=128,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    peaks = PeakMemoryCallback(every=max(1, args.steps // 2), first=2)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
            gradient_accumulation_steps=args.accumulate, learning_rate=1e-3,
            max_grad_norm=args.max_grad_norm,
            logging_steps=max(1, args.steps // 6), report_to=[], save_strategy="no",
            disable_tqdm=True, seed=0)
        trainer = MemoptTrainer(model=model, args=training, train_dataset=Chunks(ids, args.seq),
                                memopt_budget=budget_from_arg(args.budget), callbacks=[peaks],
                                memopt_options=options)
        result = trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print(f"loss: {' -> '.join(f'{x:.3f}' for x in losses)}")
        for step, measured, predicted, budget in peaks.peaks:
            print(f"step {step}: allocated peak {format_bytes(measured)}, memopt predicted "
                  f"{format_bytes(predicted)}, budget {format_bytes(budget)}"
                  f"{'' if budget is None or measured <= budget else '  OVER BUDGET'}")
        trainer.save_model(out)
        reloaded = GPT2LMHeadModel.from_pretrained(out)
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      reloaded.state_dict().values()))
        print(f"checkpoint reloaded with the trained weights: {same}")
        print(trainer.model.memopt_plan.summary(max_rows=5))
    return {"losses": losses, "peaks": peaks.peaks, "reloaded": same,
            "steps": result.global_step, "plan": trainer.model.memopt_plan,
            "optimizer": trainer.optimizer, "history": trainer.state.log_history}


if __name__ == "__main__":
    main()
