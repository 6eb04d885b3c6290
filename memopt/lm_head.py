"""A language model's head and loss as two opaque operators, run chunk by chunk over the
tokens: ``memopt::head_fwd`` and ``memopt::head_bwd``.

The last projection of a language model and its loss,
``F.cross_entropy(linear(h, W, b).view(-1, V), target)``, hold what no recomputation of
the body removes: eager saves the (tokens, vocabulary) log-probabilities for backward and
its backward makes two more tensors of that size (their gradient, and the logits'). With
a vocabulary of 50k they are most of a small model's step. memopt.passes.lm_heads finds the
pattern in dynamo's graph and puts these ops in its place; the planner then chooses
``chunk``, the rows (tokens) computed at once, by rewriting the ops' first argument:

- ``chunk >= tokens`` (one chunk): eager's way. The forward keeps the log-probabilities
  (behind the ``handle`` output, in a side table, as memopt.recurrent.ops keeps a chain's
  states) and the backward turns them into the logits' gradient in place. Nothing is
  recomputed; the bytes held are eager's, and the backward makes one such tensor fewer.
- ``chunk < tokens``: the forward computes each chunk's logits, log-softmax and loss sum
  and keeps nothing; the backward recomputes each chunk's logits (one more matmul of the
  head) and writes that chunk's gradient of ``h``, adding into ``W``'s and ``b``'s. The
  full logits and their gradient never exist at once.

The loss and every gradient are eager's (cross-entropy with ``ignore_index`` and a
``mean`` or ``sum`` reduction; rows are independent, so chunks change only the order of
the final sums). When the model also returns the logits (Hugging Face's models do), the
forward computes them whole as its second output, and the backward adds their incoming
gradient chunk by chunk. The logits may be cast to float32 before the loss (``upcast``,
as transformers' loss functions do): the loss is then computed in float32 and the
gradient cast back, as autograd does through the cast.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from memopt.passes._torch_compat import library_for_op
from memopt.passes.runtime import RUNTIMES

from .markers import SkippedLogits

if TYPE_CHECKING:  # pragma: no cover
    from memopt.passes.lm_heads import Attach

_STASH: dict[int, tuple[Tensor, Tensor]] = {}  # handle -> (log-probabilities, count)
_HANDLES = itertools.count(1)


def _fresh_scalar(x: Tensor) -> Tensor:
    """A loss on its own 0-dim storage (a reduced kernel result may view a larger one)."""
    return x.clone() if x.untyped_storage().nbytes() > x.element_size() else x


def _as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in the head's compute dtype, which is ``h``'s: under autocast passes.lm_heads
    casts ``h`` and leaves the weight and bias in their own dtype, so that the op casts
    them for its matmuls, as autocast does, and sums their gradients over the chunks in
    their own dtype (a float32 weight's over 16 chunks in bf16 came out 2.6% from eager's
    on a tied embedding)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _valid_count(target: Tensor, ignore_index: int) -> Tensor:
    return (target != ignore_index).sum()


def _chunks(rows: int, chunk: int) -> list[tuple[int, int]]:
    chunk = max(1, min(chunk, rows))
    return [(i, min(rows, i + chunk)) for i in range(0, rows, chunk)] or [(0, 0)]


def _log_probs(logits: Tensor, upcast: bool) -> Tensor:
    return F.log_softmax(logits.float() if upcast else logits, dim=1)


#: The ops are defined with torch.library's low-level API: a custom_op's Python wrappers
#: (its backend check of the outputs' aliasing, and for head_bwd an autograd layer it never
#: needs) cost about a quarter of a one-chunk head's host time per step, which a small
#: model's GPU step waits for (docs/kernels.md). One library per op, replaced when this
#: module runs again in a process (passes._torch_compat.library_for_op).
_FWD_LIB, _BWD_LIB = library_for_op("memopt", "head_fwd"), library_for_op("memopt", "head_bwd")
_FWD_LIB.define("head_fwd(int chunk, bool keep, bool want_logits, bool logits_grad, bool upcast, "
                "int ignore_index, str reduction, Tensor h, Tensor weight, Tensor? bias, "
                "Tensor target) -> Tensor[]", tags=(torch.Tag.pt2_compliant_tag,))
_BWD_LIB.define("head_bwd(int chunk, bool upcast, int ignore_index, str reduction, "
                "Tensor handle, Tensor grad_loss, Tensor? grad_logits, Tensor h, Tensor weight, "
                "Tensor? bias, Tensor target, bool need_h, bool need_weight, bool need_bias) "
                "-> Tensor[]", tags=(torch.Tag.pt2_compliant_tag,))
_REDUCTIONS = {"mean": 1, "sum": 2}  # aten's enum (torch.nn._reduction)


def _stash(kept: tuple[Tensor, Tensor] | None) -> Tensor:
    """A handle: an int64 scalar naming `kept` in the side table until head_bwd takes it
    (or the handle dies: a forward without a backward)."""
    if kept is None:
        return torch.zeros((), dtype=torch.int64)
    key = next(_HANDLES)
    handle = torch.tensor(key, dtype=torch.int64)
    _STASH[key] = kept
    weakref.finalize(handle, _STASH.pop, key, None)
    return handle


def head_fwd(chunk: int, keep: bool, want_logits: bool, logits_grad: bool, upcast: bool,
             ignore_index: int, reduction: str, h: Tensor, weight: Tensor, bias: Tensor | None,
             target: Tensor) -> list[Tensor]:
    """[loss, logits (rows, V) or an empty tensor, handle]. ``h`` is (rows, d), ``target``
    (rows,). With ``keep`` and one chunk, the log-probabilities (and aten's count of the
    rows not ignored) stay under the handle. Without ``logits_grad`` the logits output is
    not differentiable here: the caller attaches their gradient outside the compiled
    graph (``attach_logits``)."""
    rows = h.shape[0]
    weight, bias = _as(weight, h.dtype), _as(bias, h.dtype)
    logits = F.linear(h, weight, bias) if want_logits else None
    out = logits if logits is not None else h.new_empty((0,), dtype=h.dtype)
    if chunk >= rows:  # eager's way, in aten's own loss kernel (its mean, its count)
        log_probs = _log_probs(logits if logits is not None else F.linear(h, weight, bias),
                               upcast)
        loss, count = torch.ops.aten.nll_loss_forward(log_probs, target, None,
                                                      _REDUCTIONS[reduction], ignore_index)
        return [loss, out, _stash((log_probs, count) if keep else None)]
    total = None
    for i, j in _chunks(rows, chunk):
        part = logits[i:j] if logits is not None else F.linear(h[i:j], weight, bias)
        log_probs = _log_probs(part, upcast)
        del part
        loss = F.nll_loss(log_probs, target[i:j], ignore_index=ignore_index, reduction="sum")
        total = loss if total is None else total + loss
        del log_probs
    if reduction == "mean":
        total = total / _valid_count(target, ignore_index)
    return [_fresh_scalar(total), out, _stash(None)]


@torch.library.register_fake("memopt::head_fwd", lib=_FWD_LIB)
def _(chunk, keep, want_logits, logits_grad, upcast, ignore_index, reduction, h, weight, bias,
      target):
    loss_dtype = torch.float32 if upcast else torch.promote_types(h.dtype, weight.dtype)
    rows = h.shape[0] if want_logits else 0
    logits = h.new_empty((rows, weight.shape[0]) if want_logits else (0,), dtype=h.dtype)
    return [h.new_empty((), dtype=loss_dtype), logits, torch.empty((), dtype=torch.int64)]


def _grad_of_logits(log_probs_or_logits: Tensor, from_logits: bool, target: Tensor,
                    ignore_index: int, scale: Tensor) -> Tensor:
    """d loss / d logits for one chunk: scale * (softmax - onehot(target)) on the rows
    whose target is not ignored, zero on the others. From the kept log-probabilities it
    is computed in place. (An ignored row gets its -1 at column 0, then is zeroed.)"""
    if from_logits:
        g = torch.softmax(log_probs_or_logits, dim=1)
    else:
        g = log_probs_or_logits.exp_()
    valid = target != ignore_index
    g.scatter_(1, torch.where(valid, target, 0).unsqueeze(1), -1.0, reduce="add")
    scale = scale if scale.dtype == g.dtype else scale.to(g.dtype)
    g.mul_(valid.unsqueeze(1) * scale)  # one pass over (rows, V): mask and scale at once
    return g


def _whole_bwd(kept: tuple[Tensor, Tensor], upcast: bool, ignore_index: int,
               reduction: str, grad_loss: Tensor, grad_logits: Tensor | None, h: Tensor,
               weight: Tensor, bias: Tensor | None, target: Tensor, need_h: bool,
               need_weight: bool, need_bias: bool) -> list[Tensor]:
    """head_bwd from the kept log-probabilities of one chunk: the logits' gradient in
    their place, scaled by aten's count of the rows (as nll_loss's own backward)."""
    log_probs, count = kept
    scale = grad_loss.float() if upcast else grad_loss
    if reduction == "mean":
        scale = scale / count
    g = _grad_of_logits(log_probs, False, target, ignore_index, scale)
    del kept, log_probs
    if grad_logits is not None and grad_logits.numel():
        g.add_(grad_logits)
    if g.dtype != h.dtype:
        g = g.to(h.dtype)
    w = _as(weight, h.dtype)
    grad_h = torch.mm(g, w) if need_h else h.new_empty((0,))
    grad_w = torch.mm(g.t(), h) if need_weight else weight.new_empty((0,))
    if need_weight and grad_w.dtype != weight.dtype:
        grad_w = grad_w.to(weight.dtype)
    grad_b = weight.new_empty((0,))
    if need_bias and bias is not None:
        grad_b = g.sum(0)
        grad_b = grad_b if grad_b.dtype == bias.dtype else grad_b.to(bias.dtype)
    return [grad_h, grad_w, grad_b]


def head_bwd(chunk: int, upcast: bool, ignore_index: int, reduction: str, handle: Tensor,
             grad_loss: Tensor, grad_logits: Tensor | None, h: Tensor, weight: Tensor,
             bias: Tensor | None, target: Tensor, need_h: bool, need_weight: bool,
             need_bias: bool) -> list[Tensor]:
    """[grad_h, grad_weight, grad_bias] (zeros of no size where not needed)."""
    kept = _STASH.pop(int(handle), None)
    if kept is not None:
        return _whole_bwd(kept, upcast, ignore_index, reduction, grad_loss, grad_logits, h,
                          weight, bias, target, need_h, need_weight, need_bias)
    rows = h.shape[0]
    scale = grad_loss.float() if upcast else grad_loss
    if reduction == "mean":
        scale = scale / _valid_count(target, ignore_index)
    grad_h = torch.empty_like(h) if need_h else h.new_empty((0,))
    spans = _chunks(rows, chunk)
    # summed over the chunks into zeros; one span writes them at once (no (V, d) memset)
    whole = len(spans) == 1
    grad_w = weight.new_empty((0,)) if not need_weight or whole else torch.zeros_like(weight)
    grad_b = weight.new_empty((0,)) if not need_bias or bias is None or whole \
        else torch.zeros_like(bias)
    out_w, out_b = weight, bias  # their own dtypes
    weight, bias = _as(weight, h.dtype), _as(bias, h.dtype)  # the compute dtype (_as)
    for i, j in spans:
        part = F.linear(h[i:j], weight, bias)
        part = part.float() if upcast else part
        g = _grad_of_logits(part, True, target[i:j], ignore_index, scale)
        del part
        if grad_logits is not None and grad_logits.numel():
            g.add_(grad_logits[i:j])
        g = g.to(h.dtype)
        if need_h:
            torch.mm(g, weight, out=grad_h[i:j])
        if need_weight and whole:
            grad_w = torch.mm(g.t(), h[i:j]).to(out_w.dtype)
        elif need_weight and grad_w.dtype == g.dtype:
            grad_w.addmm_(g.t(), h[i:j])
        elif need_weight:  # summed in the weight's own dtype (_as)
            grad_w.add_(torch.mm(g.t(), h[i:j]))
        if need_bias and bias is not None and whole:
            grad_b = g.sum(0).to(out_b.dtype)
        elif need_bias and bias is not None:
            grad_b.add_(g.sum(0))
        del g
    return [grad_h, grad_w, grad_b]


_FWD_LIB.impl("head_fwd", head_fwd, "CompositeExplicitAutograd")
_BWD_LIB.impl("head_bwd", head_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("memopt::head_bwd", lib=_BWD_LIB)
def _(chunk, upcast, ignore_index, reduction, handle, grad_loss, grad_logits, h, weight, bias,
      target, need_h, need_weight, need_bias):
    return [torch.empty_like(h) if need_h else h.new_empty((0,)),
            torch.empty_like(weight) if need_weight else weight.new_empty((0,)),
            torch.empty_like(bias) if need_bias and bias is not None else weight.new_empty((0,))]


def _setup_context(ctx, inputs, output) -> None:
    (chunk, _keep, _want_logits, logits_grad, upcast, ignore_index, reduction, h, weight, bias,
     target) = inputs
    if not logits_grad:
        ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no (tokens, V) zeros for logits no loss reads
    ctx.args = (chunk, upcast, ignore_index, reduction)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(output[-1], h, weight, bias if bias is not None else h.new_empty(0),
                          target)


def _backward(ctx, grads):
    grad_loss, grad_logits = grads[0], grads[1]
    handle, h, weight, bias, target = ctx.saved_tensors
    bias = bias if ctx.has_bias else None
    need = ctx.needs_input_grad[1:]  # the inputs after logits_grad line up with head_fwd's
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=torch.float32 if ctx.args[1] else h.dtype,
                                device=h.device)
    out = torch.ops.memopt.head_bwd(*ctx.args, handle, grad_loss, grad_logits, h, weight,
                                      bias, target, bool(need[6]), bool(need[7]),
                                      bool(need[8]) and bias is not None)
    return (None,) * 7 + (out[0] if need[6] else None, out[1] if need[7] else None,
                          out[2] if need[8] and bias is not None else None, None)


torch.library.register_autograd("memopt::head_fwd", _backward, setup_context=_setup_context,
                                lib=_FWD_LIB)


class _AttachLogits(torch.autograd.Function):
    """The logits a compiled graph returns without a gradient, given one: the gradient
    reaching them (a loss the caller computes on the logits) flows to ``h``, ``weight``
    and ``bias`` as through ``F.linear``."""

    @staticmethod
    def forward(ctx, logits, h, weight, bias):
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        # in the logits' dtype, as F.linear ran under autocast (its inputs cast to it), and
        # each gradient back in its input's dtype, as autocast's casts return it
        h, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0])
        flat = h.reshape(-1, weight.shape[1]).to(g.dtype)
        grad_h = (g @ weight.to(g.dtype)).view_as(h).to(h.dtype) \
            if ctx.needs_input_grad[1] else None
        grad_w = (g.t() @ flat).to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_b = g.sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[3] \
            else None
        return None, grad_h, grad_w, grad_b


def attach_logits(logits: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``logits`` (returned by a compiled graph without a gradient) with autograd through
    ``F.linear(h, weight, bias)``. A model that returns its logits beside its loss would
    otherwise get a (tokens, V) zero gradient for them at every backward, made by autograd
    for a graph output the loss does not read; here nothing is made unless the caller's
    loss reads them."""
    return _AttachLogits.apply(logits, h, weight, bias)

# passes.lm_heads reaches this runtime through the registry (imports run one way)
RUNTIMES.heads = sys.modules[__name__]


def with_attached_logits(compiled: Callable, attaches: list[Attach]) -> Callable:
    """`compiled` returning what dynamo expects: the graph's extra outputs (each head's
    projection input, memopt.passes.lm_heads) stripped, and each head's logits given their
    gradient through the projection (attach_logits), or, where they were
    not computed (skip_logits), a memoryless placeholder in their place."""
    extra = sum(a.h is not None for a in attaches)

    def run(*args: Any) -> Any:
        out = list(compiled(*args))
        own = out[:len(out) - extra]
        for a in attaches:
            if a.skipped is not None:  # skip_logits: not computed (memopt.markers)
                own[a.logits] = SkippedLogits(*a.skipped)
                continue
            bias = args[a.bias] if a.bias is not None else None
            own[a.logits] = attach_logits(own[a.logits], out[a.h], args[a.weight], bias)
        return own

    return run
