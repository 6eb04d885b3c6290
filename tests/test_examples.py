"""The examples run as documented (README's first command runs the quickstart)."""

from __future__ import annotations

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
