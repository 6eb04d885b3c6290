"""The minimum a forward with graph breaks names (memopt.graph_breaks.step_minimum).

The forward is planned again at each minimum a graph names until every graph fits. HF
Encodec's never settled: each try named a higher one (2.9 MB ... 11.3 MB, found from
outside), and the last one named was refused in turn. Where the tries do not settle,
the search now checks budgets up from the last one named, ending at one above the whole
step's baseline, and names the first its forward is planned within.
"""

from __future__ import annotations

from memopt.errors import BudgetError
from memopt.graph_breaks import MINIMUM_TRIES, step_minimum


def _refusal(budget: int, minimum: int) -> BudgetError:
    return BudgetError(budget_bytes=budget, minimum_bytes=minimum, baseline_bytes=10_000)


def test_a_search_that_does_not_settle_names_a_budget_it_fits():
    """Each try names 10% more than it was given, and the step fits from 5,000 bytes:
    the name is a budget the forward is planned within."""
    tried = []

    def misses_at(nbytes: int) -> BudgetError | None:
        tried.append(nbytes)
        return None if nbytes >= 5_000 else _refusal(nbytes, int(nbytes * 1.1))

    named = step_minimum(_refusal(100, 1_000), misses_at, 10_000).minimum_bytes
    assert named >= 5_000 and misses_at(named) is None
    assert named < 10_000  # below the baseline's budget where a lower one fits
    assert len(tried) <= MINIMUM_TRIES + 12


def test_a_search_that_settles_names_what_it_settled_at():
    def misses_at(nbytes: int) -> BudgetError | None:
        return None if nbytes >= 1_500 else _refusal(nbytes, 1_500)

    assert step_minimum(_refusal(100, 1_000), misses_at, 10_000).minimum_bytes == 1_500
