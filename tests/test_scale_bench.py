"""benchmarks/scale.py runs end to end on a small Llama shape (2 layers, d 256): a plan and
a smallest budget below its peak, with the seconds each took."""

import pytest

pytest.importorskip("transformers")

from benchmarks import scale  # noqa: E402


def test_scale_row_and_table():
    row = scale.measure(2, hidden=256, seq=128)
    assert row["peak"] > row["smallest"] > 0
    assert row["total_s"] >= row["capture_s"] > 0 and row["plan_s"] > 0
    assert "| 2 |" in scale.table([row])
