"""`python -m memopt.report plan.json --out DIR`: the report of a saved plan.

Writes DIR/memory.png (bytes live over the step, the baseline beside memopt: memopt.plot),
DIR/summary.txt (`plan.summary()`) and DIR/plan.json for a plan saved with
`plan.to_json()` (a MemoryPlan, or a StepPlan of several graphs); `plan.save_report(DIR)`
does the same from Python. The picture needs matplotlib (`pip install "memopt[plot]"`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import MemoptError
from .memory_plan import MemoryPlan, StepPlan
from .plot import REPORT_FILES, save_report

__all__ = ["REPORT_FILES", "load_plan", "main"]

Plan = MemoryPlan | StepPlan


def load_plan(text: str | bytes) -> Plan:
    """A MemoryPlan or a StepPlan (a JSON object with "graphs") from `to_json`'s text."""
    data = json.loads(text)
    kind = StepPlan if isinstance(data, dict) and "graphs" in data else MemoryPlan
    return kind.from_json(text)


def main(argv: list[str] | None = None) -> int:
    """`python -m memopt.report plan.json --out DIR`: the report of a saved plan."""
    parser = argparse.ArgumentParser(
        prog="python -m memopt.report",
        description="Write a memopt plan's report: memory.png (bytes live over the step, "
                    "baseline beside memopt), summary.txt and plan.json.")
    parser.add_argument("plan", type=Path, help="a plan saved with plan.to_json()")
    parser.add_argument("--out", type=Path, default=None,
                        help="the report directory (default: <plan>_report beside the plan)")
    args = parser.parse_args(argv)
    if not args.plan.is_file():
        parser.error(f"no such file: {args.plan}")
    try:
        plan = load_plan(args.plan.read_bytes())
    except ValueError as err:  # json.JSONDecodeError and pydantic's ValidationError are
        parser.error(f"{args.plan} is not a memopt plan's JSON: {err}")
    out = args.out if args.out is not None else args.plan.with_name(f"{args.plan.stem}_report")
    try:
        paths = save_report(plan, out)
    except MemoptError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
