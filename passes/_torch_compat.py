"""Every private PyTorch import memopt depends on (inductor's: passes._inductor_compat).

memopt captures the joint forward+backward graph with AOTAutograd and hands it
to its own partition function (DESIGN.md, "the hook that makes this a real
compiler pass"). The public entry points for that are thin; the pieces below
are private in torch 2.11-2.13 and may move. A torch upgrade should touch this
file and passes._inductor_compat (inductor's pieces) only.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

# The types of an aten or custom operator (a call_function node's target).
from torch._ops import OpOverload, OpOverloadPacket  # noqa: F401

# Pytrees (nested lists, tuples, dicts of tensors), as torch.compile flattens them.
import torch.utils._pytree as pytree  # noqa: F401

# The FakeTensorMode a graph's values were traced under.
from torch._guards import detect_fake_mode  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensor


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether some elements of `tensor` share memory (an expanded view): ATen's
    `has_internal_overlap` is `MemOverlap::Yes` (passes.storage_sizes)."""
    return torch._debug_has_internal_overlap(tensor) == 1


def own_fake_mode(values: list[Any]) -> Any:
    """The fake mode of the first FakeTensor among ``values`` (None if there is none): the
    mode those values were made in, where the tracing context's may be another."""
    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)

# AOTAutograd's entry point used inside a torch.compile backend.
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: F401

# Extracts forward/backward GraphModules from the joint graph, given the set of
# forward values to save. It takes care of AOTAutograd's calling convention
# (output descriptors, tangents, RNG seeds, symbolic sizes).
from torch._functorch.partitioners import _extract_fwd_bwd_modules

# Raised by dynamo when a function has been recompiled `recompile_limit` times.
try:
    from torch._dynamo.exc import FailOnRecompileLimitHit
except ImportError:  # pragma: no cover - older/newer torch
    class FailOnRecompileLimitHit(Exception):  # type: ignore[no-redef]
        pass


def recompile_limit() -> int:
    return int(torch._dynamo.config.recompile_limit)


@dataclass(frozen=True)
class CompilingFrame:
    """The frame dynamo is compiling when it calls a backend, and why the graph ends: at
    a graph break (`reason`, and the user's file and line where it happened), or where
    the frame returns."""

    code: Any
    graph_break: bool
    reason: str
    filename: str
    lineno: int

    def ends_forward(self, forward_code: Any) -> bool:
        """The graph is all of `forward_code`'s frame: it returns, and nothing broke it.
        For a module whose forward is torch's own code (nn.Sequential), dynamo compiles
        the frame of a wrapper around it (`wrap_inline`) instead."""
        return not self.graph_break and forward_code is not None \
            and self.code in (forward_code, _wrap_inline_code())

    @property
    def at_block_boundary(self) -> bool:
        """The graph ends at a boundary of memopt.blocks (`graph_break` below)."""
        return self.graph_break and self.filename == __file__

    def where(self) -> str:
        if self.at_block_boundary:
            return "ending at a block boundary (blocks=True)"
        reason = self.reason.strip().splitlines()[0] if self.reason.strip() else "a graph break"
        return f"ending at {self.filename}:{self.lineno} ({reason})"


def _wrap_inline_code() -> Any:
    """The code object of dynamo's `wrap_inline` wrapper (None where it has none)."""
    try:
        from torch._dynamo.external_utils import wrap_inline  # noqa: PLC0415

        return wrap_inline(len).__code__
    except Exception:  # noqa: BLE001 - its internals moved
        return None


def compiling_frame() -> CompilingFrame:
    """What dynamo says of the graph it hands the backend now (its private
    InstructionTranslator: the frame's code and the GraphCompileReason)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

        tx = InstructionTranslator.current_tx()
        reason = tx.output.compile_subgraph_reason
        stack = list(getattr(reason, "user_stack", None) or [])
        last = stack[-1] if stack else None
        return CompilingFrame(
            code=tx.f_code, graph_break=bool(getattr(reason, "graph_break", False)),
            reason=str(getattr(reason, "reason", "")),
            filename=getattr(last, "filename", "?"), lineno=int(getattr(last, "lineno", 0) or 0))
    except Exception:  # noqa: BLE001 - outside dynamo, or its internals moved
        return CompilingFrame(code=None, graph_break=False, reason="", filename="?", lineno=0)


def recompile_reasons(code: Any) -> list[str]:
    """Why dynamo captured ``code`` again: the guards that failed, as dynamo words them
    (``L['self'].calls == 7``), oldest first; empty where it kept none (its private
    ``guard_failures``, filled while ``report_guard_failures`` is on, the default)."""
    try:
        from torch._dynamo.utils import guard_failures  # noqa: PLC0415

        return [str(reason) for reason in guard_failures.get(code, [])]
    except Exception:  # noqa: BLE001 - its internals moved
        return []


#: ignored_logging_config's last answer per option name: (the user's set, the changes)
_LOGGING_CHANGES: dict[str, tuple[tuple[set[Any], set[Any]], dict[str, Any]]] = {}
_LOGGING_NAMES = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log",
                  "warning_once", "info_once")


def ignored_logging_config() -> dict[str, Any]:
    """Keyword arguments for ``torch._dynamo.config.patch`` that make dynamo skip logging
    calls instead of breaking the graph at them: every ``logging.Logger`` method,
    transformers' ``warning_once`` / ``info_once`` (installed on ``logging.Logger`` when
    transformers is imported) and ``warnings.warn``, added to what the user has set.
    The option is ``ignore_logging_functions`` in torch 2.13 (``ignore_logger_methods``,
    Logger methods only, before it). Called at every step: the answer is kept while the
    user's own set and the Logger's methods stay the same."""
    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    config = torch._dynamo.config
    key = ("ignore_logging_functions" if hasattr(config, "ignore_logging_functions")
           else "ignore_logger_methods")
    user = getattr(config, key)
    # transformers installs warning_once on logging.Logger when it is imported, which
    # can be after a first step: the answer is kept for the functions found as well
    functions = {getattr(logging.Logger, n) for n in _LOGGING_NAMES
                 if hasattr(logging.Logger, n)}
    kept = _LOGGING_CHANGES.get(key)
    if kept is not None and kept[0] == (user, functions):
        return kept[1]
    found = set(functions)
    if key == "ignore_logging_functions":
        functions.add(warnings.warn)
    changes: dict[str, Any] = {key: set(user) | functions}
    if hasattr(config, "log_compilation_metrics") and not _sortable(changes[key]):
        # torch 2.11's compilation-metrics logger sorts every set in dynamo's config, and a
        # set of functions does not sort: it logged "Unexpected exception logging
        # compilation metrics" at every compile (seen on an H100, torch 2.11.0+cu130,
        # whose option is already ignore_logging_functions). The option below does not
        # stop it there (an H200 run still logged it, at runtime autotuning too), so the
        # filter drops that one record.
        changes["log_compilation_metrics"] = False
        logging.getLogger("torch._dynamo.metrics_context").addFilter(_UNSORTABLE_CONFIG)
    _LOGGING_CHANGES[key] = ((set(user), found), changes)
    return changes


def _drops_unsortable_config_record(record: Any) -> bool:
    """False for the record torch 2.11's metrics logger writes when it cannot sort the set
    of functions memopt gives dynamo (a TypeError from sorting, logged with
    "Unexpected exception logging ... metrics"); True for every other record."""
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, TypeError) and "not supported between instances" in str(error)
                and record.getMessage().startswith("Unexpected exception logging"))


class _UnsortableConfigFilter:
    """A logging filter (installed once; adding it twice is a no-op) that drops only the
    record ``_drops_unsortable_config_record`` names: noise memopt's own patch causes."""

    def filter(self, record: Any) -> bool:
        return _drops_unsortable_config_record(record)


_UNSORTABLE_CONFIG = _UnsortableConfigFilter()


def _sortable(values: set[Any]) -> bool:
    try:
        sorted(values)
    except TypeError:
        return False
    return True


# The "boxed" calling convention: the generated code takes one list and clears
# it, so each input (a saved activation in backward) is freed at its last use.
from torch.fx.graph import _BoxedCodeGen
from torch.multiprocessing.reductions import StorageWeakRef


def extract_fwd_bwd(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split `joint` into forward and backward modules that save `saved_values`.

    Every node the backward outputs need that is neither saved nor a tangent is
    copied into the backward graph (recomputed there). A random op whose value nothing
    reads is removed from both, wherever this runs: torch's extraction keeps one outside
    a compilation (fx's dead-code elimination reads inductor's `fallback_random` only
    under a TracingContext), and a plan made again after the first step (outside dynamo)
    then drew a dead dropout in its backward, moving the user's RNG, so that every later
    mask differed from eager's (found from outside, 2026-11-30). Eager's draws for unused
    random ops are in-place draws by then (passes.dead_draws), impure either way.
    """
    fw, bw = _extract_fwd_bwd_modules(
        joint, saved_values, saved_sym_nodes, num_fwd_outputs=num_fwd_outputs
    )
    for gm in (fw, bw):
        if gm.graph.eliminate_dead_code(
                is_impure_node=lambda node: node.is_impure(impure_random=False)):
            gm.recompile()
    return fw, bw


def make_boxed(gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    """Recompile `gm` with the boxed calling convention and return a boxed callable."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def is_sym_node(node: fx.Node) -> bool:
    """True for nodes whose value is a symbolic int/float/bool (not a tensor)."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))



def is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def tangent_of_output(node: fx.Node) -> int | None:
    """The index among the traced function's outputs of the output whose gradient joint
    placeholder `node` is (AOTAutograd's descriptor ``TangentAOTInput(PlainAOTOutput)``);
    None for another (a mutated input's, an alias's base) or where torch records none."""
    desc = node.meta.get("desc")
    out = getattr(desc, "output", None)
    return out.idx if type(out).__name__ == "PlainAOTOutput" else None


def gradient_of_input(desc: Any) -> int | None:
    """The primal index whose gradient a joint output with descriptor `desc` is
    (``GradAOTOutput(PlainAOTInput)``), else None."""
    of = getattr(desc, "grad_of", None)
    return of.idx if type(of).__name__ == "PlainAOTInput" else None



def engine_will_accumulate(param: torch.Tensor) -> bool:
    """Whether the backward now running will run `param`'s AccumulateGrad node (called
    from inside a backward). False inside ``torch.autograd.grad``, which captures the
    gradient instead (the engine's private query raises there for a leaf's node)."""
    # torch.autograd.graph.get_gradient_edge(param).node, with one view instead of two
    # (it also makes an ownership token that a C++ AccumulateGrad node does not need) and
    # grad mode switched without a context manager object: this runs once per parameter
    # in every backward that adds into kept gradients (memopt.grads).
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(True)
    try:
        node = param.view_as(param).grad_fn.next_functions[0][0]
    finally:
        torch._C._set_grad_enabled(enabled)
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def unwrap_backend_error(err: BaseException) -> BaseException:
    """Return the exception a torch.compile backend raised, unwrapped from dynamo's wrapper."""
    inner: BaseException | None = err
    seen = 0
    while inner is not None and seen < 8:
        if type(inner).__name__ != "BackendCompilerFailed":
            return inner
        inner = getattr(inner, "inner_exception", None) or inner.__cause__
        seen += 1
    return err



def storage_key(t: Any) -> Any:
    """A hashable identity of the storage under a (fake) tensor; views share it."""
    return StorageWeakRef(t.untyped_storage())


def storage_ref(storage: Any) -> Any:
    """A weak reference to a storage (`.expired()` once nothing holds it: no tensor, no
    view, no tensor saved by autograd)."""
    return StorageWeakRef(storage)


def autograd_inside_op():
    """A context in which autograd records again, inside a custom operator's
    implementation (which runs with the autograd dispatch keys excluded and grad
    mode off): the chain executor runs and backpropagates steps there."""
    from contextlib import ExitStack  # noqa: PLC0415

    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        exclude = exclude.remove(getattr(keys, name))
    stack = ExitStack()
    stack.enter_context(torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), exclude))
    stack.enter_context(torch.enable_grad())
    return stack


def real_tensors():
    """A context in which new tensors are real and ops run their real kernels, even
    inside AOTAutograd's partitioning (a FakeTensorMode, and the Python dispatcher,
    which would decompose a fused RNN op): planning measures a chain step's saved
    bytes on real inputs."""
    from contextlib import ExitStack  # noqa: PLC0415

    from torch._dispatch.python import no_python_dispatcher  # noqa: PLC0415
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: PLC0415

    stack = ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(no_python_dispatcher())
    return stack


def rng_kept(device: torch.device | None = None):
    """A context that leaves the RNG state as it was (CPU, and CUDA: `device`'s where
    given, else every initialized device): planning runs ops for real (a chain step, a
    workspace probe, AOTAutograd's tracing) and must not move the user's RNG, or dropout
    would draw other masks than eager's."""
    if device is not None:
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
    else:
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return torch.random.fork_rng(devices=devices)


def cpu_allocation_events(prof: Any) -> list[tuple[int, int, int]]:
    """(time in ns, bytes, address) of every allocation (bytes > 0) and free (< 0)
    PyTorch's CPU allocator reported while ``prof`` (a
    ``torch.profiler.profile(profile_memory=True)``) recorded, in time order. The events
    are public in the profiler's trace; their addresses only in its private event tree
    (``kineto_results.experimental_event_tree``, what torch.profiler's memory profiler
    reads)."""
    from torch._C._profiler import _ExtraFields_Allocation  # noqa: PLC0415

    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    return sorted(events, key=lambda ev: ev[0])


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the autograd engine finishes the backward now running (call
    from inside it: a node's hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inside_backward() -> bool:
    """Whether this thread is running an autograd engine's backward now."""
    return torch._C._current_graph_task_id() != -1


def profiler_active() -> bool:
    """Whether a torch.profiler / autograd profiler is recording (they do not nest)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def loss_decompositions() -> dict[Any, Callable]:
    """AOTAutograd decompositions for the loss ops whose kernels return their reduced
    scalar as a view of the whole elementwise loss buffer (torch 2.13, CPU and CUDA:
    ``F.mse_loss(y, t)`` is a 0-dim tensor on a storage of ``y.numel()`` floats).
    FakeTensors show 4 bytes, so a plan would miss the buffer, which lives as long as
    the loss does (through backward, in a usual loop). Decomposed, the ops allocate
    what their FakeTensors say: pointwise temporaries freed at once, a real scalar."""
    from torch._decomp import get_decompositions  # noqa: PLC0415

    aten = torch.ops.aten
    return get_decompositions([
        aten.mse_loss, aten.mse_loss_backward, aten.smooth_l1_loss,
        aten.smooth_l1_loss_backward, aten.binary_cross_entropy,
        aten.binary_cross_entropy_backward, aten.soft_margin_loss,
        aten.soft_margin_loss_backward,
    ])


def last_guard_failure(code: Any) -> str:
    """The reason dynamo gave for the last time a cached graph of `code` no longer fitted
    (its guard failure: "len(L['self'].logged) == 3", ...), or "" where it recorded none."""
    try:
        from torch._dynamo.utils import guard_failures  # noqa: PLC0415

        reasons = guard_failures.get(code) or []
        text = str(reasons[-1]).strip() if reasons else ""
        return text.splitlines()[0].split("#")[0].strip() if text else ""
    except Exception:  # noqa: BLE001 - its internals moved
        return ""


def dynamo_frames_converted() -> int:
    """How many frames dynamo has started to convert in this process (its `frames`
    counter): it moves while dynamo compiles, and not while compiled code only runs."""
    try:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        return int(counters["frames"]["total"])
    except Exception:  # noqa: BLE001 - its internals moved
        return -1


def random_ops_kept(keep: bool) -> Any:
    """inductor's `fallback_random`, patched inside a `with` block: with it on,
    AOTAutograd's capture keeps random ops whose values nothing uses (fx's dead-code
    elimination keeps them under a TracingContext; passes.dead_draws makes them eager's
    draws); memopt partitions with it off (extract_fwd_bwd)."""
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    return inductor_config.patch(fallback_random=keep)


def dynamo_config_patch(**changes: Any) -> Any:
    """torch._dynamo.config.patch: dynamo's settings changed inside a `with` block only."""
    return torch._dynamo.config.patch(**changes)


def is_dynamo_error(err: BaseException) -> bool:
    """Whether dynamo itself raised `err` (a capture failure, not the user's code)."""
    return type(err).__module__.startswith("torch._dynamo")


def functorch_config() -> Any:
    """torch._functorch.config (activation_memory_budget: the peer memopt is measured
    against, inside its own `config.patch`)."""
    import torch._functorch.config as config  # noqa: PLC0415

    return config


def rnn_kernels() -> Any:
    """torch._VF: the fused RNN kernels nn.LSTM / nn.GRU / nn.RNN's forward calls."""
    from torch import _VF  # noqa: PLC0415

    return _VF


def dynamo_error_lines(err: BaseException) -> tuple[str, str]:
    """(the first line of dynamo's error, the innermost user-code frame it points at: ""
    when it names none). Dynamo's message format is not an API: read here only."""
    text = str(err).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(err).__name__
    if first.endswith("raised:") and len(lines) > 1:  # a backend's error: what it raised
        first = f"{first} {lines[1]}"
    # an op that failed on FakeTensors: what it raised (a shape mismatch), which the first
    # line does not say
    inner = re.search(r"got (\w+)\((['\"])(.*?)\2\)\s*$",
                      next((ln for ln in lines if ln.startswith("Explanation:")), ""))
    if inner is not None:
        first = f"{first}: {inner.group(1)}: {inner.group(3)}"
    frames = []
    if "from user code:" in text:
        frames = [ln.strip() for ln in text.split("from user code:", 1)[1].splitlines()
                  if ln.strip().startswith("File ")]
    # the innermost frame of the user's code, not of torch's modules it called
    own = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]
    return first, (own or frames)[-1] if frames else ""


def sequence_nr(node: Any) -> int | None:
    """Autograd node `node`'s sequence number (made later in the forward: higher; its
    backward runs earlier), None where it has none."""
    try:
        return int(node._sequence_nr())
    except (AttributeError, RuntimeError, TypeError):
        return None


def norm_with_running_stats(module: torch.nn.Module) -> bool:
    """Whether `module` is a BatchNorm / InstanceNorm layer that tracks running statistics
    (torch's shared base class of those layers)."""
    from torch.nn.modules.batchnorm import _NormBase  # noqa: PLC0415
    return isinstance(module, _NormBase) and bool(module.track_running_stats)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What torch raises where a graph's size depends on tensor values it cannot know
    while tracing (an unbacked symbol ``u0`` from ``nonzero``, ``torch.where(mask)``,
    boolean-mask indexing, ``.item()``): a guard on it, or an op whose output size is
    data-dependent under FakeTensors."""
    from torch._subclasses.fake_tensor import (  # noqa: PLC0415
        DataDependentOutputException, DynamicOutputShapeException)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # noqa: PLC0415
    return (GuardOnDataDependentSymNode, DynamicOutputShapeException,
            DataDependentOutputException)


#: A tensor subclass's `__torch_function__` that leaves ops to `__torch_dispatch__`
#: (memopt.stepper.ConsumedGradient).
disabled_torch_function = torch._C._disabled_torch_function_impl


def foreach_zero_(tensors: list[torch.Tensor]) -> None:
    """`torch._foreach_zero_`: zero every tensor of the list in place."""
    torch._foreach_zero_(tensors)


def set_frame_skipped(code: Any, skipped: bool) -> None:
    """Whether dynamo runs the frames of `code` eagerly (the functions they call are still
    compiled) or compiles them as usual (its per-code frame strategy, which it sets to
    "skip" itself when it fails to compile a frame, e.g. at a graph break inside a loop).
    Where this torch lacks the call, nothing changes."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy  # noqa: PLC0415
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # noqa: PLC0415
    except ImportError:
        return
    action = FrameAction.SKIP if skipped else FrameAction.DEFAULT
    set_code_exec_strategy(code, FrameExecStrategy(action, FrameAction.DEFAULT))


def library_for_op(namespace: str, name: str) -> Any:
    """A `torch.library.Library` fragment to define `namespace::name` in, replacing the one
    an earlier import of the defining module made (a module imported again after its
    `sys.modules` entry was removed would define the op twice: a RuntimeError), as
    torch.library.custom_op does."""
    try:
        from torch._library.custom_ops import get_library_allowing_overwrite  # noqa: PLC0415
    except ImportError:
        return torch.library.Library(namespace, "FRAGMENT")
    return get_library_allowing_overwrite(namespace, name)


def graph_break() -> None:
    """End dynamo's graph here (a no-op outside dynamo): memopt.blocks' boundaries."""
    torch._dynamo.graph_break()


def saved_tensor_hooks_free() -> bool:
    """No saved-tensor default hooks on this thread's stack, and none disabled (inside a
    ``torch.func`` transform): a pair pushed now applies, and raises nothing."""
    autograd = torch._C._autograd
    return autograd._saved_tensors_hooks_get_disabled_error_message() is None \
        and autograd._top_saved_tensors_default_hooks(True) is None


def push_saved_tensor_hooks(pack: Callable[[torch.Tensor], Any],
                            unpack: Callable[[Any], torch.Tensor]) -> None:
    """Push a pair of saved-tensor default hooks, kept until ``pop_saved_tensor_hooks``
    (``torch.autograd.graph.saved_tensors_hooks`` without the ``with``)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def saved_tensor_pack_hook_on_top() -> Any:
    """The pack hook on top of this thread's stack of saved-tensor hooks (None: empty)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if top is None else top[0]


def pop_saved_tensor_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


def current_autograd_node() -> Any:
    """The autograd node whose backward this thread is running (None outside a
    backward): inside a saved-tensor unpack hook, the node that saved the tensor."""
    return torch._C._current_autograd_node()


def autocast_regions() -> dict[str, torch.dtype]:
    """{device type: dtype} of the autocast regions entered now (CPU and CUDA)."""
    return {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)}


@contextlib.contextmanager
def in_autocast_regions(regions: dict[str, torch.dtype]) -> Iterator[None]:
    """Grad mode on, and exactly the autocast `regions` (autocast_regions) entered, whatever
    is entered now."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        for device in ("cpu", "cuda"):
            if device in regions:
                stack.enter_context(torch.autocast(device, dtype=regions[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def step_pre_hooks_after(optimizer: Any, handle: Any) -> list[Callable]:
    """`optimizer`'s own step pre-hooks that run after the one `handle` registered
    (registered since: torch runs them in order), but memopt's."""
    hooks = list(optimizer._optimizer_step_pre_hooks.items())
    at = next((i for i, (key, _) in enumerate(hooks) if key == handle.id), len(hooks))
    return [hook for _, hook in hooks[at + 1:]
            if not getattr(hook, "__module__", "").startswith("memopt.")]


def step_pre_hook_last(optimizer: Any, handle: Any) -> None:
    """Run the step pre-hook `handle` registered after every other of `optimizer`'s (not
    while the optimizer iterates its hooks)."""
    hooks = optimizer._optimizer_step_pre_hooks
    if handle.id in hooks:
        hooks.move_to_end(handle.id)
