"""Recurrent chains (Gruslys et al. 2016): the dynamic programs, an executor, and
the modules memopt.compile uses for nn.LSTM / nn.GRU / nn.RNN and marked cell loops.

    policy = memopt.recurrent.solve(t=1000, m=32, strategy="hsm")
    policy.cost, policy.schedule                  # C(t, m), the actions in order
    ys, state = memopt.recurrent.run_chain(step, state0, xs, policy, params=params)
"""

from memopt.allocator.chain import STRATEGIES, Action, Policy, cost, solve

from .executor import ChainStats, run_chain

__all__ = ["Action", "ChainStats", "Policy", "STRATEGIES", "cost", "run_chain", "solve"]
