"""The public API: `memopt.compile` and `memopt.plan`.

    model = memopt.compile(model, budget="4GB")   # then train as usual
    plan = memopt.plan(model, x, budget="4GB")    # inspect without training

Both capture the model with torch.compile (dynamo, static shapes, one graph),
then AOTAutograd with memopt's partition function (memopt.backend). A compiled
module re-plans for every new input shape, dtype, device, train/eval mode and
autocast state (dynamo's guards), and caches each plan.

Bad input is refused with a typed error (memopt.errors) that names the fix, before the
user's model changes: a malformed budget (BudgetFormatError, at once), weights on the
meta device (InputError, in `compile`), inputs on another device or of another floating
dtype than the parameters (InputError, at the call), a budget below reach (BudgetError,
at the first call). See README.md, "Bad input".
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn

from memopt.passes._torch_compat import pytree
from . import caller_loss
from .backend import MemoptBackend
from .blocks import find_blocks, loop_codes, mark_blocks
from .capture import run_captured
from .compiled_graph import PlanOnly
from .ddp import buckets_of
from .errors import InputError, MemoptError
from .first_call import FirstCall
from .fsdp import fsdp_sharded_params, fsdp_unit, refuse_fsdp, refuse_sharded_inside
from .fsdp_blocks import block_shards, check_sharded_blocks, fsdp_units
from .input_checks import (check_options, refuse_meta, refuse_sparse_gradients,
                           refuse_wrappers, warn_numpy)
from .memory_plan import MemoryPlan, StepPlan
from .optimizer import check_after_first_step, check_optimizer, optimizer_bytes
from .pending import PendingBackwards
from .plan_blocks import check_meta, plan_blocks
from .recurrent.modules import RNNSubstitution
from .settled import ModelTensors

#: Sharing these dicts makes the compiled module hold the very same parameter
#: and buffer objects (and state_dict keys) as the user's model.
_SHARED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
#: what CompiledModule keeps on itself rather than on the model (`__setattr__`)
_OWN_ATTRIBUTES = frozenset({"training", "forward"})


class CompiledModule(nn.Module):
    """The module `memopt.compile` returns.

    It shares its parameters, buffers and submodules with the model it wraps (the
    same tensor objects, the same `state_dict` keys), so an optimizer built on
    either trains both. `memopt_plan` is the plan of the graph that ran last.

    It keeps the model's interface: `forward` has the model's signature (what
    `inspect.signature` and the HF Trainer's column filter read) and docstring, and any
    attribute or method it does not define itself reaches the model (`config`,
    `generate`, `save_pretrained`, ...; those methods run the model as it is, eagerly), and
    so do `len`, indexing and iteration of a container model (`compiled[0]`).
    `gradient_checkpointing_enable()` does nothing but warn: memopt plans recomputation.
    """

    def __init__(self, model: nn.Module, backend: MemoptBackend, fullgraph: bool = False,
                 blocks: bool = False) -> None:
        super().__init__()
        for name in _SHARED_STATE:
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "_memopt_model", model)
        object.__setattr__(self, "_memopt_backend", backend)
        # nn.LSTM / nn.GRU / nn.RNN run as recurrent chains (memopt.recurrent): the traced
        # module tree is a shallow copy with those wrapped; the model is not modified.
        rnns = RNNSubstitution(model, packed_as_called=backend.budget is None)
        traced = rnns.tree
        object.__setattr__(self, "_memopt_rnns", rnns)
        object.__setattr__(self, "_memopt_traced", traced)
        object.__setattr__(self, "_memopt_fullgraph", fullgraph)
        object.__setattr__(self, "_memopt_fsdp", None)  # FsdpRecord under fully_shard
        # calls whose backward has not run: two before one backward are not planned
        object.__setattr__(self, "_memopt_pending", PendingBackwards())
        # blocks=True: each repeated block its own graph, captured and planned once
        groups = find_blocks(traced) if blocks else []
        object.__setattr__(self, "_memopt_blocks", groups)
        object.__setattr__(self, "_memopt_block_hooks", mark_blocks(groups))
        object.__setattr__(self, "_memopt_loops", loop_codes(traced, groups))
        # its parameters and buffers, listed again only when the module tree changes
        object.__setattr__(self, "_memopt_tensors", ModelTensors(model))
        # a graph of this code that returns is the whole forward (memopt.steps)
        backend.plan_log.set_forward(traced.forward)
        # One compiled step per gradient state (memopt.grads): .grad absent, or kept from
        # earlier steps (gradient accumulation), which is planned with those tensors
        # resident and adds the new gradients into them in place. Built when first needed.
        object.__setattr__(self, "_memopt_compiled",
                           {False: _compile_step(traced, backend, fullgraph)})
        object.__setattr__(self, "forward", _forward_with_signature(self, model))
        self.training = model.training

    @property
    def memopt_plan(self) -> MemoryPlan | StepPlan | None:
        """The plan of the training step that ran most recently (None before the first
        call): a MemoryPlan, or a StepPlan of one MemoryPlan per graph when dynamo split
        the forward at graph breaks. Under `fully_shard` each MemoryPlan's `fsdp` reports
        the FSDP2 unit (memopt.fsdp)."""
        return _with_fsdp(self._memopt_backend.step_plan(), self.__dict__["_memopt_fsdp"])

    @property
    def memopt_plans(self) -> tuple[MemoryPlan, ...]:
        """Every plan made so far, one per captured shape / mode."""
        return tuple(self._memopt_backend.plans)

    @property
    def original_module(self) -> nn.Module:
        return self._memopt_model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        caller_loss.stop()  # the caller's code since the last forward is over
        warn_numpy(args, kwargs)
        self._memopt_rnns.sync()  # train()/eval(), replaced modules: the user's model
        backend, model = self._memopt_backend, self._memopt_model
        backend.plan_log.raise_pending()  # a re-plan after graph breaks did not fit
        tensors, grads, pending = self._memopt_tensors, None, (0, [])
        hooked = 0
        if torch.is_grad_enabled():  # a training step: its parameters' state, cheaply
            tensors.refresh()
            grads = tensors.grad_state()
            pending = self._memopt_pending.check()
            hooked = tensors.hooked_grad_bytes()
            if hooked and backend.budget is not None \
                    and not self.__dict__.get("_memopt_hooks_said"):
                self.__dict__["_memopt_hooks_said"] = True  # once per module
                warnings.warn(HOOKED_GRADIENTS, UserWarning, stacklevel=2)
        existing = grads is not None and _has_grads(grads)
        compiled = self._memopt_compiled.get(existing)
        if compiled is None:
            compiled = _compile_step(self._memopt_traced, backend.with_existing_grads(),
                                     self._memopt_fullgraph)
            self._memopt_compiled[existing] = compiled
        unit = fsdp_unit(self)  # fully_shard(memopt.compile(model)): what FSDP holds
        if unit is not None:
            refuse_sharded_inside(self, model)
            if backend.optimizer_source is not None and backend.optimizer is None:
                _check_sharded_optimizer(backend.optimizer_source, fsdp_sharded_params(self))
            self.__dict__["_memopt_fsdp"] = unit.record
        if grads is not None and backend.optimizer_source is not None:
            if backend.optimizer is None:
                _count_optimizer(backend, model)
            backend.optimizer_grew()
        shards = block_shards(model, self._memopt_blocks)
        # FSDP2 swaps its shards in and out itself (counted in unit.held and shards)
        held = unit.held if unit else () if shards is not None else tensors.displaced()
        backend.forward_begins(tensors, grads, args, kwargs, ddp=buckets_of(self, model),
                               held=held,
                               after_backward=(unit.after_backward if unit else 0) + hooked,
                               shards=shards, pending=pending)
        first = FirstCall(model) if grads is not None and backend.budget is not None \
            and not backend.plan_log.traced else None  # put back where it is refused
        try:
            out = run_captured(compiled, args, kwargs, backend, model,
                                bool(self._memopt_blocks), self._memopt_loops)
        except BaseException as err:
            backend.forward_aborted()
            if first is not None and isinstance(err, MemoptError):
                first.restore()
            raise
        try:
            backend.forward_ends(out)
        except MemoptError:
            if first is not None:
                first.restore()
            raise
        if grads is not None:
            self._memopt_pending.watch(out, (args, kwargs))
            backend.forward_returned()
        return out

    def __deepcopy__(self, memo: dict) -> "CompiledModule":
        """`copy.deepcopy`: the model deep-copied and compiled anew with the same budget
        and options; its graphs and plans are made at its first call (the compiled steps
        hold the original's tensors). Refused for a module compiled with `optimizer=`,
        whose optimizer steps the original's parameters."""
        budget, options = self.__dict__["_memopt_compile_args"]
        if options.get("optimizer") is not None:
            raise InputError(
                "a memopt module compiled with optimizer= cannot be deep-copied: the "
                "optimizer steps the original's parameters. Deep-copy original_module, make "
                "an optimizer for the copy, and memopt.compile the copy with it")
        copied = compile(copy.deepcopy(self._memopt_model, memo), budget, **options)
        memo[id(self)] = copied
        return copied

    def __copy__(self) -> "CompiledModule":
        """`copy.copy`: a module sharing everything with this one, as for any module."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a memopt module cannot be pickled (its compiled graphs are code): save "
            "original_module, or its state_dict(), and memopt.compile the model again after "
            "loading it")

    def train(self, mode: bool = True) -> "CompiledModule":
        self._memopt_model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._memopt_model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute set on the compiled module is set on the model, which its forward
        reads (``compiled.temperature = 2.0``), as ``torch.compile``'s module does; kept
        on the wrapper, the forward went on reading the model's old value, silently
        (found from outside). Its own (``training``, ``_memopt_*``, what its class
        defines) stay here."""
        if name in _OWN_ATTRIBUTES or name.startswith("_memopt_") or hasattr(type(self), name):
            super().__setattr__(name, value)
        else:
            setattr(self._memopt_model, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN_ATTRIBUTES or name.startswith("_memopt_") or hasattr(type(self), name) \
                or name in self.__dict__:
            super().__delattr__(name)
        else:
            delattr(self._memopt_model, name)

    # A container model (nn.Sequential, nn.ModuleList) stays one: indexing, length and
    # iteration reach its submodules, which run eagerly, as its other methods do.
    def __bool__(self) -> bool:  # truth is not the length (a model without one is true)
        return True

    def __len__(self) -> int:
        return len(self._memopt_model)

    def __getitem__(self, index: Any) -> Any:
        return self._memopt_model[index]

    def __iter__(self) -> Any:
        return iter(self._memopt_model)

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """A no-op with a warning: memopt chooses what to recompute under the budget
        (HF gradient checkpointing would recompute every layer on top of it)."""
        warnings.warn(
            "gradient_checkpointing_enable() does nothing on a memopt module: memopt plans "
            "recomputation itself, under its budget (lower the budget to recompute more)",
            UserWarning, stacklevel=2)

    def extra_repr(self) -> str:
        return f"memopt: {self._memopt_backend!r}"


#: said once per module whose parameters have tensor hooks, under a budget
HOOKED_GRADIENTS = (
    "memopt: parameters of this module have gradient hooks (Tensor.register_hook). Their "
    "gradients go back to autograd, which runs each hook as the backward ends; the plan "
    "holds one new gradient of the largest hooked parameter for what a hook returns. "
    "What a hook allocates beyond that (random noise, clones kept in a list) is not "
    "counted, and the step can exceed the budget by it.")


def _with_fsdp(plan: MemoryPlan | StepPlan | None,
               record: Any) -> MemoryPlan | StepPlan | None:
    """`plan` with its FSDP2 record set (every graph's, for a StepPlan)."""
    if plan is None or record is None:
        return plan
    if isinstance(plan, StepPlan):
        return plan.model_copy(update={"graphs": tuple(
            g.model_copy(update={"fsdp": record}) for g in plan.graphs)})
    return plan.model_copy(update={"fsdp": record})


def _forward_with_signature(compiled: CompiledModule, model: nn.Module) -> Any:
    """`compiled`'s forward as an instance attribute that carries the model's forward's
    name, docstring and signature (`__wrapped__`, which `inspect.signature` follows)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return CompiledModule.forward(compiled, *args, **kwargs)

    return functools.update_wrapper(forward, model.forward)


def _compile_step(traced: nn.Module, backend: Any, fullgraph: bool) -> Any:
    return torch.compile(traced, backend=backend, dynamic=False, fullgraph=fullgraph)


def _has_grads(grad_state: list[int]) -> bool:
    """Whether any trainable parameter holds a `.grad` (kept from an earlier step), from
    the parameters' ModelTensors.grad_state()."""
    return 3 in grad_state


def _training_device(model: nn.Module) -> torch.device:
    """The device of the model's trainable parameters (the CPU when it has none)."""
    return next((p.device for p in model.parameters() if p.requires_grad), torch.device("cpu"))


def _check_sharded_optimizer(optimizer: torch.optim.Optimizer, sharded: list | None) -> None:
    """Under fully_shard the optimizer must step FSDP2's sharded parameters (DTensors,
    `sharded`), which replace the ones the model had when it was compiled."""
    own = {id(p) for p in sharded or ()}
    if sharded and any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise InputError(
            "the optimizer given to memopt (optimizer= or count_optimizer) steps parameters "
            "fully_shard has since replaced by its sharded ones: build the optimizer after "
            "fully_shard, on sharded.parameters(), and count it with "
            "memopt.api.count_optimizer(sharded, optimizer) before the first step")


def _count_optimizer(backend: MemoptBackend, model: nn.Module) -> None:
    """The optimizer's state and step bytes, for the budget (memopt.optimizer), on the
    device of the model's parameters; checked against its real state after its first
    step when they were predicted."""
    source = backend.optimizer_source
    device = _training_device(model)
    backend.optimizer = optimizer_bytes(source, device)
    if backend.optimizer.predicted and device.type != "meta":
        check_after_first_step(source, backend.optimizer, device)


def count_optimizer(compiled: CompiledModule, optimizer: torch.optim.Optimizer) -> None:
    """Count `optimizer`'s state and step in `compiled`'s budget from its first training
    step on, as `memopt.compile(..., optimizer=optimizer)` does: for an optimizer made
    after the module (the HF Trainer's). Raises InputError when it is no optimizer of the
    module's parameters, or when the module has already planned its steps for less than
    this optimizer holds (a new optimizer holding no more than the one counted, as a
    second `trainer.train()` makes, replaces it: the plans stay valid)."""
    if not isinstance(compiled, CompiledModule):
        raise TypeError(f"count_optimizer expects a memopt module, got "
                        f"{type(compiled).__name__}")
    backend = compiled._memopt_backend
    if backend.optimizer_source is optimizer:
        return
    check_optimizer(optimizer, compiled.original_module)
    if backend.plans:
        counted = backend.optimizer
        new = optimizer_bytes(optimizer, _training_device(compiled.original_module))
        if counted is None or new.state_bytes > counted.state_bytes \
                or new.step_bytes > counted.step_bytes:
            raise InputError(
                "count_optimizer must be called before the module's first training step: its "
                "plans were made without this optimizer (or with one holding less). Pass it "
                "as memopt.compile(..., optimizer=...) or count it before training.")
        backend.optimizer_source = optimizer  # the plans count at least as much
        return
    backend.optimizer_source, backend.optimizer = optimizer, None


def compile(model: nn.Module, budget: object = None, **options: Any) -> CompiledModule:
    """Compile `model` for training under a memory budget.

    Args:
        model: any nn.Module whose forward traces as one graph.
        budget: None (no limit: in-place and memory sharing only; with
            `kernels="inductor"`, also the pointwise values fused kernels recompute
            free, memopt.planner.fusible), "4GB", "4GiB",
            "512MB", an int of bytes, or a float fraction in (0, 1] of the
            unoptimized peak. It counts parameters, buffers, inputs, activations,
            temporaries and parameter gradients of one forward+backward step, and with
            `optimizer=` the optimizer's state and step too.
        options: `inplace=False` turns the in-place pass off; `mirror="all"` (or a
            set of forward node names) recomputes those nodes in backward instead of
            letting the budget search choose (an expert override, Chen Sec. 4.5);
            `headroom` is the fraction of any budget kept free for what the plan does
            not model (default: the worst measured prediction error on the device,
            memopt.budget.HEADROOM: 1.5% on CPU, 3% on CUDA); `loops=False` turns off
            the detection of cell loops (`for t in ...: h = self.cell(xs[t], h)`, the
            same parameters every step), which otherwise run as recurrent chains like
            `memopt.recurrent.Recurrent` (Gruslys et al. 2016, Sec. 3.1; see
            memopt.passes.cell_loops for what is detected and what is left unrolled);
            `progress=False` hides the progress bar a plan longer than 2 s shows on a
            terminal; `solver="milp"` also solves the exact recomputation MILP
            (Checkmate-style, HiGHS: `pip install "memopt[solver]"`; memopt.oracle) and
            takes its plan where it recomputes less, for graphs small enough to solve
            within `solver_seconds` (default 30 s per solve); `drop_outputs=True` says
            the loop keeps only the scalar loss and drops the other outputs before
            backward (`model(**batch).loss.backward()`, the HF Trainer): the plan then
            frees them (a language model's logits) as the forward ends, and memopt warns
            at any backward where one is still alive (for a model that is one graph);
            `skip_logits=True` says the loop never reads the logits in training: a
            language-model head whose loss the model computes and whose logits it only
            returns then never forms them (a memoryless memopt.markers.SkippedLogits is
            returned in their place, raising when read; no_grad calls return real ones);
            `kernels="inductor"` has TorchInductor generate the kernels of the planned
            graphs instead of running them op by op (`"aten"`, the default; see
            memopt.kernels and docs/kernels.md); `optimizer=opt` (the
            torch.optim.Optimizer the loop steps, over the model's parameters) puts its
            state, held through the step, and what its `step()` allocates in the
            budget (memopt.optimizer; predicted before its first step, then checked);
            with it, where the budget cannot be met otherwise, the optimizer steps each
            parameter inside the backward as its gradient completes and frees the
            gradient (memopt.stepper; `step_in_backward=True` always, `False` never;
            loops that read gradients after backward, such as accumulation, clipping
            or GradScaler, then raise memopt.stepper.GradientConsumedError);
            `blocks=True` runs each of the model's repeated blocks (the layers of a
            transformer: memopt.blocks.find_blocks) as its own graph, captured once for all
            of them and planned under the step's budget with the earlier blocks' saved
            tensors held around the later ones (memopt.blocks); with it the blocks and the
            root may be FSDP2 units (`fully_shard` on each, before memopt.compile:
            memopt.fsdp_blocks); `reserved=True` makes the budget bound the bytes CUDA's
            caching allocator would reserve for the step too (its segments, as
            memopt.allocator.caching models them: plan.cuda_reserved_bytes()), not
            only the allocated peak, recomputing more where the segments need it;
            `offload` copies saved values to host memory between their forward and
            backward reads where that is faster than recomputing them (None, the
            default: on CUDA with kernels="aten", off elsewhere; True; False; or a
            memopt.Link to plan with; memopt.offload and docs/offload.md);
            `watch_loss` (default True) has the plan hold a loss the caller computes
            from the outputs: assumed at the first step (three float32 tensors of the
            largest output's size, none where forward returns a scalar that requires
            grad), then measured through saved-tensor hooks pushed as the forward
            returns and popped at the next call (memopt.caller_loss); `False` turns
            both off (`torch.func.grad`, `vjp` and `jacrev` refuse to run under such
            hooks).

    Returns a module that trains in the user's loop and computes eager's gradients; a
    call with nothing to differentiate (no_grad, no parameter or input requiring grad, or
    a forward returning no tensor) runs the forward as eager does, with no plan.
    Raises memopt.BudgetFormatError (a ValueError) for a malformed budget and
    memopt.InputError (a ValueError) for a model whose parameters or buffers are on the
    meta device, both at once; memopt.BudgetError at the first call when the budget is
    below what memopt can reach, and memopt.InputError at a call whose inputs are on
    another device, or of another floating dtype, than the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"memopt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("this module is already compiled by memopt; pass its original_module")
    if "existing_grads" in options:
        raise TypeError("memopt.compile plans the steps with and without existing .grad "
                        "tensors by itself; existing_grads is an option of memopt.plan")
    fullgraph = options.pop("fullgraph", False)
    if not isinstance(fullgraph, bool):
        raise ValueError(f"fullgraph must be True or False, got {fullgraph!r}")
    blocks = options.pop("blocks", False)
    if not isinstance(blocks, bool):
        raise ValueError(f"blocks must be True or False, got {blocks!r}")
    if blocks and fullgraph:
        raise ValueError("blocks=True runs each repeated block as its own graph, which "
                         "fullgraph=True forbids: pass one of them")
    optimizer = options.pop("optimizer", None)
    check_options(options, "memopt.compile", model)
    backend = MemoptBackend(budget, **options)  # parses the budget: nothing built before it
    if backend.step_in_backward and optimizer is None:
        raise InputError("step_in_backward=True steps the optimizer inside the backward: "
                         "pass the optimizer the loop steps as optimizer=")
    if optimizer is not None:
        check_optimizer(optimizer, model)
        backend.optimizer_source = optimizer
    refuse_meta(model)
    refuse_wrappers(model)
    refuse_sparse_gradients(model)
    if blocks and fsdp_units(model):  # FSDP2 per block (memopt.fsdp_blocks)
        check_sharded_blocks(model, find_blocks(model))
    else:
        refuse_fsdp(model, "memopt.compile")
    compiled = CompiledModule(model, backend, fullgraph, blocks)
    object.__setattr__(compiled, "_memopt_compile_args", (budget, {
        **options, "fullgraph": fullgraph, "blocks": blocks, "optimizer": optimizer}))
    return compiled


def plan(model: nn.Module, *example_inputs: Any, budget: object = None,
         example_kwargs: dict[str, Any] | None = None, **options: Any
         ) -> MemoryPlan | StepPlan:
    """Plan one training step of `model` on `example_inputs` without running it.

    Activations exist only as FakeTensors while planning; the model is not
    executed and no parameter, buffer or gradient changes. `existing_grads=True`
    plans a step that finds every trainable parameter's `.grad` already allocated
    (gradient accumulation; memopt.compile plans both kinds of step as it meets them).
    A model on the meta device plans on meta inputs. Raises memopt.InputError when
    there is no backward to plan, or the inputs do not match the model's device or dtype.
    `optimizer=opt` counts the optimizer's state and step in the plan (memopt.compile).
    `blocks=True` (a model and inputs on the meta device) gives the plan of
    memopt.compile(model, blocks=True), a StepPlan of the block graphs: the forward runs
    on shapes alone, which the loop over the blocks needs (memopt.plan_blocks).
    """
    if isinstance(model, CompiledModule):
        model = model.original_module
    blocks = options.pop("blocks", False)
    if not isinstance(blocks, bool):
        raise ValueError(f"blocks must be True or False, got {blocks!r}")
    optimizer = options.pop("optimizer", None)
    check_options(options, "memopt.plan", model)
    if blocks:
        return _plan_with_blocks(model, example_inputs, example_kwargs or {}, budget,
                                 optimizer, options)
    backend = MemoptBackend(budget, plan_only=True, **options)
    refuse_fsdp(model, "memopt.plan")
    if optimizer is not None:
        check_optimizer(optimizer, model)
        backend.optimizer_source = optimizer
        _count_optimizer(backend, model)
    traced = RNNSubstitution(model, packed_as_called=backend.budget is None).tree
    backend.plan_log.set_forward(traced.forward)
    tensors = ModelTensors(model)
    if not backend.existing_grads and not _has_grads(tensors.grad_state()):
        # what the step holds outside its graph (buffers and parameters it does not take)
        # counted as memopt.compile counts it, so that the budget a plan names is one the
        # compiled step accepts (a Llama's rotary inv_freq: 136 bytes refused)
        backend.forward_begins(tensors, tensors.grad_state(), example_inputs,
                               example_kwargs or {})
    kwargs = _without_meta_cache(model, example_inputs, example_kwargs or {})
    compiled = _compile_step(traced, _never_run(backend), fullgraph=True)
    try:
        run_captured(compiled, example_inputs, kwargs, backend, model)
    except PlanOnly as ready:
        if ready.plan is not None:
            return ready.plan
    raise InputError(
        "memopt.plan found no training graph: nothing the forward returns needs a gradient "
        "(no parameter or input requires grad, grad mode is disabled, or forward returns no "
        "tensor), so there is no backward pass to plan. Plan with grad enabled and a "
        "parameter with requires_grad=True, and make forward return the loss or an output "
        "tensor; memopt.compile runs such a forward as eager does, with no plan."
    )


def _plan_with_blocks(model: nn.Module, args: tuple, kwargs: dict[str, Any], budget: object,
                      optimizer: Any, options: dict[str, Any]) -> MemoryPlan | StepPlan:
    """memopt.plan(..., blocks=True): a meta model's blocks=True step, run forward on
    shapes (memopt.plan_blocks)."""
    if options.pop("existing_grads", False):
        raise InputError("memopt.plan(..., blocks=True) plans the step without .grad "
                         "tensors; existing_grads=True is for the one-graph plan")
    check_meta(model, args, kwargs)
    refuse_fsdp(model, "memopt.plan")
    backend = MemoptBackend(budget, **options)
    if optimizer is not None:
        check_optimizer(optimizer, model)
        backend.optimizer_source = optimizer
    compiled = CompiledModule(model, backend, blocks=True)
    return plan_blocks(compiled, args, _without_meta_cache(model, args, kwargs))


def _without_meta_cache(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                        ) -> dict[str, Any]:
    """`kwargs` with `use_cache=False` for a Hugging Face model planned on the meta device
    with its default cache (`config.use_cache`, not passed): its forward then builds a
    key/value cache from `torch.tensor([])`, which dynamo does not turn into a FakeTensor on
    meta (capture fails inside transformers' cache_utils), and a training step never reads
    the cache. Warns with what the plan then leaves out."""
    config = getattr(model, "config", None)
    if "use_cache" in kwargs or not getattr(config, "use_cache", False):
        return kwargs
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.device.type == "meta" for t in tensors):
        return kwargs
    try:
        accepts = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return kwargs
    warnings.warn(
        "memopt.plan on the meta device planned this model with use_cache=False: its "
        "config builds a key/value cache in every forward, which dynamo cannot capture on "
        "meta, and training never reads it. A step run with use_cache=True also holds that "
        "cache (a copy of every layer's keys and values) while its output is kept: pass "
        "use_cache=False to the training forward (or set model.config.use_cache = False), "
        "as the plan assumes.", UserWarning, stacklevel=3)
    return {**kwargs, "use_cache": False}


def _never_run(backend: MemoptBackend) -> Any:
    """The plan-only backend stops a training graph in its partition function; this stops
    an inference graph too, which dynamo would otherwise run for real (updating, e.g.,
    BatchNorm's statistics), so that memopt.plan never executes the model."""

    def compile_fn(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        backend(gm, example_inputs, **kwargs)
        raise PlanOnly(None)

    return compile_fn
