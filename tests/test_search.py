"""The layout search: never worse, deterministic across worker counts, screening adds up,
resumable after kill -9 to the same package, stale or corrupt state ignored."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from ipubuild import canonical
from ipubuild.build import build_in_process
from ipubuild.frontend import build_model
from ipubuild.machine import load_machine
from ipubuild.pipeline import Workspace
from ipubuild.plugins import get_plugin_manager
from ipubuild.placement import initial_layout
from ipubuild.search import SearchContext, heuristics, read_state, screen
from ipubuild.targets import load_target

from buildtree import SMALL, make_tree

ROOT = Path(__file__).resolve().parent.parent

def small_tree(path, workers=2):
    return make_tree(path, {"small": SMALL.replace("workers = 2", f"workers = {workers}")})


def search_result(tmp_path, workers):
    root = small_tree(tmp_path, workers=workers)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        out = build_in_process(root, "targets/small.toml")
    finally:
        os.chdir(cwd)
    ws = Workspace.at(root)
    state = read_state(root / ".ipubuild" / "search" / "small.state.json")
    return out["small/layout"], state, ws


def test_search_never_accepts_worse_and_is_deterministic_across_workers(tmp_path):
    layout1, state1, _ = search_result(tmp_path / "one", workers=1)
    layout2, state2, _ = search_result(tmp_path / "two", workers=2)
    assert layout1 == layout2
    assert state1["history"] == state2["history"]
    assert state1["history"], "the search found no improvement on the small target"
    for h in state1["history"]:
        assert h["after"] < h["before"]
    assert state1["cycles"] == state1["history"][-1]["after"]


def test_screening_counts_add_up():
    target = load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    model = build_model(get_plugin_manager(), target)
    sc = SearchContext(model.graph, 64, load_machine("ipu21"))
    layout = initial_layout(sc, heuristics())
    proposals = [c for h in heuristics() for c in h.propose(layout, sc)]
    counts, short = screen(proposals, layout, sc, visited={canonical.digest_of(layout)}, shortlist_size=3)
    assert sum(counts.values()) == len(proposals)
    assert counts["shortlisted"] == len(short) <= 3
    base = sc.estimator.estimate(layout)
    assert all(sc.estimator.estimate(lay) < base for _, lay, _ in short)


def test_a_budgeted_screen_does_not_depend_on_what_the_estimator_has_cached(monkeypatch):
    """Where the screening budget binds (ViT-B/16), a resumed search starts with a cold estimator
    and must still screen, and shortlist, what an uninterrupted one does."""
    from ipubuild import search
    target = load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    graph = build_model(get_plugin_manager(), target).graph
    monkeypatch.setattr(search, "SCREEN_BUDGET", 40)
    outcomes = []
    for warm in (False, True):
        sc = SearchContext(graph, 64, load_machine("ipu21"))
        layout = initial_layout(sc, heuristics())
        proposals = [c for h in heuristics() for c in h.propose(layout, sc)]
        if warm:       # every proposal's estimate already cached, as after an earlier screen
            monkeypatch.setattr(search, "SCREEN_BUDGET", 10**9)
            screen(proposals, layout, sc, visited=set(), shortlist_size=3)
            monkeypatch.setattr(search, "SCREEN_BUDGET", 40)
        counts, short = screen(proposals, layout, sc, visited=set(), shortlist_size=3)
        outcomes.append((counts, [(i, canonical.digest_of(lay)) for i, lay, _ in short]))
    assert outcomes[0][0]["unscreened"] > 0, outcomes[0][0]
    assert outcomes[0] == outcomes[1]


def _doit(root, *args, **kw):
    return subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def test_kill_during_search_resumes_to_the_same_package(tmp_path):
    clean = small_tree(tmp_path / "clean")
    p = _doit(clean, "build:small")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-2000:]
    want = (clean / "artifacts" / "small" / "small.ipuexe").read_bytes()

    root = small_tree(tmp_path / "killed")
    log = root / "run.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "doit", "build:small"], cwd=root, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            if "attempts=1" in log.read_text() or "attempts=2" in log.read_text():
                break
            time.sleep(0.05)
        killed = p.poll() is None
        if killed:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    p = _doit(root, "build:small")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-2000:]
    if killed:
        assert "resuming=true" in out
    assert (root / "artifacts" / "small" / "small.ipuexe").read_bytes() == want


def test_corrupt_search_state_is_reported_and_ignored(tmp_path):
    root = small_tree(tmp_path)
    state = root / ".ipubuild" / "search" / "small.state.json"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"{not json")
    p = _doit(root, "build:small")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-2000:]
    assert "ignored a search state that does not verify" in out
    assert "numericalTest=PASS" in out


def _vit_context():
    target = load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    model = build_model(get_plugin_manager(), target)
    return SearchContext(model.graph, 64, load_machine("ipu21"))


def test_estimator_delta_is_the_change_of_the_estimate():
    import random
    sc = _vit_context()
    est = sc.estimator
    layout = initial_layout(sc, heuristics())
    resolved, base = est.resolve(layout), est.estimate(layout)
    rnd = random.Random(0)
    invalid = 0
    for _ in range(80):
        op = rnd.choice(sc.graph.ops)
        plan = rnd.randrange(len(sc.plans[op.id]))
        changed = {"ops": dict(layout["ops"], **{str(op.id): dict(layout["ops"][str(op.id)], plan=plan)})}
        d, e = est.delta(layout, resolved, {op.id: plan}), est.estimate(changed)
        assert (d is None) == (e is None), (op.name, sc.plans[op.id][plan])
        if d is None:
            invalid += 1
        else:
            assert base + d == e, (op.name, sc.plans[op.id][plan])
    assert est.estimate(layout) == base


def test_descent_proposes_ever_cheaper_prefixes_of_one_path():
    sc = _vit_context()
    layout = initial_layout(sc, heuristics())
    (descend,) = [h for h in heuristics() if h.name == "descend"]
    proposals = descend.propose(layout, sc)
    assert len(proposals) >= 2
    estimates = []
    for i, ch in enumerate(proposals):
        assert i == 0 or set(dict(proposals[i - 1].plans)) <= set(dict(ch.plans))    # one more step on one path
        changed = ch.apply(layout, sc.plans, sc.tile_count)
        assert sc.estimator.fits(changed)
        estimates.append(sc.estimator.estimate(changed))
    assert all(a > b for a, b in zip(estimates, estimates[1:])) and estimates[0] < sc.estimator.estimate(layout)
    assert len({ch.plans for ch in proposals}) == len(proposals)


def test_initial_layout_lets_elementwise_operations_follow_their_producers():
    from ipubuild.operators import registry
    sc = _vit_context()
    layout = initial_layout(sc, heuristics())
    for op in sc.graph.ops:
        if registry().get(op.type).follows == "elements" and any("follow" in p for p in sc.plans[op.id]):
            assert "follow" in sc.plans[op.id][layout["ops"][str(op.id)]["plan"]], op.name
