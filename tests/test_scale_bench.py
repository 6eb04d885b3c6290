"""benchmarks/scale.py runs end to end on a small Llama shape (2 layers, d 512): a plan and
a smallest budget below its peak, with the seconds each took. transformers 4.x's Llama does
not trace on the meta device (its rotary embedding enters autocast on "meta"), so the
benchmark needs transformers 5."""

import pytest

from memopt.budget import default_headroom

pytest.importorskip("transformers", minversion="5.0")

from benchmarks import scale  # noqa: E402


@pytest.mark.slow  # 8 s; tests/test_blocks.py plans blocks on the meta device by default
def test_scale_row_and_table():
    row = scale.measure(2, hidden=512, seq=512)
    # a budget keeps its headroom free: the smallest budget's plan peaks below it
    assert row["peak"] >= row["smallest"] * (1 - default_headroom("meta")) > 0
    assert row["total_s"] >= row["capture_s"] > 0 and row["plan_s"] > 0
    # blocks=True plans each layer once under the step's budget: the flat plan's peak
    # within 5% (the first graph's backward counts the embedding's gradient a little early)
    assert row["blocks_peak"] == pytest.approx(row["peak"], rel=0.05)
    assert row["blocks_peak"] >= row["blocks_smallest"] * (1 - default_headroom("meta")) > 0
    assert "| 2 |" in scale.table([row])
