"""How long the runtime holds each storage of a training step, and what kind it is.

One model of the step's lifetimes, shared by the exact liveness analysis
(passes.liveness.analyze_liveness) and the step simulator (passes.simulate), which
both walk the schedule for each storage's first and last touch and then apply these
rules (Chen et al. 2016, Sec. 3 counts a value live from its first to its last use; the
runtime holds some longer):

    resident (parameters, buffers, inputs)     the whole step
    outputs the caller keeps, gradients        to the end of the step
    outputs the caller drops (drop_outputs)    at least to the forward's end
    anything else                              its last touch

and what each storage is, for the plan and its picture (`kind_of`), and the bytes the
runtime holds that no graph value owns (`held_outside`): `.grad` tensors kept from
earlier steps, what other graphs of the step hold, and the output gradients autograd
sums outside the compiled backward. Plain data in, plain data out: no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

#: Storage kinds resident for the whole step (not part of the step's arena).
RESIDENT_KINDS = ("parameter", "buffer", "input", "existing_grad")


@dataclass(frozen=True)
class StepShape:
    """`num_forward` of the schedule's `num_steps` steps are the forward's."""

    num_forward: int
    num_steps: int

    @property
    def end_of_step(self) -> int:
        return self.num_steps - 1


@dataclass(frozen=True)
class Holds:
    """The storages (by any hashable key) the runtime treats specially: `resident` maps
    each primal's storage to its kind (parameter, buffer, input); `kept` are the outputs
    the caller holds until the step ends; `outputs` every output of the forward to the
    caller; `gradients` what the backward returns; `tangents` the output gradients it
    reads; `saved` what the forward saves for it."""

    resident: Mapping[Hashable, str]
    kept: Collection[Hashable]
    outputs: Collection[Hashable]
    gradients: Collection[Hashable]
    tangents: Collection[Hashable] = ()
    saved: Collection[Hashable] = ()

    def end(self, key: Hashable, start: int, last: int, shape: StepShape) -> int:
        """The last step `key`'s storage is held, first touched at `start` and last at
        `last`."""
        if key in self.resident or key in self.kept or key in self.gradients:
            end = shape.end_of_step
        elif key in self.outputs:  # a dropped output lives to the forward's end at least
            end = max(last, shape.num_forward - 1)
        else:
            end = last
        return max(end, start)

    def kind_of(self, key: Hashable, start: int, shape: StepShape) -> str:
        """The storage's kind (passes.liveness.KINDS), first touched at `start`."""
        if key in self.resident:
            return self.resident[key]
        if key in self.tangents:
            return "tangent"
        if start >= shape.num_forward:
            return "gradient" if key in self.gradients else "backward"
        if key in self.outputs:
            return "output"
        return "saved" if key in self.saved else "activation"


@dataclass(frozen=True)
class HeldOutside:
    """Bytes the runtime holds from `start` to `end` that no graph value owns."""

    name: str
    nbytes: int
    start: int
    end: int
    kind: str


def held_outside(shape: StepShape, *, existing_grads: Mapping[str, int] | None,
                 outside_bytes: Sequence[int], outside_grad_bytes: int,
                 has_backward: bool, saved_bytes: int = 0) -> list[HeldOutside]:
    """What the step holds beside its graph's storages, in this order:

    - each `.grad` kept from earlier steps (`existing_grads`: bytes by parameter primal),
      for the whole step;
    - what the rest of the step holds (`outside_bytes`: (forward, backward[,
      after_backward]), memopt.steps) over the forward, over the backward, and as the
      backward ends (FSDP2's reduce-scatter, on top of what is live then); a fourth,
      for a graph that runs several times in the forward (a repeated block,
      memopt.blocks), (n, forward, backward) for each of its runs: what the rest holds
      around that run besides its n own earlier runs, each holding what this plan saves
      (`saved_bytes`); the largest over its runs is held; a fifth, what eager code
      after the graph holds while its backward runs, just before the graph's
      (`before_backward`), at the first backward step;
    - the output gradients autograd holds at once outside the compiled backward just
      before it starts (`outside_grad_bytes`), at the first backward step.
    """
    nf, end = shape.num_forward, shape.end_of_step
    held = [HeldOutside(f"grad.{primal}", nbytes, -1, end, "existing_grad")
            for primal, nbytes in (existing_grads or {}).items()]
    after = outside_bytes[2] if len(outside_bytes) > 2 else 0
    own = outside_bytes[3] if len(outside_bytes) > 3 else ()
    before = outside_bytes[4] if len(outside_bytes) > 4 else 0
    forward = max([outside_bytes[0]] + [f + n * saved_bytes for n, f, _ in own])
    backward = max([outside_bytes[1]] + [b + n * saved_bytes for n, _, b in own])
    for name, nbytes, start, stop in (("outside.forward", forward, 0, nf - 1),
                                      ("outside.backward", backward, nf, end),
                                      ("outside.after_backward", after, max(nf, end), end)):
        if nbytes and start <= stop:
            held.append(HeldOutside(name, nbytes, start, stop, "outside"))
    if before and has_backward and nf < shape.num_steps:
        # it runs before the graph's first backward op, whose allocations it does not
        # stack on: charged at the forward's last step, with what the rest of the step
        # holds over the backward there
        at = max(nf - 1, 0)
        held.append(HeldOutside("outside.before_backward",
                                before + (max(0, backward - forward) if at < nf else 0),
                                at, at, "outside"))
    if outside_grad_bytes and has_backward and nf < shape.num_steps:
        held.append(HeldOutside("bw.aliased_output_grads", outside_grad_bytes, nf, nf,
                                "tangent"))
    return held
