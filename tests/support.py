"""What the tests share: the checks against eager PyTorch, and the tiny models several
test files train (one tiny language model, the chain regressions, the cell loops).

The corpus itself (tests/models.py) is the models every capability is checked on; this
module is how a test checks them. No test imports another test module: what two of them
need lives here or in tests/models.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import memopt
import memopt.nn
from models import allocated_step

#: TinyLM's vocabulary, by default.
V = 700
#: A cell loop's input and hidden widths (LSTMCellLoop, GRUCellLoop).
N_IN, N_H = 8, 32
#: The reversible RNNs by name (ReversibleRegression).
REVERSIBLE = {"gru": memopt.nn.RevGRU, "lstm": memopt.nn.RevLSTM}

FP32 = {"rtol": 1e-5, "atol": 1e-6}

# bfloat16 keeps 8 significant bits: one rounding is a relative error of up to
# 2**-8 = 3.9e-3, and a result goes through a few roundings (the matmul output,
# the cast of its input, the sum of bias and product), which is where torch's own
# default bf16 tolerance, rtol=1.6e-2, comes from. Eager and the captured graph
# may round at different points (AOTAutograd decomposes some ops, and sums
# gradients of reused values in its own order), so the absolute error of a value
# near zero is bounded by the magnitude of the terms that cancelled, not by the
# value: atol is rtol times the largest magnitude of the expected tensor.
BF16_RTOL = 1.6e-2


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for key in out for t in leaves(out[key])]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in leaves(v)]
    return []


_LOSS_WEIGHTS: dict[tuple[tuple[int, ...], int, str], torch.Tensor] = {}


def _weights(shape: tuple[int, ...], index: int, device: torch.device) -> torch.Tensor:
    """A fixed random tensor per output position, drawn on the CPU from its own generator
    (the global RNG, which dropout reads, is not touched), on `device`."""
    key = (shape, index, str(device))
    if key not in _LOSS_WEIGHTS:
        gen = torch.Generator().manual_seed(1234 + index)
        _LOSS_WEIGHTS[key] = torch.randn(shape, generator=gen).to(device)
    return _LOSS_WEIGHTS[key]


def default_loss(out: Any) -> torch.Tensor:
    """A random projection of every floating output: every output element gets a
    distinct, non-trivial gradient (a plain .sum() would hide, e.g., a LayerNorm's)."""
    total = None
    for i, t in enumerate(leaves(out)):
        if t.is_floating_point():
            term = (t.float() * _weights(tuple(t.shape), i, t.device)).sum()
            total = term if total is None else total + term
    assert total is not None, "model has no floating-point output"
    return total


def clone_inputs(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Independent leaf copies (same values, same requires_grad)."""
    return tuple(
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in inputs
    )


def assert_same_structure(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_structure(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same_structure(a, e)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str,
                 tol: dict[str, float] | None) -> None:
    """fp32 tolerances by default; tol=None means the bf16 rule above."""
    if tol is None:
        scale = expected.detach().float().abs().max().item() if expected.numel() else 0.0
        tol = {"rtol": BF16_RTOL, "atol": BF16_RTOL * max(scale, 1e-6)}
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def assert_outputs_close(actual: Any, expected: Any, tol: dict[str, float] | None) -> None:
    assert_same_structure(actual, expected)
    for i, (a, e) in enumerate(zip(leaves(actual), leaves(expected))):
        assert a.shape == e.shape and a.dtype == e.dtype, (i, a.shape, e.shape, a.dtype, e.dtype)
        assert_close(a, e, f"output {i}", tol)


def assert_grads_close(model: nn.Module, eager: nn.Module, tol: dict[str, float] | None) -> None:
    ours = dict(model.named_parameters())
    for name, p_eager in eager.named_parameters():
        p = ours[name]
        if p_eager.grad is None:
            assert p.grad is None, f"grad of {name}: eager has None, memopt has a tensor"
        else:
            assert p.grad is not None, f"grad of {name}: memopt has None, eager has a tensor"
            assert_close(p.grad, p_eager.grad, f"grad of {name}", tol)


def assert_params_close(model: nn.Module, eager: nn.Module, tol: dict[str, float] | None,
                        when: str) -> None:
    ours = dict(model.named_parameters())
    for name, p_eager in eager.named_parameters():
        assert_close(ours[name].detach(), p_eager.detach(), f"{when}: parameter {name}", tol)


def assert_buffers_equal(model: nn.Module, eager: nn.Module, when: str,
                         tol: dict[str, float] | None = None) -> None:
    """Buffers equal eager's bit for bit; within `tol` where given (fused kernels, e.g.
    kernels="inductor", round a running statistic's update differently)."""
    ours = dict(model.named_buffers())
    theirs = dict(eager.named_buffers())
    assert list(ours) == list(theirs)
    for name, b_eager in theirs.items():
        b = ours[name]
        assert b.dtype == b_eager.dtype
        if tol is not None and b.is_floating_point():
            torch.testing.assert_close(b, b_eager, **tol, msg=f"{when}: buffer {name}")
            continue
        assert torch.equal(b, b_eager), (
            f"{when}: buffer {name} differs: memopt {b.flatten()[:4].tolist()} ... "
            f"eager {b_eager.flatten()[:4].tolist()} ... "
            f"(max diff {(b.double() - b_eager.double()).abs().max().item():.3g})"
        )


def batch_norm_steps(model: nn.Module) -> set[int]:
    return {int(m.num_batches_tracked) for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)}


@dataclass
class Run:
    """What `check_matches_eager` leaves behind for further checks."""

    eager: nn.Module
    model: nn.Module          # the module memopt compiled (shares state with `compiled`)
    compiled: nn.Module
    plans: list[memopt.MemoryPlan] = field(default_factory=list)


def step(module: nn.Module, inputs: tuple[Any, ...], *, seed: int, autocast: torch.dtype | None,
         loss_fn: Callable[[Any], torch.Tensor]) -> Any:
    """One forward (seeded, optionally under autocast) and backward; returns the output."""
    torch.manual_seed(seed)
    if autocast is not None:
        with torch.autocast("cpu", dtype=autocast):
            out = module(*inputs)
    else:
        out = module(*inputs)
    loss_fn(out).backward()
    return out


def check_matches_eager(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Any, ...]],
    *,
    budget: object = None,
    steps: int = 1,
    autocast: torch.dtype | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
    buffer_tol: dict[str, float] | None = None,
    accumulate: bool = False,
    same_draws: bool = True,
) -> Run:
    """Train `steps` steps eagerly and through memopt from identical states; compare
    outputs, gradients (parameters and inputs), buffers and, with an optimizer,
    parameters after every step (buffers bit for bit, or within `buffer_tol`).
    `accumulate`: gradients are zeroed before the first step only, so every later step
    adds into kept `.grad` (gradient accumulation: memopt plans that step apart).
    `same_draws`: each step leaves the CPU generator where eager's leaves it (a step
    that draws more or fewer random numbers changes every later mask of a loop seeded
    once, though this step's gradients agree)."""
    tol = FP32 if autocast is None else None
    torch.manual_seed(0)
    eager = make_model()
    model = copy.deepcopy(eager)
    compiled = (compile_fn or (lambda m: memopt.compile(m, budget=budget)))(model)
    opt_eager = make_optimizer(eager.parameters()) if make_optimizer else None
    opt_ours = make_optimizer(compiled.parameters()) if make_optimizer else None
    run = Run(eager=eager, model=model, compiled=compiled)

    for k in range(steps):
        torch.manual_seed(100 + k)
        inputs = make_inputs()
        in_eager, in_ours = clone_inputs(inputs), clone_inputs(inputs)
        if k == 0 or not accumulate:
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
        out_eager = step(eager, in_eager, seed=1000 + k, autocast=autocast, loss_fn=loss_fn)
        drawn_eager = torch.get_rng_state()
        out_ours = step(compiled, in_ours, seed=1000 + k, autocast=autocast, loss_fn=loss_fn)
        if same_draws:
            assert torch.equal(torch.get_rng_state(), drawn_eager), (
                f"step {k + 1} left the CPU generator elsewhere than eager's step did")

        assert_outputs_close(out_ours, out_eager, tol)
        assert_grads_close(model, eager, tol)
        for i, (a, e) in enumerate(zip(in_ours, in_eager)):
            if isinstance(e, torch.Tensor) and e.requires_grad:
                assert e.grad is not None and a.grad is not None, f"input {i} has no grad"
                assert_close(a.grad, e.grad, f"grad of input {i}", tol)
        assert_buffers_equal(model, eager, f"after step {k + 1}", buffer_tol)
        if batch_norm_steps(eager):
            assert batch_norm_steps(model) == {k + 1}, "BatchNorm counted a step twice (or not)"

        plan = getattr(compiled, "memopt_plan", None)
        if hasattr(compiled, "memopt_plan"):
            assert plan is not None, "no memory plan after a training step"
            assert plan.predicted_peak_bytes > 0
            run.plans.append(plan)

        if opt_eager is not None:
            opt_eager.step()
            opt_ours.step()
            assert_params_close(model, eager, tol, f"after optimizer step {k + 1}")
    return run


def snapshot(model: nn.Module) -> dict[str, object]:
    """Copies of every parameter, buffer and gradient (None kept as None)."""
    state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()}
    state |= {f"grad:{n}": None if p.grad is None else p.grad.clone()
              for n, p in model.named_parameters()}
    return state


def assert_snapshot_equal(before: dict[str, object], after: dict[str, object]) -> None:
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if old is None:
            assert new is None, f"{key} was None and is now set"
        else:
            assert new is not None and torch.equal(new, old), f"{key} changed"


class ChainRegression(nn.Module):
    """An LSTM and the MSE of its outputs, the loss inside forward (planned with it)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(32, 64)
        self.register_buffer("target", torch.randn(steps, 16, 64), persistent=False)

    def forward(self, xs):
        return nn.functional.mse_loss(self.rnn(xs)[0], self.target)


def regression_at(fraction: float):
    """ChainRegression over 120 steps, its inputs, resident bytes, and a budget of the fixed
    bytes plus ``fraction`` of eager's measured activation bytes."""
    torch.manual_seed(0)
    model = ChainRegression(120)
    xs = torch.randn(120, 16, 32)
    resident = sum(t.untyped_storage().nbytes()
                   for t in (*model.parameters(), *model.buffers(), xs))
    fixed = resident + sum(p.numel() * 4 for p in model.parameters())
    eager = allocated_step(model, xs, resident)
    return model, xs, resident, fixed + int(fraction * (eager - fixed))


class LSTMCellLoop(nn.Module):
    """The issue's example: an nn.LSTMCell called in a Python loop."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(N_IN, N_H)
        self.head = nn.Linear(N_H, 4)

    def forward(self, xs):
        h = c = xs.new_zeros(xs.shape[1], N_H)
        outs = []
        for t in range(xs.shape[0]):
            h, c = self.cell(xs[t], (h, c))
            outs.append(h)
        return self.head(torch.stack(outs)).square().mean() + c.mean()


class GRUCellLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(N_IN, N_H)

    def forward(self, xs):
        h = torch.zeros(xs.shape[1], N_H)
        outs = []
        for x in xs.unbind(0):
            h = self.cell(x, h)
            outs.append(h)
        return torch.stack(outs).square().mean() + h.mean()


class LanguageModel(nn.Module):
    def __init__(self, rnn: nn.Module, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size, vocab)

    def forward(self, tokens, targets):
        y, _ = self.rnn(self.embed(tokens))
        return nn.functional.cross_entropy(self.head(y).flatten(0, 1), targets.flatten())


class BiRegression(nn.Module):
    """A two-layer bidirectional LSTM and a loss on its outputs and final states."""

    def __init__(self, steps: int, dropout: float) -> None:
        super().__init__()
        self.rnn = nn.LSTM(32, 64, num_layers=2, bidirectional=True, dropout=dropout)
        self.register_buffer("target", torch.randn(steps, 16, 128), persistent=False)

    def forward(self, xs):
        y, (h, c) = self.rnn(xs)
        return nn.functional.mse_loss(y, self.target) + h.square().mean() + c.square().mean()


class AutocastRegression(nn.Module):
    """An RNN under the caller's autocast, its outputs and final state in the loss."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 8)

    def forward(self, xs):
        y, h = self.rnn(xs)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(y).float().square().mean() + h.float().square().mean()


def relative_error(got, ref) -> float:
    return max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(got, ref))


class ReversibleRegression(nn.Module):
    """A reversible stack, a head and the MSE loss inside forward (planned with it)."""

    def __init__(self, kind: str, steps: int, batch: int = 8, cap: int | None = 3,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.rnn = REVERSIBLE[kind](12, 32, num_layers=2, batch_first=True, max_forget_bits=cap,
                                 dropout=dropout)
        self.head = nn.Linear(32, 5)
        self.register_buffer("target", torch.randn(batch, steps, 5), persistent=False)

    def forward(self, xs):
        out, _ = self.rnn(xs)
        return nn.functional.mse_loss(self.head(out), self.target)


class TinyLM(nn.Module):
    """The tests' one tiny language model: an embedding, a body (a GELU MLP, or a 2-layer
    LSTM: a recurrent chain), a head to the vocabulary and its loss, in the forms real
    language models write it.

    `form`: "cross_entropy" (mean or sum `reduction`, ignore_index -100), "nll_loss"
    (log_softmax then nll_loss) or "label_smoothing"; `returns_logits`: return
    (loss, logits), as HF models do; `dropout`: a Dropout inside the MLP body (None:
    none); `bias`: the head's."""

    def __init__(self, vocab: int = V, width: int = 32, *, body: str = "mlp",
                 hidden: int = 96, dropout: float | None = None, bias: bool = True,
                 form: str = "cross_entropy", reduction: str = "mean",
                 returns_logits: bool = False) -> None:
        super().__init__()
        self.vocab, self.recurrent = vocab, body == "lstm"
        self.form, self.reduction, self.returns_logits = form, reduction, returns_logits
        self.embed = nn.Embedding(vocab, width)
        if self.recurrent:
            self.body = nn.LSTM(width, hidden, num_layers=2)
        else:
            layers = [nn.Linear(width, hidden), nn.GELU()]
            layers += [nn.Dropout(dropout)] if dropout is not None else []
            self.body = nn.Sequential(*layers, nn.Linear(hidden, width))
        self.head = nn.Linear(hidden if self.recurrent else width, vocab, bias=bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
        h = self.body(self.embed(tokens))
        logits = self.head(h[0] if self.recurrent else h)
        flat = logits.float().view(-1, self.vocab)
        if self.form == "nll_loss":
            loss = F.nll_loss(F.log_softmax(flat, dim=-1), targets.view(-1),
                              reduction=self.reduction)
        elif self.form == "label_smoothing":
            loss = F.cross_entropy(flat, targets.view(-1), label_smoothing=0.1)
        else:
            loss = F.cross_entropy(flat, targets.view(-1), ignore_index=-100,
                                   reduction=self.reduction)
        return (loss, logits) if self.returns_logits else loss


#: The host link the offload tests plan with (memopt.offload)
OFFLOAD_LINK = memopt.Link(d2h_bytes_per_s=20e9, h2d_bytes_per_s=20e9)


def offload_rates(device: str = "cpu") -> tuple[str, tuple[Any, Any]]:
    """(key, value) of memopt.link's table of measured rates that pins what the planner
    reads for `device` to OFFLOAD_LINK and a fixed device rate, so that what a test
    offloads does not depend on this machine's timing."""
    import memopt.link  # noqa: PLC0415
    from memopt.passes.offload import ComputeModel  # noqa: PLC0415

    return memopt.link._key(torch.device(device)), (
        OFFLOAD_LINK, ComputeModel(flops_per_s=2e11, bytes_per_s=1e11))


def offload_everywhere(monkeypatch: Any, device: str = "cpu") -> list[Any]:
    """memopt.compile with offload on at OFFLOAD_LINK and pinned rates, the copies real and
    outside PyTorch's allocator (memopt.offload.CPU_HOST_COPIES), for the rest of the test;
    the list every compiled module is appended to."""
    import memopt.link  # noqa: PLC0415
    from memopt import offload as runtime  # noqa: PLC0415

    monkeypatch.setattr(runtime, "CPU_HOST_COPIES", True)
    monkeypatch.setitem(memopt.link._measured, *offload_rates(device))
    made: list[Any] = []
    original = memopt.compile

    def compile_with_offload(*args: Any, **kwargs: Any) -> Any:
        made.append(original(*args, offload=OFFLOAD_LINK, **kwargs))
        return made[-1]

    monkeypatch.setattr(memopt, "compile", compile_with_offload)
    return made


def minimum_that_holds(compile_one: Callable[[object], nn.Module],
                       step: Callable[[nn.Module], int], *, steps: int = 3,
                       attempts: int = 3, budget: object = 0.01
                       ) -> tuple[nn.Module, list[int], object]:
    """Compile with `budget`, pass back each minimum a refusal names (at the first call,
    or at a later step where a measurement raised it), until `steps` steps run: the
    module, each step's peak (`step(module)`) and the budget that ran."""
    for _ in range(attempts):
        compiled = compile_one(budget)
        try:
            return compiled, [step(compiled) for _ in range(steps)], budget
        except memopt.BudgetError as refused:
            budget = refused.minimum_bytes
    raise AssertionError(f"no minimum named held within {attempts} compiles")
