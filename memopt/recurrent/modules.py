"""Modules that run as chains inside memopt.compile.

- ``ChainedRNN`` wraps an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (same parameters, same
  call signature and results): the sequence is split into chunks, each one call of
  the fused RNN kernel (cuDNN on CUDA), the chunks forming the chain. memopt.compile
  puts one in place of every such module it finds, in a shallow copy of the model's
  module tree (the user's model is not modified). Every case is splittable:
  unidirectional (one chain over all layers), bidirectional (two chains a layer, the
  reverse one from the end of the sequence), PackedSequence input (with no budget
  the module's own packed call, ``ChainedRNN.packed_as_called``; under one, a chain a
  layer and direction over the sorted rows at a capacity, each chunk the packed kernel on
  the rows its steps' batch sizes lay out, memopt.recurrent.packed),
  and under autocast (the step enters the caller's autocast state, also when
  recomputed in backward). Their outputs, final states and gradients are eager's
  (inter-layer dropout included: a bidirectional RNN draws it in the graph, a packed
  one on its packed rows in eager code, as nn.LSTM's CPU kernel does; a unidirectional one inside its chunks, replayed when
  recomputed, so a split one's masks are not eager's).
- ``Recurrent`` marks a user's cell loop: ``Recurrent(cell)(xs, state)`` runs
  ``state = cell(xs[i], state)`` for every i and returns the stacked outputs (the
  first state tensor of each step) and the final state, as one chain.
- ``loop_step`` makes a chain step of a per-time-step cell function; ``Recurrent`` and
  the unmarked cell loops memopt finds in a captured graph (memopt.passes.cell_loops) use it.

Outside memopt.compile both run eagerly as a single chunk (plain BPTT).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from memopt.passes._torch_compat import rnn_kernels
from memopt.passes.runtime import RUNTIMES
from memopt.errors import CaptureError, InputError

from . import ops, packed
from .executor import Step, Tensors

_RNN_TYPES = (nn.LSTM, nn.GRU, nn.RNN)


#: The autocast states a ChainedRNN registers chains for, besides autocast off: the
#: step of each enters it (the chain ops run outside the caller's autocast region).
AUTOCASTS = tuple((d, t) for d in ("cpu", "cuda") for t in (torch.bfloat16, torch.float16))


def _rnn_step(rnn: nn.RNNBase, *, layers: int, reverse: bool = False,
              autocast: tuple[str, torch.dtype] | None = None, packed: bool = False,
              bidirectional: bool = False) -> Step:
    """step(params, state, x_chunk) for one chunk: one call of the fused kernel over
    ``layers`` layers of one direction (``params`` theirs, in ``rnn._flat_weights_names``
    order; with ``bidirectional`` both directions, the fused call nn.LSTM makes). With
    ``reverse`` the chunk runs time-reversed (the reverse direction of a
    bidirectional RNN): flipped in, its outputs flipped back, a chunk's copies only.
    With ``autocast`` (device type, dtype) the kernel runs under it, as eager's nn.LSTM
    would.

    ``packed``: the chunk is ``(rows, ended)`` (ops.ChainSpec.rows): a span of a
    PackedSequence's rows, time-major in the packed order, sorted by decreasing length,
    and the (steps, B) flags of the sequences ended at each of its steps. Its live rows
    run through one call of the kernel's packed overload (what nn.LSTM runs on a
    PackedSequence: the same arithmetic) from the live sequences' states, the ended
    sequences' states carried unchanged. A packed chain runs in time order only: the
    reverse direction gets each sequence reversed within its own length
    (``packed.reversed_rows``), which keeps the active counts falling. (Run backwards, the
    counts rise and the kernel takes them a call per run of equal counts, each taking
    oneDNN, whose workspace made a bidirectional packed tagger hold 2.13x eager's
    peak.)"""
    _VF = rnn_kernels()  # what nn.LSTM.forward calls

    batch_first = rnn.batch_first and not packed
    lstm = isinstance(rnn, nn.LSTM)
    time_dim = 1 if batch_first else 0
    dropout = float(rnn.dropout) if layers > 1 else 0.0

    def kernel(params, state, x):
        args = (list(params), rnn.bias, layers, dropout, rnn.training, bidirectional,
                batch_first)
        if isinstance(rnn, nn.LSTM):
            out, h, c = _VF.lstm(x, list(state), *args)
            return out, (h, c)
        if isinstance(rnn, nn.GRU):
            out, h = _VF.gru(x, state[0], *args)
        elif rnn.nonlinearity == "tanh":
            out, h = _VF.rnn_tanh(x, state[0], *args)
        else:
            out, h = _VF.rnn_relu(x, state[0], *args)
        return out, (h,)

    def packed_kernel(params, state, data, sizes):
        """The packed overload (what nn.LSTM runs on a PackedSequence), on CPU always
        ATen's own step loop: where every sequence of a call is active at every step,
        the overload takes oneDNN instead, whose saved workspace is 2.2x the bytes a
        row (an LSTM(64, 128): 8.7 against 3.9 KB), so which path a chunk takes would
        depend on the batch's lengths and the plan could not price it."""
        batch_sizes = torch.tensor(sizes, dtype=torch.int64)
        rest = (list(params), rnn.bias, layers, dropout, rnn.training, False)
        with _native_rnn():
            if lstm:
                out, h, c = _VF.lstm(data, batch_sizes, list(state), *rest)
                return out, (h, c)
            fn = _VF.gru if isinstance(rnn, nn.GRU) else (
                _VF.rnn_tanh if rnn.nonlinearity == "tanh" else _VF.rnn_relu)
            out, h = fn(data, batch_sizes, state[0], *rest)
            return out, (h,)

    def live_rows(params, state, x):
        """A chunk of packed rows, ``(rows, ended)`` (ops.ChainSpec.rows): the kernel
        on the live rows from the live sequences' states (the first ``n``: sorted by
        length, they end last first), its output padded with zero rows to the chunk's
        (the last chunk also holds the capacity's zero rows); the states of the
        sequences that ended before the chunk carried beside the kernel's unchanged."""
        rows, ended = x
        batch = ended.shape[1]
        active = (batch - ended.sum(1)).tolist()  # sequences active at each step: falls
        live, n = sum(active), active[0]
        out, new = packed_kernel(params, tuple(s[:, :n] for s in state), rows[:live], active)
        if live < rows.shape[0]:
            out = torch.cat([out, out.new_zeros((rows.shape[0] - live, out.shape[-1]))])
        if n < batch:
            new = tuple(torch.cat([a, b[:, n:].to(a.dtype)], 1) for a, b in zip(new, state))
        return out, tuple(new)

    run = live_rows if packed else kernel

    def step(params, state, x):
        if reverse:
            x = x.flip(time_dim)
        if autocast is None:
            out, new = run(params, state, x)
        else:
            with ops.chunk_autocast(autocast):
                out, new = run(params, state, x)
        return (out.flip(time_dim) if reverse else out), new

    return step


@contextlib.contextmanager
def _native_rnn() -> Iterator[None]:
    """oneDNN off for the RNN kernels called inside (torch.backends.mkldnn's scoped
    flags; its note on TF32 for Intel GPUs, which it prints on entering, is silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
        with torch.backends.mkldnn.flags(enabled=False):
            yield


def loop_step(cell_step: Callable[[Tensors, Tensors, Tensor], tuple[Tensor, Tensors]],
              time_dim: int = 0) -> Step:
    """The chain step of a cell loop: ``cell_step(params, state, x_t) -> (y_t, new_state)``
    run at every time step of a chunk (``x_chunk`` along ``time_dim``), the ``y_t``
    stacked along ``time_dim``. A chunk of the loop is one step of Gruslys et al. 2016's
    chain (Sec. 3.1). Used by ``Recurrent`` and by the loops memopt finds in a captured
    graph (memopt.passes.cell_loops)."""

    def step(params: Tensors, state: Tensors, x: Tensor) -> tuple[Tensor, Tensors]:
        ys = []
        for k in range(x.shape[time_dim]):
            y, state = cell_step(params, state, x.select(time_dim, k))
            ys.append(y)
        return torch.stack(ys, time_dim), tuple(state)

    return step


class ChainedRNN(nn.Module):
    """An nn.LSTM / nn.GRU / nn.RNN run as chains of chunks (see module docstring).

    A unidirectional RNN is one chain whose step is the fused kernel over all its layers
    (its inter-layer dropout inside, replayed when a chunk is recomputed). A
    bidirectional one is two chains per layer, each a one-layer, one-direction call of
    the kernel with that direction's weights: the forward direction over the sequence,
    the reverse one over the time-reversed sequence (its chunks taken from the end, each
    flipped in the step, ``ChainSpec.reverse``), their outputs concatenated as
    nn.LSTM's are and read by the next layer, the inter-layer dropout a traced
    ``F.dropout`` between them (the call, on the same tensor, in the same order, that
    nn.LSTM's CPU kernel makes: the same numbers). Every chain can be split.

    Under autocast the chain registered for that (device type, dtype) runs: its step
    enters the same autocast state, also when recomputed in backward.
    """

    #: A PackedSequence runs the wrapped module's own packed call, in eager code
    #: (``_called``): memopt.compile sets it with no budget. Nothing is recomputed then,
    #: so each chain would be one chunk over every live row: the packed kernel's call
    #: on the rows laid out by the batch sizes, which is that call, without the rows'
    #: capacity, a graph for each capacity or a plan (``_packed_chains``; the padded
    #: layout those chains ran on before measured 1.08x and 1.16x eager's peak on a
    #: 2-layer tagger over lengths spread 4x, benchmarks.recurrent, Part 2b).
    packed_as_called: bool = False

    def __init__(self, rnn: nn.RNNBase, name: str = "") -> None:
        super().__init__()
        if not isinstance(rnn, _RNN_TYPES):
            raise TypeError(f"ChainedRNN wraps nn.LSTM, nn.GRU or nn.RNN, got {type(rnn).__name__}")
        # Dynamo refuses to trace through an nn.RNNBase, even an attribute access: keep
        # the module out of the traced tree; its parameters are registered here too.
        object.__setattr__(self, "rnn", rnn)
        #: whether the module has forward (pre-)hooks, kept by RNNSubstitution.sync: read
        #: in forward, where an attribute of the nn.RNNBase would break dynamo's graph
        self.hooked = _hooked(rnn)
        self.weight_names = list(rnn._flat_weights_names)
        for n in self.weight_names:
            self.register_parameter(n, getattr(rnn, n))
        self.lstm = isinstance(rnn, nn.LSTM)
        self.batch_first, self.directions = rnn.batch_first, 2 if rnn.bidirectional else 1
        self.layers = rnn.num_layers * self.directions  # of the state, as nn.LSTM's h_0
        self.dropout = float(rnn.dropout)
        self.h_size, self.c_size = rnn.proj_size or rnn.hidden_size, rnn.hidden_size
        time_dim = 1 if rnn.batch_first else 0
        name = self.path = name or type(rnn).__name__
        # the chains: one for a unidirectional RNN, else (layer, direction) in
        # _flat_weights_names order; each once per autocast state (None: off)
        if rnn.bidirectional:
            parts = [{"layers": 1, "reverse": bool(d),
                      "name": f"{name}.l{layer}{'_reverse' if d else ''}"}
                     for layer in range(rnn.num_layers) for d in range(2)]
        else:
            parts = [{"layers": rnn.num_layers, "reverse": False, "name": name}]
        out_size = self.h_size  # of each chain: one direction
        per = len(self.weight_names) // self.layers  # a layer's and direction's weights
        self.part_weights = [self.weight_names[k * per:(k + 1) * per]
                             for k in range(self.layers)]

        def output_like(state: tuple[Tensor, ...], xs: Tensor) -> Tensor:
            return xs.new_empty((*xs.shape[:-1], out_size))

        # PackedSequence inputs: one chain per layer and direction, time-major
        # (the reverse direction reversed within each sequence: a forward chain)
        layered = [{"layers": 1, "reverse": False, "packed": True,
                    "name": f"{name}.l{layer}{'_reverse' if d else ''}"}
                   for layer in range(rnn.num_layers) for d in range(self.directions)]
        self.chain_ids: dict[tuple[str, torch.dtype] | None, list[int]] = {}
        self.packed_ids: dict[tuple[str, torch.dtype] | None, list[int]] = {}
        for autocast in (None, *AUTOCASTS):
            for table, specs in ((self.chain_ids, parts), (self.packed_ids, layered)):
                table[autocast] = [ops.register(ops.ChainSpec(
                    name=part["name"], module_type=type(rnn).__name__,
                    step=_rnn_step(rnn, layers=part["layers"], reverse=part["reverse"],
                                   autocast=autocast, packed=part.get("packed", False)),
                    time_dim=0 if part.get("packed") else time_dim, output_like=output_like,
                    preserve_rng=part["layers"] > 1 and rnn.dropout > 0,
                    reverse=part["reverse"], autocast=autocast,
                    keep_output=not part.get("packed", False),
                    rows=part.get("packed", False))) for part in specs]
        self.chain_id = self.chain_ids[None][0]  # the (first) chain without autocast
        # cuDNN draws a bidirectional stack's inter-layer dropout inside its fused call
        # (its own generator): on CUDA, training, that case stays one unsplittable chunk
        # of the fused call, as nn.LSTM runs it (split, the masks would not be eager's)
        self.fused_ids: dict[tuple[str, torch.dtype] | None, list[int]] = {}
        if rnn.bidirectional and rnn.num_layers > 1 and rnn.dropout > 0:
            def fused_like(state: tuple[Tensor, ...], xs: Tensor) -> Tensor:
                return xs.new_empty((*xs.shape[:-1], 2 * out_size))

            for autocast in (None, *AUTOCASTS):
                self.fused_ids[autocast] = [ops.register(ops.ChainSpec(
                    name=name, module_type=type(rnn).__name__,
                    step=_rnn_step(rnn, layers=rnn.num_layers, autocast=autocast,
                                   bidirectional=True),
                    time_dim=time_dim, output_like=fused_like, unsplittable=True,
                    autocast=autocast))]

    def _chains(self, device: str, table: dict) -> list[int]:
        autocast = ((device, torch.get_autocast_dtype(device))
                    if torch.is_autocast_enabled(device) else None)
        if autocast not in table:
            raise CaptureError(f"memopt runs nn.LSTM/nn.GRU/nn.RNN as chains under autocast "
                               f"to {AUTOCASTS}, not {autocast}")
        return table[autocast]

    def forward(self, input: Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        if self.hooked:  # the user's module is out of the traced tree: its hooks run here
            return _with_hooks(self.rnn, self._forward, input, hx)
        return self._forward(input, hx)

    def _forward(self, input: Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        if isinstance(input, PackedSequence):
            return self._packed(input, hx)
        lstm, batch_first = self.lstm, self.batch_first
        batched = input.dim() == 3
        if not batched:
            input = input.unsqueeze(1 if not batch_first else 0)
            if hx is not None:
                hx = tuple(h.unsqueeze(1) for h in hx) if lstm else hx.unsqueeze(1)
        batch = input.shape[0 if batch_first else 1]
        if hx is None:
            h0 = input.new_zeros(self.layers, batch, self.h_size)
            state = [h0, input.new_zeros(self.layers, batch, self.c_size)] if lstm else [h0]
        else:
            state = list(hx) if lstm else [hx]
        cudnn_dropout = bool(self.fused_ids) and input.device.type == "cuda" and self.training
        ids = self._chains(input.device.type,
                           self.fused_ids if cudnn_dropout else self.chain_ids)
        time = input.shape[1 if batch_first else 0]
        keep = torch.is_grad_enabled()
        if len(ids) == 1:
            params = [getattr(self, n) for n in self.weight_names]
            out = torch.ops.memopt.chain_fwd(ids[0], time, 1, "hsm", keep, state, input,
                                             params)
            y, final = out[0], out[1:-1]
        else:
            y, final = self._bidirectional(ids, time, keep, state, input)
        if not batched:
            y = y.squeeze(1 if not batch_first else 0)
            final = [f.squeeze(1) for f in final]
        return y, (final[0], final[1]) if lstm else final[0]

    def _bidirectional(self, ids: list[int], time: int, keep: bool, state: list[Tensor],
                       input: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Layer by layer, a forward and a reverse chain (state rows ``2 * layer + d``, as
        nn.LSTM's h_0), their outputs concatenated; the final states stacked as nn.LSTM's
        h_n / c_n (layers * directions, batch, hidden)."""
        finals: list[list[Tensor]] = []
        layers = len(ids) // 2
        for layer in range(layers):
            ys = []
            for d in range(2):
                k = 2 * layer + d
                params = [getattr(self, n) for n in self.part_weights[k]]
                out = torch.ops.memopt.chain_fwd(ids[k], time, 1, "hsm", keep,
                                                 [s[k:k + 1] for s in state], input, params)
                ys.append(out[0])
                finals.append(out[1:-1])
            if self.dropout > 0 and self.training and layer < layers - 1:
                # eager runs a batch_first stack time-major and draws the noise on the
                # layer's (time, batch, 2 * hidden) output: drawn on that layout here, the
                # same numbers fall on the same elements (on the batch-first layout they did
                # not: another loss and other gradients)
                if self.batch_first:
                    timed = torch.cat([y.transpose(0, 1) for y in ys], -1)
                    input = nn.functional.dropout(timed, self.dropout, True).transpose(0, 1)
                else:
                    input = nn.functional.dropout(torch.cat(ys, -1), self.dropout, True)
            elif self.batch_first:  # eager's layout: time-major, seen batch-first (a
                # dropout after the RNN draws its noise in memory order: another layout put
                # the same numbers on other elements; found from outside)
                input = torch.cat([y.transpose(0, 1) for y in ys], -1).transpose(0, 1)
            else:
                input = torch.cat(ys, -1)
        return input, [torch.cat([f[i] for f in finals]) for i in range(len(state))]

    @torch.compiler.disable(recursive=False)
    def _packed(self, input: PackedSequence, hx: Any) -> tuple[PackedSequence, Any]:
        """A PackedSequence, in eager code (memopt.recurrent.packed): its rows at their
        capacity, the chains run on them (``_packed_chains``, which dynamo traces as a
        frame of its own: no tensor shaped by the batch's total length enters it), the
        output cut back to the batch's rows. The states are permuted by
        ``sorted_indices`` / ``unsorted_indices`` as nn.LSTM's."""
        if self.packed_as_called:
            return _called(self.rnn, input, hx)
        data, batch_sizes, sorted_indices, unsorted_indices = input
        if self.fused_ids and data.device.type == "cuda" and self.training:
            raise CaptureError(
                "memopt cannot run a bidirectional nn.LSTM/nn.GRU/nn.RNN with dropout between "
                "layers on a CUDA PackedSequence in training as chains: cuDNN draws that "
                "dropout inside its fused call; pad the batch (it then runs as one chunk), "
                "or set dropout=0")
        rows, ended, order = packed.layout(data, batch_sizes, self.directions > 1)
        batch = ended.shape[1]
        if hx is None:
            h0 = rows.new_zeros(self.layers, batch, self.h_size)
            state = [h0, rows.new_zeros(self.layers, batch, self.c_size)] if self.lstm \
                else [h0]
        else:
            state = list(hx) if self.lstm else [hx]
            if sorted_indices is not None:
                state = [s.index_select(1, sorted_indices) for s in state]
        layers = self.layers // self.directions
        masks = []
        if self.dropout > 0 and self.training:  # drawn here: the rows are eager code's
            dtype = (torch.get_autocast_dtype(rows.device.type)
                     if torch.is_autocast_enabled(rows.device.type) else rows.dtype)
            masks = packed.dropout_masks(batch_sizes, layers - 1,
                                         self.h_size * self.directions, self.dropout,
                                         rows.new_empty((), dtype=dtype), rows.shape[0])
        y, final = self._packed_chains(rows, ended, order, state, masks)
        if unsorted_indices is not None:
            final = [f.index_select(1, unsorted_indices) for f in final]
        output = PackedSequence(packed.repack(y, batch_sizes), batch_sizes,
                                sorted_indices, unsorted_indices)
        return output, (final[0], final[1]) if self.lstm else final[0]

    def _packed_chains(self, y: Tensor, ended: Tensor, order: Tensor | None,
                       state: list[Tensor], masks: list[Tensor]
                       ) -> tuple[Tensor, list[Tensor]]:
        """One chain per layer and direction over the packed rows ``y`` at their capacity
        (ops.ChainSpec.rows: ``ended`` (T, B), the flags of the sequences ended at each
        step, is each chain's last param): the last layer's output and the final states
        (nn.LSTM's h_n). ``order``: the rows of each sequence reversed within its length
        (the reverse directions'); ``state``: every layer's and direction's initial
        state; ``masks``: the inter-layer dropout's, drawn by ``packed.dropout_masks``
        (none outside training or without dropout)."""
        steps = ended.shape[0]
        ids = self._chains(y.device.type, self.packed_ids)
        keep = torch.is_grad_enabled()
        directions = self.directions
        finals: list[list[Tensor]] = []
        for layer in range(self.layers // directions):
            if layer and masks:
                y = packed.apply_dropout(y, masks[layer - 1], self.dropout)
            ys = []
            for d in range(directions):
                k = directions * layer + d
                params = [*(getattr(self, n) for n in self.part_weights[k]), ended]
                seq = packed.reverse_each(y, order) if d else y
                out = torch.ops.memopt.chain_fwd(ids[k], steps, 1, "hsm", keep,
                                                 [s[k:k + 1] for s in state], seq, params)
                ys.append(packed.reverse_each(out[0], order) if d else out[0])
                finals.append(out[1:-1])
            y = torch.cat(ys, -1) if directions > 1 else ys[0]
        return y, [torch.cat([f[i] for f in finals]) for i in range(len(state))]


class Recurrent(nn.Module):
    """A user's cell loop as one chain: ``ys, state = Recurrent(cell)(xs, state)``.

    ``cell(x, state) -> new_state`` where state is a tensor or a tuple of tensors
    (nn.LSTMCell, nn.GRUCell, nn.RNNCell, or your own); ``xs`` has time along dim 0.
    Returns the stacked first state tensor of every step, and the final state.
    """

    def __init__(self, cell: nn.Module, name: str = "") -> None:
        super().__init__()
        self.cell = cell
        names = [n for n, _ in cell.named_parameters()]

        def cell_step(params, state, x):
            arg = state if len(state) > 1 else state[0]
            new = torch.func.functional_call(cell, dict(zip(names, params)), (x, arg))
            new = tuple(new) if isinstance(new, (tuple, list)) else (new,)
            return new[0], new

        def output_like(state: tuple[Tensor, ...], xs: Tensor) -> Tensor:
            return state[0].new_empty((xs.shape[0], *state[0].shape))

        self.chain_id = ops.register(ops.ChainSpec(
            name=name or type(cell).__name__, module_type=type(cell).__name__,
            step=loop_step(cell_step), time_dim=0, output_like=output_like, preserve_rng=True))

    def forward(self, xs: Tensor, state: Any) -> tuple[Tensor, Any]:
        tupled = isinstance(state, (tuple, list))
        state = list(state) if tupled else [state]
        params = list(self.cell.parameters())
        out = torch.ops.memopt.chain_fwd(self.chain_id, xs.shape[0], 1, "hsm",
                                         torch.is_grad_enabled(), state, xs, params)
        final = out[1:-1]
        return out[0], tuple(final) if tupled else final[0]


def _with_hooks(module: nn.Module, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)`` with ``module``'s forward pre-hooks and forward hooks around it, as
    nn.Module.__call__ runs them (those registered with_kwargs too): the wrapped RNN is
    not called as a module, and its hooks were skipped, silently (found from outside)."""
    kwargs: dict[str, Any] = {}
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            got = hook(module, args, kwargs)
            if got is not None:
                args, kwargs = got
        else:
            got = hook(module, args)
            if got is not None:
                args = got if isinstance(got, tuple) else (got,)
    out = run(*args, **kwargs)
    for key, hook in list(module._forward_hooks.items()):
        got = hook(module, args, kwargs, out) if key in module._forward_hooks_with_kwargs \
            else hook(module, args, out)
        if got is not None:
            out = got
    return out


@torch.compiler.disable
def _called(rnn: nn.RNNBase, input: PackedSequence, hx: Any) -> tuple[PackedSequence, Any]:
    """``rnn(input, hx)``, out of dynamo's reach: the rows' count (the batch's total
    length) changes from batch to batch, and traced, each would be a new graph
    (``ChainedRNN.packed_as_called``). The autograd graph it leaves is eager code's,
    whose saved tensors memopt counts between its graphs (memopt.eager_reads)."""
    return rnn(input, hx)


class RNNSubstitution:
    """A shallow copy of a model's module tree (``tree``) with every nn.LSTM / nn.GRU /
    nn.RNN wrapped in a ChainedRNN (parameters, buffers, hooks and other modules shared);
    the model itself when it has none. ``pairs``: each copied module's (original, copy,
    path), which ``sync`` keeps in step with the model. ``packed_as_called`` (no budget):
    each wrapper runs a PackedSequence as the module's own call
    (``ChainedRNN.packed_as_called``)."""

    def __init__(self, model: nn.Module, packed_as_called: bool = False) -> None:
        self.packed_as_called = packed_as_called
        self.pairs: list[tuple[nn.Module, nn.Module, str]] = []
        self.tree = self._rebuild(model, "") if _has_rnn(model) else model

    def _rebuild(self, m: nn.Module, path: str) -> nn.Module:
        if isinstance(m, _RNN_TYPES):
            _refuse_backward_hooks(m, path or type(m).__name__)
            wrapped = ChainedRNN(m, path or type(m).__name__)
            wrapped.packed_as_called = self.packed_as_called
        elif not _has_rnn(m):
            return m
        else:
            wrapped = copy.copy(m)
            wrapped._modules = {
                k: self._rebuild(v, f"{path}.{k}" if path else k) if v is not None else None
                for k, v in m._modules.items()}
        self.pairs.append((m, wrapped, path))
        return wrapped

    def sync(self) -> None:
        """Carry into the tree what the user changed on the model since it was built (at
        every call; it walks only the modules the tree copied): train() / eval(); an RNN
        parameter replaced (``lstm.weight_hh_l0 = nn.Parameter(...)``); a plain attribute
        set on a copied module (``model.temperature = 2.0``); a submodule added,
        replaced or removed on a copied module, an RNN among them wrapped anew (and the
        copies of what it replaced dropped, with the modules they held). Left as built,
        the copy kept computing with the old tensors and modules, silently (found from
        outside)."""
        source = {id(twin): original for original, twin, _ in self.pairs}
        dropped: list[nn.Module] = []
        for original, twin, path in list(self.pairs):
            twin.training = original.training
            if not isinstance(twin, ChainedRNN):  # plain attributes its forward reads
                mine = twin.__dict__
                for k, v in original.__dict__.items():
                    if k != "_modules" and mine.get(k, _MISSING) is not v:
                        mine[k] = v
            if isinstance(twin, ChainedRNN):
                _refuse_backward_hooks(original, twin.path)
                twin.hooked = _hooked(original)
                for n in twin.weight_names:
                    p = getattr(original, n)
                    if twin._parameters.get(n) is not p:
                        twin._parameters[n] = p
                continue
            mine, theirs = twin._modules, original._modules
            for k, child in theirs.items():
                held = mine.get(k)
                if held is child or (held is not None and source.get(id(held)) is child):
                    continue
                if held is not None:
                    dropped.append(held)
                mine[k] = self._rebuild(child, f"{path}.{k}" if path else k) \
                    if child is not None else None
            for k in [k for k in mine if k not in theirs]:
                dropped.append(mine.pop(k))
        if dropped:  # the copies inside what was replaced or removed: no longer synced
            gone = {id(m) for d in dropped if d is not None for m in d.modules()}
            self.pairs = [pair for pair in self.pairs if id(pair[1]) not in gone]


_MISSING = object()


def _refuse_backward_hooks(rnn: nn.Module, name: str) -> None:
    """InputError where the RNN has module backward hooks: nn.Module runs them around a
    module call, and memopt runs its chains instead (they were skipped, silently)."""
    if rnn._backward_hooks or rnn._backward_pre_hooks:
        raise InputError(
            f"{name} ({type(rnn).__name__}) has a module backward hook "
            f"(register_full_backward_hook / register_full_backward_pre_hook): memopt runs "
            f"it as recurrent chains, not as a module call, so the hook would not run. "
            f"Register it on a module around it, or hook its output tensors "
            f"(`out.register_hook`).")


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_pre_hooks or m._forward_hooks)


def _has_rnn(m: nn.Module) -> bool:
    return any(isinstance(s, _RNN_TYPES) for s in m.modules())


RUNTIMES.loop_step = loop_step  # for passes.cell_loops (memopt.passes.runtime)
