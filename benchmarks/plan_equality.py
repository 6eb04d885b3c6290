"""Plan equality before and after a behaviour-preserving change to the planner (issue 24).

A refactor of memopt's planner must leave every plan as it was. This script snapshots
`memopt.plan(...).to_json()` for a fixed set of models and budgets, and compares two
snapshots:

    python -m benchmarks.plan_equality snapshot OUTDIR [--only SUBSTRING] [--jobs N]
    python -m benchmarks.plan_equality compare DIR_A DIR_B

Take the BEFORE snapshot from a checkout of the old code (run from its root, with
PYTHONPATH set to it, so that it imports that checkout's memopt: the snapshot prints
and records `memopt.__file__`), the AFTER one from the new code, and compare them.
`compare` prints a table of the plans that differ and which JSON fields do, and exits 1
on any difference, 0 when every plan is identical.

The models (the test corpus, the transformers zoo, 20 fuzzed models drawn
reproducibly) and the budgets (None, 0.6, and the smallest fraction memopt accepts)
are in benchmarks/plan_equality_models.py, with how each is built and seeded. A
snapshot holds one JSON file per (model, budget), named `<source>-<model>--<budget>`,
so that `diff -r` of two snapshots reads as well, and meta.json (what ran: memopt's
path, the commit, versions, timings; `compare` shows, never compares it).

Conditions of a run, without which two runs of the same code differ:

- every record is planned in a fresh process (`--jobs` of them at a time): memopt
  caches the kernel workspaces it measures for the whole process (passes/workspace.py,
  SHARED), so a plan made after others would depend on what ran before it;
- with Python's automatic garbage collection off (gc.disable()) in that process:
  memopt measures an op's workspace as the peak minus the end of the allocator's events
  while it runs once (passes/workspace.py, `_run`, collect=False), and a collection
  inside that window frees unrelated tensors, whose bytes then count as the op's
  workspace. Two runs with it on, each record in a fresh process, differed in 8 of 117
  plans (zoo/t5's `bw.pow` 256 KiB or 2.5 MiB, zoo/efficientnet's
  `bw.convolution_backward` 607 KiB or 1.35 MiB, corpus/tuple_outputs' `bw.mm` 100 B or
  none; with efficientnet's and t5's budget searches taking other paths); with it off,
  none did;
- one intra-op thread (torch.set_num_threads(1): workspaces are keyed by it).

What a record leaves out, the only fields that still differed between two such runs
of the same code:

- `plan_seconds`, `capture_seconds` (of every MemoryPlan; a BudgetError's are not
  recorded): the wall time of memopt's passes and of dynamo's tracing;
- `chains[*].estimated_seconds`: a recurrent chain policy's time, from chunk times
  measured while planning (passes/chains.py, ChunkCosts).

And it writes the checkout's own path in any string as "<repo>" (a graph break names
its file), so that two checkouts compare.

Timing-dependent models: the planner picks a recurrent chain's policy by the least time
estimated from those measurements, among the policies that fit, so a plan with chains
could change from one run to the next where several fit. None did here (corpus/lstm_loop
is the only model with a chain: at None it is one chunk, 0.6 is refused, and at its
minimum one policy fits), so every field but the three above is compared. A model
found to vary goes into TIMING_DEPENDENT with the fields its comparison leaves out;
`compare` names the plans with chains, and those it compares in part.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

#: Models whose plans vary with measured times: model -> the fields left out of their
#: comparison, as generic paths ("plan.chains[*].chunk"); see the module docstring.
TIMING_DEPENDENT: dict[str, tuple[str, ...]] = {}
META = "meta.json"
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# snapshot
# --------------------------------------------------------------------------


def _init_worker() -> None:
    """A worker's conditions (see the module docstring)."""
    import torch  # noqa: PLC0415

    gc.disable()
    torch.set_num_threads(1)


def _file_name(record: dict[str, Any]) -> str:
    return f"{record['model'].replace('/', '-')}--{record['budget']}.json"


def snapshot_plan(name: str, label: str, outdir: str) -> tuple[str, float, str]:
    """Plan one model at one budget and write its record; (what it wrote, seconds, the
    outcome). Runs in a fresh worker process (see the module docstring)."""
    from benchmarks.plan_equality_models import all_models, record  # noqa: PLC0415

    (model,) = [m for m in all_models() if m.name == name]
    start = time.perf_counter()
    result = record(model, label)
    result["memopt_file"] = _checked().replace(str(ROOT), "<repo>")  # every module it used
    (Path(outdir) / _file_name(result)).write_text(json.dumps(result, indent=1, sort_keys=True)
                                                   + "\n")
    outcome = result["outcome"] + (f" at {result['requested']}" if label == "minimum" else "")
    return _file_name(result), time.perf_counter() - start, outcome


def _checked() -> str:
    """memopt's path, where every memopt module loaded is this checkout's (ROOT): an
    editable install elsewhere maps memopt.passes and memopt.allocator to its own tree
    when the checkout has no memopt/passes, and the snapshot would be of other code."""
    import memopt  # noqa: PLC0415

    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if (name == "memopt" or name.startswith("memopt.")) and where and \
                not Path(where).resolve().is_relative_to(ROOT):
            raise RuntimeError(f"imported {name} from {where}, not from {ROOT}: run from "
                               f"{ROOT} with PYTHONPATH={ROOT} (and memopt/passes, "
                               f"memopt/allocator linked to ../passes, ../allocator where "
                               f"the checkout lacks them)")
    return memopt.__file__


def _commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or None


def _versions() -> dict[str, str]:
    import hypothesis  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "hypothesis": hypothesis.__version__}


def snapshot(outdir: Path, only: str, jobs: int) -> int:
    """Write one record per (model, budget) into `outdir`, each planned in a fresh process,
    `jobs` at a time, and meta.json."""
    from benchmarks.plan_equality_models import BUDGETS, all_models  # noqa: PLC0415

    print(f"memopt: {_checked()}", flush=True)
    if outdir.exists() and any(outdir.iterdir()):
        raise SystemExit(f"{outdir} is not empty: a snapshot goes into a new directory")
    outdir.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in all_models() if only in m.name]
    tasks = [(name, str(b), str(outdir)) for name in names for b in BUDGETS]
    start = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=_init_worker,
                             max_tasks_per_child=1) as pool:
        for written, seconds, outcome in pool.map(snapshot_plan, *zip(*tasks)):
            print(f"{written:<40} {seconds:6.1f} s  {outcome}", flush=True)
    seconds = time.perf_counter() - start
    meta = {"memopt_file": _checked(), "commit": _commit(), "only": only,
            "jobs": jobs, "models": len(names), "plans": len(tasks),
            "seconds": round(seconds, 1), **_versions()}
    (outdir / META).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(names)} models, {len(tasks)} plans in {seconds:.0f} s -> {outdir}")
    return 0


# --------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------


def _load(directory: Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))
            if p.name != META}


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """The paths ("plan.storages[3].offset") where `a` and `b` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            yield from differences(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from differences(x, y, f"{path}[{i}]")
    elif a != b or type(a) is not type(b):
        yield path


def generic(path: str) -> str:
    """A path with its list indices as [*]: "plan.chains[*].chunk"."""
    return re.sub(r"\[\d+\]", "[*]", path)


def _has_chains(record: dict[str, Any]) -> bool:
    return bool((record.get("plan") or {}).get("chains"))


def _compared(record: dict[str, Any], paths: list[str]) -> list[str]:
    """`paths` less those TIMING_DEPENDENT leaves out for the record's model."""
    left_out = TIMING_DEPENDENT.get(record["model"], ())
    return [p for p in paths if not any(generic(p) == f or generic(p).startswith((f + ".", f + "["))
                                        for f in left_out)]


def _fields(paths: list[str]) -> str:
    """Differing paths, grouped by their field ("plan.storages (12)")."""
    counts: dict[str, int] = {}
    for path in paths:
        field = re.split(r"[\[.]", path.removeprefix("plan."), maxsplit=1)[0]
        field = f"plan.{field}" if path.startswith("plan.") else field
        counts[field] = counts.get(field, 0) + 1
    return ", ".join(f"{f} ({n})" if n > 1 else f for f, n in counts.items())


def compare(dir_a: Path, dir_b: Path) -> int:
    """Print the plans that differ between two snapshots and their differing fields;
    1 if any does (or is in one snapshot only), else 0."""
    for directory in (dir_a, dir_b):
        meta = directory / META
        info = json.loads(meta.read_text()) if meta.exists() else {}
        print(f"{directory}: memopt {info.get('memopt_file')}, commit {info.get('commit')}")
    a, b = _load(dir_a), _load(dir_b)
    rows = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            rows.append((name, f"only in {dir_a if name in a else dir_b}", ""))
        elif paths := _compared(a[name], list(differences(a[name], b[name]))):
            rows.append((name, "differs", f"{_fields(paths)}; first: {paths[0]}"))
    chains = [n for n in sorted(a.keys() & b.keys()) if _has_chains(a[n]) or _has_chains(b[n])]
    if chains:
        print(f"with recurrent chains (policy chosen by measured time): {', '.join(chains)}")
    for model, fields in TIMING_DEPENDENT.items():
        print(f"timing-dependent: {model}, compared without {', '.join(fields)}")
    if rows:
        width = max(len(r[0]) for r in rows)
        print(f"{'plan':<{width}}  status   fields")
        for name, status, fields in rows:
            print(f"{name:<{width}}  {status:<7}  {fields}")
    print(f"{len(a.keys() & b.keys())} plans in both, {len(rows)} differ")
    return 1 if rows else 0


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_equality",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    snap = commands.add_parser("snapshot", help="plan every model, one JSON file per plan")
    snap.add_argument("outdir", type=Path)
    snap.add_argument("--only", default="", metavar="SUBSTRING",
                      help="only the models whose name (corpus/mlp, zoo/bert, fuzz/07) has it")
    snap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    comp = commands.add_parser("compare", help="compare two snapshots; exit 1 if they differ")
    comp.add_argument("dir_a", type=Path)
    comp.add_argument("dir_b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        return snapshot(args.outdir, args.only, args.jobs)
    return compare(args.dir_a, args.dir_b)


if __name__ == "__main__":
    sys.exit(main())
