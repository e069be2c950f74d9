"""The mutation harness (issue 23): every deliberate bug of ``tests/source_mutations.py`` — one
or more of each kind a weak test once let through: an action key missing a configuration leaf,
the search accepting a worse layout, a heal by a cold rebuild, a widened tolerance, a wrong
estimator term, the simulator or planner mishandling paired exchange — applied to its own
scratch copy of the repository, and the tests it names run there with ``-x``: the harness fails
if they all pass (the mutation survived), so a weakened test is noticed by CI, not by an audit.
(Kernel bugs go through the kernel loop: ``tests/mutations.py``, ``tests/test_numerics_mutations.py``.)

The copies run two at a time (the suite's CI has two cores); the whole harness costs about as
much as the named tests take, once per mutation.
"""
from __future__ import annotations

import concurrent.futures

import pytest
from source_mutations import MUTATIONS, run_tests, scratch_copy

KINDS = {"key", "search", "heal", "tolerance", "estimator", "paired"}
PARALLEL = 2


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Each mutation's run of its named tests in its own mutated copy: ``{name: (exit, output)}``."""
    base = tmp_path_factory.mktemp("mutations")      # made here: the factory is not thread-safe

    def one(m):
        tree = scratch_copy(base / m.name)
        m.apply(tree)
        run = run_tests(tree, m.tests)
        return m.name, (run.returncode, run.stdout[-4000:] + run.stderr[-2000:])
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        return dict(pool.map(one, MUTATIONS))


def test_the_mutations_cover_every_kind_and_name_real_tests():
    assert {m.kind for m in MUTATIONS} == KINDS
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    from source_mutations import ROOT
    for m in MUTATIONS:
        for node in m.tests:
            path, _, name = node.partition("::")
            assert (ROOT / path).is_file() and f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), node


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_no_mutation_survives_its_tests(outcomes, mutation):
    code, output = outcomes[mutation.name]
    # 1: a test failed. (2: interrupted or a collection error, 5: nothing collected — the
    # mutation broke the import, or the node id went stale: that proves nothing about the test)
    assert code == 1 and " failed" in output, (
        f"mutation {mutation.name} ({mutation.what}) survived {', '.join(mutation.tests)}: exit {code}\n{output}")
