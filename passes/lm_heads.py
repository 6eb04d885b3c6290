"""A language model's head run chunk by chunk over the tokens: find it in dynamo's graph,
price its chunk sizes, apply one.

In a language model the last projection and its loss hold what no recomputation of the
body removes: ``F.cross_entropy(F.linear(h, W, b).view(-1, V), target)`` keeps the
(tokens, V) log-probabilities for backward, whose backward then makes their gradient
and the logits' gradient, each as large. ``chunk_heads`` (run on dynamo's torch-level
graph, before AOTAutograd traces it, like passes.cell_loops) puts memopt's ``head_fwd`` op
(memopt.lm_head) in the pattern's place; AOTAutograd then traces its ``head_bwd`` into
the backward. The planner (memopt.planner) chooses each head's chunk, the tokens
computed at once, after capture, by rewriting the ops' first argument (``apply``):
one chunk keeps eager's log-probabilities and recomputes nothing; smaller chunks keep
nothing and recompute each chunk's logits in backward (one more matmul of the head).

Requires (``chunk_heads``): the torch-level FX graph dynamo hands a backend, FakeTensors
in ``node.meta["example_value"]``, a graph that records gradients outside autocast.

The pattern, from the loss back:
    loss   = F.cross_entropy(x, target, ignore_index=i, reduction="mean" | "sum")
             (no class weights, no label smoothing), or
             F.nll_loss(F.log_softmax(x, dim=1 or -1), target, ...) alike;
    x      = logits through views / reshapes / ``.contiguous()`` / a cast to float32,
             each read only by the next, ending (tokens, V) with target (tokens,);
    logits = F.linear(h, W, b): the projection to the vocabulary, V = W.shape[0].
The logits may have other readers after the loss (a model that returns them, as Hugging
Face's do): the op then returns them too, computed whole in the forward.

Ensures: the loss and every gradient are eager's (memopt.lm_head); ``find_heads`` lists
the ops in the joint graph; ``apply`` records the bytes liveness charges
(passes.meta.HELD_BYTES behind the forward op's handle, WORKSPACE_BYTES on both ops),
measured on real tensors at two chunk sizes (``head_costs``).
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from ._torch_compat import real_tensors
from .allocated import can_track, maybe_allocation_peak, note_unmeasured
from .meta import NN_MODULE_STACK, OpBytes, _clean_path, fake_value, record_op_bytes, \
    handle_readers
from .runtime import runtime

log = logging.getLogger("memopt")

#: The key dynamo writes each node's FakeTensor value under.
EXAMPLE_VALUE = "example_value"
#: Positions of the ops' arguments (memopt.lm_head schemas).
_CHUNK, _WANT_LOGITS, _UPCAST, _IGNORE, _REDUCTION = 0, 2, 4, 5, 6
_FWD_H, _FWD_W, _FWD_B, _FWD_TARGET = 7, 8, 9, 10
_BWD_HANDLE = 4
#: The smallest chunk the planner tries: below it the matmuls get slow for little gain.
MIN_CHUNK_ROWS = 16

_PASS_METHODS = frozenset({"view", "reshape", "contiguous", "flatten", "float", "to"})
_PASS_FUNCTIONS = frozenset({torch.reshape, torch.flatten})


def _ops():
    return torch.ops.memopt.head_fwd.default, torch.ops.memopt.head_bwd.default


# -- in dynamo's graph: find the pattern and rewrite it ---------------------------------


@dataclass(frozen=True)
class Attach:
    """Where a graph returns a head's logits without a gradient, and what gives them one
    outside it (memopt.lm_head.attach_logits): positions in the graph's flat output tuple
    (the projection's input is an extra output, after the graph's own) and among its
    placeholders (the projection's weight and bias). With ``skip_logits`` the logits are
    not computed: ``h`` is None (no extra output) and ``skipped`` their (shape, dtype,
    device), for the caller's memoryless placeholder (memopt.markers.SkippedLogits)."""

    logits: int
    h: int | None
    weight: int
    bias: int | None
    skipped: tuple[tuple[int, ...], torch.dtype, torch.device] | None = None


@dataclass(frozen=True)
class ChunkedHeadSite:
    """A head the pass replaced by ``memopt::head_fwd``."""

    name: str
    rows: int
    vocab: int
    attach: Attach | None = None


def _example(node) -> torch.Tensor | None:
    value = node.meta.get(EXAMPLE_VALUE) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _bind(fn, node: fx.Node) -> dict | None:
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


@dataclass(frozen=True)
class _Match:
    loss: fx.Node
    through: tuple[fx.Node, ...]   # from the loss's input back to the logits' first reader
    linear: fx.Node
    target: fx.Node
    ignore_index: int
    reduction: str
    upcast: bool


def _loss_input(node: fx.Node) -> tuple[fx.Node, dict, list[fx.Node]] | str:
    """The loss node's logits-side input, its arguments, and a log_softmax between them."""
    if node.target is F.cross_entropy:
        args = _bind(F.cross_entropy, node)
        if args is None:
            return "cross_entropy's arguments could not be read"
        if args["label_smoothing"] != 0.0:
            return "label smoothing"
        return args["input"], args, []
    args = _bind(F.nll_loss, node)
    if args is None:
        return "nll_loss's arguments could not be read"
    source = args["input"]
    if not isinstance(source, fx.Node) or len(source.users) != 1:
        return "nll_loss of a value read elsewhere"
    if source.op == "call_function" and source.target is F.log_softmax:
        ls = _bind(F.log_softmax, source)
    elif source.op == "call_method" and source.target == "log_softmax":
        ls = {"input": source.args[0], "dim": source.args[1] if len(source.args) > 1
              else source.kwargs.get("dim"), "dtype": source.kwargs.get("dtype")}
    else:
        return "nll_loss not of a log_softmax"
    if ls is None or ls.get("dim") not in (1, -1) or ls.get("dtype") is not None:
        return "log_softmax not over the classes of a 2-D input"
    return ls["input"], args, [source]


def _match(loss: fx.Node) -> _Match | str:
    """The head pattern ending at ``loss`` (a cross_entropy or nll_loss call), or why not."""
    found = _loss_input(loss)
    if isinstance(found, str):
        return found
    x, args, between = found
    if args.get("weight") is not None:
        return "class weights"
    if args.get("size_average") is not None or args.get("reduce") is not None:
        return "the deprecated size_average / reduce arguments"
    reduction, ignore_index, target = args["reduction"], args["ignore_index"], args["target"]
    if reduction not in ("mean", "sum") or not isinstance(ignore_index, int):
        return f"reduction {reduction!r}"
    xv, tv = _example(x), _example(target)
    if xv is None or tv is None or xv.dim() != 2 or tv.dim() != 1 or tv.is_floating_point() \
            or tv.shape[0] != xv.shape[0]:
        return "not (tokens, classes) logits with (tokens,) class targets"
    through: list[fx.Node] = [*between]
    node = x
    while isinstance(node, fx.Node) and not (node.op == "call_function"
                                             and node.target is F.linear):
        passes = (node.op == "call_method" and node.target in _PASS_METHODS) or (
            node.op == "call_function" and node.target in _PASS_FUNCTIONS)
        if not passes or len(node.users) != 1:
            return f"the logits pass through {node.target} (or are read elsewhere)"
        if node.target == "to" and _example(node) is not None and (
                _example(node).dtype != torch.float32 or len(node.args) + len(node.kwargs) > 2):
            return "a cast other than to float32"
        through.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return "no linear projection before the loss"
    lv, xv0 = _example(node), _example(x)
    if lv is None or lv.shape[-1] != xv.shape[1] or lv.numel() != xv.numel():
        return "the loss's classes are not the projection's last dimension"
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    wv = _example(weight)
    if wv is None or wv.dim() != 2 or not lv.is_floating_point():
        return "a projection whose weight is not a 2-D tensor"
    upcast = xv0.dtype != lv.dtype
    if upcast and xv0.dtype != torch.float32:
        return "a cast other than to float32"
    return _Match(loss=loss, through=tuple(reversed(through)), linear=node, target=target,
                  ignore_index=ignore_index, reduction=reduction, upcast=upcast)


def _describe(node: fx.Node) -> str:
    stack = node.meta.get(NN_MODULE_STACK) or {}
    paths = [_clean_path(str(p)) for p, _ in stack.values()]
    return paths[-1] if paths and paths[-1] else "head"


def _returned_only(gm: fx.GraphModule, linear: fx.Node, others: list[fx.Node]
                   ) -> tuple[int, int, int | None] | None:
    """When the logits' only other reader is the graph's output (a flat tuple, as dynamo
    writes it) and the projection's weight and bias are placeholders: the logits' output
    position and the weight's and bias's placeholder positions. Else None."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    flat = output.args[0]
    if others != [output] or not isinstance(flat, (tuple, list)) or list(flat).count(linear) != 1:
        return None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs.get("weight")
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if weight not in placeholders or (bias is not None and bias not in placeholders):
        return None
    return (list(flat).index(linear), placeholders.index(weight),
            placeholders.index(bias) if bias is not None else None)


def _autocast_inside(gm: fx.GraphModule) -> dict[fx.Node, dict[str, torch.dtype | None]]:
    """The autocast regions a forward enters itself (`with torch.autocast(...)` inside it:
    dynamo's `_enter_autocast` / `_exit_autocast` nodes): per node inside one, {device
    type: dtype, or None where the region turns autocast off}, innermost last."""
    active: list[tuple[fx.Node, str, torch.dtype | None]] = []
    found: dict[fx.Node, dict[str, torch.dtype | None]] = {}
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == "_enter_autocast" and len(node.args) >= 3:
            device, dtype, enabled = node.args[:3]
            active.append((node, device, dtype if enabled else None))
        elif name == "_exit_autocast":
            active = [a for a in active if a[0] not in node.args]
        elif active:
            found[node] = {device: dtype for _, device, dtype in active}
    return found


def chunk_heads(gm: fx.GraphModule, autocast: dict[str, torch.dtype] | None = None,
                skip_logits: bool = False, returned_only: bool = False
                ) -> list[ChunkedHeadSite]:
    """Replace every head pattern of ``gm`` (see the module docstring) by ``head_fwd``
    with one chunk (the planner chooses the chunk later); returns what it replaced. A
    pattern it cannot prove equal is left as it is, with one debug line saying why.

    ``autocast``: {device type: dtype} of the autocast regions the graph is traced in
    (``torch.autocast`` around the forward), and those the forward enters itself
    (``_autocast_inside``: its loss came out bfloat16 where eager's is float32, found
    from outside). There eager runs the projection in that
    dtype (``linear`` is on autocast's lower-precision list) and the loss in float32, so
    the op is given ``h`` cast to it, an explicit node that AOTAutograd differentiates (its
    backward casts the gradient back, as autocast's cast does), and upcasts the logits for
    the loss. The op computes in ``h``'s dtype: it casts the weight and bias for its
    matmuls and sums their gradients over the chunks in their own dtype
    (memopt.lm_head._as), so it runs the same kernels with autocast on or off (the
    backward runs outside it).

    Logits the graph only returns (a Hugging Face model's ``outputs.logits``) leave it
    without a gradient, and the projection's input becomes one more output, after the
    graph's own: the caller strips it and attaches the logits' gradient outside the graph
    (``ChunkedHeadSite.attach``, memopt.lm_head.attach_logits). Otherwise autograd would
    make a (tokens, V) zero gradient for them at every backward that does not read them.
    With ``skip_logits`` such logits are not computed at all: the op returns the loss
    alone and the graph an empty tensor in their place, which the caller replaces by a
    placeholder of their shape (``Attach.skipped``).

    ``returned_only`` (no budget: nothing to chunk): only the heads whose logits the graph
    returns beside the loss and which are wider than their input (vocabulary above the
    hidden size: a language model's head, not a classifier's). What the op saves there is
    the logits' zero gradient; elsewhere it would only change what the step holds (a ViT's
    classifier: 0.8 MB more)."""
    runtime("heads")
    fwd_op, _ = _ops()
    done = []
    inside = _autocast_inside(gm)  # regions the forward enters itself
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    output = next(iter(gm.graph.find_nodes(op="output")))
    for loss in list(gm.graph.nodes):
        if loss.op != "call_function" or loss.target not in (F.cross_entropy, F.nll_loss):
            continue
        match = _match(loss)
        if isinstance(match, str):
            log.debug("memopt heads: %s left as it is: %s", loss.name, match)
            continue
        linear = match.linear
        others = [u for u in linear.users if u not in match.through]
        if any(order[u] < order[loss] for u in others):
            log.debug("memopt heads: %s left as it is: its logits are read before the loss",
                      loss.name)
            continue
        returned = _returned_only(gm, linear, others)
        h = linear.args[0]
        if returned_only and (returned is None
                              or _example(linear).shape[-1] <= _example(h).shape[-1]):
            log.debug("memopt heads: %s left as it is: no budget, and no wide logits it "
                      "returns", loss.name)
            continue
        weight = linear.args[1] if len(linear.args) > 1 else linear.kwargs["weight"]
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        logits = _example(linear)
        rows, vocab = logits.numel() // logits.shape[-1], logits.shape[-1]
        cast = {**(autocast or {}), **inside.get(loss, {})}.get(logits.device.type)
        skip = skip_logits and returned is not None
        if skip:
            others = []
        graph = gm.graph
        with graph.inserting_before(loss):
            flat = graph.call_function(torch.reshape, (h, (rows, _example(h).shape[-1])))
            args = [flat, weight, bias]
            if cast is not None:  # autocast's cast of h, made explicit (the docstring)
                args[0] = graph.call_method("to", (flat, cast))
            op = graph.call_function(fwd_op, (
                rows, True, bool(others), returned is None, match.upcast or cast is not None,
                match.ignore_index, match.reduction, *args, match.target))
            for key in ("stack_trace", NN_MODULE_STACK):
                if key in linear.meta:
                    op.meta[key] = linear.meta[key]
            value = graph.call_function(operator.getitem, (op, 0))
            value.meta[EXAMPLE_VALUE] = loss.meta.get(EXAMPLE_VALUE)
            if others:
                out = graph.call_function(operator.getitem, (op, 1))
                out = graph.call_function(torch.reshape, (out, tuple(logits.shape)))
                out.meta[EXAMPLE_VALUE] = logits.detach() if returned else logits
        loss.replace_all_uses_with(value)
        graph.erase_node(loss)
        for node in reversed(match.through):
            graph.erase_node(node)
        if others:
            linear.replace_all_uses_with(out)
        elif skip:  # nothing computed: an empty tensor holds the output's place
            with graph.inserting_before(output):
                empty = graph.call_function(torch.empty, ((0,),), {
                    "dtype": logits.dtype, "device": logits.device})
            linear.replace_all_uses_with(empty)
        graph.erase_node(linear)
        attach = None
        if skip:
            position, w_at, b_at = returned
            attach = Attach(logits=position, h=None, weight=w_at, bias=b_at,
                            skipped=(tuple(logits.shape), logits.dtype, logits.device))
        elif returned is not None:
            position, w_at, b_at = returned
            outputs = list(output.args[0])
            attach = Attach(logits=position, h=len(outputs), weight=w_at, bias=b_at)
            output.args = (tuple(outputs + [h]), *output.args[1:])
        done.append(ChunkedHeadSite(name=_describe(linear), rows=rows, vocab=vocab,
                                    attach=attach))
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


# -- in the joint graph: sites, costs, configurations -----------------------------------


@dataclass(frozen=True)
class HeadSite:
    """One head_fwd op of the joint graph and its backward op(s)."""

    fwd: str
    bwds: tuple[str, ...]
    name: str
    rows: int                   # tokens
    vocab: int
    hidden: int                 # d, the projection's input features
    log_prob_bytes: int         # the (tokens, V) float log-probabilities one chunk keeps
    #: where the forward op returns its handle, which holds what the op keeps for backward
    #: (its last output; -1 for a site made by hand)
    handle: int = -1
    #: the op forms the whole logits for a reader besides the loss (a model returning
    #: them); False: never formed (the loss is the only reader, or skip_logits)
    returns_logits: bool = False

    @property
    def matmul_flops(self) -> int:
        """One forward of the projection: what a chunked backward recomputes."""
        return 2 * self.rows * self.hidden * self.vocab


def find_heads(joint: fx.GraphModule) -> list[HeadSite]:
    """Every head_fwd node and its head_bwd nodes (none in an inference graph)."""
    fwd_op, bwd_op = _ops()
    nodes = list(joint.graph.nodes)
    sites = []
    for node in nodes:
        if node.target is not fwd_op:
            continue
        bwds = handle_readers(nodes, node, bwd_op, _BWD_HANDLE)
        h, w = fake_value(node.args[_FWD_H]), fake_value(node.args[_FWD_W])
        rows, vocab = int(h.shape[0]), int(w.shape[0])
        upcast = node.args[_UPCAST]
        size = 4 if upcast else torch.promote_types(h.dtype, w.dtype).itemsize
        stack = node.meta.get(NN_MODULE_STACK) or {}
        paths = [_clean_path(str(p)) for p, _ in stack.values()]
        sites.append(HeadSite(fwd=node.name, bwds=tuple(n.name for n in bwds),
                              name=paths[-1] if paths and paths[-1] else "head", rows=rows,
                              vocab=vocab, hidden=int(h.shape[1]),
                              log_prob_bytes=rows * vocab * size,
                              handle=len(fake_value(node)) - 1,
                              returns_logits=bool(node.args[_WANT_LOGITS])))
    return sites


@dataclass(frozen=True)
class HeadCosts:
    """A chunked head's transient bytes, linear in the chunk's rows c: ``forward_*`` is
    what its forward op allocates beyond what it returns (the chunk's logits and
    log-probabilities), ``backward_*`` what its backward op allocates beyond its
    gradients (the chunk's logits and their gradient); ``whole_*`` the same for one
    chunk, which keeps the log-probabilities instead."""

    forward_first: int
    forward_per_row: int
    backward_first: int
    backward_per_row: int
    whole_forward: int
    whole_backward: int

    def forward(self, chunk: int) -> int:
        return max(0, self.forward_first + (chunk - 1) * self.forward_per_row)

    def backward(self, chunk: int) -> int:
        return max(0, self.backward_first + (chunk - 1) * self.backward_per_row)


def _node(joint: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in joint.graph.nodes if n.name == name)


def head_costs(joint: fx.GraphModule, site: HeadSite) -> HeadCosts:
    """Measured on zeros of the real shapes on the real device (inside real_tensors):
    the forward and backward ops at two chunk sizes and as one chunk, under allocation
    tracking. Where allocations cannot be tracked (another profiler is recording on
    CPU: memopt planning a step inside a user's memory profile) they are estimated from
    the sizes instead (``_estimated_costs``)."""
    fwd_op, bwd_op = _ops()
    node = _node(joint, site.fwd)
    a = node.args
    h, w = fake_value(a[_FWD_H]), fake_value(a[_FWD_W])
    b = fake_value(a[_FWD_B]) if a[_FWD_B] is not None else None
    device = h.device
    if not can_track(device):
        note_unmeasured()
        return _estimated_costs(site, h.element_size(), bool(a[_UPCAST]))
    # once per process for a head of these shapes and options: a compilation plans its
    # graphs several times (the first forward's re-plans, a repeated block's second plan),
    # and measuring took ~1 s each time for the zoo Llama's 512 x 8000 head
    try:
        key = (site.rows, tuple(a[_WANT_LOGITS:_FWD_H]), str(device), torch.get_num_threads(),
               *((tuple(map(int, t.shape)), tuple(map(int, t.stride())), t.dtype)
                 if t is not None else None for t in (h, w, b)))
    except TypeError:  # a symbolic size: measured every time
        return _measured_costs(site, a, h, w, b, fwd_op, bwd_op)
    if key not in _COSTS:
        _COSTS[key] = _measured_costs(site, a, h, w, b, fwd_op, bwd_op)
    return _COSTS[key]


#: head_costs' measurements, by what they depend on
_COSTS: dict[tuple, HeadCosts] = {}


def _measured_costs(site: HeadSite, a: tuple, h: torch.Tensor, w: torch.Tensor,
                    b: torch.Tensor | None, fwd_op: Any, bwd_op: Any) -> HeadCosts:
    """head_costs' measurement, on zeros of `h`, `w` and `b`'s shapes."""
    device, tracked = h.device, True

    def measure(chunk: int) -> tuple[int, int]:
        def zeros(t):
            return None if t is None else torch.zeros(t.shape, dtype=t.dtype, device=device)

        hr, wr, br = zeros(h), zeros(w), zeros(b)
        target = torch.zeros(site.rows, dtype=torch.int64, device=device)
        with maybe_allocation_peak(device, tracked, own_only=True) as fwd:
            loss, logits, handle = fwd_op(chunk, True, *a[_WANT_LOGITS:_FWD_H], hr, wr, br,
                                          target)
        grad_logits = torch.zeros_like(logits) if logits.numel() and a[3] else None
        grad_loss = torch.ones_like(loss)
        with maybe_allocation_peak(device, tracked) as bwd:
            grads = bwd_op(chunk, a[_UPCAST], a[_IGNORE], a[_REDUCTION], handle, grad_loss,
                           grad_logits, hr, wr, br, target, True, True, br is not None)
            out = sum(g.untyped_storage().nbytes() for g in grads)
        return fwd.peak - fwd.end, max(0, bwd.peak - out)

    def least(chunk: int) -> tuple[int, int]:
        # twice, the smaller of each: what a run allocates once for the process (a
        # library's first-call buffers) or frees of what lived before it (a collected
        # tensor) is not the chunk's own transient; in the reverse-order suite one
        # process's head measured 230 KB above the same head's step
        (f, b), (g, c) = measure(chunk), measure(chunk)
        return min(f, g), min(b, c)

    # both sizes below the rows: a chunk of every row runs the one-chunk path (in place,
    # nothing recomputed), whose transients are not a chunk's (a 64-row head measured at
    # 16 and 64 rows priced its 32-row chunks at half what they hold: a step 2-3% over
    # its budget, found from outside on two MoE models)
    top = max(1, site.rows - 1)
    small = min(top, MIN_CHUNK_ROWS)
    large = min(top, 4 * small)
    with real_tensors():
        (f1, b1) = least(small)
        (f2, b2) = least(large) if large > small else (f1, b1)
        whole = least(site.rows)
    f_per = max(0, (f2 - f1) // (large - small)) if large > small else 0
    b_per = max(0, (b2 - b1) // (large - small)) if large > small else 0
    return HeadCosts(forward_first=f1 - (small - 1) * f_per, forward_per_row=f_per,
                     backward_first=b1 - (small - 1) * b_per, backward_per_row=b_per,
                     whole_forward=whole[0], whole_backward=whole[1])


def _estimated_costs(site: HeadSite, itemsize: int, upcast: bool) -> HeadCosts:
    """The transients from the sizes, for where allocations cannot be measured (a
    profiler already recording: memopt planning inside a user's memory profile).

    Split, counted high: per row of a chunk, its logits (``itemsize`` each), their float
    copy when ``upcast``, and two float (tokens, V) temporaries (log-probabilities or
    softmax, and the gradient). One chunk as memopt.lm_head runs it: its forward keeps
    the logits and log-probabilities it returns and holds, and makes only the float copy
    of the logits when it upcasts them; its backward turns the kept log-probabilities
    into the logits' gradient in place, and makes only that gradient's copy in the
    weight's dtype when that is not float (measured on CPU, fp32: 4.5 KiB and 8.5 KiB for
    a (512, 8000) head; the split estimate charged 15.6 MiB each, 12% over a Llama's
    step). Where it does not return the logits, they are a temporary of its forward
    (measured: 409,596 bytes for a (512, 200) head, which this estimate once left out).
    A plan made on this estimate is made again at the first step outside the profiler
    (memopt.backend)."""
    row = site.vocab * (itemsize + (4 if upcast else 0) + 2 * 4)
    copy = upcast and itemsize != 4
    logits = 0 if site.returns_logits else site.rows * site.vocab * itemsize  # a temporary
    whole_forward = logits + (site.rows * site.vocab * 4 if copy else 0)
    whole_backward = site.rows * site.vocab * itemsize if copy else 0
    return HeadCosts(forward_first=row, forward_per_row=row, backward_first=row,
                     backward_per_row=row, whole_forward=whole_forward,
                     whole_backward=whole_backward)


@dataclass(frozen=True)
class HeadConfig:
    """One chunk size for a head, with the bytes liveness charges."""

    chunk: int
    chunks: int
    held_bytes: int
    forward_workspace_bytes: int
    workspace_bytes: int
    recompute_flops: int


def configure(site: HeadSite, costs: HeadCosts, chunk: int) -> HeadConfig:
    """The head run in chunks of ``chunk`` tokens (one chunk: eager's log-probabilities
    kept, nothing recomputed)."""
    chunk = max(1, min(chunk, site.rows))
    if chunk >= site.rows:
        return HeadConfig(chunk=site.rows, chunks=1, held_bytes=site.log_prob_bytes,
                          forward_workspace_bytes=costs.whole_forward,
                          workspace_bytes=costs.whole_backward, recompute_flops=0)
    return HeadConfig(chunk=chunk, chunks=math.ceil(site.rows / chunk), held_bytes=0,
                      forward_workspace_bytes=costs.forward(chunk),
                      workspace_bytes=costs.backward(chunk), recompute_flops=site.matmul_flops)


def configurations(site: HeadSite, costs: HeadCosts) -> list[HeadConfig]:
    """One chunk, then 2, 4, 8, ... chunks while a chunk has at least MIN_CHUNK_ROWS
    tokens (always at least one split when the head has two tokens or more)."""
    configs = [configure(site, costs, site.rows)]
    parts = 2
    while site.rows >= parts and (site.rows // parts >= MIN_CHUNK_ROWS or parts == 2):
        configs.append(configure(site, costs, math.ceil(site.rows / parts)))
        parts *= 2
    return configs


def op_bytes(site: HeadSite, config: HeadConfig) -> dict[str, OpBytes]:
    """What ``config`` makes the site's ops hold and allocate, by node name."""
    return {site.fwd: OpBytes(((site.handle, config.held_bytes),),
                              config.forward_workspace_bytes),
            **{b: OpBytes((), config.workspace_bytes) for b in site.bwds}}


def apply(graphs: list[fx.GraphModule], site: HeadSite, config: HeadConfig) -> None:
    """Rewrite the site's ops in ``graphs`` to run ``config``, and record its bytes."""
    fwd_op, bwd_op = _ops()
    nbytes = op_bytes(site, config)
    for gm in graphs:
        for node in gm.graph.nodes:
            if (node.target is fwd_op and node.name == site.fwd) or (
                    node.target is bwd_op and node.name in site.bwds):
                node.args = (config.chunk, *node.args[1:])
                record_op_bytes(node, nbytes[node.name])
