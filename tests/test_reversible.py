"""Reversible RNNs (MacKay et al. 2018): memopt.nn's RevGRU / RevLSTM and their parts.

- The information buffer alone (Alg. 1 with Sec. 5.1's overflow): exact undo, spills.
- Bit-exact reconstruction of h(0) from h(T), T = 1000, both cells, every cap.
- Gradients of the reversible backward equal autograd through the same fixed-point
  forward (T in {1, 10, 100}, 1 and 2 layers), and stay near the floating-point model's.
- The buffer's size against eq. 16-17, with the forget values recomputed here from the
  states by this file's own reading of eq. 4 / eq. 11 and Sec. 5.3.
- The interface, bad arguments, training, and the memory held for backward.

Each test sets torch to one thread: on the shared 2-core machine small matmuls take
milliseconds with two threads fighting other jobs, microseconds with one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from memopt.measure import allocation_peak, can_track
from memopt.nn import (
    R_H,
    R_Z,
    BufferSize,
    InformationBuffer,
    RevGRU,
    RevGRUCell,
    RevLSTM,
    RevLSTMCell,
)
from memopt.nn.dropout import LayerDropout, draw_seeds

CAPS = [2, 3, 5, None]
CELLS = {"gru": RevGRUCell, "lstm": RevLSTMCell}
MODULES = {"gru": RevGRU, "lstm": RevLSTM}


pytestmark = pytest.mark.usefixtures("one_thread")


def _random_hx(cell, batch: int, scale: float = 2.0):
    h = scale * torch.randn(batch, cell.hidden_size)
    return h if isinstance(cell, RevGRUCell) else (h, scale * torch.randn(batch, cell.hidden_size))


def _run_cell(cell, xs, state):
    buffers = cell.new_buffers(state)
    for x in xs:
        state = cell.step(x, state, buffers)
    return state, buffers


# The information buffer on its own.

def _multiply_all(hs: torch.Tensor, zs: torch.Tensor) -> tuple[list[torch.Tensor], InformationBuffer]:
    buf = InformationBuffer(hs)
    trace = [hs]
    for z in zs:
        trace.append(buf.multiply(trace[-1], z))
    return trace, buf


@pytest.mark.parametrize("z_kind", ["one", "full", "random"])
def test_buffer_undoes_every_multiplication(z_kind):
    """h* of either sign and up to 2^40, z* = 1 (10 bits lost a step: a spill every ~5
    steps), z* = 2^R_Z (nothing lost) or random: every step is undone exactly."""
    steps, shape = 400, (3, 7)
    hs = torch.randint(-2**40, 2**40, shape)
    zs = {"one": torch.ones(steps, *shape, dtype=torch.int64),
          "full": torch.full((steps, *shape), 2**R_Z),
          "random": torch.randint(1, 2**R_Z + 1, (steps, *shape))}[z_kind]
    trace, buf = _multiply_all(hs, zs)
    size = buf.size()
    if z_kind == "one":
        assert len(buf.words) >= steps * R_Z // 63  # overflowed into further words
        assert size.ideal_bits == steps * R_Z * hs.numel()
    if z_kind == "full":
        assert size.bits == 0 and not buf.words
        assert all(torch.equal(h, hs) for h in trace)
    h = trace[-1]
    for t in reversed(range(steps)):
        h = buf.divide(h, zs[t])
        assert torch.equal(h, trace[t])
    assert buf.is_empty()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-2**45, 2**45), min_size=1, max_size=6),
       st.lists(st.integers(1, 2**R_Z), min_size=1, max_size=60))
def test_buffer_round_trip_property(h_values, z_values):
    hs = torch.tensor(h_values)
    zs = torch.tensor(z_values)[:, None].expand(-1, len(h_values))
    trace, buf = _multiply_all(hs, zs)
    words, bookkeeping = buf.saved()
    restored = InformationBuffer.restore(words, bookkeeping)
    h = trace[-1]
    for t in reversed(range(len(z_values))):
        h = restored.divide(h, zs[t])
    assert torch.equal(h, hs) and restored.is_empty()
    assert buf.count == len(z_values)  # the restored buffer popped, the saved one did not
    assert all(map(torch.equal, buf.saved()[0], words))


def test_buffer_noise_is_bounded():
    """Alg. 1 adds B mod z* < 2^R_Z to h*: h changes from z h by less than 2^(R_Z - R_H)."""
    hs = torch.randint(-2**30, 2**30, (1000,))
    zs = torch.randint(1, 2**R_Z, (30, 1000))
    trace, _ = _multiply_all(hs, zs)
    for h, z, new in zip(trace, zs, trace[1:]):
        exact = h.double() * z.double() / 2**R_Z
        assert ((new.double() - exact).abs() / 2**R_H).max() < 2.0 ** (R_Z - R_H)


# Bit-exact reconstruction.

@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("kind", CELLS)
def test_reconstruction_is_bit_exact(kind, cap):
    """MacKay et al. 2018, Sec. 5: h(0) recovered from h(T), T = 1000, torch.equal on the
    int64 fixed-point values, and every intermediate state on the way."""
    steps, batch = 1000, 3
    cell = CELLS[kind](5, 16, max_forget_bits=cap)
    xs = 2 * torch.randn(steps, batch, 5)
    state0 = cell.fixed_state(_random_hx(cell, batch))
    buffers = cell.new_buffers(state0)
    checkpoints, state = {0: state0}, state0
    for t in range(steps):
        state = cell.step(xs[t], state, buffers)
        if t % 250 == 0:
            checkpoints[t + 1] = state
    assert sum((b.size() for b in buffers), BufferSize()).bits > 0  # it did forget
    for t in reversed(range(steps)):
        if t + 1 in checkpoints:
            assert all(map(torch.equal, state, checkpoints[t + 1]))
        state = cell.reverse(xs[t], state, buffers)
    assert all(map(torch.equal, state, state0))
    assert all(b.is_empty() for b in buffers)


@pytest.mark.parametrize("kind", CELLS)
def test_reconstruction_needs_the_buffer(kind):
    """Reversing with emptied buffers does not recover h(0): the buffer is what makes
    forgetting reversible (Sec. 3.3)."""
    cell = CELLS[kind](5, 16)
    xs = torch.randn(50, 2, 5)
    state0 = cell.fixed_state(_random_hx(cell, 2))
    state, _ = _run_cell(cell, xs, state0)
    empty = cell.new_buffers(state)
    for x in reversed(xs):
        state = cell.reverse(x, state, empty)
    assert not all(map(torch.equal, state, state0))


# Gradients.

def _loss_and_grads(forward, module, xs, hx):
    out, h_n = forward(xs, hx)
    finals = h_n if isinstance(h_n, tuple) else (h_n,)
    weights = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=weights)).sum()
    loss = loss + sum((h * torch.randn(h.shape, generator=weights)).sum() for h in finals)
    hxs = hx if isinstance(hx, tuple) else (hx,)
    return out.detach(), torch.autograd.grad(loss, [xs, *hxs, *module.parameters()])


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("steps", [1, 10, 100])
@pytest.mark.parametrize("kind", MODULES)
def test_gradients_match_autograd_reference(kind, steps, layers):
    """The reversible backward (states reconstructed, one step at a time) against
    autograd through the same fixed-point forward holding every step: the outputs are
    equal, the gradients for the inputs, the initial state and every parameter close."""
    batch, hidden = 3, 16
    rnn = MODULES[kind](5, hidden, num_layers=layers, max_forget_bits=3)
    xs = torch.randn(steps, batch, 5, requires_grad=True)
    shape = (layers, batch, hidden)
    hx = (torch.randn(shape, requires_grad=True) if kind == "gru" else
          (torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)))
    out, grads = _loss_and_grads(rnn, rnn, xs, hx)
    ref_out, ref_grads = _loss_and_grads(rnn.autograd_forward, rnn, xs, hx)
    assert torch.equal(out, ref_out)
    assert all(g.abs().sum() > 0 for g in ref_grads)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MODULES)
def test_backward_twice_and_frozen_parameters(kind):
    """retain_graph: a second backward reads the buffers again (it pops a restored
    buffer, not the saved words); parameters that need no gradient get none."""
    rnn = MODULES[kind](4, 8, num_layers=2)
    rnn.cells[0].gates[0].weight.requires_grad_(False)
    xs = torch.randn(12, 2, 4, requires_grad=True)
    out, _ = rnn(xs)
    loss = out.square().sum()
    first = torch.autograd.grad(loss, xs, retain_graph=True)[0]
    second = torch.autograd.grad(loss, xs)[0]
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError):  # autograd freed the words and states after backward
        out.grad_fn.saved_tensors  # noqa: B018
    out, _ = rnn(xs)
    out.sum().backward()
    assert rnn.cells[0].gates[0].weight.grad is None
    assert rnn.cells[1].gates[0].weight.grad is not None


@pytest.mark.parametrize("kind", CELLS)
def test_fixed_point_gradients_near_floating_point_model(kind):
    """Straight-through is a small approximation: the fixed-point model's gradients are
    within 1% of those of the same cell run in floating point (``cell.forward``)."""
    rnn = MODULES[kind](5, 16, max_forget_bits=3)
    cell = rnn.cells[0]
    xs = torch.randn(30, 3, 5, requires_grad=True)
    out, _ = rnn(xs)
    grads = torch.autograd.grad(out.square().sum(), [xs, *rnn.parameters()])
    hx, outs = None, []
    for x in xs:
        hx = cell(x, hx)
        outs.append(hx if kind == "gru" else hx[0])
    float_grads = torch.autograd.grad(torch.stack(outs).square().sum(), [xs, *rnn.parameters()])
    for grad, ref in zip(grads, float_grads):
        assert (grad - ref).norm() <= 1e-2 * ref.norm()


# Dropout between layers (MacKay et al. 2018, App. E): masks rebuilt from seeds.

def _with_weights_of(rnn, layers, **kwargs):
    """A stack of the given layers of ``rnn`` (same weights), as its own module."""
    first = layers[0]
    part = type(rnn)(rnn.input_size if first == 0 else rnn.hidden_size, rnn.hidden_size,
                     num_layers=len(layers), max_forget_bits=rnn.max_forget_bits, **kwargs)
    for mine, theirs in zip(part.cells, (rnn.cells[i] for i in layers)):
        mine.load_state_dict(theirs.state_dict())
    return part


def test_dropout_masks_are_bernoulli_and_rebuilt_exactly():
    """Each mask is 0 or 1 / (1 - p), about p of it 0; asking again gives the same mask,
    another step or another seed a different one."""
    p, like = 0.3, torch.empty(64, 128)
    dropout = LayerDropout(p, (12345, 678))
    first, second = dropout.masks(5, like)
    assert first.unique().tolist() == pytest.approx([0.0, 1 / (1 - p)])
    assert abs(float((first == 0).float().mean()) - p) < 0.02
    assert all(map(torch.equal, dropout.masks(5, like), (first, second)))
    assert not torch.equal(first, second)
    assert not torch.equal(dropout.masks(6, like)[0], first)
    assert not torch.equal(LayerDropout(p, (12346, 678)).masks(5, like)[0], first)


@pytest.mark.parametrize("kind", MODULES)
def test_dropout_between_layers_as_two_stacks(kind):
    """Written apart from the stack's loop: a 2-layer stack with dropout computes layer 1,
    multiplies its outputs by masks drawn from the seeds the module drew, then layer 2;
    the top layer's outputs are not dropped."""
    torch.manual_seed(0)
    rnn = MODULES[kind](5, 16, num_layers=2, dropout=0.4, max_forget_bits=3)
    xs = torch.randn(12, 3, 5)
    torch.manual_seed(7)
    out, _ = rnn(xs)
    torch.manual_seed(7)
    dropout = LayerDropout(0.4, tuple(draw_seeds(1, xs.device).tolist()))
    lower, _ = _with_weights_of(rnn, [0])(xs)
    masks = torch.stack([dropout.masks(t, lower[0])[0] for t in range(12)])
    expected, _ = _with_weights_of(rnn, [1])(lower * masks)
    assert torch.equal(out, expected)
    assert (masks == 0).any() and (out != 0).all()


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("kind", MODULES)
def test_dropout_gradients_match_autograd_reference(kind, layers):
    """With dropout between layers, the reversible backward (masks rebuilt from the seeds)
    against autograd through the same forward (same seeds, hence the same masks, held
    with the graph): equal outputs, close gradients; the masks change the outputs."""
    torch.manual_seed(0)
    batch, hidden, steps = 3, 16, 20
    rnn = MODULES[kind](5, hidden, num_layers=layers, dropout=0.5, max_forget_bits=3)
    xs = torch.randn(steps, batch, 5, requires_grad=True)
    shape = (layers, batch, hidden)
    hx = (torch.randn(shape, requires_grad=True) if kind == "gru" else
          (torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)))
    torch.manual_seed(1)
    out, grads = _loss_and_grads(rnn, rnn, xs, hx)
    torch.manual_seed(1)
    ref_out, ref_grads = _loss_and_grads(rnn.autograd_forward, rnn, xs, hx)
    assert torch.equal(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
    rnn.eval()
    assert not torch.equal(rnn(xs, hx)[0], out)


@pytest.mark.parametrize("kind", MODULES)
def test_dropout_eval_mode_and_rng(kind):
    """Eval mode drops nothing and draws nothing; a training forward draws exactly one
    randint of one seed per layer boundary from the caller's generator, its backward
    (twice, retain_graph) nothing: the RNG state after the step is the forward's, and
    the second backward rebuilds the same masks."""
    torch.manual_seed(0)
    rnn = MODULES[kind](4, 8, num_layers=3, dropout=0.25)
    plain = _with_weights_of(rnn, [0, 1, 2])
    xs = torch.randn(15, 2, 4, requires_grad=True)
    rnn.eval()
    before = torch.get_rng_state()
    assert torch.equal(rnn(xs)[0], plain(xs)[0])
    assert torch.equal(torch.get_rng_state(), before)
    rnn.train()
    out, _ = rnn(xs)
    after_forward = torch.get_rng_state()
    torch.set_rng_state(before)
    draw_seeds(2, xs.device)
    assert torch.equal(torch.get_rng_state(), after_forward)
    loss = out.square().sum()
    first = torch.autograd.grad(loss, [xs, *rnn.parameters()], retain_graph=True)
    second = torch.autograd.grad(loss, [xs, *rnn.parameters()])
    assert all(map(torch.equal, first, second))
    assert torch.equal(torch.get_rng_state(), after_forward)
    assert not torch.equal(out, plain(xs)[0])


def test_dropout_on_one_layer_warns_and_drops_nothing():
    with pytest.warns(UserWarning, match="drops nothing"):
        rnn = RevGRU(4, 8, dropout=0.5)
    plain = _with_weights_of(rnn, [0])
    xs = torch.randn(6, 2, 4)
    assert torch.equal(rnn(xs)[0], plain(xs)[0])


# The buffer's size against eq. 16-17.

def _forget_values(cell, k: int, x: torch.Tensor, other: torch.Tensor) -> list[torch.Tensor]:
    """z* for half k, recomputed from the paper: the forget gates of eq. 4 (RevGRU: z)
    or eq. 11 (RevLSTM: f for c, p for h), bounded below by a = 2^-cap (Sec. 5.3),
    rounded to R_Z bits and kept in [max(1, a 2^R_Z), 2^R_Z]."""
    floor = 0.0 if cell.max_forget_bits is None else 2.0 ** -cell.max_forget_bits

    def quantize(gate):
        z = torch.round(((1 - floor) * gate + floor) * 2**R_Z).long()
        return z.clamp(max(1, round(floor * 2**R_Z)), 2**R_Z)
    gates = torch.sigmoid(cell.gates[k](torch.cat([x, other], dim=-1)))
    if isinstance(cell, RevGRUCell):
        return [quantize(gates[:, :cell.half_size])]  # [z; r]
    f, _, _, p, _ = gates.chunk(5, dim=-1)
    return [quantize(f), quantize(p)]


def _forgotten_bits(cell, xs, states) -> list[torch.Tensor]:
    """Eq. 16 for every step and every unit of every state half, shaped (T, batch,
    hidden / 2) per half, from the fixed-point states h(0..T); buffer i serves half i."""
    per_half: list[list[torch.Tensor]] = [[] for _ in states[0]]
    with torch.no_grad():
        for t, x in enumerate(xs):
            for k in (0, 1):
                other = states[t + k][1 - k]  # half 0 reads h2(t-1), half 1 reads h1(t)
                zs = _forget_values(cell, k, x, other.float() / 2**R_H)
                targets = [k] if len(per_half) == 2 else [2 + k, k]  # LSTM: c_k then h_k
                for i, z in zip(targets, zs):
                    per_half[i].append(R_Z - torch.log2(z.double()))
    return [torch.stack(steps) for steps in per_half]


def _bit_length(words: torch.Tensor) -> torch.Tensor:
    return torch.tensor([int(w).bit_length() for w in words.flatten()]).view(words.shape)


@pytest.mark.parametrize("cap", [2, 5, None])
@pytest.mark.parametrize("kind", CELLS)
def test_buffer_size_matches_forgotten_bits(kind, cap):
    """Eq. 16-17: each unit's words hold about the bits forgotten. Overheads (Sec. 5.1):
    a unit's word chain differs from the ideal unbounded integer by a few bits per word
    (bits left in h*'s low R_Z bits, word boundaries), and the words are 64 bits deep
    for every unit as soon as any unit's word is full (53 bits)."""
    steps, batch = 300, 4
    cell = CELLS[kind](5, 32, max_forget_bits=cap)
    xs = 2 * torch.randn(steps, batch, 5)
    states = [cell.fixed_state(_random_hx(cell, batch))]
    buffers = cell.new_buffers(states[0])
    for x in xs:
        states.append(cell.step(x, states[-1], buffers))
    forgotten = _forgotten_bits(cell, xs, states)
    for buf, bits in zip(buffers, forgotten):
        unit_ideal = bits.sum(0)  # eq. 17, unit by unit
        size = buf.size()
        words = [*buf.words, buf.top]
        held = sum(_bit_length(w) for w in words).double()
        # Eq. 17, as the buffer counted it and as recomputed here.
        assert size.ideal_bits == pytest.approx(float(unit_ideal.sum()), rel=1e-6)
        assert size.bits == int(held.sum())
        # Per unit: the bits held are the bits forgotten, within a few bits a word.
        assert (held - unit_ideal).max() <= 2 * len(words)
        assert (unit_ideal - held).max() <= (R_Z + 2) * len(words)
        # Storage: 64 bits a word for every unit. Depth: no fewer words than the unit
        # forgetting most needs (63 bits a word, up to R_Z + 2 bits a word of slack);
        # no more than one per 63 - 2 R_Z bits forgotten by whichever unit forgets most
        # at each step (a spill needs one unit's word past 2^53, less R_Z bits of slack).
        assert size.nbytes == 8 * len(words) * unit_ideal.numel()
        most = float(unit_ideal.max())
        worst = float(bits.flatten(1).max(1).values.sum())
        assert most / (63 + R_Z + 2) <= len(words) <= 1 + worst / (63 - 2 * R_Z)
        if cap is not None:  # Sec. 5.3: at most ``cap`` bits forgotten a step
            assert float(bits.max()) <= cap


def test_module_reports_its_buffer():
    """RevGRU.buffer_size sums every layer's buffers; ideal bits match eq. 17 computed
    from the outputs (a 1-layer RevGRU's outputs are its fixed-point states)."""
    rnn = RevGRU(5, 16, max_forget_bits=3)
    xs = torch.randn(40, 2, 5)
    out, _ = rnn(xs)
    size = rnn.buffer_size
    cell = rnn.cells[0]
    states = [(torch.zeros(2, 8, dtype=torch.int64),) * 2]
    states += [tuple(torch.round(h * 2**R_H).long() for h in o.split(8, -1)) for o in out]
    ideal = sum(float(bits.sum()) for bits in _forgotten_bits(cell, xs, states))
    assert size.ideal_bits == pytest.approx(ideal, rel=1e-6)
    assert size.units == 2 * 16  # batch x hidden
    assert 8 * size.units <= size.nbytes and 0 < size.bits <= 8 * size.nbytes


@pytest.mark.parametrize("kind", MODULES)
def test_cap_changes_the_forward(kind):
    """Sec. 5.3: the cap bounds the forget values below, so it changes the outputs,
    and fewer bits are forgotten (and stored) with a tighter cap."""
    xs = torch.randn(60, 2, 5)
    outs, ideal = [], []
    for cap in (2, None):
        torch.manual_seed(3)
        rnn = MODULES[kind](5, 16, max_forget_bits=cap)
        outs.append(rnn(xs)[0])
        ideal.append(rnn.buffer_size.ideal_bits)
    assert not torch.equal(*outs)
    assert ideal[0] < ideal[1]
    assert ideal[0] <= 2 * 60 * 16 * 2 * (1 if kind == "gru" else 2)


# The interface.

@pytest.mark.parametrize("kind", MODULES)
def test_interface_like_torch(kind):
    """Shapes as nn.GRU / nn.LSTM: batch_first, unbatched input, h_0 given or zeros;
    no_grad gives the same values; the cell's forward is one floating-point step."""
    torch_rnn = {"gru": nn.GRU, "lstm": nn.LSTM}[kind](5, 8, num_layers=2, batch_first=True)
    rnn = MODULES[kind](5, 8, num_layers=2, batch_first=True)
    xs = torch.randn(3, 7, 5)
    out, h_n = rnn(xs)
    torch_out, torch_h = torch_rnn(xs)
    assert out.shape == torch_out.shape
    flat = h_n if isinstance(h_n, tuple) else (h_n,)
    torch_flat = torch_h if isinstance(torch_h, tuple) else (torch_h,)
    assert [h.shape for h in flat] == [h.shape for h in torch_flat]
    zeros = tuple(torch.zeros_like(h) for h in flat)
    again, _ = rnn(xs, zeros[0] if kind == "gru" else zeros)
    assert torch.equal(out, again)
    with torch.no_grad():
        assert torch.equal(rnn(xs)[0], out)
    single, _ = rnn(xs[0])  # unbatched (T, input_size), as a batch of one
    assert torch.equal(single, rnn(xs[:1])[0][0])
    cell = rnn.cells[0]
    step = cell(xs[:, 0], None)
    assert (step[0] if kind == "lstm" else step).shape == (3, 8)


@pytest.mark.parametrize("make", [
    lambda: RevGRU(4, 8, bidirectional=True),
    lambda: RevGRU(4, 8, num_layers=2, dropout=1.5),
    lambda: RevLSTM(4, 8, num_layers=2, dropout=-0.1),
    lambda: RevGRU(4, 8, num_layers=2, dropout=True),
    lambda: RevLSTM(4, 8, proj_size=4),
    lambda: RevGRU(4, 7),
    lambda: RevGRU(4, 8, num_layers=0),
    lambda: RevLSTM(4, 8, max_forget_bits=0),
    lambda: RevLSTM(4, 8, max_forget_bits=11),
    lambda: RevGRU(4, 8, max_forget_bits=2.5),
    lambda: RevGRUCell(0, 8),
])
def test_bad_arguments_raise(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("call", [
    lambda gru, lstm: gru(torch.randn(5, 2, 3)),                       # wrong input_size
    lambda gru, lstm: gru(torch.randn(5)),                              # 1-D input
    lambda gru, lstm: gru(torch.randn(5, 2, 4, dtype=torch.float64)),   # wrong dtype
    lambda gru, lstm: gru(torch.randn(5, 2, 4), torch.zeros(1, 3, 8)),  # wrong h_0 batch
    lambda gru, lstm: lstm(torch.randn(5, 2, 4), torch.zeros(1, 2, 8)),  # h_0 without c_0
    lambda gru, lstm: gru(nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 4), [5, 3])),
])
def test_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call(RevGRU(4, 8), RevLSTM(4, 8))


# Training and memory.

@pytest.mark.parametrize("kind", MODULES)
def test_modules_train(kind):
    """A toy task (output the previous input's sign): a few Adam steps through the
    reversible backward reduce the loss."""
    rnn = MODULES[kind](1, 16, max_forget_bits=3)
    head = nn.Linear(16, 1)
    optimizer = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=3e-2)
    xs = torch.randn(20, 8, 1)
    target = torch.sign(torch.cat([torch.zeros(1, 8, 1), xs[:-1]]))
    losses = []
    for _ in range(40):
        out, _ = rnn(xs)
        loss = nn.functional.mse_loss(head(out), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.skipif(not can_track("cpu"), reason="allocation tracking unavailable here")
@pytest.mark.parametrize("kind", MODULES)
def test_memory_held_for_backward(kind):
    """At T = 200 the reversible module holds (after its forward, besides the outputs
    it returns) the buffers and the final state: far below autograd's every-step graph."""
    rnn = MODULES[kind](8, 32, max_forget_bits=3)
    xs = torch.randn(200, 4, 8, requires_grad=True)
    held = {}
    for name, forward in (("reversible", rnn), ("autograd", rnn.autograd_forward)):
        with allocation_peak("cpu") as seen:
            out, h_n = forward(xs)
        finals = h_n if isinstance(h_n, tuple) else (h_n,)
        held[name] = seen.end - out.nbytes - sum(h.nbytes for h in finals)
        del out, h_n, finals
    assert 0 < held["reversible"] < held["autograd"] / 3
    # Besides the buffers: the int64 final state and the float zero initial state (h, and
    # c for the RevLSTM), kept to check the reversal, and a few bytes of counters; the
    # input sequence was allocated before the block.
    states = 1 if kind == "gru" else 2
    assert held["reversible"] <= rnn.buffer_size.nbytes + states * (8 + 4) * 4 * 32 + 256


@pytest.mark.skipif(not can_track("cpu"), reason="allocation tracking unavailable here")
@pytest.mark.parametrize("kind", MODULES)
def test_dropout_masks_are_not_held(kind):
    """With dropout between 2 layers the forward holds what it holds without (the seeds
    are 8 bytes; T = 100 steps of masks would be 100 x 4 x 32 x 4 = 51 kB)."""
    held = {}
    for p in (0.0, 0.5):
        torch.manual_seed(0)
        rnn = MODULES[kind](8, 32, num_layers=2, dropout=p, max_forget_bits=3)
        xs = torch.randn(100, 4, 8, requires_grad=True)
        with allocation_peak("cpu") as seen:
            out, h_n = rnn(xs)
        finals = h_n if isinstance(h_n, tuple) else (h_n,)
        held[p] = seen.end - out.nbytes - sum(h.nbytes for h in finals) - rnn.buffer_size.nbytes
        del out, h_n, finals
    assert abs(held[0.5] - held[0.0]) <= 256, held
