"""The conftest guard fails the test that leaves global state changed, at its source."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import changed_state, global_state

pytest_plugins = ("pytester",)


def test_scoped_patch_is_seen_while_active_and_gone_after() -> None:
    before = global_state()
    with torch._dynamo.config.patch(recompile_limit=3):
        inside = changed_state(before, global_state())
    assert inside == ["torch._dynamo.config.recompile_limit: 8 -> 3"]
    assert changed_state(before, global_state()) == []


def test_a_polluting_test_fails_and_the_next_one_does_not(pytester) -> None:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_leaky="""
        import sys, torch

        def test_sets_dynamo_config():
            torch._dynamo.config.recompile_limit = 3

        def test_sees_the_default_again():
            assert torch._dynamo.config.recompile_limit == 8

        def test_sets_default_dtype():
            torch.set_default_dtype(torch.float64)

        def test_raises_recursion_limit():
            sys.setrecursionlimit(sys.getrecursionlimit() + 1000)

        def test_clean():
            assert torch.get_default_dtype() == torch.float32
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, errors=3)
    result.stdout.fnmatch_lines([
        "*test_sets_dynamo_config left global state changed*",
        "*test_sets_default_dtype left global state changed*",
        "*test_raises_recursion_limit left global state changed*",
    ])
