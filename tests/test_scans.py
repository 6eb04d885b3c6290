"""A parallel (associative) scan in a training graph (passes.scans): transformers' Mamba
takes it under torch.compile by default, and its traced tree keeps every level for backward
where eager's sequential loop keeps less (issue 28: 1.57x eager's peak at no budget).
memopt warns once, with the bytes the plan saves of the tree, and names the switch; with
the switch off it is silent. Eager's gradients either way."""

import copy
import warnings

import pytest
import torch

import memopt

transformers = pytest.importorskip("transformers")


def _mamba(associative: bool):
    config = transformers.MambaConfig(vocab_size=100, hidden_size=32, state_size=8,
                                      num_hidden_layers=1, expand=2, conv_kernel=4)
    if not hasattr(config, "use_associative_scan"):
        pytest.skip("this transformers' Mamba has no associative scan (transformers < 5)")
    config.use_associative_scan = associative
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config)


@pytest.mark.parametrize("associative", [True, False], ids=["parallel_scan", "sequential"])
def test_a_parallel_scan_is_named_with_its_bytes(associative):
    model = _mamba(associative)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 32))
    eager(input_ids=ids, labels=ids).loss.backward()
    compiled = memopt.compile(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(input_ids=ids, labels=ids).loss.backward()
    said = [str(w.message) for w in seen if "parallel (associative) scan" in str(w.message)]
    if associative:
        assert len(said) == 1 and "use_associative_scan = False" in said[0], said
    else:
        assert not said, said
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
