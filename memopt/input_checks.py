"""What memopt.compile and memopt.plan check in the user's input before anything is built
or run, and the typed errors that name the fix: options, wrappers that must go outside
memopt, a model on the meta device, inputs on another device or of another dtype than
the model."""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch
from torch import nn

from .backend import MemoptBackend
from .errors import InputError
from .passes._torch_compat import pytree


def input_mismatch(model: nn.Module, args: tuple, kwargs: dict,
                   err: BaseException) -> InputError | None:
    """After a failed call: an InputError when the tensor inputs sit on a device the model's
    parameters and buffers do not, or have a floating dtype they do not; else None.

    Only a failed call is diagnosed, so a model that moves or casts its inputs itself
    (`x.to(self.weight)`, CPU token ids for a CUDA embedding) runs as in eager. The
    original error is quoted in the message and kept as the InputError's `cause`."""
    state = [*model.parameters(), *model.buffers()]
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    first = (str(err).strip().splitlines() or [""])[0]
    failed = f"the call failed ({type(err).__name__}: {first})"
    model_devices = {str(t.device) for t in state}
    input_devices = {str(t.device) for t in inputs}
    if len(model_devices) == 1 and input_devices - model_devices:
        (device,) = model_devices
        fix = ("materialize the weights first: model.to_empty(device=...) and load or "
               "initialize them" if device == "meta" else f"move the inputs with "
               f".to({device!r}), or the model with model.to(...), before the call")
        return InputError(
            f"{failed}: the inputs are on {', '.join(sorted(input_devices))} but the model's "
            f"parameters and buffers are on {device}. memopt runs the step where the model "
            f"is: {fix}.", cause=err)
    model_dtypes = {t.dtype for t in state if t.is_floating_point()}
    input_dtypes = {t.dtype for t in inputs if t.is_floating_point()}
    if len(model_dtypes) == 1 and input_dtypes - model_dtypes:
        (dtype,) = model_dtypes
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in input_dtypes))
        short = str(dtype).replace("torch.", "")
        return InputError(
            f"{failed}: the floating-point inputs are {names} but the model's parameters and "
            f"buffers are {short}. Cast the inputs (x.to(torch.{short})) or the model "
            f"(model.to(<dtype>)) so that they agree; memopt plans each dtype separately, so "
            f"either works, as does casting inside forward.", cause=err)
    integer = {t.dtype for t in inputs if not t.is_floating_point() and not t.is_complex()
               and t.dtype != torch.bool}
    if len(model_dtypes) == 1 and integer and ("dtype" in first or "scalar type" in first):
        (dtype,) = model_dtypes  # an int64 tensor into a Linear: torch's bare error before
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in integer))
        short = str(dtype).replace("torch.", "")
        return InputError(
            f"{failed}: the inputs include {names} tensors, which the model's {short} layers "
            f"cannot compute with (integer tensors are indices, e.g. for an nn.Embedding). "
            f"Cast them (x.to(torch.{short})) before the call.", cause=err)
    return None


def warn_numpy(args: tuple, kwargs: dict) -> None:
    """Warn where an argument is a NumPy array: eager PyTorch's layers refuse one
    (TypeError), dynamo converts it silently, and memopt trained on a data pipeline's bug
    (found from outside). A forward that converts it itself is legal, so it runs."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return
    for name, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, numpy.ndarray):
            warnings.warn(
                f"argument {name!r} of the call is a numpy.ndarray, which dynamo converts to a "
                f"tensor; eager PyTorch's layers refuse one (TypeError). Convert it with "
                f"torch.from_numpy(...) before the call unless the forward converts it.",
                UserWarning, stacklevel=3)


def refuse_wrappers(model: nn.Module) -> None:
    """memopt compiles the model inside the data-parallel wrapper, not the wrapper: DDP's
    forward runs bucket and hook bookkeeping that is no part of a training graph; and a
    model whose HF gradient checkpointing is on would be recomputed twice."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel  # noqa: PLC0415

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        kind = type(model).__name__
        raise InputError(
            f"memopt.compile was given a {kind}: compile the model inside it and wrap the "
            f"result instead, {kind}(memopt.compile(model, budget=...)), so that {kind} "
            f"all-reduces the gradients memopt's backward produces. The budget then counts "
            f"one rank's step.")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise InputError(
            "the model has HF gradient checkpointing enabled; memopt plans recomputation "
            "itself, under its budget. Call model.gradient_checkpointing_disable() before "
            "memopt.compile.")


def refuse_sparse_gradients(model: nn.Module) -> None:
    """An nn.Embedding / nn.EmbeddingBag with ``sparse=True`` gives its weight a sparse
    gradient, which has no storage for a plan to count or share: the first step failed
    deep inside the step model (PassError over torch's NotImplementedError, found from
    outside). Refused by name before anything runs."""
    sparse = [name or type(m).__name__ for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise InputError(
            f"{', '.join(sparse)} has sparse=True: memopt plans dense gradients (a sparse "
            f"gradient has no storage to count or share). Construct it with sparse=False "
            f"(the default; dense optimizers such as AdamW need that anyway), or train it "
            f"without memopt.")


#: Options of MemoptBackend a user passes (the rest are memopt's own plumbing)
_INTERNAL_OPTIONS = {"self", "budget", "plan_only", "workspaces"}


def check_options(options: dict[str, Any], where: str, model: nn.Module) -> None:
    """TypeError naming an unknown option of memopt.compile / memopt.plan, and, where it
    is one of the model's forward arguments, how to pass it (a model's keyword inputs go
    in example_kwargs= for memopt.plan; memopt.compile takes them at the call)."""
    known = set(inspect.signature(MemoptBackend.__init__).parameters) - _INTERNAL_OPTIONS
    unknown = sorted(set(options) - known)
    if not unknown:
        return
    names = ", ".join(repr(k) for k in unknown)
    try:
        inputs = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        inputs = set()
    if where == "memopt.plan" and set(unknown) & inputs:
        raise TypeError(
            f"memopt.plan got {names}, which {'is' if len(unknown) == 1 else 'are'} the "
            f"model's forward argument{'s' if len(unknown) > 1 else ''}, not "
            f"{'an option' if len(unknown) == 1 else 'options'}: pass the model's keyword "
            f"inputs as example_kwargs=dict({unknown[0]}=...), its positional inputs "
            f"after the model")
    # besides MemoptBackend's: what each entry point takes itself; compile plans both
    # kinds of step, so existing_grads is memopt.plan's alone
    own = {"memopt.plan": {"optimizer"}, "memopt.compile": {"blocks", "fullgraph", "optimizer"}}
    valid = sorted((known | own[where]) - ({"existing_grads"} if where == "memopt.compile"
                                            else set()))
    raise TypeError(f"{where} got unknown option{'s' if len(unknown) > 1 else ''} {names}; "
                    f"its options are {', '.join(valid)}")


def refuse_meta(model: nn.Module) -> None:
    """memopt.compile runs the model, so its weights must exist (memopt.plan does not: it
    plans a meta model on meta inputs, e.g. benchmarks/chen_resnet.py)."""
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_meta]
    if meta:
        more = f" and {len(meta) - 1} more" if len(meta) > 1 else ""
        raise InputError(
            f"memopt.compile needs the model's weights in memory, but {meta[0]!r}{more} "
            f"{'is' if len(meta) == 1 else 'are'} on the meta device (shapes without data). "
            f"Materialize them first: model.to_empty(device='cpu' or 'cuda'), then load a "
            f"state_dict or initialize them, and compile that model. To plan a meta model "
            f"without weights, memopt.plan(model, *meta_inputs) works.")
