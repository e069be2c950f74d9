"""Fixtures shared by the test modules that build trees in subprocesses."""
from __future__ import annotations

from pathlib import Path

import pytest
from buildtree import copy_ipubuild


@pytest.fixture(scope="module")
def code(tmp_path_factory) -> Path:
    """A snapshot of ipubuild/ that every build (and cluster worker) of the module imports, so that
    edits to the working tree while the tests run cannot reach them."""
    path = tmp_path_factory.mktemp("code")
    copy_ipubuild(path)
    return path
