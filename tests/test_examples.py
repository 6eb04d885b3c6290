"""The examples run as documented (README's first command runs the quickstart)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", [
    "quickstart.py",
    pytest.param("budget.py", marks=pytest.mark.slow),  # 12 s; tests/test_recompute.py covers budgets
    # 15 s; tests/test_chains*.py run the LSTM language model's chains by default
    pytest.param("word_language_model.py", marks=pytest.mark.slow),
    # 39 s; tests/test_reversible_compile.py trains the same RevGRU by default
    pytest.param("reversible_language_model.py", marks=pytest.mark.slow)])
def test_example_runs_and_matches_eager(script: str, tmp_path: Path) -> None:
    """Run from an empty directory: what an example writes (the quickstart's picture of
    its plan) lands there, not in the repository."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equal" in proc.stdout and ": True" in proc.stdout
    if script == "quickstart.py":  # the picture, or why not (no [plot] extra)
        picture = tmp_path / "memopt_quickstart.png"
        assert picture.is_file() or 'pip install "memopt[plot]"' in proc.stdout


@pytest.mark.slow  # 12 s; tests/test_ddp_accumulation.py runs its DDP steps on 2 ranks by default
def test_ddp_example_under_torchrun() -> None:
    """examples/ddp.py on 2 gloo ranks as torchrun starts them (`--standalone`: a free
    rendezvous port): every rank within its budget, gradients equal to eager's."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(EXAMPLES / "ddp.py")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = re.findall(r"rank (\d): budget .*?within budget: (\w+); gradients equal "
                       r"eager's: (\w+)", proc.stdout)  # found anywhere: the ranks share stdout
    assert sorted(ranks) == [("0", "True", "True"), ("1", "True", "True")], proc.stdout
    assert "DDP gradient buckets:" in proc.stdout


@pytest.mark.slow  # 12 s; tests/test_fsdp.py runs its FSDP2 steps on 2 ranks by default
@pytest.mark.parametrize("variant", [[], ["--per-block"]], ids=["unit", "per-block"])
def test_fsdp_example_runs_on_two_gloo_ranks(variant: list[str]) -> None:
    """examples/fsdp.py as documented (`torchrun --nproc_per_node 2`, and with
    --per-block), on a free port."""
    import socket  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    # One retry: a rank once aborted as gloo's threads were torn down at exit ("terminate
    # called without an active exception", CI, reverse order), after the example's work.
    for attempt in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master-port", str(port), str(EXAMPLES / "fsdp.py"), *variant],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode == 0 or "terminate called without an active exception" \
                not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "equal eager's on the whole batch: True" in proc.stdout
    if variant:  # one block graph, run by each of the six blocks
        assert "runs (0, 0, 0, 0, 0, 0)" in proc.stdout, proc.stdout
    else:
        assert "FSDP2 shards" in proc.stdout and "refused" in proc.stdout
