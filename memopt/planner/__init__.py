"""memopt's planner: one joint forward+backward graph in, a forward, a backward and a
MemoryPlan out (`plan_joint`).

    request.py      PlanRequest (validated once), StepContext, Options, ExistingGrads
    plan.py         plan_joint: the stages in order
    build.py        the exact build of a candidate (partition, in-place, liveness)
    chen.py         Chen et al. 2016's search: Alg. 3, Appendix A, Sec. 4.2, Sec. 4.4,
                    the peak-directed path, the exact MILP
    families.py     memopt's own op families (chains, LM heads, reversible stacks) under
                    one protocol; chain_family.py the Gruslys policy choice
    assemble.py     the MemoryPlan of the chosen build
    observe.py      observing() / verifying(): hooks for the oracle and the tests
"""

from .build import Mirror
from .observe import Observed, observing, verifying
from .plan import plan_joint
from .request import ExistingGrads, Options, PlanRequest, StepContext

__all__ = ["ExistingGrads", "Mirror", "Observed", "Options", "PlanRequest", "StepContext",
           "observing", "plan_joint", "verifying"]
