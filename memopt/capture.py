"""How memopt calls dynamo: its settings while memopt's compiled steps run, and dynamo's
failures turned into memopt's errors (memopt.api calls every compiled step through
`run_captured`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from memopt.passes._torch_compat import (FailOnRecompileLimitHit, dynamo_config_patch,
                                         dynamo_error_lines, ignored_logging_config,
                                         is_dynamo_error, recompile_limit,
                                         set_frame_skipped, unwrap_backend_error)
from .backend import MemoptBackend
from .blocks import capturing
from .compiled_graph import PlanOnly
from .errors import CaptureError, InputError, MemoptError
from .graph_facts import DOUBLE_BACKWARD
from .input_checks import input_mismatch

#: Dynamo's recompile limits while memopt's compiled steps run. Dynamo counts the graphs
#: of one code object across every module and backend in the process (every compiled
#: module's frame is the same wrapper code), so its own limit of 8 would stop the ninth
#: model a process compiles. memopt counts each module's graphs itself instead
#: (MemoptBackend.graph_limit, the user's `recompile_limit`).
_DYNAMO_LIMITS = {"recompile_limit": 1 << 20, "accumulated_recompile_limit": 1 << 20}

#: Dynamo's DDPOptimizer off while memopt's compiled steps run: inside DDP's forward it
#: would split memopt's graph at DDP's bucket boundaries and hand memopt each piece as if
#: it were the whole step (each planned without what the others hold), and it refuses a
#: `bucket_cap_mb` under 1 MB outright. memopt plans the one graph; DDP's reducer
#: all-reduces the gradients its backward returns (memopt.ddp).
_DYNAMO_DDP = {"optimize_ddp": False}

#: Dynamo guards each module's hook dictionaries: a forward hook or pre-hook registered
#: after the first step is then traced into a new graph, as eager runs it. With dynamo's
#: default (skip_nnmodule_hook_guards=True) such a hook never ran and the step's loss and
#: gradients were silently eager's without it (found from outside; torch.compile does the
#: same by default).
_DYNAMO_HOOKS = {"skip_nnmodule_hook_guards": False}

#: torch's error at a double backward through an AOTAutograd graph: memopt refuses the
#: create_graph=True backward before it (graph_facts.refuse_double_backward); a graph
#: whose node that hook missed still raises this one inside a forward
DOUBLE_BACKWARD_TORCH = "does not currently support double backward"


def run_captured(fn: Any, args: tuple, kwargs: dict, backend: MemoptBackend,
                  model: nn.Module, blocks: bool = False, loops: tuple[Any, ...] = ()) -> Any:
    """Call a torch.compile'd function; surface memopt's own errors and name capture failures
    (inputs that do not match `model`'s device or dtype as InputError). `blocks`: the
    repeated blocks' boundaries end graphs (memopt.blocks); otherwise they do nothing, as
    for a model compiled with blocks=True elsewhere and planned or compiled whole here;
    `loops`, the forwards that loop over the blocks, run eagerly (blocks.loop_codes)."""
    backend.graph_limit = recompile_limit()  # the user's setting, read outside the patch
    backend.plan_log.start_clock()  # a plan's capture time counts from here
    if not backend.plan_log.traced:
        # dynamo runs a code eagerly for good once a torch.compile of it hit the recompile
        # limit: 9 modules of one class under memopt.compile, then one under
        # torch.compile(backend="memopt"), and memopt planned nothing for the next ones
        # (found from outside); under memopt's limits it is compiled again
        code = getattr(type(model).forward, "__code__", None)
        if code is not None:
            set_frame_skipped(code, False)
    try:
        with _dynamo_patch(), capturing(blocks, loops):
            return fn(*args, **kwargs)
    except (MemoptError, PlanOnly):
        raise
    except Exception as err:  # dynamo wraps backend errors; unwrap memopt's own
        inner = unwrap_backend_error(err)
        if isinstance(inner, (MemoptError, PlanOnly)):
            raise inner from None
        if isinstance(err, FailOnRecompileLimitHit):  # only with a user's own lower limit
            raise CaptureError(
                f"dynamo's recompile limit was hit while memopt compiled this module "
                f"(torch._dynamo.config.recompile_limit = {recompile_limit()})"
            ) from err
        if isinstance(inner, RecursionError):
            raise CaptureError(
                "PyTorch hit Python's recursion limit while compiling this model's training "
                f"step ({inner}); very deep models (e.g. ResNets of ~1000 layers) need "
                "sys.setrecursionlimit(20000) or more before memopt.compile / memopt.plan"
            ) from err
        if isinstance(inner, RuntimeError) and DOUBLE_BACKWARD_TORCH in str(inner):
            raise InputError(DOUBLE_BACKWARD) from err
        mismatch = input_mismatch(model, args, kwargs, err)
        if mismatch is not None:  # the message quotes err; its traceback is torch's internals
            raise mismatch from None
        if is_dynamo_error(err):
            raise CaptureError(_capture_message(err)) from err
        raise


#: (the logging changes it was made with, the patch): one patch object, entered at every
#: step, while ignored_logging_config gives the same changes (the user's own set of
#: ignored functions unchanged); making a config patch defines a class, at every call.
_PATCH: list[tuple[dict, Any]] = []


def _dynamo_patch() -> Any:
    """dynamo's settings for memopt's compiled steps, as one reusable config patch."""
    logging_changes = ignored_logging_config()
    if not _PATCH or _PATCH[0][0] is not logging_changes:
        _PATCH[:] = [(logging_changes, dynamo_config_patch(
            fail_on_recompile_limit_hit=True, **_DYNAMO_LIMITS, **_DYNAMO_DDP, **_DYNAMO_HOOKS,
            **logging_changes))]
    return _PATCH[0][1]


def _capture_message(err: BaseException) -> str:
    """The first line of dynamo's error and the innermost user-code line it points at."""
    first, frame = dynamo_error_lines(err)
    where = f" at {frame}" if frame else ""
    return (
        f"memopt could not capture the model as one training graph: {type(err).__name__}: "
        f"{first}{where}. One graph is needed by memopt.plan (it never runs the code "
        "between graphs) and by memopt.compile(..., fullgraph=True); memopt.compile without "
        "fullgraph plans every graph of a forward that dynamo splits at graph breaks "
        "(Python branches on tensor values, .item()/.tolist(), print calls)."
    )
