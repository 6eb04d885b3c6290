"""How a training step's tensors are told apart: storages, by (device, data pointer).

memopt.steps counts what the rest of a step holds around each graph, and
memopt.eager_reads what eager code between the graphs reads and saves; both key tensors
by their storage, so that views and aliases count once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from memopt.passes._torch_compat import storage_ref

from .markers import Memoryless

StorageId = tuple[str, int]


#: meta tensors count as holding their bytes (`meta_counted`)
_META_COUNTED = False


@contextmanager
def meta_counted() -> Iterator[None]:
    """A step run on the meta device counts its meta tensors' bytes as a real one's
    (memopt.plan(blocks=True)); outside it meta tensors are memopt's own templates."""
    global _META_COUNTED
    before, _META_COUNTED = _META_COUNTED, True
    try:
        yield
    finally:
        _META_COUNTED = before


def holds_memory(t: Any) -> bool:
    """A tensor with memory of its own to count: not on the meta device (but in
    `meta_counted`), not one of memopt's memoryless placeholders (memopt.markers)."""
    return isinstance(t, torch.Tensor) and (_META_COUNTED or t.device.type != "meta") \
        and not isinstance(t, Memoryless)


def storage_id(t: torch.Tensor) -> StorageId:
    """(device, data pointer); on meta, where every data pointer is 0, the StorageImpl's."""
    storage = t.untyped_storage()
    if t.device.type == "meta":
        return ("meta", storage_ref(storage).cdata)
    return (str(t.device), storage.data_ptr())


