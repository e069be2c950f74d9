"""``build_program`` resumes the kept build of a layout that starts the same (a search candidate
changes one or two operations), and takes the later operations that read what they read there
from it, renumbered: the program it makes is the one a fresh build makes, byte for byte,
whatever the order of the layouts and whichever build it resumes."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest

from ipubuild import frontend, plugins, targets
from ipubuild.compiler.planning.program import (KEPT_BUILDS, PlanResolver, build_program, default_layout,
                                                plans_of, program_blob)
from ipubuild.compiler.machine import load_machine
from ipubuild.compiler.planning.cost import program_cost, step_compute
from ipubuild.engine.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TILES = 64


@pytest.fixture(scope="module")
def graph():
    t = targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))
    return frontend.build_model(plugins.get_plugin_manager(), t).graph


def _candidates(graph, count: int, seed: int):
    """Layouts as a search makes them: an incumbent, candidates changing one or two operations'
    plan or offset, now and then a candidate taken as the new incumbent."""
    plans, rng = plans_of(graph, TILES), random.Random(seed)
    incumbent = default_layout(graph, TILES)
    for i in range(count):
        layout = {"ops": {k: dict(v) for k, v in incumbent["ops"].items()}}
        for op in rng.sample(graph.ops, rng.choice([1, 2])):
            choice = layout["ops"][str(op.id)]
            if rng.random() < 0.5:
                choice["plan"] = rng.randrange(len(plans[op.id]))
            else:
                choice["offset"] = rng.randrange(TILES)
        if i % 4 == 3:
            incumbent = layout
        yield layout


@pytest.mark.parametrize("seed", [0, 1])
def test_a_resumed_program_is_the_program_a_fresh_build_makes(graph, seed):
    machine = load_machine(targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))["target"]["machine"])
    resolver = PlanResolver(graph, TILES)
    resumed = compared = 0                     # operations taken from a kept build, not lowered again
    for layout in _candidates(graph, 24, seed):
        by_op = resolver.resolve(layout)
        resumed += max((b.common([by_op[op.id] for op in graph.ops]) for b in resolver.builds), default=0)
        try:
            got = build_program(graph, layout, TILES, resolver)
        except UserError as exc:           # a plan that cannot follow its producer's blocks: the
            assert "cannot follow" in str(exc)      # search counts it unfollowable; so does a fresh build
            with pytest.raises(UserError, match="cannot follow"):
                build_program(graph, layout, TILES, PlanResolver(graph, TILES))
            continue
        fresh = build_program(graph, layout, TILES, PlanResolver(graph, TILES))
        assert program_blob(got) == program_blob(fresh)
        compared += 1
        # its cost too: each step's compute is memoised by the step, which resumed programs share
        zeros = [0] * len(got["steps"])
        assert program_cost(got, zeros, machine) == program_cost(fresh, zeros, machine)
        assert len(resolver.builds) <= KEPT_BUILDS
    assert compared >= 16 and resumed >= 24 * len(graph.ops) // 4     # a quarter resumed (a third here)
    # and of the operations after the first change, many taken from the kept build renumbered
    assert resolver.replayed >= 4 * len(graph.ops)


def test_a_layout_built_again_resumes_at_its_end_and_keeps_one_build(graph):
    resolver = PlanResolver(graph, TILES)
    layout = default_layout(graph, TILES)
    first = program_blob(build_program(graph, layout, TILES, resolver))
    kept = list(resolver.builds)
    assert program_blob(build_program(graph, layout, TILES, resolver)) == first
    assert resolver.builds == kept and len(kept) == 1


def test_a_build_that_fails_half_way_leaves_the_kept_builds_as_they_were(graph, monkeypatch):
    resolver = PlanResolver(graph, TILES)
    layout = default_layout(graph, TILES)
    first = program_blob(build_program(graph, layout, TILES, resolver))
    kept = list(resolver.builds)
    other = {"ops": {k: dict(v) for k, v in layout["ops"].items()}}
    middle, last = graph.ops[len(graph.ops) // 2], graph.ops[-1]
    other["ops"][str(middle.id)]["offset"] = 7
    lowering = resolver.lowering

    def cannot_follow(op, choice):
        if op is last:
            raise ValueError("blocks it cannot follow")
        return lowering(op, choice)
    monkeypatch.setattr(resolver, "lowering", cannot_follow)
    with pytest.raises(UserError, match=f"operation {last.name}.*cannot follow"):
        build_program(graph, other, TILES, resolver)      # resumes at `middle`, fails at the end
    monkeypatch.undo()
    assert resolver.builds == kept
    assert program_blob(build_program(graph, layout, TILES, resolver)) == first
    assert program_blob(build_program(graph, other, TILES, resolver)) == program_blob(
        build_program(graph, other, TILES, PlanResolver(graph, TILES)))


def test_a_steps_compute_is_the_machines_it_is_asked_for(graph):
    machine = load_machine(targets.load_target(str(ROOT / "targets" / "vit_fp8.toml"))["target"]["machine"])
    faster = copy.deepcopy(machine)
    faster["compute"]["amp_macs_per_cycle"] = {k: 2 * v for k, v in machine["compute"]["amp_macs_per_cycle"].items()}
    program = build_program(graph, default_layout(graph, TILES), TILES)
    slow = [step_compute(s, machine, program["kernels"]) for s in program["steps"]]
    fast = [step_compute(s, faster, program["kernels"]) for s in program["steps"]]
    assert slow != fast and slow == [step_compute(s, machine, program["kernels"]) for s in program["steps"]]
    assert fast == [step_compute(s, copy.deepcopy(faster), program["kernels"]) for s in program["steps"]]


def test_a_steps_renumbered_transfers_are_memoised_by_the_array_not_its_address():
    """Both phases that read a step's transfers renumber and hash them once per array; an array
    made later at a freed array's address is never taken for it."""
    import gc
    from ipubuild.compiler.planning import exchange, phases
    from ipubuild.engine import canonical
    rows = lambda k: np.arange(40, dtype=np.int32).reshape(4, 10) * k        # noqa: E731
    a = rows(1)
    first = phases._renumbered(a)
    assert phases._renumbered(a) is first
    digests = {first.digest[0]}
    for k in range(2, 40):        # freed and remade: CPython reuses the address
        del a
        gc.collect()
        a = rows(k)
        step = phases._renumbered(a)
        renamed, codes = exchange.renumbered(a)
        assert step.digest[0] == canonical.digest(np.ascontiguousarray(renamed)) and np.array_equal(step.codes, codes)
        digests.add(step.digest[0])
    assert len(digests) == 39


def test_a_replayed_operation_reads_in_place_casts_as_a_fresh_build_does(tmp_path):
    """A cast stored in place writes over its input's buffer: an output where the read is a
    stored block, a gathered copy where it is not. Moving a cast's producer changes which, so
    the operations after it are taken from the kept build only where the kinds agree."""
    text = (ROOT / "targets" / "vit_fp8.toml").read_text()
    assert 'default = "separate"' in text
    (tmp_path / "t.toml").write_text(text.replace('default = "separate"', 'default = "inplace"')
                                     .replace('policy = "f143"', 'policy = "f143"\nfuse = ["attention_context"]', 1))
    g = frontend.build_model(plugins.get_plugin_manager(), targets.load_target(str(tmp_path / "t.toml"))).graph
    producer = g.producer()
    base = default_layout(g, TILES)
    resolver = PlanResolver(g, TILES)
    build_program(g, base, TILES, resolver)
    compared = 0
    for cast in (op for op in g.ops if op.type == "cast"):
        source = producer[cast.inputs[0]]
        for move in (1, 3, 17):
            layout = {"ops": {k: dict(v) for k, v in base["ops"].items()}}
            choice = layout["ops"][str(source.id)]
            choice["offset"] = (choice.get("offset", 0) + move) % TILES
            try:
                got = build_program(g, layout, TILES, resolver)
            except UserError:
                continue
            assert program_blob(got) == program_blob(build_program(g, layout, TILES, PlanResolver(g, TILES))), \
                (cast.name, move)
            compared += 1
    assert compared >= 6 and resolver.replayed > 0
