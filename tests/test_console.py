"""The console a developer meets (ipubuild/console.py, progress.py, explain.py, commands.py): a
quiet build at a pipe and at a terminal, the full log in build.log, a no-op that says "up to
date", ``doit explain:``, doit's own commands (bare ``doit``, ``clean``, ``forget``, ``list``,
``info``), compiler warnings shown and replayed, Ctrl-C, and errors reported early.

Each tree carries its own copy of ipubuild/ (so a test can edit a kernel as a developer would);
the trees of this module share one cache, so that only the first build does all the work.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from buildtree import SMALL, TIMEOUT, copy_ipubuild, doit, env, make_tree

from ipubuild.build import explain
from ipubuild.ui.progress import Activity

TEXT = SMALL.replace("rounds = 3", "rounds = 1")
CLOSING = ("final_cycles=", "profile=", "float32MinimumCosineSimilarity=", "referenceMinimumCosineSimilarity=",
           "referenceMaximumAbsoluteError=", "package=")
WARNING_C = "\nstatic int ipubuild_probe(void) { int unused_here; return 0; }\n"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared") / "cache"


def tree_with(path: Path, targets: dict | None = None) -> Path:
    tree = make_tree(path, targets if targets is not None else {"small": TEXT})
    copy_ipubuild(tree)
    return tree


def quiet(tree: Path, cache: Path, **extra) -> dict:
    """The environment of a user who set nothing: the default console."""
    e = env(tree, IPUBUILD_CACHE_DIR=str(cache), **extra)
    for k in ("IPUBUILD_CONSOLE", "IPUBUILD_LOG"):
        if k not in extra:
            e.pop(k)
    return e


def scripted(tree: Path, cache: Path, **extra) -> dict:
    return env(tree, IPUBUILD_CACHE_DIR=str(cache), **extra)


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def assert_ends_with_closing_lines(out: str) -> None:
    tail = lines(out)[-len(CLOSING):]
    assert [ln.split("=")[0] + "=" for ln in tail] == [c.split("=")[0] + "=" for c in CLOSING], out
    assert "numericalTest=PASS" in tail[4] and "deviceTest=PASS" in tail[5], out


@pytest.fixture(scope="module")
def built(tmp_path_factory, cache):
    """A tree built once with the default console at a pipe: (tree, run)."""
    tree = tree_with(tmp_path_factory.mktemp("built"))
    run = doit(tree, "build:small", environ=quiet(tree, cache))
    assert run.returncode == 0, run.tail()
    return tree, run


# --- the quiet console ----------------------------------------------------------------------------

def test_a_build_at_a_pipe_is_short_and_ends_with_the_closing_lines(built):
    tree, run = built
    out = run.stdout + run.stderr
    assert len(lines(out)) <= 30, out
    assert_ends_with_closing_lines(run.stdout)
    assert "Traceback" not in out and "INFO" not in out and "ipubuild.build{" not in out, out
    assert not re.search(r"^(\.  |-- )", out, re.M), out          # no per-task lines
    assert "referencePrecision" not in out                          # the stray line stays in the log
    progress = re.findall(r"^\[\s*\d+/\d+\] (\w+):\S+", run.stdout, re.M)
    assert progress and len(progress) == len(set(progress)), run.stdout   # one line per phase kind
    assert "plan_package" in progress and "place_storage" not in progress   # planning phases nest in it
    assert re.search(r"plan_package:small .*search [\d,]+ . [\d,]+ cycles \(.\d+\.\d %\) in 1 round", run.stdout)
    m = re.search(r"^small built: (\d+) tasks: (\d+) ran, (\d+) from the cache, 0 up to date, [\d.]+ s; "
                  r"log: artifacts/small/build.log$", run.stdout, re.M)
    assert m and int(m[1]) == int(m[2]) + int(m[3]) and int(m[2]) > 0, run.stdout


def test_the_full_structured_log_goes_to_build_log(built):
    tree, _ = built
    log = (tree / "artifacts" / "small" / "build.log").read_text()
    assert re.search(r'^\S+Z  INFO ipubuild\.build\{target="small" tile_count=16 operations=\d+\}:'
                     r'ipubuild\.phase\{phase="plan_package"\}: validated search incumbent cycles=\d+', log, re.M)
    assert 'package build phase finished phase="read_machine"' in log      # lines of no target too
    assert "referencePrecision=device" in log and "compiled kernel variant" in log
    assert lines(log)[-1].startswith("package=") and "deviceTest=PASS" in log   # it ends as the seed's


def test_a_no_op_says_up_to_date_and_keeps_the_last_log_and_trace(built, cache):
    tree, _ = built
    keep = {n: (tree / "artifacts" / "small" / n).read_bytes() for n in ("build.log", "build.trace.json")}
    run = doit(tree, "build:small", environ=quiet(tree, cache))
    assert run.returncode == 0, run.tail()
    out = lines(run.stdout + run.stderr)
    assert re.fullmatch(r"small is up to date \(\d+ tasks checked, [\d.]+ s\)", out[0]), out
    assert len(out) == 1 + len(CLOSING), out
    assert_ends_with_closing_lines(run.stdout)
    for name, data in keep.items():
        assert (tree / "artifacts" / "small" / name).read_bytes() == data, name


def test_scripts_keep_the_per_task_lines_and_the_log(built, cache):
    tree, _ = built
    run = doit(tree, "build:small", environ=scripted(tree, cache))
    assert re.search(r"^-- lower_model:small$", run.stdout, re.M) and re.search(r"^-- build:small$", run.stdout, re.M)
    assert "up to date" not in run.stdout
    assert_ends_with_closing_lines(run.stdout.replace("-- build:small\n", ""))


def test_doit_verbosity_2_and_IPUBUILD_LOG_bring_the_log_back(built, cache):
    tree, _ = built
    for args, extra in ((("-v", "2"), {}), ((), {"IPUBUILD_LOG": "debug"})):
        assert doit(tree, "forget", environ=quiet(tree, cache)).returncode == 0
        run = doit(tree, *args, "build:small", environ=quiet(tree, cache, **extra))
        assert run.returncode == 0, run.tail()
        assert re.search(r'INFO ipubuild\.build\{target="small".*package build phase finished phase="lower_model"',
                         run.stderr), (args, extra, run.tail())
        assert not re.search(r"^\.  ", run.stdout, re.M)


def test_a_bad_console_setting_is_one_warning(built, cache):
    tree, _ = built
    run = doit(tree, "build:small", environ=quiet(tree, cache, IPUBUILD_CONSOLE="fancy", IPUBUILD_LOG="loud"))
    assert run.returncode == 0, run.tail()
    assert "warning: IPUBUILD_CONSOLE=fancy: expected one of auto, live, plain, tasks; using auto" in run.stderr
    assert "warning: IPUBUILD_LOG=loud: expected debug, info, warning or error; using warning" in run.stderr


def _pty_run(tree: Path, environ: dict, *args: str) -> tuple[int, str]:
    """Run doit with a terminal as its stdout and stderr; return its exit code and what it drew."""
    master, slave = os.openpty()
    p = subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=tree, stdin=slave, stdout=slave,
                         stderr=slave, env=dict(environ, TERM="xterm", COLUMNS="120"), start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:          # EIO: the terminal's other end has closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace")


def test_at_a_terminal_one_live_line_shows_the_search(tmp_path):
    tree = tree_with(tmp_path / "t")
    own = tmp_path / "own-cache"          # so that the search runs
    code, screen = _pty_run(tree, quiet(tree, own), "build:small")
    assert code == 0, screen
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in re.split(r"\r|\n|\x1b\[2K", screen)]
    live = [f for f in frames if re.search(r"\[\d+/\d+\] \S+:small", f)]
    assert any("plan_package:small" in f and "best" in f and "cycles" in f for f in live), live
    assert any(re.search(r"round 1/1", f) for f in live), live
    assert "numericalTest=PASS" in screen and "Traceback" not in screen
    assert not re.search(r"^\.  ", screen, re.M)
    # a no-op at a terminal draws no live line (and loads no terminal library: see below)
    code, screen = _pty_run(tree, quiet(tree, own), "build:small")
    assert code == 0 and "small is up to date" in screen and "\x1b[" not in screen, screen


def test_a_no_op_and_a_pipe_load_no_heavy_module(built, cache):
    tree, _ = built
    e = quiet(tree, cache, PYTHONPROFILEIMPORTTIME="1")
    run = doit(tree, "build:small", environ=e)
    loaded = set(re.findall(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", run.stderr))
    assert "ipubuild.tasks" in loaded
    for heavy in ("rich", "tqdm", "numpy", "pluggy", "diskcache", "ipubuild.engine.log", "ipubuild.ui.progress"):
        assert heavy not in loaded, heavy
    code, screen = _pty_run(tree, e, "build:small")
    assert code == 0 and "import time:" in screen and not re.search(r"\| +(rich|numpy|pluggy|diskcache)\b", screen)


# --- explain ------------------------------------------------------------------------------------------

def test_explain_after_a_kernel_comment_edit_names_the_file_and_the_early_cutoff(built, cache):
    tree, _ = built
    gelu = tree / "ipubuild" / "kernels" / "gelu.c"
    text = gelu.read_text()
    try:
        gelu.write_text(text.replace("0.044715", "0.0447150", 1) + "/* edit */\n")
        run = doit(tree, "build:small", environ=quiet(tree, cache))
        assert run.returncode == 0, run.tail()
        # the compile, and the counted builds (whose objects come out identical too)
        assert re.search(r"^small built: \d+ tasks: 2 ran, 0 from the cache", run.stdout, re.M), run.stdout
        run = doit(tree, "explain:small", environ=quiet(tree, cache))
        assert run.returncode == 0, run.tail()
        out = run.stdout
        assert re.search(r"^small: the last build that ran tasks started .*; 2 of \d+ tasks ran", out, re.M), out
        assert re.search(r"^compile_kernels:small ran", out, re.M), out
        assert re.search(r"because source ipubuild/kernels/gelu\.c changed \([0-9a-f]{12} → [0-9a-f]{12}\)", out), out
        assert "it compiled kernel variant gelu_f32" in out
        m = re.search(r"early cutoff: it gave identical bytes \(kernel_code_sizes, "
                      r"kernel_objects, kernel_reservations\); (\d+) tasks downstream skipped", out)
        assert m and int(m.group(1)) >= 15, out
    finally:
        gelu.write_text(text)
    assert doit(tree, "build:small", environ=quiet(tree, cache)).returncode == 0
    # a later no-op does not replace what explain tells
    assert doit(tree, "build:small", environ=quiet(tree, cache)).returncode == 0
    again = doit(tree, "explain:small", environ=quiet(tree, cache)).stdout
    assert "gelu.c changed" in again and "2 of" in again


def test_explain_names_a_configuration_key_and_a_code_change(tmp_path, cache):
    tree = tree_with(tmp_path)
    assert doit(tree, "build:small", environ=quiet(tree, cache)).returncode == 0
    target = tree / "targets" / "small.toml"
    target.write_text(TEXT + "[numerics]\nmin_cosine = 0.98\n")
    report = tree / "ipubuild" / "ui" / "report.py"
    report.write_text(report.read_text() + "\n\ndef _explain_probe():\n    return 1\n")
    run = doit(tree, "build:small", environ=quiet(tree, cache))
    assert run.returncode == 0, run.tail()
    out = doit(tree, "explain:small", environ=quiet(tree, cache)).stdout
    assert re.search(r"^check_numerics:small ran", out, re.M), out
    assert "because configuration numerics.min_cosine changed: 0.99 → 0.98" in out, out
    assert re.search(r"^report_profile:small ran.*\n    because code changed: ipubuild/ui/report\.py", out, re.M), out
    assert not re.search(r"^plan_package:small ran", out, re.M), out


def test_a_damaged_explain_record_never_fails_a_build(tmp_path, cache):
    tree = tree_with(tmp_path)
    assert doit(tree, "build:small", environ=quiet(tree, cache)).returncode == 0
    ledger = tree / ".ipubuild" / "explain" / "ledger" / "small.json"
    ledger.write_text('{"check_numerics:small": [1, 2]}')
    (tree / "targets" / "small.toml").write_text(TEXT + "[numerics]\nmin_cosine = 0.98\n")
    run = doit(tree, "build:small", environ=quiet(tree, cache))
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    out = doit(tree, "explain:small", environ=quiet(tree, cache)).stdout
    assert re.search(r"^check_numerics:small ran.*\n    because unknown \(AttributeError", out, re.M), out
    (tree / "targets" / "small.toml").write_text(TEXT)           # the ledger has healed
    assert doit(tree, "build:small", environ=quiet(tree, cache)).returncode == 0
    out = doit(tree, "explain:small", environ=quiet(tree, cache)).stdout
    assert "because configuration numerics.min_cosine changed: 0.98 → 0.99" in out, out


def test_explain_before_any_build_is_one_line(tmp_path, cache):
    tree = tree_with(tmp_path)
    run = doit(tree, "explain:small", environ=quiet(tree, cache))
    assert run.returncode == 1 and "Traceback" not in run.output, run.tail()
    assert run.error_lines == ["error: explain:small: no build of small has run a task in this tree yet; "
                               "run `doit build:small` first"], run.tail()
    # bare `doit explain` / `doit inspect`: a target never built is one line, and the others go on
    for group, says in (("explain", "no build of small has run a task in this tree yet"),
                        ("inspect", "no package yet"), ("profile", "no profile yet")):
        run = doit(tree, group, environ=quiet(tree, cache))
        assert run.returncode == 0 and not run.error_lines, run.tail()
        assert re.search(rf"^skipped {group}:small: .*{says}", run.stdout, re.M), run.tail()


def test_explain_reasons(tmp_path):
    base = {"inputs": {"t/graph": "a" * 64}, "sources": {"k.c": "b" * 64}, "code": {"ipubuild.x": "c"},
            "plugins": {"p": "dist==1.0:f1"}, "toolchain": {"numpy": "1.26"}, "config": {"search.rounds": 3,
            "model": {"heads": 2}}, "cache": "id1"}
    cur = {**base, "inputs": {"t/graph": "d" * 64}, "plugins": {"p": "dist==1.1:f2"},
           "toolchain": {"numpy": "2.0"}, "config": {"search.rounds": 4, "model": {"heads": 2}}, "cache": "id2"}
    got = explain.reasons(base, cur, ["artifacts/t/t.ipuexe"], True, tmp_path)
    assert got == [f"input t/graph changed ({'a' * 12} → {'d' * 12})",
                   "configuration search.rounds changed: 3 → 4",
                   "plugin p changed: dist==1.0 → dist==1.1",
                   "toolchain numpy changed: 1.26 → 2.0",
                   "the cache changed (another IPUBUILD_CACHE_DIR, or a new cache)",
                   "output artifacts/t/t.ipuexe was missing"]
    assert explain.reasons(None, cur, [], True, tmp_path)[0].startswith("no earlier run of it in this tree is recorded")
    assert "doit had no record" in explain.reasons(base, base, [], False, tmp_path)[0]
    assert "`doit -a`" in explain.reasons(base, base, [], True, tmp_path)[0]


def test_progress_words_from_the_log_events():
    a = Activity({"rounds": 3})
    a.event("INFO", "validated search incumbent", {"cycles": 118279, "resuming": False})
    assert a.now() == "tile mapping · best 118,279 cycles"
    a.event("INFO", "screened local search round", {"round": 2})
    a.event("INFO", "evaluating ordered local candidates concurrently", {"candidates": 3})
    a.event("INFO", "accepted local layout improvement", {"after": 110201})
    assert a.now() == "round 2/3 · best 110,201 cycles (−6.8 %) · measuring 3 candidates"
    a.event("INFO", "measured local search round", {"evaluations_per_s": "1.25"})
    assert a.now().endswith("· 1.25 candidates/s")
    assert a.summary() == "search 118,279 → 110,201 cycles (−6.8 %) in 2 rounds"
    b = Activity({}, fancy=False)
    for _ in range(8):
        b.event("INFO", "compiled kernel variant", {"variant": "x"})
    assert b.summary() == "8 kernel variants compiled"


def test_a_long_task_at_a_pipe_says_how_far_it_is(monkeypatch):
    """A phase's progress events become a line now and then while its task runs (a pipe has no
    live line): the work, done of total, and the seconds so far; none once the work is done."""
    import io

    from ipubuild.engine import log as logmod
    from ipubuild.ui.progress import PipeView

    class Console:
        real_stdout, total, done = io.StringIO(), 26, 3

        def write_to(self, out, text):
            out.write(text)

    monkeypatch.setattr(logmod, "_PROGRESS_EVERY", 0.0)
    monkeypatch.setattr(logmod.log, "level", 2)       # the log's lines off the console
    view = PipeView(Console())
    view.PROGRESS_EVERY = 0.0
    try:
        view.start("lower_model:big", {})
        for n in (0, 5, 12):
            logmod.progress("reference operations", n, 12)
        said = view.out.getvalue().splitlines()
        assert said == ["  lower_model:big · reference operations 0/12 · 0 s",
                        "  lower_model:big · reference operations 5/12 · 0 s"], said
        assert view.activity.now() == ""
    finally:
        view.stop()


def test_a_search_at_a_pipe_says_its_round_and_best_cycles(monkeypatch):
    """At a pipe the search's rounds come as lines too (its candidates run in workers, whose
    progress the console does not see): the round, the best cycles and what it measures; the
    placement's work no longer shows once it has finished."""
    import io

    from ipubuild.engine import log as logmod
    from ipubuild.ui.progress import PipeView

    class Console:
        real_stdout, total, done = io.StringIO(), 26, 6

        def write_to(self, out, text):
            out.write(text)

    monkeypatch.setattr(logmod, "_PROGRESS_EVERY", 0.0)
    monkeypatch.setattr(logmod.log, "level", 2)
    view = PipeView(Console())
    view.PROGRESS_EVERY = 0.0
    try:
        view.start("plan_package:big", {"rounds": 3})
        for n in (0, 1472):
            logmod.progress("tiles' storage placed", n, 1472)
        logmod.log.info("validated search incumbent", cycles=1373051, resuming=False)
        logmod.log.info("screened local search round", round=1, proposed=10)
        logmod.log.info("evaluating ordered local candidates concurrently", candidates=3, threads=2)
        logmod.log.info("accepted local layout improvement", attempt=2, before=1373051, after=1287449)
        said = view.out.getvalue().splitlines()
        assert said == ["  plan_package:big · tiles' storage placed 0/1,472 · 0 s",
                        "  plan_package:big · tile mapping · best 1,373,051 cycles · 0 s",
                        "  plan_package:big · round 1/3 · best 1,373,051 cycles · 0 s",
                        "  plan_package:big · round 1/3 · best 1,373,051 cycles · measuring 3 candidates · 0 s",
                        "  plan_package:big · round 1/3 · best 1,287,449 cycles (-6.2 %) · measuring 3 candidates · 0 s"], said
    finally:
        view.stop()


def test_progress_lines_in_the_log_are_few():
    """``progress`` writes a line at most every few seconds per kind of work, and the last one."""
    from ipubuild.engine import log as logmod
    seen = []
    logmod.log.listeners.append(lambda level, message, kv: seen.append((kv["done"], kv["total"])))
    try:
        for n in range(1001):
            logmod.progress("tiles' storage placed", n, 1000)
    finally:
        logmod.log.listeners.pop()
    assert seen[0] == (0, 1000) and seen[-1] == (1000, 1000) and len(seen) <= 3, seen


# --- doit's conventions ---------------------------------------------------------------------------

def test_bare_doit_builds_what_it_can_and_names_what_it_skips(tmp_path, cache):
    rms = TEXT.replace('family = "vit"', 'family = "zz_not_installed"')     # a family no plugin gives
    big = TEXT.replace("[target]\n", "[target]\ndefault = false\n", 1)      # built only when named
    tree = tree_with(tmp_path, {"small": TEXT, "zz_rms": rms, "big": big})
    run = doit(tree, environ=quiet(tree, cache))
    assert run.returncode == 0, run.tail()
    assert re.search(r"^skipped 1 target marked \[target\] default = false: big \(build one by name: doit build:big\)$",
                     run.stdout, re.M), run.stdout
    assert not (tree / "artifacts" / "big").exists() and "big built:" not in run.stdout
    typo = doit(tree, "build:smal", environ=quiet(tree, cache))       # a misspelt target: a suggestion
    assert typo.returncode != 0 and 'no task or target "build:smal"; did you mean build:small' in typo.output, \
        typo.tail()
    assert re.search(r"^skipped build:zz_rms: targets/zz_rms\.toml: model\.family: unknown family 'zz_not_installed'",
                     run.stdout, re.M), run.stdout
    assert "numericalTest=PASS" in run.stdout and "small built:" in run.stdout, run.stdout
    group = doit(tree, "build", environ=quiet(tree, cache))
    assert group.returncode == 0 and "skipped build:zz_rms" in group.stdout, group.tail()
    named = doit(tree, "build:zz_rms", environ=quiet(tree, cache))
    assert named.returncode == 1 and named.error_lines[0].startswith("error: targets/zz_rms.toml: model.family"), \
        named.tail()
    listed = doit(tree, "list", environ=quiet(tree, cache)).stdout
    assert re.search(r"^build +compile, package, run .*: big, small, zz_rms \(error: targets/zz_rms\.toml: "
                     r"model\.family: unknown family 'zz_not_installed'", listed, re.M), listed
    assert re.search(r"^explain +why each task .*: big, small(, .*)?$", listed, re.M), listed   # (and shipped targets)
    assert re.search(r"^plan_package +phase plan_package: search the layout$", listed, re.M), listed
    info = doit(tree, "info", "build:small", environ=quiet(tree, cache))
    assert info.returncode == 0 and "up-to-date" in info.stdout and "final_cycles" not in info.stdout, info.tail()


def test_a_failed_line_counts_the_failed_targets_tasks_only(tmp_path, cache):
    """Bare ``doit`` with one target that builds and one whose numerical gate fails: the
    ``failed:`` line counts the failing target's tasks (and the shared ones), not the other's."""
    strict = TEXT + "\n[numerics]\nmin_cosine = 0.9999999\nmax_abs_error = 0.0000001\n"
    tree = tree_with(tmp_path, {"small": TEXT, "strict": strict})
    run = doit(tree, environ=quiet(tree, cache))
    assert run.returncode != 0, run.tail()
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("failed: "))
    assert "build:strict" in line, line
    n = int(re.search(r"\((\d+) tasks: ", line)[1])
    assert n <= 28, line          # one target's 27 tasks and the shared machine task at most
    assert "small built:" in run.stdout, run.tail()


def test_clean_forget_and_the_cache(tmp_path, cache):
    tree = tree_with(tmp_path)
    own = tmp_path / "own-cache"
    assert doit(tree, "build:small", environ=quiet(tree, own)).returncode == 0
    package = tree / "artifacts" / "small" / "small.ipuexe"
    refs = tree / ".ipubuild" / "refs" / "small"
    assert package.exists() and any(refs.iterdir())
    run = doit(tree, "clean", environ=quiet(tree, own))
    assert run.returncode == 0, run.tail()
    assert not package.exists() and not (tree / "artifacts" / "small").exists(), run.stdout
    assert not any(p.is_file() for p in refs.rglob("*")), run.stdout
    assert (own / "id").is_file()                                # the cache stays
    again = doit(tree, "build:small", environ=scripted(tree, own))     # ... and serves the rebuild
    assert again.returncode == 0 and package.exists(), again.tail()
    assert "cached=true" in again.stderr and "compiled kernel variant" not in again.stderr
    assert doit(tree, "clean", "--all", environ=quiet(tree, own)).returncode == 0 and not package.exists()
    restored = doit(tree, "build:small", environ=quiet(tree, own))
    # the quiet console and explain say the results came from the cache, not that tasks "ran"
    m = re.search(r"^small built: (\d+) tasks: 0 ran, (\d+) from the cache, 0 up to date", restored.stdout, re.M)
    assert restored.returncode == 0 and m and m[1] == m[2], restored.stdout
    told = doit(tree, "explain:small", environ=quiet(tree, own)).stdout
    assert re.search(rf"; {m[1]} of \d+ tasks ran \({m[1]} of them from the cache: nothing computed\)", told), told
    assert "its result came from the local cache" in told, told
    assert doit(tree, "clean", "build:small", environ=quiet(tree, own)).returncode == 0 and not package.exists()
    # doit forget: every task of the tree runs again (out of the cache)
    assert doit(tree, "build:small", environ=quiet(tree, own)).returncode == 0
    forgot = doit(tree, "forget", environ=quiet(tree, own))
    assert forgot.returncode == 0 and "forgetting lower_model:small" in forgot.stdout, forgot.tail()
    after = doit(tree, "build:small", environ=scripted(tree, own))
    assert "lower_model:small" in after.executed and "plan_package:small" in after.executed, after.tail()
    gone = doit(tree, "clean", "--cache", environ=quiet(tree, own))
    assert gone.returncode == 0 and not own.exists() and f"removing the action cache '{own}'" in gone.stdout


# --- compiler diagnostics ------------------------------------------------------------------------------

def test_compiler_warnings_are_shown_once_replayed_from_the_cache_and_werror_fails(tmp_path):
    own = tmp_path / "own-cache"
    tree = tree_with(tmp_path / "t", {"small": TEXT, "small2": TEXT})
    gelu = tree / "ipubuild" / "kernels" / "gelu.c"
    gelu.write_text(gelu.read_text() + WARNING_C)
    run = doit(tree, "build", environ=quiet(tree, own))
    assert run.returncode == 0, run.tail()
    # once per source, naming the variants (only the one the targets use is compiled)
    assert run.output.count("kernel gelu_f32_fp8 (ipubuild/kernels/gelu.c): compiler diagnostics:") == 1, run.output
    assert "compiler diagnostics (cached)" not in run.output
    assert re.search(r"ipubuild/kernels/gelu\.c:\d+:\d+: warning: unused variable .unused_here.", run.output)
    for t in ("small", "small2"):
        assert "unused_here" in (tree / "artifacts" / t / "build.log").read_text(), t
    # a cache hit replays them (once, for both targets)
    assert doit(tree, "forget", environ=quiet(tree, own)).returncode == 0
    run = doit(tree, "build", environ=quiet(tree, own))
    assert run.returncode == 0, run.tail()
    assert run.output.count("kernel gelu_f32_fp8 (ipubuild/kernels/gelu.c): compiler diagnostics (cached):") == 1, \
        run.output
    assert "unused_here" in run.output
    # -Werror through the flags: the warning fails the build, one line naming the kernel
    werror = quiet(tree, own, IPUBUILD_CFLAGS="-O2 -std=c11 -Wall -Werror -fPIC -shared")
    run = doit(tree, "build:small", environ=werror)
    assert run.returncode == 1 and "Traceback" not in run.output, run.tail()
    assert run.error_lines[0].startswith("error: kernel gelu_f32_fp8 (ipubuild/kernels/gelu.c): compile failed: "), \
        run.tail()
    assert "unused_here" in run.output


# --- Ctrl-C -------------------------------------------------------------------------------------------

def test_ctrl_c_mid_search_is_one_line_exit_130_and_the_next_build_resumes(tmp_path, cache):
    tree = tree_with(tmp_path, {"small": SMALL})
    log = tree / "artifacts" / "small" / "build.log"
    p = subprocess.Popen([sys.executable, "-m", "doit", "build:small"], cwd=tree, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=quiet(tree, tmp_path / "own-cache"), text=True,
                         start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and p.poll() is None:
        if log.exists() and "saved mid-plan search state" in log.read_text():
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)          # as a terminal's Ctrl-C: the whole process group
    out, _ = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the build finished before it could be interrupted")
    assert p.returncode == 130, out
    assert "Traceback" not in out, out
    said = [ln for ln in lines(out) if "interrupted" in ln]
    assert len(said) == 1 and len(lines(out)) <= 12, out
    assert re.fullmatch(r"interrupted during \S+:small; finished tasks are kept, and the next build resumes "
                        r"from them", said[0]), out
    run = doit(tree, "build:small", environ=scripted(tree, tmp_path / "own-cache"))
    assert run.returncode == 0 and "numericalTest=PASS" in run.stdout, run.tail()
    assert "lower_model:small" not in run.executed and "compile_kernels:small" not in run.executed, run.executed
    if said[0].startswith("interrupted during plan_package:small"):
        assert "resuming=true" in run.stderr, run.tail()


# --- errors early ---------------------------------------------------------------------------------------

def test_a_misspelt_key_gets_did_you_mean_and_doit_list_names_it(tmp_path, cache):
    tree = tree_with(tmp_path, {"small": TEXT.replace("shortlist = 3", "shortlst = 3")})
    run = doit(tree, "build:small", environ=quiet(tree, cache))
    assert run.returncode == 1 and "Traceback" not in run.output, run.tail()
    assert run.error_lines == ["error: targets/small.toml: search.shortlst: unknown key 'shortlst' (did you mean "
                               "'shortlist'?); known keys: rounds, shortlist, workers, evaluations, seconds, seed, proposals"]
    listed = doit(tree, "list", environ=quiet(tree, cache)).stdout
    assert "small (error: targets/small.toml: search.shortlst: unknown key 'shortlst'" in listed, listed


def test_a_bad_model_parameter_fails_before_any_kernel_compiles(tmp_path, cache):
    tree = tree_with(tmp_path, {"small": TEXT.replace("heads = 2", "heads = 3")})
    run = doit(tree, "build:small", environ=scripted(tree, cache))
    assert run.returncode == 1 and "Traceback" not in run.output, run.tail()
    assert run.error_lines == ["error: targets/small.toml: model.heads: heads 3 does not divide width 64; choose a divisor"], run.tail()
    assert "compile_kernels:small" not in run.executed and "compiled kernel variant" not in run.output
    assert run.executed[-1] == "lower_model:small", run.executed
