"""A PackedSequence between memopt's graphs: its rows handed to the chains at a capacity of
a few fixed sizes, in eager code, and cut back to the batch's rows after them.

memopt plans each input shape once (``dynamic=False``). A PackedSequence's ``data`` has
one row per live (time step, sequence): its length, the sum of the batch's sequence
lengths, changes from batch to batch even when the padded input keeps its shape. Read
inside a graph, every new total length would be a new graph, planned again. So the graph
of the chains sees the rows at a *capacity*: the batch's rows, in their packed order,
followed by zero rows up to the next of ``BUCKETS`` sizes (eighths of T x B, the padded
layout's rows; ``capacity``). A batch of T x B whose lengths spread 4x takes one of at most
7 graphs, each planned once, and the rows the chains hold are the batch's plus at most an
eighth of T x B (the padded (T, B) layout they replaced held T x B: 1.52x the rows of the
benchmark's tagger, where the capacity holds 1.14x).

In the graph, each chain (memopt.recurrent.ops.ChainSpec.rows) reads a chunk of steps as
the rows those steps' batch sizes lay out, from ``ended`` (T, B), the flags of the
sequences ended at each step: the chunks are laid out by the packed batch sizes, and the
kernel runs on each chunk's live rows from the live sequences' states.

- ``layout`` (eager): the rows at their capacity, ``ended``, and for a bidirectional RNN
  the row order that reverses each sequence within its length (the reverse direction
  then runs forward on it: every sequence starts at step 0, the live counts fall);
- ``dropout_masks`` (eager) draws the inter-layer dropout's noise on the packed rows
  before the layers run (as nn.LSTM's packed kernel draws it: the same numbers), handed
  to the graph as bool masks at the capacity (``apply_dropout``, traced);
- ``repack`` (eager) cuts the chains' output back to the batch's rows (a view).

The eager functions are graph breaks; autograd records their copies as eager code, which
memopt counts between its graphs (memopt.eager_reads)."""

from __future__ import annotations

import torch
from torch import Tensor

#: The capacities a (T, B) batch's packed rows are rounded up to: multiples of an eighth of
#: T x B. Each is a graph of its own (planned once), so a batch's rows take at most this
#: many plans; more would hold fewer zero rows and plan more often.
BUCKETS = 8


def capacity(rows: int, steps: int, batch: int) -> int:
    """The rows a batch of ``rows`` packed rows is handed to the graph at: ``rows``
    rounded up to a multiple of T x B / ``BUCKETS``, at most T x B."""
    whole = steps * batch
    unit = -(-whole // BUCKETS)
    return min(whole, -(-rows // unit) * unit)


def _ended(batch_sizes: Tensor) -> Tensor:
    """(T, B) bool: sequence b (sorted by decreasing length) has ended by step t."""
    return torch.arange(int(batch_sizes[0]))[None, :] >= batch_sizes[:, None]


def _reversed_rows(batch_sizes: Tensor, rows: int) -> Tensor:
    """The (rows,) index that reads each sequence reversed within its length: the row of
    (step t, sequence b) reads the row of (step length_b - 1 - t, b), rows past the
    batch's (the capacity's zeros) read themselves. Applied twice it is the identity."""
    sizes = batch_sizes.tolist()
    offsets = torch.tensor([0, *sizes]).cumsum(0)
    step = torch.cat([torch.full((n,), t) for t, n in enumerate(sizes)])
    seq = torch.cat([torch.arange(n) for n in sizes])
    lengths = (~_ended(batch_sizes)).sum(0)  # each sequence's length, (B,)
    index = offsets[lengths[seq] - 1 - step] + seq
    return torch.cat([index, torch.arange(int(offsets[-1]), rows)])


@torch.compiler.disable
def layout(data: Tensor, batch_sizes: Tensor, reverse: bool
           ) -> tuple[Tensor, Tensor, Tensor | None]:
    """``data`` with zero rows after it up to its ``capacity``, the (T, B) ``ended``
    flags on its device, and with ``reverse`` the ``_reversed_rows`` order (else None)."""
    steps, batch = len(batch_sizes), int(batch_sizes[0])
    rows = capacity(data.shape[0], steps, batch)
    padded = torch.nn.functional.pad(data, (0, 0, 0, rows - data.shape[0]))
    order = _reversed_rows(batch_sizes, rows).to(data.device) if reverse else None
    return padded, _ended(batch_sizes).to(data.device), order


def reverse_each(rows: Tensor, order: Tensor) -> Tensor:
    """``rows`` with each sequence reversed within its length (``order`` from
    ``layout``). Traced."""
    return rows.index_select(0, order)


@torch.compiler.disable
def repack(rows: Tensor, batch_sizes: Tensor) -> Tensor:
    """The batch's rows of the chains' output at its capacity (a view)."""
    return rows[:int(batch_sizes.sum())]


@torch.compiler.disable
def dropout_masks(batch_sizes: Tensor, layers: int, width: int, p: float,
                  like: Tensor, rows: int) -> list[Tensor]:
    """The inter-layer dropout masks of a packed RNN, drawn before its layers run: for each
    of ``layers`` boundaries the noise eager's dropout draws on the layer's packed rows
    (``empty((rows, width)).bernoulli_(1 - p)``, ``like``'s dtype and device, in layer
    order: nothing between two layers draws, so the numbers are eager's), kept as a bool
    mask at the capacity ``rows`` (False past the batch's rows). The graph scales by it
    (``apply_dropout``); a bool mask is a quarter of eager's float noise a row."""
    live = int(batch_sizes.sum())
    masks = []
    for _ in range(layers):
        noise = torch.empty((live, width), dtype=like.dtype, device=like.device)
        mask = noise.bernoulli_(1 - p).bool()
        masks.append(torch.nn.functional.pad(mask, (0, 0, 0, rows - live)))
    return masks


def apply_dropout(y: Tensor, mask: Tensor, p: float) -> Tensor:
    """Eager's dropout with a drawn mask: ``y`` times eager's noise value, 1 / (1 - p) in
    ``y``'s dtype (torch's CPU dropout divides the noise so: the same rounding), where the
    mask is set, else 0. Traced; its backward keeps the bool mask, not a float one."""
    scale = torch.ones((), dtype=y.dtype, device=y.device).div(1 - p)
    return torch.where(mask, y * scale, 0)
