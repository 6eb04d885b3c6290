"""Shared test setup.

Dynamo caches compiled code per Python code object and stops recompiling a code
object after `recompile_limit` entries; the corpus compiles many instances of the
same model classes, so every test starts from a clean dynamo cache and a fixed seed.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_seed():
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: the reversible modules run many small ops per
    time step, which threads slow down on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
