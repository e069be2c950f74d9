"""This checkout's plugin, registered for every test whether or not it is installed."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setenv("IPUBUILD_PLUGINS", "ipubuild_rmsnorm.plugin")
