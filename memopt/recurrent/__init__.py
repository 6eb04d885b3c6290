"""Recurrent chains (Gruslys et al. 2016): the dynamic programs, an executor, and
the modules memopt.compile runs as chains.

    policy = memopt.recurrent.solve(t=1000, m=32, strategy="hsm")
    policy.cost, policy.schedule                  # C(t, m), the actions in order
    ys, state = memopt.recurrent.run_chain(step, state0, xs, policy, params=params)

Inside ``memopt.compile``, every nn.LSTM / nn.GRU / nn.RNN becomes a chain of chunks
(``ChainedRNN``), and a cell loop marked with ``Recurrent(cell)`` becomes a chain of
steps; the planner picks each chain's chunk length and policy (BPTT-HSM, ISM or MSM,
and its m) under the one budget.
"""

from memopt.allocator.gruslys import STRATEGIES, Action, Policy, cost, solve

from .executor import ChainStats, run_chain
from .modules import ChainedRNN, Recurrent

__all__ = ["Action", "ChainStats", "ChainedRNN", "Policy", "Recurrent", "STRATEGIES", "cost",
           "run_chain", "solve"]
