"""Fixed-point numbers for exactly reversible recurrent cells (MacKay et al. 2018, Sec. 5).

A hidden value h is held as the int64 h* with h = 2^-R_H h*, R_H = 23 fractional bits;
a forget value z as z = 2^-R_Z z*, R_Z = 10 bits, with 0 < z* <= 2^R_Z (the paper's
"R_H = 23 and R_Z = 10 work well": Alg. 1 adds less than 2^(R_Z - R_H) = 2^-13 of
noise to h). Floating-point values are computed from these integers and from nothing
else, so a forward step and its reversal, reading the same integers, compute the same
gates bit for bit.

Gradients treat every rounding as the identity (straight-through), as the authors'
code does (``ConvertToFixed`` / ``ConvertToFloat`` pass gradients unchanged):
``straight_through`` gives a tensor whose value is the exact fixed-point one and whose
gradient is that of the floating-point expression it replaces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

R_H = 23  # fractional bits of a hidden value
R_Z = 10  # fractional bits of a forget value

_ONE_H = 2.0**R_H
_ONE_Z = 2**R_Z


class Forget(NamedTuple):
    """A quantized forget value: ``value`` = z* / 2^R_Z in floating point (its gradient
    goes straight through to the gate), ``fixed`` = z* as int64."""

    value: Tensor
    fixed: Tensor


def to_fixed(x: Tensor) -> Tensor:
    """h -> h* = round(h 2^R_H), int64 (scaling by a power of two is exact)."""
    return torch.round(x * _ONE_H).to(torch.int64)


def to_float(fixed: Tensor, dtype: torch.dtype) -> Tensor:
    """h* -> h = h* 2^-R_H in ``dtype`` (one rounding, in the int -> float conversion)."""
    return fixed.to(dtype) / _ONE_H


def straight_through(surrogate: Tensor, exact: Tensor) -> Tensor:
    """A tensor equal to ``exact`` bit for bit, with the gradient of ``surrogate``.
    (``surrogate - surrogate.detach()`` is exactly zero, so no rounding creeps in.)"""
    return surrogate - surrogate.detach() + exact


def check_forget_cap(max_forget_bits: int | None) -> None:
    """Raise ValueError unless the cap is None or an int in 1..R_Z (Sec. 5.3)."""
    if max_forget_bits is None:
        return
    if (isinstance(max_forget_bits, bool) or not isinstance(max_forget_bits, int)
            or not 1 <= max_forget_bits <= R_Z):
        raise ValueError(f"max_forget_bits must be None or an int in 1..{R_Z} (bits forgotten "
                         f"per unit per step, MacKay et al. 2018 Sec. 5.3), got "
                         f"{max_forget_bits!r}")


def min_forget_fixed(max_forget_bits: int | None) -> int:
    """The least z*: 2^(R_Z - cap) (at most ``cap`` bits forgotten), or 1 with no cap."""
    return 1 if max_forget_bits is None else 2 ** (R_Z - max_forget_bits)


def quantize_forget(gate: Tensor, max_forget_bits: int | None) -> Forget:
    """A gate in [0, 1] -> the forget value Alg. 1 multiplies by.

    1. Bound forgetting (MacKay et al. 2018, Sec. 5.3): z = (1 - a) gate + a with
       a = 2^-cap, so at most ``cap`` bits are forgotten per step; no cap: a = 0.
    2. Quantize: z* = round(z 2^R_Z), clamped to [max(1, 2^R_Z a), 2^R_Z]. z* > 0 keeps
       the multiplication invertible (the authors' ``EnsureNotForgetAll``); Alg. 1 asks
       for z* < 2^R_Z since a sigmoid never reaches 1, but a gate rounded to 1 is exact
       as well (Alg. 1 reduces to the identity), as in the authors' code.
    3. Straight-through: the value is z* / 2^R_Z, the gradient that of z.
    """
    # Step 1: bound forgetting below.
    if max_forget_bits is not None:
        floor = 2.0**-max_forget_bits
        gate = (1.0 - floor) * gate + floor
    # Step 2: quantize to R_Z bits, z* > 0.
    fixed = torch.round(gate.detach() * _ONE_Z).to(torch.int64)
    fixed = fixed.clamp(min_forget_fixed(max_forget_bits), _ONE_Z)
    # Step 3: straight-through value.
    return Forget(straight_through(gate, fixed.to(gate.dtype) / _ONE_Z), fixed)


def forgotten_bits(z_fixed: Tensor) -> Tensor:
    """Eq. 16: bits forgotten by one multiplication, log2(2^R_Z / z*), in float64."""
    return R_Z - torch.log2(z_fixed.to(torch.float64))


def bit_length(words: Tensor) -> Tensor:
    """Elementwise bit length of non-negative int64 words (0 -> 0), exact."""
    length = torch.zeros_like(words)
    rest = words
    for shift in (32, 16, 8, 4, 2, 1):
        high = rest >= (1 << shift)
        length = length + high * shift
        rest = torch.where(high, rest >> shift, rest)
    return length + (rest > 0)
