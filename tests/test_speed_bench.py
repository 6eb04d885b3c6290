"""The speed table (benchmarks/speed.py, ``python -m benchmarks.run --speed``): on tiny_mlp,
one round, in child processes, its rows and columns are there and its ratios positive; and,
with measurements scripted, times are paired with the same round's eager run and a budget
memopt refuses reads "refused"."""

from __future__ import annotations

import json

import pytest

from benchmarks import speed
from benchmarks.run import markdown
from benchmarks.speed import SPEED_HEADER, Config, run_speed
from memopt.budget import format_bytes
from memopt.measure import Measurement

MATCHED = f"memopt aten @ inductor budget={speed.MATCHED_KNOB} peak"


def _table(rows: list[list[str]]) -> dict[str, dict[str, str]]:
    """The markdown table's rows as {config: {column: cell}} (read back from the text)."""
    lines = [line for line in markdown(rows, SPEED_HEADER).splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
             for line in lines[1:]]
    return {row["config"]: row for row in cells}


def _ratio(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


@pytest.mark.slow
def test_tiny_mlp_one_round() -> None:
    only = (f"inductor budget={speed.MATCHED_KNOB}", "memopt aten", MATCHED)
    table = _table(run_speed(["tiny_mlp"], "cpu", rounds=1, timed_steps=1, cold_cache=False,
                             only=only))
    assert list(table) == ["eager", *only]
    assert list(table["eager"]) == SPEED_HEADER
    for label in ("eager", only[0], "memopt aten"):
        row = table[label]
        assert row["model"] == "tiny_mlp"
        assert _ratio(row["time / eager"]) > 0 and _ratio(row["peak / eager"]) > 0
        assert float(row["first step (s)"]) >= 0  # eager's may round to 0.00
    assert float(table[only[0]]["first step (s)"]) > 0.1  # inductor compiles
    assert table["eager"]["time / eager"] == "1.00x"
    assert table["memopt aten"]["predicted peak"] != "-"
    assert table[only[0]]["predicted peak"] == "-"
    # the budget is the inductor row's measured peak; tiny_mlp's resident bytes leave
    # memopt nothing to drop under it, so it refuses, or meets it
    matched = table[MATCHED]
    assert matched["budget"] == table[only[0]]["measured peak"]
    assert matched["time / eager"] == "refused" or matched["peak <= budget"] == "yes"


def _measurement(seconds: float, peak: int, predicted: int | None = None) -> Measurement:
    return Measurement(peak_bytes=peak, resident_bytes=0, step_seconds=seconds,
                       predicted_peak_bytes=predicted, plan_seconds=None, device="cpu",
                       allocated_peak_bytes=peak, warmup_seconds=2 * seconds)


def test_ratios_pair_each_round_with_its_eager(monkeypatch, tmp_path) -> None:
    configs = [Config("eager", "eager"), Config("torch.compile", "torch_compile"),
               Config("memopt aten", "memopt", "aten"),
               Config("memopt aten @ 60% eager", "memopt", "aten", "eager:0.6"),
               Config("memopt aten @ 10% eager", "memopt", "aten", "eager:0.1")]
    monkeypatch.setattr(speed, "configs", lambda model: configs)
    # Per round: eager 1, 4, 1 s; torch.compile 0.5, 2, 2 s (ratios 0.5, 0.5, 2): the
    # median paired ratio is 0.5; unpaired medians (2 s over 1 s) would say 2.
    eager_s, compiled_s = (1.0, 4.0, 1.0), (0.5, 2.0, 2.0)
    calls: dict[tuple, int] = {}
    budgets = []

    def fake(spec, *, mode, budget, device, timed_steps, options, isolate):
        if mode == "memopt":
            budgets.append(budget)
            if budget == 100:
                raise RuntimeError("child stderr ends with:\nmemopt.errors.BudgetError: no")
        r = calls.get((mode, budget), 0)  # the round: each runs once a round
        calls[mode, budget] = r + 1
        if mode == "eager":
            return _measurement(eager_s[r], 1000)
        if mode == "torch_compile":
            return _measurement(compiled_s[r], 900)
        return _measurement(2.0 * eager_s[r], 600 if budget else 1000, predicted=590)

    monkeypatch.setattr(speed, "measure_step", fake)
    log = tmp_path / "runs.jsonl"
    table = _table(run_speed(["m"], "cpu", rounds=3, cold_cache=False, log=str(log)))
    assert table["torch.compile"]["time / eager"] == "0.50x"
    assert table["torch.compile"]["peak / eager"] == "0.90x"
    assert table["memopt aten"]["time / eager"] == "2.00x"
    assert table["memopt aten @ 60% eager"]["budget"] == format_bytes(600)
    assert table["memopt aten @ 60% eager"]["peak <= budget"] == "yes"
    assert table["memopt aten @ 60% eager"]["predicted peak"] != "-"
    assert table["memopt aten @ 10% eager"]["time / eager"] == "refused"
    assert sorted(set(budgets), key=str) == [100, 600, None]
    assert float(table["eager"]["first step (s)"]) == pytest.approx(2.0)  # median of 2, 8, 2
    # --log: every finished run, one JSON line as it ends (the refused one is not a run)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(runs) == 3 * 4
    assert {(r["config"], r["round"]) for r in runs} == {
        (c.label, k) for c in configs[:4] for k in (1, 2, 3)}
    assert [r["step_seconds"] for r in runs if r["config"] == "eager"] == list(eager_s)


def test_profile_step_interleaves_in_one_process(capsys) -> None:
    """benchmarks.profile_step on tiny_mlp: one row per configuration that was built (a
    refused budget said and left out), the first the reference of the ratios, aten calls
    counted on CPU; two inductor peers in one run refused (they share dynamo's cache)."""
    from benchmarks import profile_step

    code = profile_step.main(["--model", "tiny_mlp", "--device", "cpu", "--configs", "eager",
                              "memopt:aten", "memopt:aten:1KiB", "--rounds", "2", "--steps", "1",
                              "--warmup", "1", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "memopt:aten:1KiB: refused" in out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "config" not in line}
    assert set(rows) == {"eager", "memopt:aten"}, rows
    assert rows["eager"][0] == "1.00" and float(rows["memopt:aten"][0]) > 0
    assert int(rows["memopt:aten"][4]) > 0 and rows["memopt:aten"][6] != "-"  # predicted
    with pytest.raises(SystemExit):
        profile_step.main(["--configs", "torch_compile", "inductor:0.5"])
