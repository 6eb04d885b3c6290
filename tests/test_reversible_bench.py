"""The reversible-RNN benchmark (benchmarks/reversible.py) at tiny sizes: the table has a
row per cell with the reversible module holding less for backward than nn.GRU / nn.LSTM
and than its own autograd reference, a row measured in a child process comes back, and
``python -m benchmarks.recurrent --parts reversible`` reaches it.

One torch thread, as in test_reversible.py: on the shared 2-core machine tiny ops take
milliseconds with two spinning OpenMP threads and microseconds with one."""

from __future__ import annotations

import pytest

from benchmarks import recurrent, reversible
from benchmarks.reversible import HEADER, Config, run_reversible

TINY = (Config("gru", 24, 16, batch=4), Config("lstm", 24, 16, batch=4))


pytestmark = pytest.mark.usefixtures("one_thread")


def _table(text: str) -> list[dict[str, str]]:
    """The markdown table's rows as {column: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in lines[1:]]


def _times(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


@pytest.mark.slow  # 24 s; test_row_in_a_child_process runs the same rows' code by default
def test_tiny_grid_in_process() -> None:
    rows = _table(run_reversible(TINY, repeats=1, isolate=False))
    assert [(r["cell"], r["T"], r["hidden"], r["cap"]) for r in rows] == [
        ("GRU", "24", "16", "3"), ("LSTM", "24", "16", "3")]
    assert list(rows[0]) == HEADER
    for row in rows:
        assert _times(row["standard / reversible"]) > 1
        assert _times(row["reference / reversible"]) > 1
        assert _times(row["peak: reference / reversible"]) > 1
        assert _times(row["states / buffer"]) > 1
        # Untrained, capped at 3 bits: the forget gates sit near 0.5.
        assert 0.5 < float(row["bits forgotten / unit / step (eq. 17)"]) <= 3


def test_row_in_a_child_process() -> None:
    config = Config("gru", 8, 8, cap=None, batch=2)
    (row,) = _table(run_reversible([config], repeats=1))
    assert row["cap"] == "none" and not row["standard held"].startswith("failed")
    assert _times(row["reference / reversible"]) > 1


def test_recurrent_runs_the_reversible_part(monkeypatch, capsys) -> None:
    calls = []

    def fake(**kwargs):
        calls.append(kwargs)
        return "reversible table"

    monkeypatch.setattr(recurrent, "run_reversible", fake)
    assert recurrent.main(["--parts", "reversible", "--quick", "--timed-steps", "2"]) == 0
    assert calls == [{"quick": True, "repeats": 2, "cell_timeout": 900}]
    assert "reversible table" in capsys.readouterr().out
    assert reversible.QUICK_GRID == tuple(Config(c, 100, 256) for c in ("gru", "lstm"))
