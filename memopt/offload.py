"""The runtime of offloaded values: copies to pinned host memory and back on a side
stream, fenced by events (the plan's schedule: memopt.allocator.offload).

The planned graphs call three functions (passes.offload puts them there):

    to_host(x)              after the op that produces a saved value, in the forward:
                            the side stream waits for that op, copies `x` into a pinned
                            host buffer and records an event; `x.record_stream` keeps the
                            allocator from handing its block to another op before the
                            copy has read it. The host buffer is what the forward saves.
    prefetch(host, device)  at the plan's prefetch step in the backward: a device buffer
                            is allocated on the main stream, the side stream waits for the
                            main stream's work so far (whatever last used that block); its
                            own order puts the copy back after the copy out; it records an
                            event.
    ready(x)                before the value's first backward read: the main stream waits
                            for that event. Nothing reads the value before it.

Correct by construction: a value is copied, never recomputed, so a dropout mask comes
back as drawn; only memopt's own side stream touches the copies, and each is ordered
after the op that wrote its source by an event, so collectives on other streams (DDP's
buckets, FSDP's all-gathers) neither read nor free them. Nothing here keeps a buffer:
the host buffer is a saved tensor of autograd's graph and the events live in a table
whose entries go with their tensors (`weakref.finalize`), so a step that raises, or a
forward whose backward never runs, frees every pinned buffer with the graph
(`pending()` counts what is left).

Where the device has no separate host memory (CPU), the copy is a no-op that runs
through the same calls: the host "buffer" is the value itself and the streams and
events do nothing, so the planner, the rewritten graphs and this runtime are tested on
CPU with eager's gradients, but memory is only freed on a GPU (or with CPU_HOST_COPIES,
which the tests use to measure the plan's accounting). `host_bytes()` counts the bytes
between their copy out and their copy back either way.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch


class _NoStream:
    """A stream where the device has no separate host memory: every call does nothing."""

    def wait_event(self, event: Any) -> None:
        pass


class _NoEvent:
    def record(self, stream: Any = None) -> None:
        pass


class Streams:
    """Everything device-specific the copies do, for one device: its current and side
    streams, events, the host buffer and the device buffer, the copy, and keeping a block
    from reuse while the side stream reads it. CUDA's are torch.cuda's; elsewhere every
    call does nothing and the "host buffer" is the value itself (or, with CPU_HOST_COPIES,
    a copy outside PyTorch's allocator). The tests put a recording stand-in in `_streams`
    to check the order of events the CUDA path relies on."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.side = torch.cuda.Stream(device) if self.cuda else _NoStream()

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else _NoStream()

    def event(self) -> Any:
        return torch.cuda.Event() if self.cuda else _NoEvent()

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        if self.cuda:
            with torch.cuda.stream(self.side):
                yield
        else:
            yield

    def host_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        """An empty host buffer for `x` (None: `x` itself stands for it, nothing copied)."""
        if self.cuda:
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu",
                                       pin_memory=True)
        if CPU_HOST_COPIES:
            return torch.frombuffer(bytearray(x.numel() * x.element_size()),
                                    dtype=x.dtype).view(x.shape)
        return None

    def device_buffer(self, host: torch.Tensor, device: str) -> torch.Tensor | None:
        """An empty device buffer for `host` (None: `host` itself is on the device)."""
        if self.cuda or CPU_HOST_COPIES:
            return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype,
                                       device=device)
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)

    def keep_for_side(self, x: torch.Tensor) -> None:
        """The allocator may not reuse `x`'s block until the side stream's work so far ends."""
        if self.cuda:
            x.record_stream(self.side)


#: True: on CPU the copy to host is real, into memory outside PyTorch's allocator (a
#: Python bytearray), and the copy back a new tensor, so the bytes PyTorch's allocator
#: hands out during a step are those a GPU's would hold: the tests measure the plan's
#: accounting this way (memopt.measure.allocation_peak). False (the default): a no-op.
CPU_HOST_COPIES = False

_streams: dict[torch.device, Streams] = {}
#: id(device buffer) -> the event its copy back records
_events: dict[int, Any] = {}
#: host buffer's data pointer -> the bytes it holds off the device
_host: dict[int, int] = {}


def _streams_of(device: torch.device) -> Streams:
    if device not in _streams:
        _streams[device] = Streams(device)
    return _streams[device]


def _track(table: dict[int, Any], key: int, t: torch.Tensor, value: Any) -> None:
    """`table[key] = value` for as long as `t` lives."""
    table[key] = value
    weakref.finalize(t, table.pop, key, None)


def to_host(x: torch.Tensor) -> torch.Tensor:
    """Start copying `x` to pinned host memory; the host buffer (on CPU: `x`)."""
    s = _streams_of(x.device)
    produced = s.event()
    produced.record(s.current())
    s.side.wait_event(produced)  # the copy reads `x` only once the op that made it ran
    with s.on_side():
        host = s.host_buffer(x)
        if host is None:
            host = x
        else:
            s.copy(host, x)
            s.keep_for_side(x)
    _track(_host, host.untyped_storage().data_ptr(), host, x.untyped_storage().nbytes())
    return host


def prefetch(host: torch.Tensor, device: str) -> torch.Tensor:
    """Start copying `host` back to `device`; the device buffer (on CPU: `host`)."""
    s = _streams_of(torch.device(device))
    _host.pop(host.untyped_storage().data_ptr(), None)
    x = s.device_buffer(host, device)  # allocated on the main stream
    issued = s.event()
    issued.record(s.current())
    s.side.wait_event(issued)  # whatever the main stream ran in that block first is done
    with s.on_side():  # the side stream's order puts it after the copy out
        if x is None:
            x = host
        else:
            s.copy(x, host)
        done = s.event()
        done.record(s.side)
    _track(_events, id(x), x, done)
    return x


def ready(x: torch.Tensor) -> torch.Tensor:
    """Make the main stream wait for `x`'s copy back; `x`."""
    event = _events.pop(id(x), None)
    if event is not None:
        _streams_of(x.device).current().wait_event(event)
    return x


def pending() -> int:
    """Copies in flight or values on the host that a live tensor still stands for."""
    return len(_events) + len(_host)


def host_bytes() -> int:
    """Bytes of offloaded values between their copy out and their copy back."""
    return sum(_host.values())
