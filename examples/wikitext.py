"""The WikiText-2 slice the language-model examples train on (examples/data/, CC BY-SA,
see its README), as token ids. Imported by the examples (``python examples/<name>.py``
puts this folder on the path)."""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "wikitext-2-valid-slice.txt"


def load_corpus(path: Path = DATA) -> tuple[torch.Tensor, list[str]]:
    """Token ids and vocabulary: whitespace-split words and an `<eos>` after each line."""
    index: dict[str, int] = {}
    ids = [index.setdefault(word, len(index))
           for line in path.read_text(encoding="utf8").splitlines()
           for word in [*line.split(), "<eos>"]]
    return torch.tensor(ids), list(index)


def batchify(ids: torch.Tensor, batch: int) -> torch.Tensor:
    """(N,) -> (N // batch, batch): each column a contiguous stretch of the text."""
    rows = ids.numel() // batch
    return ids[: rows * batch].view(batch, rows).t().contiguous()
