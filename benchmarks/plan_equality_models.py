"""What `benchmarks.plan_equality` plans: its models, its budgets, and one plan as a record.

The models, each built from a fixed seed (torch.manual_seed(0) before the weights, 100
before the inputs, as tests/test_corpus.py and tests/test_fuzz.py do):

- ``corpus/<name>``: tests/models.py's CORPUS, the cases tests/test_corpus.py runs;
- ``zoo/<name>``: benchmarks/zoo.py's ZOO, built with ``build(name)`` (transformers
  configs, random weights, no download);
- ``fuzz/<nn>``: FUZZ_COUNT specs of tests/fuzz_models.model_specs, drawn by hypothesis
  from ``@seed(FUZZ_SEED)`` with no example database and only its generate phase, so
  the same hypothesis and the same strategy draw the same specs on every run. A
  record keeps its spec's repr (Python: ``from fuzz_models import *`` reads it back),
  so a changed strategy shows as a difference rather than as other models.

Each model is planned with ``memopt.plan(model, *args, example_kwargs=kwargs,
budget=...)`` at every budget of BUDGETS. "minimum" plans at
``BudgetError.smallest_fraction`` of a probe at PROBE_FRACTION (the probe's own outcome
is kept in the record). A budget memopt refuses is recorded as its BudgetError's
fields; any other exception as its type and first line.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memopt

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tests") not in sys.path:  # tests/ is no package: models, fuzz_models
    sys.path.insert(0, str(ROOT / "tests"))

FUZZ_COUNT = 20
FUZZ_SEED = 24        # issue 24, the planner refactor this snapshot guards
PROBE_FRACTION = 0.01
MINIMUM = "minimum"
BUDGETS: tuple[object, ...] = (None, 0.6, MINIMUM)

#: Fields of a plan (at any depth) that measure wall-clock time: they differ between
#: two runs of the same code, so records leave them out. See plan_equality's docstring.
TIMING_FIELDS = frozenset({"plan_seconds", "capture_seconds", "estimated_seconds"})

Built = tuple[nn.Module, tuple, dict]


@dataclass(frozen=True)
class Model:
    """One model of the snapshot: its name, what builds it, and a builder."""

    name: str                       # "corpus/mlp", "zoo/bert", "fuzz/07"
    source: str                     # the corpus case, the zoo builder, or the fuzz spec
    build: Callable[[], Built]      # a fresh model and its example args and kwargs


def _corpus() -> list[Model]:
    from models import CORPUS  # noqa: PLC0415

    def build(case: Any) -> Built:
        torch.manual_seed(0)
        model = case.make_model()
        torch.manual_seed(100)
        return model, case.make_inputs(), {}

    return [Model(f"corpus/{c.name}", f"tests/models.py CORPUS {c.name}",
                  functools.partial(build, c)) for c in CORPUS]


def _zoo() -> list[Model]:
    from benchmarks.zoo import ZOO  # noqa: PLC0415
    from benchmarks.zoo import build as build_zoo  # noqa: PLC0415

    def build(name: str) -> Built:
        case = build_zoo(name, seed=0)  # seeds torch itself
        return case.model, case.args, case.kwargs

    return [Model(f"zoo/{name}", f"benchmarks/zoo.py {name}", functools.partial(build, name))
            for name in ZOO]


def fuzz_specs(count: int = FUZZ_COUNT, seed: int = FUZZ_SEED) -> list[Any]:
    """`count` ModelSpecs, the same ones on every run (see the module docstring)."""
    from fuzz_models import model_specs  # noqa: PLC0415
    from hypothesis import HealthCheck, Phase, given, settings  # noqa: PLC0415
    from hypothesis import seed as hypothesis_seed  # noqa: PLC0415

    specs: list[Any] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, phases=(Phase.generate,), deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(spec=model_specs())
    def collect(spec: Any) -> None:
        specs.append(spec)

    collect()
    return specs[:count]


def _fuzz() -> list[Model]:
    from fuzz_models import build_model, make_inputs  # noqa: PLC0415

    def build(spec: Any) -> Built:
        torch.manual_seed(0)
        model = build_model(spec)
        torch.manual_seed(100)
        return model, make_inputs(spec), {}

    return [Model(f"fuzz/{i:02d}", repr(spec), functools.partial(build, spec))
            for i, spec in enumerate(fuzz_specs())]


@functools.cache
def all_models() -> tuple[Model, ...]:
    """Every model, in a fixed order."""
    return (*_corpus(), *_zoo(), *_fuzz())


def normalize(value: Any) -> Any:
    """A parsed plan without TIMING_FIELDS, with the repository's path in any string
    written as "<repo>" (graph breaks name the file they are in: /work/base/... before,
    another checkout after)."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str):
        return value.replace(str(ROOT), "<repo>")
    return value


def _budget_error(err: memopt.BudgetError) -> dict[str, Any]:
    return {"budget_bytes": err.budget_bytes, "minimum_bytes": err.minimum_bytes,
            "baseline_bytes": err.baseline_bytes, "headroom": err.headroom,
            "smallest_byte_budget": err.smallest_byte_budget,
            "smallest_fraction": err.smallest_fraction, "step": err.step}


def plan_once(model: Model, budget: object) -> dict[str, Any]:
    """The outcome of planning a freshly built `model` at `budget`."""
    torch._dynamo.reset()  # no guards or caches from the plans before
    module, args, kwargs = model.build()
    try:
        plan = memopt.plan(module, *args, budget=budget, example_kwargs=kwargs)
    except memopt.BudgetError as err:
        return {"outcome": "BudgetError", "budget_error": _budget_error(err)}
    except Exception as err:  # noqa: BLE001 (recorded: a refactor must fail the same way)
        first = (str(err).strip().splitlines() or [""])[0]
        return {"outcome": "error", "error": type(err).__name__, "message": normalize(first)}
    return {"outcome": "plan", "plan": normalize(json.loads(plan.to_json()))}


def _minimum(model: Model) -> dict[str, Any]:
    """The record at the smallest fraction budget memopt accepts, with the probe that
    named it (at PROBE_FRACTION; its plan, where it is accepted, is the record's)."""
    probe = plan_once(model, PROBE_FRACTION)
    summary = {"requested": PROBE_FRACTION, "outcome": probe["outcome"],
               **{k: v for k, v in probe.items() if k in ("budget_error", "error", "message")}}
    if probe["outcome"] == "plan":
        return {"requested": PROBE_FRACTION, **probe, "probe": summary}
    fraction = probe.get("budget_error", {}).get("smallest_fraction")
    if fraction is None:
        return {"requested": None, "outcome": "no fraction budget", "probe": summary}
    return {"requested": fraction, **plan_once(model, fraction), "probe": summary}


def record(model: Model, label: str) -> dict[str, Any]:
    """`model`'s record at the budget of BUDGETS labelled `label` ("None", "0.6",
    "minimum")."""
    (budget,) = [b for b in BUDGETS if str(b) == label]
    outcome = (_minimum(model) if budget == MINIMUM
               else {"requested": budget, **plan_once(model, budget)})
    return {"model": model.name, "budget": label, "source": model.source, **outcome}
