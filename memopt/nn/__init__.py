"""Reversible recurrent networks (MacKay et al. 2018): layers whose backward rebuilds
the hidden states instead of storing them.

    rnn = memopt.nn.RevGRU(32, 256, num_layers=2, max_forget_bits=3)
    output, h_n = rnn(x)               # as nn.GRU; backward reconstructs h(t-1) from h(t)
    rnn.buffer_size                    # bytes and bits the backward holds

- ``fixed_point``: R_H / R_Z fixed point, forget-value quantization (Sec. 5, 5.3).
- ``buffer``: the information buffer, Alg. 1 with Sec. 5.1's overflow and vectorization.
- ``stepping``, ``cells``: RevGRUCell (eq. 4-5), RevLSTMCell (eq. 11-14), stepped
  forward, in reverse, or under autograd.
- ``sequence``: the fixed-point forward, the reversible backward and its autograd
  reference.
- ``dropout``: the masks between layers, rebuilt from per-layer seeds (App. E).
- ``ops``: the two custom operators the modules run through (memopt::reversible_fwd /
  reversible_bwd), opaque to dynamo, so memopt.compile plans them as reversible stacks
  (passes.reversible_stacks): no hidden-state slots, the buffers counted at their bound.
- ``modules``: RevGRU, RevLSTM with nn.GRU / nn.LSTM's interface.
"""

from .buffer import BufferSize, InformationBuffer
from .cells import ReversibleCell, RevGRUCell, RevLSTMCell
from .fixed_point import R_H, R_Z
from .modules import ReversibleRNN, RevGRU, RevLSTM

__all__ = ["R_H", "R_Z", "BufferSize", "InformationBuffer", "RevGRU", "RevGRUCell", "RevLSTM",
           "RevLSTMCell", "ReversibleCell", "ReversibleRNN"]
