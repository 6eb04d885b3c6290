"""The information buffer: the bits that multiplying by a forget value discards, kept so
that the multiplication can be undone exactly (MacKay et al. 2018, Alg. 1, Sec. 5.1;
the algorithm is Maclaurin et al. 2015's).

One ``InformationBuffer`` serves one state tensor (one half of a hidden or cell state):
each element ("unit") has its own stack of 64-bit words. The words are vectorized
(Sec. 5.1): ``top`` is an int64 tensor shaped like the state, holding every unit's
current word, and the full words below it are a Python list of such tensors, the same
depth for every unit.

Overflow (Sec. 5.1): Alg. 1 step 1 multiplies the current word by 2^R_Z. Words are
signed int64 here, so a word at or above 2^(63 - R_Z) would overflow; before the step,
if any unit's word is that large, every unit's word is pushed onto the list and a zero
word starts ("whenever a buffer being used for any hidden unit in the minibatch
overflows, an extra integer must be added to the buffer list for every hidden unit").
The step at which each push happened is recorded, so the reversal pops at that step.
This costs storage on top of eq. 17's ideal: up to R_Z bits of the overflowing unit's
word unused (and its sign bit), and the other units' words pushed however full they are.
``BufferSize`` reports both the bits held and the bytes allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .fixed_point import R_Z, bit_length, forgotten_bits

_SPILL_AT = 1 << (63 - R_Z)  # a word this large would overflow int64 at Alg. 1 step 1
_LOW_BITS = (1 << R_Z) - 1  # h* mod 2^R_Z as a mask


@dataclass(frozen=True)
class BufferSize:
    """How large an information buffer is.

    ``nbytes``: bytes of int64 words allocated (what the buffer costs in memory).
    ``bits``: the bits it holds: each unit's words' bit lengths, summed.
    ``ideal_bits``: eq. 17, the bits forgotten, sum of log2(2^R_Z / z*) over every
    multiplication: what an ideal, unboundedly growing integer per unit would hold.
    ``units``: how many per-unit stacks (state elements) there are.
    """

    nbytes: int = 0
    bits: int = 0
    ideal_bits: float = 0.0
    units: int = 0

    def __add__(self, other: BufferSize) -> BufferSize:
        return BufferSize(self.nbytes + other.nbytes, self.bits + other.bits,
                          self.ideal_bits + other.ideal_bits, self.units + other.units)


class InformationBuffer:
    """Per-unit stacks of int64 words for one state tensor (see the module docstring).

    ``multiply`` runs Alg. 1 and pushes what it discards; ``divide`` undoes the last
    ``multiply`` and pops. ``saved`` and ``restore`` snapshot the words and rebuild a
    buffer from them (popping the rebuilt one leaves the snapshot as it was).
    """

    def __init__(self, like: Tensor) -> None:
        self.top = torch.zeros_like(like, dtype=torch.int64)
        self.words: list[Tensor] = []
        self.pushed_at: list[int] = []  # the multiplication count at each push
        self.count = 0
        self._ideal = torch.zeros((), dtype=torch.float64, device=like.device)

    def multiply(self, h: Tensor, z: Tensor) -> Tensor:
        """h* -> about h* z* / 2^R_Z, storing the lost information.

        MacKay et al. 2018, Alg. 1 (with Sec. 5.1's overflow as step 0); B is ``top``,
        h* and z* are int64 tensors shaped like it, 0 < z* <= 2^R_Z:
        0. If any B >= 2^(63 - R_Z), push every unit's B and start from B = 0.
        1-2. B <- B 2^R_Z + (h* mod 2^R_Z)   (make room, store the lost low bits)
        3. h* <- floor(h* / 2^R_Z)
        4. h* <- h* z*
        5. h* <- h* + (B mod z*)              (give back what fits under z*)
        6. B <- floor(B / z*)
        """
        # Step 0: overflow (Sec. 5.1).
        if bool((self.top >= _SPILL_AT).any()):
            self.words.append(self.top)
            self.pushed_at.append(self.count)
            self.top = torch.zeros_like(self.top)
        # Steps 1-2: B is non-negative, so shift and mask are exact.
        buf = (self.top << R_Z) | (h & _LOW_BITS)
        # Steps 3-5: the arithmetic shift floors, also for negative h*.
        h = (h >> R_Z) * z + torch.remainder(buf, z)
        # Step 6.
        self.top = torch.div(buf, z, rounding_mode="floor")
        self.count += 1
        self._ideal = self._ideal + forgotten_bits(z).sum()
        return h

    def divide(self, h: Tensor, z: Tensor) -> Tensor:
        """Undo the last ``multiply`` (Alg. 1's steps in reverse order): returns the h*
        that was multiplied, and restores B to what it was before."""
        self.count -= 1
        # Undo steps 5-6: the B of step 5 left its remainder under z* in h*.
        buf = self.top * z + torch.remainder(h, z)
        # Undo steps 3-4 (floor division: h* = q z* + r with 0 <= r < z*).
        h = torch.div(h, z, rounding_mode="floor") * (1 << R_Z) + (buf & _LOW_BITS)
        # Undo steps 1-2.
        self.top = buf >> R_Z
        # Undo step 0.
        if self.pushed_at and self.pushed_at[-1] == self.count:
            self.pushed_at.pop()
            self.top = self.words.pop()
        self._ideal = self._ideal - forgotten_bits(z).sum()
        return h

    def saved(self) -> tuple[list[Tensor], tuple[list[int], int]]:
        """The words (bottom to top, then the current one) and the bookkeeping needed to
        rebuild this buffer with ``restore``."""
        return [*self.words, self.top], (list(self.pushed_at), self.count)

    @classmethod
    def restore(cls, words: list[Tensor], bookkeeping: tuple[list[int], int]
                ) -> InformationBuffer:
        """The buffer ``saved`` described (popping it leaves ``words`` untouched)."""
        buffer = cls(words[-1])
        buffer.words, buffer.top = list(words[:-1]), words[-1]
        buffer.pushed_at, buffer.count = list(bookkeeping[0]), bookkeeping[1]
        return buffer

    def is_empty(self) -> bool:
        """True when no information is held (every multiplication has been undone and
        the words are back to zero)."""
        return not self.words and self.count == 0 and not bool(self.top.any())

    def size(self) -> BufferSize:
        """Bits held and bytes allocated now (one device synchronization)."""
        words = [*self.words, self.top]
        bits = sum(int(bit_length(word).sum()) for word in words)
        return BufferSize(nbytes=sum(w.numel() * w.element_size() for w in words), bits=bits,
                          ideal_bits=float(self._ideal), units=self.top.numel())
