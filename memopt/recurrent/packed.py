"""A PackedSequence between memopt's graphs: laid out padded and time-major for the
chains, and packed again after them, in eager code.

memopt plans each input shape once (``dynamic=False``). A PackedSequence's ``data`` has
one row per live (time step, sequence): its length, the sum of the batch's sequence
lengths, changes from batch to batch even when the padded input keeps its shape. Read
inside a graph, every new total length would be a new graph, planned again, and after
dynamo's recompile limit memopt refuses the module (``CaptureError``). So the rows never
enter a graph:

- ``unpack`` lays them out padded (T, B) in eager code before the chains' graph;
- ``dropout_masks`` draws the inter-layer dropout's noise on the packed rows before the
  layers run (as nn.LSTM's packed kernel draws it: the same numbers), handed to the
  graph as padded bool masks (``apply_dropout``);
- ``reversal`` / ``reverse_each`` (traced) reverse each sequence within its length for
  the reverse direction of a bidirectional RNN;
- ``repack`` packs the chains' padded output again after the graph.

What the graphs see is shaped by T (the longest sequence) and B only. The eager functions
are graph breaks; autograd records their copies (index_copy / index_select, which save
the row index only) as eager code, which memopt counts between its graphs
(memopt.eager_reads)."""

from __future__ import annotations

import torch
from torch import Tensor


def packed_layout(batch_sizes: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """Where a PackedSequence's rows go in the time-major padded layout (T, B) of its
    sorted sequences: each row's flat index t * B + b, and a (T, B, 1) tensor (``like``'s
    dtype and device), 1.0 where sequence b has ended by step t."""
    sizes = batch_sizes.tolist()
    batch = sizes[0]
    index = torch.cat([torch.arange(n) + t * batch for t, n in enumerate(sizes)])
    ended = torch.arange(batch)[None, :] >= torch.tensor(sizes)[:, None]
    return (index.to(like.device),
            ended.to(dtype=like.dtype, device=like.device).unsqueeze(-1))


def reversal(ended: Tensor) -> Tensor:
    """For the padded layout of ``ended`` (T, B, 1): the (T, B, 1) time index that
    reverses each sequence within its own length (step t of sequence b reads step
    length_b - 1 - t; steps past its end stay where they are). Traced (fixed shapes)."""
    steps = ended.shape[0]
    lengths = (ended == 0).sum(0, keepdim=True)
    t = torch.arange(steps, device=ended.device).view(steps, 1, 1)
    return torch.where(t < lengths, lengths - 1 - t, t)


def reverse_each(padded: Tensor, order: Tensor) -> Tensor:
    """``padded`` (T, B, features) with each sequence reversed within its length
    (``order`` from ``reversal``; applied twice it is the identity). The reverse
    direction of a bidirectional RNN on packed sequences is the forward direction on
    these: every sequence starts at step 0, so the active counts fall as a packed
    kernel needs."""
    return padded.gather(0, order.expand(-1, -1, padded.shape[-1]))


def _rows(padded: Tensor, batch_sizes: Tensor) -> Tensor:
    index, _ = packed_layout(batch_sizes, padded)
    return padded.flatten(0, 1).index_select(0, index)


def _pad(rows: Tensor, batch_sizes: Tensor) -> Tensor:
    index, _ = packed_layout(batch_sizes, rows)
    steps, batch = len(batch_sizes), int(batch_sizes[0])
    padded = rows.new_zeros(steps * batch, rows.shape[-1]).index_copy(0, index, rows)
    return padded.view(steps, batch, -1)


@torch.compiler.disable
def unpack(data: Tensor, batch_sizes: Tensor) -> tuple[Tensor, Tensor]:
    """The rows padded (T, B, features), zeros where a sequence has ended, and the
    (T, B, 1) ended flags (``packed_layout``)."""
    _, ended = packed_layout(batch_sizes, data)
    return _pad(data, batch_sizes), ended


@torch.compiler.disable
def repack(padded: Tensor, batch_sizes: Tensor) -> Tensor:
    """The live rows of a padded (T, B, features) output, in the packed order."""
    return _rows(padded, batch_sizes)


@torch.compiler.disable
def dropout_masks(batch_sizes: Tensor, layers: int, width: int, p: float,
                  like: Tensor) -> list[Tensor]:
    """The inter-layer dropout masks of a packed RNN, drawn before its layers run: for each
    of ``layers`` boundaries the noise eager's dropout draws on the layer's packed rows
    (``empty((rows, width)).bernoulli_(1 - p)``, ``like``'s dtype and device, in layer
    order: nothing between two layers draws, so the numbers are eager's), kept as a
    padded (T, B, width) bool mask. The graph scales by it (``apply_dropout``); the bool
    padded mask is a quarter of eager's float noise a row."""
    rows = int(batch_sizes.sum())
    masks = []
    for _ in range(layers):
        noise = torch.empty((rows, width), dtype=like.dtype, device=like.device)
        masks.append(_pad(noise.bernoulli_(1 - p).bool(), batch_sizes))
    return masks


def apply_dropout(y: Tensor, mask: Tensor, p: float) -> Tensor:
    """Eager's dropout with a drawn mask: ``y * noise`` where ``noise`` is the mask in
    ``y``'s dtype divided by 1 - p (torch's CPU dropout: the same operations, the same
    rounding). Traced."""
    return y * mask.to(y.dtype).div(1 - p)
