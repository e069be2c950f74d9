"""The project's tests pass with any well-formed plugin installed. Here two are: the rmsnorm
example and the throw-away plugin of ``tests/throwaway`` (one of everything a plugin can
register: operator and kernel, graph pass, family, cast policy, heuristic, device, cache
backend, target), each announced by an installed distribution's entry point (a ``dist-info``
on ``PYTHONPATH``, which is all ``pip install`` leaves for ``importlib.metadata`` to find). The
tests that look at what plugins are loaded, what targets and families exist, what ``doit``
builds and lists, and what the search does then run again in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["tests/test_plugins.py", "tests/test_targets.py", "tests/test_vit.py", "tests/test_passes.py",
           "tests/test_reference_docs.py", "tests/test_plugin_targets.py", "tests/test_cli_errors.py",
           "tests/test_search.py", "tests/test_console.py::test_bare_doit_builds_what_it_can_and_names_what_it_skips",
           "plugins/ipubuild-rmsnorm/tests"]
#: what a plugin cannot change: a search resumed after kill -9 or from a damaged state, and the
#: search's tests whose subject no plugin enters: a clock, a model too big for its tiles, one
#: built-in heuristic or mechanism on a layout the test builds itself (the screening caps, the
#: estimator's terms, the descent, the combination of a round's best, candidates made to fail
#: or a worker killed). What stays runs the registered heuristics: the search, its round log and
#: counts, and screening all their proposals. This re-run was the suite's longest test (380 s of
#: a 19.5-minute run on 2 cores)
SKIPPED = " and ".join(f"not {name}" for name in (
    "kill_during_search", "corrupt_search_state", "fast_clock", "constants_cannot_fit", "refuses_what",
    "descent_", "candidates_all_fail", "estimator_delta", "estimator_terms", "align_columns",
    "widen_rows", "grid_heads", "leaves_the_grids", "settle_light", "reshape_alike", "resolver_keeps",
    "weight_sums", "exact_headroom", "allowance_placement", "code_room", "shortlist_takes", "combined_takes",
    "disjoint_improvements", "combination", "worker_killed"))


def install(site: Path) -> dict:
    """Entry points for both plugins under ``site``; the environment that sees them installed."""
    for dist, version, entry in (("ipubuild_throwaway", "0.1", "throwaway = ipubuild_throwaway"),
                                 ("ipubuild_rmsnorm", "0.1.0", "rmsnorm = ipubuild_rmsnorm.plugin")):
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[ipubuild]\n{entry}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("IPUBUILD_PLUGINS", "IPUBUILD_DISABLE_PLUGIN_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "tests" / "throwaway"),
                                         str(ROOT / "plugins" / "ipubuild-rmsnorm")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.mark.slow
def test_the_suite_passes_with_two_plugins_installed(tmp_path):
    env = install(tmp_path / "site")
    loaded = subprocess.run([sys.executable, "-c", "from ipubuild.plugins import get_plugin_manager as g; "
                             "print(sorted(n for n, _ in g().list_name_plugin()))"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "ipubuild_throwaway" in loaded.stdout and "ipubuild_rmsnorm.plugin" in loaded.stdout, loaded
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-k", SKIPPED,
                          *MODULES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
