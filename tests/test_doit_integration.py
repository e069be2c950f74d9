"""doit integration (ipubuild/tasks.py, ipubuild/pipeline.py): a toy three-step pipeline run
through doit in-process — up-to-date checks, early cutoff, action-cache hits after the doit DB
is lost, configuration signatures — and the per-tree build lock."""

from __future__ import annotations

import collections
import io
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from doit.cmd_base import ModuleTaskLoader
from doit.doit_cmd import DoitMain

from ipubuild.engine import canonical
from ipubuild.engine.engine import config_subset, phase
from ipubuild.errors import UserError
from ipubuild.build.pipeline import Step, Workspace
from ipubuild.tasks import ContentChecker, Reporter, step_task

ROOT = Path(__file__).resolve().parents[1]

CALLS: collections.Counter = collections.Counter()


# --- toy phases -------------------------------------------------------------------------------

@phase("doittoy_norm", inputs=("src",), outputs=("norm",), config=("norm.case",))
def _norm(ctx):
    """Whitespace-normalised text, optionally case-folded."""
    CALLS["norm"] += 1
    text = " ".join(ctx.bytes("src").decode().split())
    case = config_subset(ctx.config, ("norm.case",))["norm.case"]
    text = text.lower() if case == "lower" else text.upper() if case == "upper" else text
    return {"norm": text.encode()}


@phase("doittoy_words", inputs=("norm",), outputs=("words",))
def _words(ctx):
    """The number of words."""
    CALLS["words"] += 1
    return {"words": canonical.dumps({"words": len(ctx.bytes("norm").split())})}


@phase("doittoy_report", inputs=("words",), outputs=("report",))
def _report(ctx):
    CALLS["report"] += 1
    return {"report": f"word count: {ctx.json('words')['words']}\n".encode()}


@phase("doittoy_fail", inputs=("src",), outputs=("never",))
def _fail(ctx):
    CALLS["fail"] += 1
    raise UserError("src.txt", "this toy phase always refuses its input")


TASKS = ("norm:t", "words:t", "report:t")


def _steps(root: Path, config: dict) -> list[Step]:
    return [
        Step("norm", "t", "doittoy_norm", sources={"src": root / "src.txt"},
             outputs={"norm": "t/norm"}, config=config),
        Step("words", "t", "doittoy_words", inputs={"norm": "t/norm"},
             outputs={"words": "t/words"}, config=config),
        Step("report", "t", "doittoy_report", inputs={"words": "t/words"},
             outputs={"report": "t/report"}, files={"report": root / "out" / "report.txt"},
             config=config),
    ]


class Toy:
    """A workspace in tmp_path and a way to run doit over it in-process."""

    def __init__(self, root: Path):
        self.root = root
        self.ws = Workspace(root)
        self.config = {"norm": {"case": "lower"}, "other": 1}
        self.extra_steps: list[Step] = []

    def namespace(self, outfile) -> dict:
        ws, steps = self.ws, _steps(self.root, self.config) + self.extra_steps

        def task_toy():
            for s in steps:
                yield step_task(ws, s)

        return {"DOIT_CONFIG": {"backend": "sqlite3", "dep_file": str(self.root / ".doit.db"),
                                "verbosity": 2, "reporter": Reporter, "outfile": outfile,
                                "check_file_uptodate": ContentChecker},
                "task_toy": task_toy}

    def doit(self, *args) -> tuple[int, set, set, str]:
        stream = io.StringIO()  # doit's reporter writes here (its default is the sys.stdout
        code = DoitMain(ModuleTaskLoader(self.namespace(stream)),  # of import time)
                        config_filenames=()).run(list(args))
        out = stream.getvalue()
        lines = out.splitlines()
        ran = {ln[3:].strip() for ln in lines if ln.startswith(".  ")}
        fresh = {ln[3:].strip() for ln in lines if ln.startswith("-- ")}
        return code, ran, fresh, out

    def write_src(self, text: str) -> None:
        p = self.root / "src.txt"
        p.write_text(text)
        # make the edit visible to doit's timestamp check even on coarse-mtime filesystems
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))

    def ref(self, artifact: str) -> str:
        return self.ws.read_ref(artifact)

    def ref_state(self) -> dict:
        out = {}
        for a in ("t/norm", "t/words", "t/report"):
            p = self.ws.ref_path(a)
            out[a] = (p.read_bytes(), p.stat().st_mtime_ns)
        rep = self.root / "out" / "report.txt"
        out["report.txt"] = (rep.read_bytes(), rep.stat().st_mtime_ns)
        return out


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.delenv("IPUBUILD_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    CALLS.clear()
    t = Toy(tmp_path)
    t.write_src("Hello   World\n")
    yield t
    t.ws.store.close()


def _built(toy: Toy) -> None:
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert set(TASKS) <= ran, out
    assert CALLS == {"norm": 1, "words": 1, "report": 1}


# --- tests ------------------------------------------------------------------------------------

def test_first_run_executes_all_second_run_none(toy):
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert set(TASKS) <= ran and not (set(TASKS) & fresh), out
    assert CALLS == {"norm": 1, "words": 1, "report": 1}
    # refs hold the output digests, and the file slot holds the bytes
    norm = toy.ref("t/norm")
    assert toy.ws.store.get(norm) == b"hello world"
    assert toy.ws.engine.decoded(toy.ref("t/words")) == {"words": 2}
    assert (toy.root / "out" / "report.txt").read_bytes() == b"word count: 2\n"
    assert toy.ws.ref_path("t/norm").read_text() == norm + "\n"

    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert not (set(TASKS) & ran), out
    assert set(TASKS) <= fresh, out
    assert CALLS == {"norm": 1, "words": 1, "report": 1}


def test_run_single_task_runs_its_dependencies_first(toy):
    code, ran, fresh, out = toy.doit("run", "report:t")
    assert code == 0, out
    order = [ln[3:].strip() for ln in out.splitlines() if ln.startswith(".  ")]
    assert [t for t in order if t in TASKS] == list(TASKS)


def test_early_cutoff_through_doit(toy):
    _built(toy)
    before = toy.ref_state()

    # whitespace-only edit: norm re-runs, its output is byte-identical, the rest stays fresh
    toy.write_src("  Hello World  \n\n")
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert "norm:t" in ran, out
    assert {"words:t", "report:t"} <= fresh and not ({"words:t", "report:t"} & ran), out
    assert CALLS == {"norm": 2, "words": 1, "report": 1}
    assert toy.ref_state() == before  # the ref was not even rewritten (mtime kept)

    # a real change with the same word count: norm and words re-run, report is cut off
    toy.write_src("Goodbye World\n")
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert {"norm:t", "words:t"} <= ran and "report:t" in fresh and "report:t" not in ran, out
    assert CALLS == {"norm": 3, "words": 2, "report": 1}

    # a change that propagates all the way
    toy.write_src("one two three\n")
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert set(TASKS) <= ran, out
    assert CALLS == {"norm": 4, "words": 3, "report": 2}
    assert (toy.root / "out" / "report.txt").read_bytes() == b"word count: 3\n"


def test_action_cache_hit_when_doit_db_is_lost(toy):
    _built(toy)
    before = toy.ref_state()
    (toy.root / ".doit.db").unlink()

    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    assert set(TASKS) <= ran, out          # doit knows nothing: every task executes ...
    assert CALLS == {"norm": 1, "words": 1, "report": 1}  # ... but every phase is a cache hit
    assert toy.ref_state() == before       # refs and files untouched (bytes and mtimes)

    code, ran, fresh, out = toy.doit()
    assert code == 0 and set(TASKS) <= fresh and not (set(TASKS) & ran), out


def test_restored_source_hits_the_action_cache(toy):
    _built(toy)
    toy.write_src("something else entirely\n")
    assert toy.doit()[0] == 0
    assert CALLS == {"norm": 2, "words": 2, "report": 2}
    toy.write_src("Hello   World\n")          # back to the original bytes
    code, ran, fresh, out = toy.doit()
    assert code == 0 and set(TASKS) <= ran, out
    assert CALLS == {"norm": 2, "words": 2, "report": 2}  # all three were hits
    assert (toy.root / "out" / "report.txt").read_bytes() == b"word count: 2\n"


def test_config_signature_declared_vs_undeclared(toy):
    _built(toy)
    toy.config = {"norm": {"case": "lower"}, "other": 2, "more": {"x": 1}}   # undeclared keys
    code, ran, fresh, out = toy.doit()
    assert code == 0 and set(TASKS) <= fresh and not (set(TASKS) & ran), out

    toy.config = {"norm": {"case": "upper"}, "other": 2}                       # declared key
    code, ran, fresh, out = toy.doit()
    assert code == 0, out
    # norm re-runs for its signature; words for its changed input; report is cut off
    assert {"norm:t", "words:t"} <= ran and "report:t" in fresh and "report:t" not in ran, out
    assert toy.ws.store.get(toy.ref("t/norm")) == b"HELLO WORLD"
    assert CALLS == {"norm": 2, "words": 2, "report": 1}


def test_doit_db_is_sqlite(toy):
    _built(toy)
    db = toy.root / ".doit.db"
    assert db.read_bytes()[:16] == b"SQLite format 3\x00"
    con = sqlite3.connect(db)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        assert tables
        dumped = "\n".join(con.iterdump())
    finally:
        con.close()
    assert "norm:t" in dumped and "report:t" in dumped
    assert not list(toy.root.glob(".doit.db.*"))  # no dbm side files


def test_phase_user_error_is_one_line_and_fails_the_run(toy, capsys):
    toy.extra_steps = [Step("fail", "t", "doittoy_fail", sources={"src": toy.root / "src.txt"},
                            outputs={"never": "t/never"})]
    code, ran, fresh, out = toy.doit("run", "fail:t")
    assert code != 0
    assert "error: src.txt: this toy phase always refuses its input" in out
    assert "Traceback" not in out + capsys.readouterr().err
    assert not toy.ws.ref_path("t/never").exists()
    assert CALLS["fail"] == 1


# --- the build lock ---------------------------------------------------------------------------

_HOLDER = textwrap.dedent("""\
    import pathlib, sys, time
    from ipubuild.tasks import hold_build_lock
    root, marks = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    hold_build_lock(root)
    (marks / "p1_locked").write_text("1")
    deadline = time.time() + 30
    while not (marks / "release").exists() and time.time() < deadline:
        time.sleep(0.01)
    (marks / "p1_released").write_text(str(time.time_ns()))
    """)

_WAITER = textwrap.dedent("""\
    import pathlib, sys, time
    from ipubuild.tasks import hold_build_lock
    root, marks = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    (marks / "p2_trying").write_text("1")
    hold_build_lock(root)
    hold_build_lock(root)  # idempotent within a process: must not deadlock on itself
    (marks / "p2_acquired").write_text(str(time.time_ns()))
    """)


def _spawn(script: str, *args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process exited early: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.01)


def test_build_lock_second_process_waits_for_first(tmp_path):
    root, marks = tmp_path / "tree", tmp_path / "marks"
    root.mkdir()
    marks.mkdir()
    p1 = _spawn(_HOLDER, root, marks)
    p2 = None
    try:
        _wait_for(marks / "p1_locked", p1)
        assert (root / ".ipubuild" / "build.lock").exists()
        p2 = _spawn(_WAITER, root, marks)
        _wait_for(marks / "p2_trying", p2)
        time.sleep(0.4)
        assert p2.poll() is None and not (marks / "p2_acquired").exists(), "p2 did not wait"
        (marks / "release").write_text("1")
        assert p1.wait(20) == 0
        _, err = p2.communicate(timeout=20)
        assert p2.returncode == 0, err
        assert int((marks / "p2_acquired").read_text()) >= int((marks / "p1_released").read_text())
        assert "waiting for another build in this tree" in err
    finally:
        for p in (p1, p2):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_build_lock_other_tree_does_not_wait(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    p1 = _spawn(_HOLDER, tmp_path / "tree1", marks)
    try:
        _wait_for(marks / "p1_locked", p1)
        p2 = _spawn(_WAITER, tmp_path / "tree2", marks)
        _, err = p2.communicate(timeout=20)
        assert p2.returncode == 0, err
        assert (marks / "p2_acquired").exists() and not (marks / "p1_released").exists()
        assert "waiting" not in err
    finally:
        (marks / "release").write_text("1")
        p1.wait(20)


def test_a_doit_database_row_that_is_not_json_is_damage(tmp_path):
    """heal_doit_db reads every row as doit does: truncated JSON moves the database aside."""
    import sqlite3
    from ipubuild.tasks import heal_doit_db
    db = tmp_path / ".doit.db"
    con = sqlite3.connect(db)
    con.execute("create table doit (task_id text not null primary key, task_data json)")
    con.execute("insert into doit values ('a:b', '{\"dep\": ')")
    con.commit()
    con.close()
    heal_doit_db(db)
    assert not db.exists() and list(tmp_path.glob(".doit.db.corrupt-*"))
    db2 = tmp_path / "ok" / ".doit.db"
    db2.parent.mkdir()
    con = sqlite3.connect(db2)
    con.execute("create table doit (task_id text not null primary key, task_data json)")
    con.execute("insert into doit values ('a:b', '{\"dep\": 1}')")
    con.commit()
    con.close()
    heal_doit_db(db2)
    assert db2.exists()


def test_a_source_edited_while_its_task_ran_is_recorded_as_read_and_rebuilt(tmp_path, monkeypatch):
    """doit's record of a dependency a step read is the bytes it read, not the file when the task
    ends: an edit made meanwhile is reported once, and the next check finds the task changed."""
    import os
    from ipubuild import tasks
    from ipubuild.engine import files
    from ipubuild.log import log
    warned = []
    monkeypatch.setattr(log, "warning", lambda message, **kv: warned.append(message))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tasks, "_changed", set())
    src = tmp_path / "add.c"
    src.write_text("int add(int a, int b) { return a + b; }\n")
    os.utime(src, ns=(1, 1))                   # an old file: its stat key is trusted
    checker = tasks.ContentChecker()
    files.read_recorded(src)                   # the phase reads it …
    src.write_text("int add(int a, int b) { return a + b + 1; }\n")    # … and it is edited
    state = checker.get_state("add.c", None)
    assert state == [None] * 4 + [files.hashlib.sha256(b"int add(int a, int b) { return a + b; }\n").hexdigest()]
    assert checker.check_modified("add.c", os.stat(src), state)      # the next build rebuilds it
    assert checker.get_state("add.c", None) == state
    assert warned == ["add.c changed during the build; the next build rebuilds it"]
    # a source read and left alone is recorded as usual (its stat key and digest)
    other = tmp_path / "gelu.c"
    other.write_text("int gelu;\n")
    os.utime(other, ns=(1, 1))
    files.read_recorded(other)
    st = checker.get_state("gelu.c", None)
    assert st[4] == files.file_digest(other) and not checker.check_modified("gelu.c", os.stat(other), st)
    assert len(warned) == 1
