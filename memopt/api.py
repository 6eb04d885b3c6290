"""The public API: `memopt.compile` and `memopt.plan`.

    model = memopt.compile(model, budget="4GB")   # then train as usual
    plan = memopt.plan(model, x, budget="4GB")    # inspect without training

Both capture the model with torch.compile (dynamo, static shapes, one graph),
then AOTAutograd with memopt's partition function (memopt.backend). A compiled
module re-plans for every new input shape, dtype, device, train/eval mode and
autocast state (dynamo's guards), and caches each plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._torch_compat import FailOnRecompileLimitHit, recompile_limit, unwrap_backend_error
from .backend import MemoptBackend
from .errors import CaptureError, MemoptError
from .memory_plan import MemoryPlan
from .recurrent.modules import substitute_rnns

#: Sharing these dicts makes the compiled module hold the very same parameter
#: and buffer objects (and state_dict keys) as the user's model.
_SHARED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


class _PlanOnly(Exception):
    """Raised by the backend in plan-only mode, carrying the plan out of torch.compile."""

    def __init__(self, plan: MemoryPlan) -> None:
        super().__init__("plan ready")
        self.plan = plan


def _run_captured(fn: Any, args: tuple, kwargs: dict) -> Any:
    """Call a torch.compile'd function; surface memopt's own errors and name capture failures."""
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return fn(*args, **kwargs)
    except (MemoptError, _PlanOnly):
        raise
    except Exception as err:  # dynamo wraps backend errors; unwrap memopt's own
        inner = unwrap_backend_error(err)
        if isinstance(inner, (MemoptError, _PlanOnly)):
            raise inner from None
        if isinstance(err, FailOnRecompileLimitHit):
            raise CaptureError(
                f"memopt plans each input shape / dtype / train-eval mode separately and this "
                f"module has now seen more than torch._dynamo.config.recompile_limit = "
                f"{recompile_limit()} of them. Pad inputs to a few bucket sizes, or raise "
                f"that limit if every shape really needs its own plan."
            ) from err
        if isinstance(inner, RecursionError):
            raise CaptureError(
                "PyTorch hit Python's recursion limit while compiling this model's training "
                f"step ({inner}); very deep models (e.g. ResNets of ~1000 layers) need "
                "sys.setrecursionlimit(20000) or more before memopt.compile / memopt.plan"
            ) from err
        if type(err).__module__.startswith("torch._dynamo"):
            raise CaptureError(_capture_message(err)) from err
        raise


def _capture_message(err: BaseException) -> str:
    """The first line of dynamo's error and the innermost user-code line it points at."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    where = ""
    if "from user code:" in text:
        frames = [ln.strip() for ln in text.split("from user code:", 1)[1].splitlines()
                  if ln.strip().startswith("File ")]
        if frames:
            where = f" at {frames[-1]}"
    return (
        f"memopt could not capture the model as one training graph: {type(err).__name__}: "
        f"{first}{where}. memopt needs the forward to trace without graph breaks "
        "(no Python branches on tensor values, no .item()/.tolist(), no print or logging "
        "calls inside forward)."
    )


class CompiledModule(nn.Module):
    """The module `memopt.compile` returns.

    It shares its parameters, buffers and submodules with the model it wraps (the
    same tensor objects, the same `state_dict` keys), so an optimizer built on
    either trains both. `memopt_plan` is the plan of the graph that ran last.
    """

    def __init__(self, model: nn.Module, backend: MemoptBackend) -> None:
        super().__init__()
        for name in _SHARED_STATE:
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "_memopt_model", model)
        object.__setattr__(self, "_memopt_backend", backend)
        # nn.LSTM / nn.GRU / nn.RNN run as recurrent chains (memopt.recurrent): the traced
        # module tree is a shallow copy with those wrapped; the model is not modified.
        traced, pairs = substitute_rnns(model)
        object.__setattr__(self, "_memopt_pairs", pairs)
        compiled = torch.compile(traced, backend=backend, dynamic=False, fullgraph=True)
        object.__setattr__(self, "_memopt_compiled", compiled)
        self.training = model.training

    @property
    def memopt_plan(self) -> MemoryPlan | None:
        """The plan of the training graph that ran most recently (None before the first call)."""
        return self._memopt_backend.last_plan

    @property
    def memopt_plans(self) -> tuple[MemoryPlan, ...]:
        """Every plan made so far, one per captured shape / mode."""
        return tuple(self._memopt_backend.plans)

    @property
    def original_module(self) -> nn.Module:
        return self._memopt_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for original, copy in self._memopt_pairs:  # train()/eval() on the user's model
            copy.training = original.training
        return _run_captured(self._memopt_compiled, args, kwargs)

    def train(self, mode: bool = True) -> "CompiledModule":
        self._memopt_model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._memopt_model, name)

    def extra_repr(self) -> str:
        return f"memopt: {self._memopt_backend!r}"


def compile(model: nn.Module, budget: object = None, **options: Any) -> CompiledModule:
    """Compile `model` for training under a memory budget.

    Args:
        model: any nn.Module whose forward traces as one graph.
        budget: None (no limit: in-place and memory sharing only), "4GB", "4GiB",
            "512MB", an int of bytes, or a float fraction in (0, 1] of the
            unoptimized peak. It counts parameters, buffers, inputs, activations,
            temporaries and parameter gradients of one forward+backward step.
        options: `inplace=False` turns the in-place pass off; `mirror="all"` (or a
            set of forward node names) recomputes those nodes in backward instead of
            letting the budget search choose (an expert override, Chen Sec. 4.5);
            `headroom=0.06` is the fraction of the budget kept free for what the plan
            does not model (library workspaces, fragmentation); `loops=False` turns off
            the detection of cell loops (`for t in ...: h = self.cell(xs[t], h)`, the
            same parameters every step), which otherwise run as recurrent chains like
            `memopt.recurrent.Recurrent` (Gruslys et al. 2016, Sec. 3.1; see
            memopt.passes.loops for what is detected and what is left unrolled).

    Returns a module that trains in the user's loop and computes eager's gradients.
    Raises ValueError for a malformed budget, memopt.BudgetError (at the first
    call) when the budget is below what memopt can reach.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("this module is already compiled by memopt; pass its original_module")
    return CompiledModule(model, MemoptBackend(budget, **options))


def plan(model: nn.Module, *example_inputs: Any, budget: object = None,
         example_kwargs: dict[str, Any] | None = None, **options: Any) -> MemoryPlan:
    """Plan one training step of `model` on `example_inputs` without running it.

    Activations exist only as FakeTensors while planning; the model is not
    executed and no parameter, buffer or gradient changes.
    """
    if isinstance(model, CompiledModule):
        model = model.original_module
    backend = MemoptBackend(budget, plan_only=True, **options)
    traced, _ = substitute_rnns(model)
    compiled = torch.compile(traced, backend=backend, dynamic=False, fullgraph=True)
    try:
        _run_captured(compiled, example_inputs, example_kwargs or {})
    except _PlanOnly as ready:
        return ready.plan
    raise ValueError(
        "memopt.plan found no training graph: no parameter or input requires grad "
        "(or grad mode is disabled), so there is no backward pass to plan"
    )
