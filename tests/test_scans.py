"""A parallel (associative) scan in a training graph (passes.scans): transformers' Mamba
takes it under torch.compile by default, and its traced tree kept every level for backward
where eager's sequential loop keeps less (issue 28: 1.57x eager's peak at no budget). memopt
rewrites a tree it recognizes into the sequential loop and runs that as a chain; a tree it
does not (a reversed scan) is left as it is, and memopt warns once with the bytes the plan
saves of it. Eager's gradients either way."""

import copy
import warnings

import pytest
import torch
from torch import nn

import memopt

transformers = pytest.importorskip("transformers")


def _mamba(associative: bool, layers: int = 1):
    config = transformers.MambaConfig(vocab_size=100, hidden_size=32, state_size=8,
                                      num_hidden_layers=layers, expand=2, conv_kernel=4)
    if not hasattr(config, "use_associative_scan"):
        pytest.skip("this transformers' Mamba has no associative scan (transformers < 5)")
    config.use_associative_scan = associative
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config)


def _warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if "parallel (associative) scan" in str(w.message)]


@pytest.mark.parametrize("associative", [True, False], ids=["parallel_scan", "sequential"])
def test_mamba_runs_its_scan_as_a_chain_either_way(associative):
    """Both paths become the same chain, one per layer: no tree level saved, no warning, the
    same plan peak, eager's gradients (eager runs the sequential loop)."""
    model = _mamba(associative, layers=2)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 32))
    eager(input_ids=ids, labels=ids).loss.backward()
    compiled = memopt.compile(model)
    assert not _warnings_of(lambda: compiled(input_ids=ids, labels=ids).loss.backward())
    plan = compiled.memopt_plan
    assert [c.steps for c in plan.chains] == [31, 31] if associative else [32, 32], plan.chains
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # 11 s: plans the tree too; the benchmark's table shows it at 256 tokens
def test_the_parallel_path_plans_far_below_its_tree():
    """The tree's levels are gone from the plan: with no budget the parallel path's plan
    is within 30% of the sequential path's (1.17x here: it holds the scan's states whole for the
    matmul after it, which the loop does per step), and memopt's smallest budget for it is
    below half of what it was with the tree (measured on transformers' Mamba over 256
    tokens: 0.34x eager's peak, was 0.98x; docs/benchmarks/recurrent.md)."""
    ids = torch.randint(0, 100, (2, 64))
    kwargs = dict(input_ids=ids, labels=ids)
    peaks = [memopt.plan(_mamba(a), example_kwargs=kwargs).predicted_peak_bytes
             for a in (True, False)]
    assert peaks[0] <= 1.3 * peaks[1], peaks
    lowest = []
    for loops in (True, False):  # loops=False leaves the tree
        with pytest.raises(memopt.BudgetError) as err:
            memopt.plan(_mamba(True), example_kwargs=kwargs, budget=1, loops=loops)
        lowest.append(err.value.minimum_bytes)
    assert lowest[0] < 0.5 * lowest[1], lowest


class _CumulativeScan(nn.Module):
    """A user's associative scan (the generic combine mode dynamo traces inline): a gated
    cumulative sum ``h[t] = a[t] * h[t-1] + b[t]`` along dim 1, forward or reversed."""

    def __init__(self, reverse: bool) -> None:
        super().__init__()
        self.gate, self.value, self.reverse = nn.Linear(8, 8), nn.Linear(8, 8), reverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.associative_scan import associative_scan  # noqa: PLC0415

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        a, b = torch.sigmoid(self.gate(x)), self.value(x)
        _, h = associative_scan(combine, (a, b), dim=1, reverse=self.reverse,
                                combine_mode="generic")
        return h.square().mean()


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_a_users_scan_runs_as_a_chain_or_is_named(reverse):
    """A forward scan runs as a chain of its combine function; a reversed one is left as
    its tree and named once in a warning with its bytes. Eager's gradients either way."""
    torch.manual_seed(0)
    model, x = _CumulativeScan(reverse), torch.randn(2, 16, 8, requires_grad=True)
    ref = torch.autograd.grad(model(x), [x, *model.parameters()])
    compiled = memopt.compile(copy.deepcopy(model))
    got = []
    said = _warnings_of(lambda: got.extend(
        torch.autograd.grad(compiled(x), [x, *compiled.parameters()])))
    assert len(compiled.memopt_plan.chains) == (0 if reverse else 1)
    assert len(said) == (1 if reverse else 0), said
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("budget", [None, pytest.param(0.8, marks=pytest.mark.slow)])
def test_under_inductor_the_rewritten_scan_gives_eager_gradients(budget):
    """kernels="inductor" runs the graph with the rewritten scan, one chunk or split, and
    the gradients are eager's. (They were not until the chain's initial state counted as
    held by its forward op: the run saved the op's input h_0, the plan recomputed h_0 for
    the backward op, and inductor reused its buffer once the op had run; A_log's gradient
    came out 3x off on this Mamba.)"""
    model = _mamba(True)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 16))
    eager(input_ids=ids, labels=ids).loss.backward()
    compiled = memopt.compile(model, kernels="inductor", budget=budget)
    compiled(input_ids=ids, labels=ids).loss.backward()
    plan = compiled.memopt_plan
    assert plan.kernels == "inductor" and len(plan.chains) == 1, (plan.kernels, plan.chains)
    assert (plan.chains[0].t > 1) == (budget is not None), plan.chains
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("associative", [
    pytest.param(True, marks=pytest.mark.slow, id="parallel_scan"),  # 7 s; the same chain
    pytest.param(False, id="sequential")])
def test_under_bf16_autocast_the_scan_runs_as_a_chain(associative):
    """Under bf16 autocast the sequential scan starts from a bf16 zeros state its first
    step promotes to float32 (passes.initial_states casts it once before the loop): both
    paths run as chains, and the gradients are eager's under the same autocast (fp32
    tolerances: the scan runs in float32 either way), at a budget that splits them."""
    model = _mamba(associative, layers=2)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 32))
    with torch.autocast("cpu", torch.bfloat16):
        loss = eager(input_ids=ids, labels=ids).loss
    loss.backward()
    compiled = memopt.compile(model, budget=0.6)
    with torch.autocast("cpu", torch.bfloat16):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    chains = compiled.memopt_plan.chains
    assert len(chains) == 2 and any(c.t > 1 for c in chains), chains
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
