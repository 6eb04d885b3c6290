"""Ways into memopt from training frameworks.

- `memopt.integrations.hf` (needs `transformers` and `accelerate`): `MemoptTrainer`, a
  Hugging Face `Trainer` that compiles its model with memopt under a budget and saves
  checkpoints `from_pretrained` can load, and `PeakMemoryCallback`, which measures the
  allocated peak of training steps against memopt's plan and budget.

A plain `Trainer(model=memopt.compile(model, budget=...))` trains too: the compiled
module keeps the model's forward signature, so the Trainer keeps the dataset's columns.
Nothing here is imported by `import memopt`.
"""
