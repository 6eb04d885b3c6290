"""Kernel workspaces: what an op allocates for itself beyond its outputs, measured.

A FakeTensor says what an op returns, not what its kernel allocates while it runs.
Some kernels allocate a lot: on CPU, ``convolution_backward`` of a depthwise or
channels-last convolution computes its gradients in another layout and copies them
(12 MiB at once in a small ConvNeXt, beside outputs of 4 MiB), BatchNorm and
LayerNorm backward keep per-thread partial sums, ``native_dropout`` draws its mask
through a float buffer, and an ``out=`` variant with no kernel of its own (``clone.out``,
``native_dropout_backward.out``, written by passes.inplace) computes the result aside
and copies it. On CUDA, cuDNN's workspaces come from the caching allocator and are
freed when the op returns. None of this is in the graph, so a plan that leaves it out
undercounts the step's peak at exactly the ops where it is highest (convolution
backward in a CNN). This pass measures it, once per op and shape, and records it where
liveness charges it.

Requires: forward and/or backward GraphModules after passes.partition and
passes.inplace (the variants that will run), with FakeTensors in ``node.meta['val']``.
Run right before passes.liveness, which adds ``WORKSPACE_BYTES`` at the op's step.

Ensures: every measured node whose kernel allocated more than it returned carries
``memopt.workspace_bytes`` (passes.meta.WORKSPACE_BYTES) = the most bytes live at
once during the call minus those still live after it (its new outputs): with the
op's outputs charged at its step as well, liveness then sees the op's real peak.
Nodes that already carry the key (memopt's own chain and reversible ops, priced by
passes.chain_policy and passes.reversible_stacks) are left as they are, and so are
memopt's other own ops but those that only call ATen kernels (``_OWN_MEASURED``). The
graphs are not otherwise changed, and the caller's RNG state is not moved.

Which ops: every aten op that returns a tensor, except views (``OpOverload.is_view``:
they allocate nothing) and ops of the ``memopt`` namespace, however small: a small
model's budget is small too, and a 512-byte LayerNorm buffer or a 16-channel padded
copy of a 4-channel convolution's operands (oneDNN's blocked layout) put small models
10-120% over their budgets when ops under 64 KiB were skipped (found by the fuzzer,
tests/test_fuzz.py). Measuring all of them rather than a named list costs little (each
distinct op and shape runs once per process: about one training step of compute, plus
~0.5 ms of profiler start/stop per distinct op on CPU) and finds workspaces nobody
thought to list.

Algorithm:
    Step 1: key each node by its op overload, its arguments (tensors by shape,
        strides, storage offset, dtype, and which of them share a storage), the
        device and the intra-op thread count (CPU kernels size per-thread buffers
        by it); look the key up in the cache (a candidate plan rebuilds the same
        graphs many times: memopt.planner).
    Step 2: for each key not yet measured: real zero-filled storages of the
        FakeTensors' storage sizes (storages shared as in the graph), the op's
        tensors as strided views of them, and one call of the op under allocation
        tracking (passes.allocated), with gradients off and autocast off; on CUDA
        one untimed call first, so that cuDNN's algorithm search (benchmark mode)
        and cuBLAS's handle workspace, allocated once per process, are not taken for
        a per-call workspace. An op that fails on zeros runs again on ones (``torch.multinomial`` refuses rows of zero probability: it was
        charged 0 where it allocates a copy of its input, and a step at 0.7 measured
        1.02x its budget; found from outside); one that fails on both is charged 0.
    Step 3: record the bytes on every node of that key.

Where allocations cannot be tracked (a profiler is already recording on CPU) nothing
is measured, and a warning says the plan may undercount. A plan on the meta device
(shapes only, e.g. benchmarks/chen_resnet.py) measures nothing either: its peak leaves
workspaces out. On CUDA the same code reads
the caching allocator's counters (``torch.cuda.max_memory_allocated``); it has not
been run on a GPU yet. Not counted: allocations made outside PyTorch's allocator
(oneDNN's scratchpads on CPU, cuBLAS's workspace, which is allocated once and kept),
and workspaces that depend on tensor values rather than shapes, except the ops of
_VALUE_DEPENDENT, measured on zeros and on ones (linalg_matrix_exp: ones are its worst
case, so its charge is an upper bound).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ._torch_compat import OpOverload, real_tensors, rng_kept, storage_key
from .allocated import allocation_peak, can_track, note_unmeasured, say_untracked
from memopt.allocator.units import format_bytes

from .meta import WORKSPACE_BYTES, fake_value, value_tensors

log = logging.getLogger("memopt")

@dataclass
class WorkspaceCache:
    """Measured workspace bytes by key (Step 1); ``hits`` / ``misses`` / ``seconds``
    count lookups and the time spent measuring. The planner never reaches for a global:
    the cache is handed to it (memopt.planner.PlanRequest.workspaces) by its owner, the
    compiled module's backend (memopt.backend.MemoptBackend.workspaces), which takes
    the process's `SHARED` cache unless given its own."""

    max_entries: int = 1 << 16
    bytes_of: dict[tuple, int] = field(default_factory=dict)
    #: what the op returned, by key: for each tensor (its strides, its storage's bytes),
    #: or None for one that aliases an input or another output; None where the op did
    #: not run. Read by passes.runtime_layouts
    returned_of: dict[tuple, tuple | None] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    def clear(self) -> None:
        self.bytes_of.clear()
        self.returned_of.clear()
        self.hits = self.misses = 0
        self.seconds = 0.0




#: The process's cache, which every MemoptBackend takes by default: one measurement per op
#: and shape per process, so that memopt.plan predicts what memopt.compile then runs (a
#: kernel's measured bytes can differ from one call to the next: per-thread buffers, a
#: first call's one-time allocations; each module measuring its own put memopt.plan's and
#: memopt.compile's plans of one transformer 5,824 bytes apart).
SHARED = WorkspaceCache()


@dataclass(frozen=True)
class WorkspaceResult:
    """What one call of ``measure_workspaces`` did."""

    charged: int           # nodes given WORKSPACE_BYTES > 0
    measured: int          # keys run on real tensors in this call (cache misses)
    hits: int              # nodes whose key was already measured
    seconds: float         # wall time spent measuring
    total_bytes: int       # sum of the bytes charged (each node once)


def measure_workspaces(graphs: Sequence[fx.GraphModule], cache: WorkspaceCache,
                       relaid: Callable[[fx.Node], tuple[int, ...]] | None = None
                       ) -> WorkspaceResult:
    """Measure (or look up) and record the workspace of every eligible node of
    ``graphs`` (see the module docstring); `relaid(node)`: the positional arguments
    the kernel that runs it is given contiguous (inductor's, passes.fusion)."""
    t0 = time.perf_counter()
    # Step 1: keys.
    calls = [(node, call) for gm in graphs for node in gm.graph.nodes
             if (call := node_call(node, relaid=relaid(node) if relaid else ())) is not None]
    new_keys = {call.key for _, call in calls if call.key not in cache.bytes_of}
    hits = sum(1 for _, call in calls if call.key not in new_keys)
    found = workspace_bytes_of([call for _, call in calls], cache)   # Step 2
    measured = len(new_keys)
    # Step 3: record.
    charged = total = 0
    for (node, _), nbytes in zip(calls, found):
        if nbytes > 0:
            node.meta[WORKSPACE_BYTES] = nbytes
            charged += 1
            total += nbytes
    seconds = time.perf_counter() - t0
    if measured:
        log.debug("memopt workspaces: %d ops measured (%d cached) in %.2fs; %d nodes "
                  "charged %s", measured, hits, seconds, charged, format_bytes(total))
    return WorkspaceResult(charged=charged, measured=measured, hits=hits, seconds=seconds,
                           total_bytes=total)


@dataclass(frozen=True)
class Call:
    """One op call as passes.workspace keys and runs it: the op, its arguments (fx
    Nodes standing for their FakeTensors) and the key (Step 1)."""

    target: Any
    args: tuple
    kwargs: dict
    key: tuple


@dataclass(frozen=True)
class Relaid:
    """An argument passed as a copy of the node's tensor laid out anew (what inductor
    hands an extern kernel whose layout it constrains: passes.fusion.relaid_args), with
    `stride`, or contiguous."""

    node: fx.Node
    stride: tuple[int, ...] | None = None


def node_call(node: fx.Node, target: Any = None, kwargs: dict | None = None,
              relaid: tuple[int, ...] = (),
              strides: dict[int, tuple[int, ...]] | None = None) -> Call | None:
    """The Call of an eligible `node` (None otherwise), or of the variant of it that
    calls `target` with `kwargs` (an in-place or `out=` rewrite: passes.inplace), with
    the positional arguments at `relaid` passed laid out anew (Relaid: with `strides`
    where given, else contiguous)."""
    if not _eligible(node):
        return None
    target = node.target if target is None else target
    kwargs = dict(node.kwargs) if kwargs is None else kwargs
    strides = strides or {}
    args = tuple(Relaid(a, strides.get(k)) if k in relaid else a
                 for k, a in enumerate(node.args))
    key = _key(target, args, kwargs)
    return None if key is None else Call(target, args, kwargs, key)


def workspace_bytes_of(calls: Sequence[Call], cache: WorkspaceCache) -> list[int]:
    """The workspace bytes of each call: looked up in `cache`, the calls not in it run
    once each first (Step 2); 0 where nothing can be measured (a meta device, a profiler
    already recording)."""
    t0 = time.perf_counter()
    todo: dict[tuple, Call] = {}
    for call in calls:
        if call.key not in cache.bytes_of:
            todo.setdefault(call.key, call)
    if todo:
        device = torch.device(next(iter(todo))[-2])
        if device.type not in ("cpu", "cuda"):  # meta: a plan of shapes, nothing to run
            log.info("memopt: planning on %s: kernel workspaces are not measured", device)
            todo = {}
        elif not can_track(device):
            note_unmeasured()
            say_untracked("workspaces", " (a profiler is recording); kernel workspaces are "
                          "estimated in this plan (it is made again, measured, once the "
                          "profiler stops)")
            cache.misses += len(todo)
            return [cache.bytes_of.get(call.key, estimated_workspace(call)) for call in calls]
        if len(cache.bytes_of) + len(todo) > cache.max_entries:
            cache.clear()
        with real_tensors(), rng_kept(device):
            for key, call in todo.items():
                cache.bytes_of[key], cache.returned_of[key] = _run(call, device)
    cache.hits += len(calls) - len(todo)
    cache.misses += len(todo)
    cache.seconds += time.perf_counter() - t0
    return [cache.bytes_of.get(call.key, 0) for call in calls]


#: where a profiler keeps planning from measuring: the workspace of the ops known to
#: allocate one, in multiples of their largest tensor argument, as measured on CPU (a
#: depthwise-convolution CNN, activations of 4.5 MiB: convolution_backward 2x,
#: convolution and native_batch_norm_backward 1x, and its profiled first step measured
#: 1.16x its budget with none of them counted; an MLP with dropout: native_dropout and
#: its backward 1x, the backward's ``out=`` variant 2x, a multiply by the boolean mask 1x).
#: ``linalg_matrix_exp`` (its Pade terms and squarings) measured up to 12x its input, 8x
#: on a small norm, on 16 to 256 rows; ``nn.utils.parametrizations.orthogonal``'s backward
#: runs it on a matrix twice the size, and a minimum named inside the user's profiler,
#: with it charged nothing, was 4.2x too low (found from outside, 2026-12-01);
#: ``_linalg_solve_ex`` (``torch.linalg.solve``) factors a copy of A: 1x.
#: An ``out=`` variant with no kernel of its own computes aside and copies: 2x; an op
#: whose tensor arguments differ in dtype converts one: 1x. Other ops are charged nothing.
_ESTIMATED = {"convolution_backward": 2, "convolution": 1, "native_batch_norm_backward": 1,
              "native_layer_norm_backward": 1, "native_group_norm_backward": 1,
              "native_dropout": 1, "native_dropout_backward": 1, "_safe_softmax": 1,
              "linalg_matrix_exp": 12, "_linalg_solve_ex": 1}
#: CPU's flash attention, in multiples of its first argument (the queries; the output's
#: gradient), for every two threads (its blocks are per thread: the forward measured
#: 0.31, 0.63 and 1.25 times the queries on 1, 2 and 4 threads). A Perceiver's
#: cross-attention of 64 latents over 2,048 inputs measured 82,176 bytes forward and
#: 262,272 backward over queries of 131,072 (one thread), and its minimum named inside
#: the user's allocation_peak was refused a step later (found from outside, 2026-12-01;
#: `_safe_softmax`, 66,564 over 262,144, and a LayerNorm backward over two permuted
#: arguments, 2x, the same)
_CPU_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": 1,
                  "_scaled_dot_product_flash_attention_for_cpu_backward": 2}


_ESTIMATE_MARGIN = 1024
#: dtypes of index arguments (gather, scatter, index_select, embedding), which a kernel
#: reads without converting them
_INDICES = (torch.int32, torch.int64)
#: ops that sort their indices into buffers of their own: `_SORTED` times the largest
#: (an EmbeddingBag's backward measured 49,160 bytes over an index of 8,192 on CPU)
_SORTS = frozenset({"_embedding_bag_backward", "_embedding_bag_dense_backward",
                    "embedding_dense_backward", "_index_put_impl", "index_put", "sort",
                    "unique", "_unique2"})
_SORTED = 6


def estimated_workspace(call: Call) -> int:
    """`_ESTIMATED`'s bytes for `call`, from its FakeTensors' sizes."""
    tensors = []
    for value in [*call.args, *call.kwargs.values()]:
        value = getattr(value, "node", value)
        if isinstance(value, fx.Node):
            tensors += value_tensors(fake_value(value))
    if not tensors:
        return _ESTIMATE_MARGIN
    name = getattr(getattr(call.target, "overloadpacket", None), "__name__", "")
    factor = 2 if call.target._overloadname == "out" else _ESTIMATED.get(name, 0)
    if name == "native_layer_norm" and not tensors[0].is_contiguous():
        factor = 1  # it normalizes a contiguous copy (timm's LayerNorm2d permutes first)
    if name == "native_layer_norm_backward":  # and a copy of each argument that is not
        factor = max(1, sum(not t.is_contiguous() for t in tensors[:2]))  # (2x measured)
    if name in _CPU_ATTENTION:  # per-thread blocks of the queries' rows: in units of q
        threads = max(1, torch.get_num_threads() // 2)
        return _CPU_ATTENTION[name] * threads * _spanned_bytes(tensors[0]) + _ESTIMATE_MARGIN
    if not factor:
        return _converted_or_sorted(name, tensors) + _ESTIMATE_MARGIN
    if name == "convolution_backward" and len(tensors) >= 3 and tensors[1].dim() > 2 \
            and not tensors[1].is_contiguous():
        return max(factor * max(t.numel() * t.element_size() for t in tensors),
                   _columns(*tensors[:3])) + _ESTIMATE_MARGIN
    # and a little more, any op: what a minimum named under the estimate holds measured
    # too (an MLP's native_dropout_backward measured 1x and 12 bytes, a mean 12 bytes,
    # and minimums named under the profiler were refused, 12 bytes short, once it closed).
    # One op's workspace is charged at a time, so these do not add up.
    return factor * max(t.numel() * t.element_size() for t in tensors) + _ESTIMATE_MARGIN


def _converted_or_sorted(name: str, tensors: list[torch.Tensor]) -> int:
    """An op with no workspace of its own: a copy cast to the common dtype where its
    tensors' dtypes differ (a multiply by a boolean mask: its largest operand in the widest
    dtype, an expanded view counting what it spans), and `_SORTED` times its largest index
    where it sorts them (_SORTS). Other indices are read as they are: a scatter_add over
    a (B, N, N, C) zeros by an int64 index (a gather's backward) was charged its 128 MiB,
    and a DGCNN's minimum named inside the user's allocation_peak was 1.84x eager's peak
    (found from outside, 2026-12-01)."""
    values = [t for t in tensors if t.dtype not in _INDICES]
    cast = max(_spanned_bytes(t) // t.element_size() for t in values) \
        * max(t.element_size() for t in values) if len({t.dtype for t in values}) > 1 else 0
    indices = [_spanned_bytes(t) for t in tensors if t.dtype in _INDICES]
    return max(cast, _SORTED * max(indices) if name in _SORTS and indices else 0)


def _spanned_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements `t` reads: a dimension of stride 0 (a broadcast)
    counts once."""
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st) * t.element_size()


def _columns(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> int:
    """What a convolution's backward allocates on CPU for an input that is not contiguous
    (channels-last), charged while planning cannot measure. Measured for 2-d kernels
    (CPU, 1 and 2 threads, 7x7 depthwise, maps of 2x2 to 32x32, batches of 2 to 8):
    ``max(batch, 8) x channels x taps x 32`` elements whatever the map's size, and a
    channels-last copy of the output's gradient where it is not one. A ConvNeXt's late
    stage, (8, 320, 2, 2) maps, allocated 16,120,320 bytes, 8x its unfolded columns, and
    its first step planned under the profiler with half the columns charged measured
    1.31x an accepted budget (found from outside, 2026-12-02; timm's LayerNorm2d leaves
    its output channels-last). Other kernels: half the unfolded columns, as measured on
    the first such case (1.6 MB over 64 KB inputs, 2026-11-30)."""
    kernel = math.prod(weight.shape[2:])
    if x.dim() != 4:
        whole = x.shape[0] * x.shape[1] * kernel * math.prod(grad_out.shape[2:])
        return whole * x.element_size() // 2
    blocks = max(x.shape[0], 8) * x.shape[1] * kernel * 32 * x.element_size()
    copied = 0 if grad_out.is_contiguous(memory_format=torch.channels_last) \
        else grad_out.numel() * grad_out.element_size()
    return int(1.01 * blocks) + copied


#: memopt's own ops that run ATen kernels and nothing else: measured as those are
#: (passes.fused_upsample; a bilinear upsampling's backward allocates twice its input's
#: gradient on CPU)
_OWN_MEASURED = frozenset({"memopt::upsample", "memopt::upsample_backward"})


def _eligible(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return False
    own = node.target.namespace == "memopt" and node.target.name() not in _OWN_MEASURED
    if own or node.target.is_view or WORKSPACE_BYTES in node.meta:
        return False
    return bool(value_tensors(fake_value(node)))


def _key(target: Any, node_args: tuple, node_kwargs: dict) -> tuple | None:
    """Step 1: (op, arguments, kwargs, device, threads); None if an argument cannot be
    keyed (then the node is not measured)."""
    storages: dict[Any, int] = {}
    devices: set[str] = set()

    def freeze(value: Any) -> Any:
        if isinstance(value, Relaid):
            stride = value.stride
            value = fake_value(value.node)
            devices.add(str(value.device))
            return ("relaid", tuple(value.shape), stride, str(value.dtype))
        if isinstance(value, fx.Node):
            value = fake_value(value)
            if isinstance(value, torch.Tensor):
                index = storages.setdefault(storage_key(value), len(storages))
                devices.add(str(value.device))
                return ("tensor", index, tuple(value.shape), tuple(value.stride()),
                        int(value.storage_offset()), str(value.dtype),
                        value.untyped_storage().nbytes())
            return freeze(value)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *(freeze(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, freeze(v)) for k, v in sorted(value.items())))
        if isinstance(value, torch.Tensor):
            raise _Unkeyable  # a constant tensor in the graph: not worth measuring
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype,
                                               torch.device, torch.layout,
                                               torch.memory_format)):
            return value
        raise _Unkeyable

    try:
        args, kwargs = freeze(node_args), freeze(node_kwargs)
    except _Unkeyable:
        return None
    if len(devices) != 1:
        return None
    return (str(target), args, kwargs, devices.pop(), torch.get_num_threads())


class _Unkeyable(Exception):
    pass


def _reads_host_scalars(target: Any) -> bool:
    """Fused attention kernels (``_scaled_dot_product_efficient_attention_backward``,
    flash and cuDNN attention) read their dropout's Philox seed and offset, 0-dim int64
    tensors, through a host pointer: eager passes them on the CPU, while the FakeTensor
    puts them on the op's device, and a kernel run on zeros of that layout dereferences
    a device pointer on the host (a segmentation fault, HF GPT-2 on an H100). Such
    scalars are made on the CPU for these ops."""
    return "attention" in str(getattr(target, "__name__", target))


#: Readings per op on CUDA, of which the smallest is charged: a library's one-time
#: allocations (cuBLAS's per-stream workspace, an algorithm cache) can land on the call
#: after the untimed one; the first GPU run charged a backward ``bmm`` 92 MiB that the
#: training step never allocated.
CUDA_READINGS = 2


#: ops whose workspace follows their inputs' values, not only their shapes: measured on
#: zeros and on ones, the larger charged. linalg_matrix_exp picks its Taylor degree and
#: squarings by the input's norm (none on zeros; nn.utils.parametrizations.orthogonal's
#: step measured 1.49x an accepted budget), _embedding_bag_backward's max mode gathers
#: the gradient by its indices (none on zeros; a step 1.16x its budget): found from outside
_VALUE_DEPENDENT = ("linalg_matrix_exp", "_embedding_bag")


def _run(call: Call, device: torch.device) -> tuple[int, tuple | None]:
    """Step 2: the op's transient bytes on zeros of its inputs' layout (inside
    real_tensors); on ones where it refuses zeros, and also
    where its workspace follows the values (_VALUE_DEPENDENT): the larger then. With
    them what it returned (_returned_by; None where it ran on neither)."""
    name = str(getattr(call.target, "__name__", call.target))
    both = any(op in name for op in _VALUE_DEPENDENT)
    readings, failed, returned = [], [], None
    for ones in (False, True):
        try:
            nbytes, got = _measure(call, device, ones=ones)
        except Exception as exc:  # noqa: BLE001 (an op's own check: any type)
            failed.append(f"{type(exc).__name__}: {exc}")
        else:
            readings.append(nbytes)
            returned = got if returned is None else returned
        if readings and not both:
            break
    if not readings:
        log.debug("memopt workspaces: %s could not run on zeros nor ones (%s); charged 0",
                  call.target, "; ".join(failed))
        return 0, None
    return max(readings), returned


def _real_arguments(call: Call, ones: bool = False) -> tuple[tuple, dict]:
    """Real tensors for `call`'s arguments (inside real_tensors): zeros, or with `ones`
    ones of each dtype, in the FakeTensors' layouts, on storages shared as the graph's are."""
    bases: dict[Any, torch.UntypedStorage] = {}
    host_scalars = _reads_host_scalars(call.target)

    def filled(t: torch.Tensor) -> torch.Tensor:
        if ones and t.element_size() and not t.is_complex():
            whole = t.untyped_storage().nbytes() // t.element_size()
            t.as_strided((whole,), (1,), 0).fill_(1)
        return t

    def real(value: Any) -> Any:
        if isinstance(value, Relaid):
            fake = fake_value(value.node)
            if value.stride is None:
                return filled(torch.zeros(fake.shape, dtype=fake.dtype, device=fake.device))
            return filled(torch.empty_strided(fake.shape, value.stride, dtype=fake.dtype,
                                              device=fake.device).zero_())
        if isinstance(value, fx.Node):
            return real(fake_value(value))
        if isinstance(value, torch.Tensor):
            where = value.device
            if host_scalars and value.dim() == 0 and not value.is_floating_point():
                where = torch.device("cpu")
            key = (storage_key(value), where)
            if key not in bases:
                bases[key] = torch.zeros(value.untyped_storage().nbytes(), dtype=torch.uint8,
                                         device=where).untyped_storage()
            t = torch.empty(0, dtype=value.dtype, device=where)
            return filled(t.set_(bases[key], value.storage_offset(), value.shape,
                                 value.stride()))
        if isinstance(value, (tuple, list)):
            return type(value)(real(v) for v in value)
        if isinstance(value, dict):
            return {k: real(v) for k, v in value.items()}
        return value

    return real(call.args), real(call.kwargs)


def _measure(call: Call, device: torch.device, ones: bool) -> tuple[int, tuple]:
    """One reading of ``_run``: inputs of zeros, with ``ones`` every input's storage
    filled with ones of its dtype (indices too: _embedding_bag_backward's max-mode
    workspace follows its indices, and is none on zeros); and what it returned
    (`_returned_by`)."""
    readings, got = [], ()
    args, kwargs = _real_arguments(call, ones)
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        if device.type == "cuda":
            call.target(*args, **kwargs)
        for _ in range(CUDA_READINGS if device.type == "cuda" else 1):
            with allocation_peak(device, collect=False, own_only=True) as seen:
                out = call.target(*args, **kwargs)
            got = _returned_by(out, (args, tuple(kwargs.values())))
            del out
            readings.append(max(0, seen.peak - seen.end))
    return min(readings), got


def _returned_by(out: Any, inputs: Any) -> tuple:
    """For each tensor of `out`: (its strides, its storage's bytes), or None where its
    storage is an input's or another output's (the op did not allocate it alone)."""
    tensors = value_tensors(out)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    taken = {t.untyped_storage().data_ptr() for t in value_tensors(inputs)}
    return tuple(None if ptr in taken or ptrs.count(ptr) > 1
                 else (tuple(t.stride()), t.untyped_storage().nbytes())
                 for t, ptr in zip(tensors, ptrs))


def workspace_summary(graphs: Iterable[fx.GraphModule]) -> dict[str, int]:
    """{op: the largest workspace charged to a node of that op} over ``graphs``."""
    largest: dict[str, int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            nbytes = node.meta.get(WORKSPACE_BYTES, 0)
            if nbytes and isinstance(node.target, OpOverload):
                name = str(node.target)
                largest[name] = max(largest.get(name, 0), nbytes)
    return largest
