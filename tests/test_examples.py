"""The examples run as documented (README's first command runs the quickstart)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["quickstart.py", "budget.py", "word_language_model.py",
                                    "reversible_language_model.py"])
def test_example_runs_and_matches_eager(script: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equal" in proc.stdout and ": True" in proc.stdout


def test_fsdp_example_runs_on_two_gloo_ranks() -> None:
    """examples/fsdp.py as documented (`torchrun --nproc_per_node 2`), on a free port."""
    import socket  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master-port", str(port), str(EXAMPLES / "fsdp.py")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equal eager's on the whole batch: True" in proc.stdout
    assert "FSDP2 shards" in proc.stdout and "refused" in proc.stdout
