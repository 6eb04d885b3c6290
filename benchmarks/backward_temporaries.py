"""What an eager autograd node's backward makes beyond the gradients it is handed and
returns: the measurement behind memopt.eager_reads.BACKWARD_TEMPORARIES.

    python -m benchmarks.backward_temporaries             # CPU, every op below
    python -m benchmarks.backward_temporaries --device cuda

Code memopt does not compile (a loss the caller computes from the outputs, eager code
after a graph break) runs its backward while the plan's tensors are held, and memopt
counts what each of its autograd nodes holds at once (eager_reads.gradient_bytes). The
gradients are in autograd's metadata; what a formula makes on the way is not:
``PowBackward0`` computes ``grad * (2 * self.pow(1))`` and holds three tensors of the
input's size with the gradient it was handed, where handed and returned count two.

For each op below, one node: ``y = op(x)`` over a (512, 512) float32 ``x`` made by
autograd (not a leaf, so the gradient it returns counts as eager code's would), then
``torch.autograd.grad(y, x, ones)`` inside ``memopt.measure.allocation_peak``. What the
node held at once is the handed gradient plus the block's peak; the table prints that
over what ``gradient_bytes`` counts, in units of the node's largest gradient ("missing",
0 or less where the count covers it), with the kind's entry in the table. A row whose
"missing" is above 0 is a kind the table under-counts.

A second table measures the forward of the fused losses (``forward_ops``): the peak of
``y = op(x)`` beyond its output, in units of ``x``, against
``memopt.eager_reads.FORWARD_TEMPORARIES``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from memopt.eager_reads import (BACKWARD_TEMPORARIES, FORWARD_TEMPORARIES, gradient_bytes,
                                node_kind)
from memopt.measure import allocation_peak

SIZE = 512


def ops(device: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """One-node ops over a positive (SIZE, SIZE) input: name -> op."""
    torch.manual_seed(0)
    other = torch.rand(SIZE, SIZE, device=device) + 0.1
    classes = torch.randint(0, SIZE, (SIZE,), device=device)
    return {
        "pow": lambda x: x ** 2, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
        "div": lambda x: other / x, "div_numerator": lambda x: x / other,
        "div_scalar": lambda x: x / 0.1, "erf": torch.erf, "erfc": torch.erfc,
        "asin": lambda x: torch.asin(x * 0.5), "acos": lambda x: torch.acos(x * 0.5),
        "atan": torch.atan, "cos": torch.cos, "sinh": torch.sinh, "cosh": torch.cosh,
        "log2": torch.log2, "log10": torch.log10,
        "minimum": lambda x: torch.minimum(x, other), "amin": lambda x: x.amin(-1),
        "clamp_min": lambda x: x.clamp_min(0.5), "clamp_max": lambda x: x.clamp_max(0.5),
        "var": lambda x: x.var(), "prod": lambda x: (x * 0.01 + 1).prod(-1),
        "soft_margin_loss": lambda x: F.soft_margin_loss(x, other.sign()),
        "binary_cross_entropy": lambda x: F.binary_cross_entropy(x.clamp(0.01, 0.99),
                                                                 other.clamp(0, 1)),
        "tan": torch.tan, "logsumexp": lambda x: x.logsumexp(-1), "cumsum": lambda x: x.cumsum(-1),
        "maximum": lambda x: torch.maximum(x, other), "amax": lambda x: x.amax(-1),
        "norm": lambda x: x.norm(dim=-1), "std": lambda x: x.std(), "sqrt": torch.sqrt,
        "sin": torch.sin, "log1p": torch.log1p, "abs": torch.abs,
        "clamp": lambda x: x.clamp(0.2, 0.8), "exp": torch.exp, "log": torch.log,
        "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
        "softmax": lambda x: x.softmax(-1), "log_softmax": lambda x: x.log_softmax(-1),
        "mul": lambda x: x * x, "mse_loss": lambda x: F.mse_loss(x, other),
        "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, other),
        "nll_loss": lambda x: F.nll_loss(x, classes),
        "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, other.clamp(0, 1)),
    }


def measure(op: Callable[[torch.Tensor], torch.Tensor], device: str) -> tuple[str, float, int]:
    """(the node's kind, what it held beyond ``gradient_bytes`` in units of its largest
    gradient, the bytes it held at once) for one op."""
    torch.manual_seed(1)
    x = (torch.rand(SIZE, SIZE, device=device) + 0.1).requires_grad_() * 1.0
    y = op(x)
    node = y.grad_fn
    handed = torch.ones_like(y)
    with allocation_peak(device) as seen:
        (grad,) = torch.autograd.grad(y, x, handed)
        del grad
    held = handed.numel() * handed.element_size() + seen.peak
    unit = max(x.numel(), y.numel()) * x.element_size()
    return node_kind(node), (held - gradient_bytes(node)) / unit, held


def forward_ops(device: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Ops over a (SIZE, SIZE) input in (0.1, 0.9) whose forward frees temporaries of its
    size before it returns (and controls that make none): name -> op."""
    torch.manual_seed(0)
    target = torch.rand(SIZE, SIZE, device=device)
    classes = torch.randint(0, SIZE, (SIZE,), device=device)
    return {
        "bce_with_logits": lambda x: F.binary_cross_entropy_with_logits(x, target),
        "mse_loss": lambda x: F.mse_loss(x, target),
        "smooth_l1_loss": lambda x: F.smooth_l1_loss(x, target),
        "huber_loss": lambda x: F.huber_loss(x, target), "logsumexp": lambda x: x.logsumexp(-1),
        "cross_entropy": lambda x: F.cross_entropy(x, classes),
        "soft_margin_loss": lambda x: F.soft_margin_loss(x, target.round() * 2 - 1),
        "binary_cross_entropy": lambda x: F.binary_cross_entropy(x, target),
    }


def measure_forward(op: Callable[[torch.Tensor], torch.Tensor], device: str
                    ) -> tuple[str, float]:
    """(the kind of the node ``op`` ends in, what its forward held beyond its output and
    what it saved, in units of its input) for one op."""
    torch.manual_seed(1)
    x = (torch.rand(SIZE, SIZE, device=device) * 0.8 + 0.1).requires_grad_() * 1.0
    with allocation_peak(device) as seen:
        y = op(x)
    kind = node_kind(y.grad_fn)
    del y
    return kind, (seen.peak - seen.end) / (x.numel() * x.element_size())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print(f"{'op':18s} {'node kind':20s} {'held':>10s} {'missing':>8s} {'table':>6s}")
    for name, op in ops(args.device).items():
        kind, missing, held = measure(op, args.device)
        print(f"{name:18s} {kind:20s} {held:10d} {missing:8.2f} "
              f"{BACKWARD_TEMPORARIES.get(kind, 0):6.1f}")
    print(f"\n{'forward of':18s} {'node kind':28s} {'made':>6s} {'table':>6s}")
    for name, op in forward_ops(args.device).items():
        kind, made = measure_forward(op, args.device)
        print(f"{name:18s} {kind:28s} {made:6.2f} {FORWARD_TEMPORARIES.get(kind, 0):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
