"""Fixtures shared by the test modules that build trees in subprocesses."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
from buildtree import ROOT, copy_ipubuild, precompile


@pytest.fixture(scope="module")
def code(tmp_path_factory) -> Path:
    """A snapshot of ipubuild/ that every build (and cluster worker) of the module imports, so that
    edits to the working tree while the tests run cannot reach them."""
    path = tmp_path_factory.mktemp("code")
    copy_ipubuild(path)
    return path


#: the longest test files, longest first (``pytest --durations``): with the suite spread over two
#: processes a file at a time, starting them first keeps one long file from running alone at the end
#: (``--no-loadscope-reorder`` in pyproject.toml keeps this order: xdist would put files with the
#: most tests first, and the one-test isolation re-run last)
LONGEST_FIRST = ("test_plugin_isolation.py", "test_mutations_bite.py", "test_incremental.py", "test_cluster.py",
                 "test_selfheal.py", "test_reliability.py", "test_search.py", "test_console.py")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):       # once, in the process that starts the workers
        precompile(ROOT / "ipubuild")
    # the tests that interrupt a build send Ctrl-C as a terminal does; a runner may start pytest with
    # SIGINT blocked or ignored, which every child process would keep (a blocked Ctrl-C never arrives)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: the rest keep their order
