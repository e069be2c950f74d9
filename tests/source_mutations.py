"""Deliberate bugs in ipubuild's Python sources, one of each kind a weak test once let through
(issue 23), and the tests that must catch each: ``tests/test_mutations_bite.py`` applies each one
to a scratch copy of the repository (``ipubuild/``, ``tests/``, ``dodo.py``, ``targets/``), runs
its named tests there with ``-x``, and fails if they all still pass (the mutation survived).

A mutation is a regular expression replaced exactly once in a named file under ``ipubuild/``
(a kernel bug lives in ``tests/mutations.py``: those go through the kernel loop). Each names the
fast tests that catch it; the slower ones (whole builds) are marked ``slow``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from buildtree import copy_ipubuild

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class SourceMutation:
    name: str
    kind: str               # which of issue 23's seven kinds of bug
    what: str
    file: str               # under the repository
    pattern: str            # a regular expression, replaced exactly once
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (relative to the repository) that must fail
    slow: bool = False

    def apply(self, tree: Path) -> None:
        path = Path(tree) / self.file
        text = path.read_text()
        new, n = re.subn(self.pattern, self.replacement, text, count=0, flags=re.M)
        if n != 1:
            raise AssertionError(f"mutation {self.name}: {self.pattern!r} matches {n} times in {self.file}, not once")
        path.write_text(new)


def scratch_copy(dest: Path) -> Path:
    """A copy of the repository's ``ipubuild/``, ``tests/``, ``dodo.py`` and ``targets/`` (what
    the named tests import and build) at ``dest``."""
    dest = Path(dest)
    copy_ipubuild(dest)       # its bytecode is hash-checked: a mutated module's is never used
    for d in ("tests", "targets"):
        shutil.copytree(ROOT / d, dest / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*.tmp", "throwaway"))
    for f in ("dodo.py", "pyproject.toml"):
        shutil.copyfile(ROOT / f, dest / f)
    return dest


def run_tests(tree: Path, tests, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``tests`` (node ids) in ``tree`` with its own ``ipubuild/`` first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]]
                                                                      if os.environ.get("PYTHONPATH") else [])))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *tests], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


E = "ipubuild/engine/engine.py"
S = "ipubuild/compiler/search.py"
T_KEY = "tests/test_engine.py::test_every_declared_leaf_of_every_phase_moves_its_key_and_doit_signature"

MUTATIONS = [
    # (1) an action key missing a configuration leaf
    SourceMutation("key_drops_numerics_compare", "key", "the signature leaves map_values' numerics.compare out",
                   E, r'"config": config_subset\(config, ph\.config\)\}\)',
                   '"config": config_subset(config, [k for k in ph.config if k != "numerics.compare"])})',
                   (T_KEY,)),
    SourceMutation("key_drops_last_declared_leaf", "key", "config_subset forgets a phase's last declared key",
                   E, r"    for key in keys:\n", "    for key in list(keys)[:-1]:\n", (T_KEY,)),
]
MUTATIONS += [
    # (3) healing by a cold rebuild
    SourceMutation("heal_deletes_the_cache", "heal", "a damaged doit database 'healed' by deleting the whole cache too",
                   "ipubuild/build/tasks.py", r"^        os\.replace\(path, aside\)\n",
                   "        os.replace(path, aside)\n        import shutil\n"
                   "        shutil.rmtree(path.parent / '.ipubuild' / 'cache', ignore_errors=True)\n",
                   ("tests/test_selfheal.py::test_a_damaged_database_is_moved_aside[.doit.db]",), slow=True),
]
T_TOL = "tests/test_compare.py::test_every_operators_tolerance_is_pinned"
MUTATIONS += [
    # (4) a tolerance widened
    SourceMutation("softmax_tolerance_100x", "tolerance", "softmax's tolerance widened 100 times",
                   "ipubuild/builtin/operators.py",
                   r"return \[\(4 \* LIBM_ULPS \* 2 \* U \+ 2 \* gamma\(n\) \+ 2 \* U\) \* _abs",
                   "return [100 * (4 * LIBM_ULPS * 2 * U + 2 * gamma(n) + 2 * U) * _abs", (T_TOL,)),
    SourceMutation("matmul_tolerance_3x", "tolerance", "the matmul bound's gamma(k) taken three times",
                   "ipubuild/builtin/operators.py", r"return 2 \* gamma\(k \+ terms\) \* mags",
                   "return 6 * gamma(k + terms) * mags", (T_TOL,)),
    SourceMutation("layernorm_tolerance_10x", "tolerance", "layer norm's tolerance widened 10 times",
                   "ipubuild/builtin/operators.py", r"return \[g \* dv \+ 2 \* U",
                   "return [10 * g * dv + 2 * U", (T_TOL,)),
    SourceMutation("add_tolerance_nonzero", "tolerance", "adds given a tolerance of an ulp (they are bit-exact)",
                   "ipubuild/builtin/operators.py", r"return \[0\.0 for _ in op\.outputs\]",
                   "return [2.0 ** -23 for _ in op.outputs]", (T_TOL,)),
    SourceMutation("gelu_libm_ulps", "tolerance", "GELU's tanh allowed 400 ulps", "ipubuild/builtin/operators.py",
                   r"half \* \(2 \* LIBM_ULPS", "half * (200 * LIBM_ULPS", (T_TOL,)),
]
T_WORSE = ("tests/test_search.py::test_the_search_never_ships_a_layout_costlier_than_its_incumbent_when_worse_ones_are_evaluated",)
MUTATIONS += [
    # (2) the search accepting a worse layout
    SourceMutation("search_accepts_anything", "search", "the acceptance check made `if True`", S,
                   r'^                if r\["cycles"\] < cycles:$', "                if True:", T_WORSE),
    SourceMutation("search_accepts_5pc_worse", "search", "the acceptance check takes a candidate within 5 % worse", S,
                   r'^                if r\["cycles"\] < cycles:$', '                if r["cycles"] < cycles * 1.05:', T_WORSE),
]
T_EST = ("tests/test_search.py::test_estimator_terms_are_pinned_against_the_exact_cost_model",)
MUTATIONS += [
    # (5) the search's estimator
    SourceMutation("estimator_drops_sync", "estimator", "the estimator leaves out the sync", "ipubuild/compiler/estimator.py",
                   r"total \+= port\.horizon\(\) \+ compute \+ sync", "total += port.horizon() + compute", T_EST),
    SourceMutation("estimator_halves_broadcast_sends", "estimator", "broadcast sends charged half",
                   "ipubuild/compiler/estimator.py", r'port\.add\("send", src\[far\]\[first\], cycles\[first\],',
                   'port.add("send", src[far][first], cycles[first] // 2,', T_EST),
    SourceMutation("estimator_sends_per_receiver", "estimator", "a broadcast charged one send per receiver",
                   "ipubuild/compiler/estimator.py", r'port\.add\("send", src\[far\]\[first\], cycles\[first\], nbytes\[far\]\[first\]\)',
                   'port.add("send", src[far], cycles, nbytes[far])', T_EST),
    SourceMutation("estimator_compute_drops_overhead", "estimator", "the slowest tile's compute taken as the mean",
                   "ipubuild/compiler/estimator.py", r"stages\.append\(\(max\(compute\.values\(\), default=0\),",
                   "stages.append((sum(compute.values()) // max(1, len(compute)),", T_EST),
    SourceMutation("estimator_exchange_setup_per_fragment", "estimator", "a transfer's setup charged once, not per row",
                   "ipubuild/compiler/estimator.py", r"setup = x\[\"transfer_setup_cycles\"\] \* rows", 'setup = x["transfer_setup_cycles"] + 0 * rows', T_EST),
]
T_PAIRED = ("tests/test_programs.py::test_a_paired_exchange_plan_builds_runs_and_is_timed_paired_on_the_simulator",)
SIM = "ipubuild/builtin/simulator.py"
MUTATIONS += [
    # (6) paired exchange
    SourceMutation("planner_times_paired_as_ordinary", "paired", "the planner (whose horizons the package carries "
                   "and the simulator reports) ignores pairing when timing a step",
                   "ipubuild/compiler/planning/phases.py", r"exchange\.horizon_of\(entries, m, t\[\"use_paired\"\]\)",
                   "exchange.horizon_of(entries, m, False)", T_PAIRED),
    SourceMutation("simulator_skips_paired_exchanges", "paired", "the simulator skips the transfers of paired steps",
                   SIM, r"^                run_exchange\(memory, row_of, plan\.entries\[s\], pool\)$",
                   "                if not host_program['paired'][s]:\n"
                   "                    run_exchange(memory, row_of, plan.entries[s], pool)", T_PAIRED),
    SourceMutation("planner_never_pairs", "paired", "the planner never keeps a paired schedule",
                   "ipubuild/compiler/planning/exchange.py", r"use_paired = paired < ordinary", "use_paired = False", T_PAIRED),
]
MUTATIONS += [
    SourceMutation("phase_sees_all_configuration", "key", "a phase handed the whole configuration, its key only the declared part",
                   E, r"blobs = ph\.fn\(Context\(self, ph, inputs, _unflatten\(subset\)\)\)",
                   "blobs = ph.fn(Context(self, ph, inputs, config))",
                   ("tests/test_engine.py::test_a_phase_sees_only_the_configuration_it_declares",)),
]
MUTATIONS += [
    SourceMutation("map_values_declares_nothing", "key", "map_values no longer declares numerics.compare (it still reads it)",
                   "ipubuild/device/compare.py", r'outputs=\("value_map",\), config=\("numerics\.compare",\)\)',
                   'outputs=("value_map",))', T_PAIRED),
]
MUTATIONS += [
    SourceMutation("mapping_accepts_anything", "search", "the tile-mapping screen keeps its candidate whatever it costs", S,
                   r'if "invalid" not in r and r\["cycles"\] < cycles:', 'if "invalid" not in r:', T_WORSE),
]
