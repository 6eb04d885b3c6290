"""The compiled module keeps the model's interface.

`inspect.signature(compiled.forward)` is the model's (the HF Trainer filters dataset
columns by it); attributes and methods reach the model (`config`, `generate`,
`save_pretrained`); `state_dict` keys are the original's; HF gradient checkpointing is a
no-op with a warning on a memopt module, and refused when already on; logging calls inside
forward do not break the graph; wrappers that must go outside memopt are refused with the
fix named.
"""

from __future__ import annotations

import copy
import io
import inspect
import logging
import warnings

import pytest
import torch
import transformers  # noqa: F401  (installs logging.Logger.warning_once, as HF models use it)
from torch import nn

import memopt
from benchmarks.zoo import ZOO

log = logging.getLogger("memopt.tests.interface")


class Logs(nn.Module):
    """A model that logs and warns in forward (transformers' `warning_once` included)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        log.info("forward on %s", tuple(x.shape))
        h = torch.tanh(self.a(x))
        log.warning("hidden ready")
        warnings.warn("a user warning inside forward")
        log.warning_once("once")
        return self.b(h) * scale


def _llama():
    case = ZOO["llama"]()
    return case, memopt.compile(case.model, budget=0.9)


def test_forward_has_the_models_signature() -> None:
    model = Logs()
    compiled = memopt.compile(model)
    assert inspect.signature(compiled.forward) == inspect.signature(model.forward)
    assert compiled.forward.__doc__ == model.forward.__doc__
    case, compiled = _llama()
    assert inspect.signature(compiled.forward) == inspect.signature(case.model.forward)
    assert "input_ids" in inspect.signature(compiled.forward).parameters


def test_logging_inside_forward_is_one_graph_with_eager_gradients() -> None:
    torch.manual_seed(0)
    eager = Logs()
    model = copy.deepcopy(eager)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = memopt.compile(model)  # fullgraph: a break would raise CaptureError
        compiled(x, scale=2.0).sum().backward()
        eager(x, scale=2.0).sum().backward()
    assert len(compiled.memopt_plans) == 1
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_logging_methods_installed_after_a_first_step_are_ignored_too(monkeypatch) -> None:
    """transformers installs `Logger.warning_once` when it is imported, which can come
    after memopt's first step: the ignored functions were kept from that step, and a
    model that called warning_once then broke dynamo's graph (a test order found it)."""
    from memopt.passes._torch_compat import ignored_logging_config  # noqa: PLC0415

    once = logging.Logger.warning_once
    monkeypatch.delattr(logging.Logger, "warning_once")
    key = next(iter(ignored_logging_config()))
    assert once not in ignored_logging_config()[key]
    monkeypatch.setattr(logging.Logger, "warning_once", once, raising=False)
    assert once in ignored_logging_config()[key]


def test_the_metrics_loggers_sort_error_from_memopts_patch_is_dropped() -> None:
    """torch 2.11's compilation-metrics logger cannot sort memopt's set of ignored logging
    functions and logged the TypeError at every compile: after a memopt step that record
    is dropped, and any other record of that logger still shows."""
    compiled = memopt.compile(Logs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(torch.randn(4, 8), scale=2.0).sum().backward()
    metrics = logging.getLogger("torch._dynamo.metrics_context")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # torch's loggers do not propagate to pytest's caplog
    metrics.addHandler(handler)
    try:
        for error in (TypeError("'<' not supported between instances of 'function' and "
                                "'function'"), RuntimeError("another failure")):
            try:
                raise error
            except Exception:
                metrics.exception("Unexpected exception logging compilation metrics")
    finally:
        metrics.removeHandler(handler)
    assert [r.exc_info[1] for r in seen] == [error], seen


def test_attributes_methods_and_state_dict_reach_the_model(tmp_path) -> None:
    case, compiled = _llama()
    assert compiled.config is case.model.config
    assert list(compiled.state_dict()) == list(case.model.state_dict())
    case.run_step(compiled)  # trains compiled
    compiled.eval()
    with torch.no_grad():
        generated = compiled.generate(case.kwargs["input_ids"][:1, :8], max_new_tokens=3,
                                      do_sample=False)
        assert generated.shape == (1, 11)
        out = compiled(input_ids=case.kwargs["input_ids"])  # eval forward, no_grad
        assert out.logits.shape[-1] == case.model.config.vocab_size
    compiled.train()
    compiled.save_pretrained(tmp_path)
    reloaded = type(case.model).from_pretrained(tmp_path)
    for (name, p), q in zip(case.model.state_dict().items(), reloaded.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name)


class Tempered(nn.Module):
    """Logits over a plain attribute its forward reads, through an LSTM (which memopt runs
    from a copy of the modules around it) or a linear layer."""

    def __init__(self, rnn: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.LSTM(8, 8, batch_first=True) if rnn else None
        self.head = nn.Linear(8, 4)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rnn is not None:
            x = self.rnn(x)[0]
        return self.head(x) / self.temperature


@pytest.mark.parametrize("rnn", [False, True], ids=["linear", "lstm"])
def test_an_attribute_set_on_the_compiled_module_reaches_its_forward(rnn: bool) -> None:
    """``compiled.temperature = 4.0`` sets it on the model, as on torch.compile's module,
    and so does setting it on the model itself: the next step computes eager's outputs
    and gradients. Kept on the wrapper, the forward read the old value, silently (found
    from outside); with an LSTM, the copy memopt runs read the old value either way."""
    model = Tempered(rnn)
    eager = copy.deepcopy(model)
    compiled = memopt.compile(model, budget=None)
    x = torch.randn(2, 5, 8)
    compiled(x).sum().backward()
    for target in (compiled, model):
        target.temperature *= 4.0
        eager.temperature *= 4.0
        assert compiled.temperature == model.temperature == eager.temperature
        for m in (compiled, eager):
            for p in m.parameters():
                p.grad = None
        out, want = compiled(x), eager(x)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        for p, q in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    compiled.extra = "kept"
    assert model.extra == "kept"
    del compiled.extra
    assert not hasattr(model, "extra")


def test_a_container_model_is_indexed_measured_and_iterated_as_the_model() -> None:
    """compiled[0], len(compiled) and list(compiled) reach an nn.Sequential's submodules
    (they raised TypeError, found from outside); a model that is no container is still
    true, and len() of it raises the model's own TypeError."""
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = memopt.compile(seq)
    assert compiled[0] is seq[0] and len(compiled) == 2 and list(compiled) == list(seq)
    assert isinstance(compiled[1:], nn.Sequential)
    single = memopt.compile(nn.Linear(4, 4))
    assert bool(single)
    with pytest.raises(TypeError, match="Linear"):
        len(single)


def test_gradient_checkpointing_enable_is_a_no_op_with_a_warning() -> None:
    case, compiled = _llama()
    with pytest.warns(UserWarning):
        compiled.gradient_checkpointing_enable()
    assert not any(getattr(m, "gradient_checkpointing", False) is True
                   for m in case.model.modules())
    case.run_step(compiled)
    assert compiled.memopt_plan is not None


def test_a_model_with_checkpointing_on_is_refused() -> None:
    case = ZOO["llama"]()
    case.model.gradient_checkpointing_enable()
    with pytest.raises(memopt.InputError):
        memopt.compile(case.model)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in case.model.modules())


def test_data_parallel_is_refused_naming_the_order() -> None:
    model = Logs()
    with pytest.raises(memopt.InputError):
        memopt.compile(nn.DataParallel(model))
    # the order that works
    compiled = memopt.compile(model)
    wrapped = nn.DataParallel(compiled)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped(x).sum().backward()
    assert compiled.memopt_plan is not None


class _Net(nn.Module):
    """Two repeated blocks with dropout and a head (blocks=True finds them)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.1),
                                                  nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


@pytest.mark.parametrize("blocks", [False, True])
def test_a_deep_copy_is_the_model_copied_and_compiled_again(blocks: bool) -> None:
    """copy.deepcopy of a memopt module ran the original's parameters (before a step:
    the gradients went to the original's .grad, the copy's stayed None) or raised from
    deep inside torch (after one: the compiled graphs' FakeTensors). Now the copy is the
    model deep-copied and compiled with the same budget and options."""
    torch.manual_seed(0)
    eager = _Net()
    x = torch.randn(1024, 32)
    # with blocks a fraction of 0.98 is out of reach (refused at the first step)
    budget = 1_000_000 if blocks else 0.98
    compiled = memopt.compile(copy.deepcopy(eager), budget=budget, blocks=blocks)
    before = copy.deepcopy(compiled)
    torch.manual_seed(1)
    compiled(x).backward()
    after = copy.deepcopy(compiled)
    for module in (before, after):
        assert isinstance(module, type(compiled)) and module is not compiled
        assert module._memopt_backend.budget == compiled._memopt_backend.budget
        reference = copy.deepcopy(eager)
        for m in (module, reference):
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(1)
            m(x).backward()
        for (name, p), q in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            assert all(p is not r for r in compiled.parameters())
        assert module.memopt_plan is not None and module.memopt_plan is not compiled.memopt_plan
        hooks = [len(b._forward_pre_hooks) for b in module.original_module.blocks]
        assert hooks == [int(blocks)] * 2  # the copied boundaries, not marked twice
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    with pytest.raises(memopt.InputError, match="optimizer"):
        copy.deepcopy(memopt.compile(eager, optimizer=optimizer))
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(compiled, io.BytesIO())
    assert copy.copy(compiled).original_module is compiled.original_module  # shallow: shared
