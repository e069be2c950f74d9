#!/usr/bin/env python3
"""ipubuild's reliability harness: attacks on a built tree, and what the next plain build does.

    python benchmarks/reliability.py [--target small|vit_fp8] [--out benchmarks/results/reliability.json]

Every attack starts from a tree whose cache was filled by one clean build (copied, so attacks do
not see each other), does its damage, then runs a plain ``doit build:<target>``. The outcome is

* ``healed``: the build passes and its package is byte-identical to a clean build's, and a second
  build right after executes nothing;
* ``clean error``: the build stops with exactly one ``error:`` line and no traceback (the right
  answer where no build can succeed, e.g. a full disk);
* ``FAILED``: anything else (a traceback, a wrong package, a hang, several error lines).

Attacks: ``kill -9`` while each kind of phase runs (chosen by the task doit has just started, not
by time), corruptions of every kind of file the build keeps (cache blobs, pinned blobs, references,
both SQLite databases, the search state, an output file), lost state (the cache, a changed cache
folder, a tiny cache), and storage faults (a full disk, a read-only cache — these need permission to
mount, and are skipped with the reason otherwise — and a vanished compiler). Prints the table
``attack | tried | healed | clean error | failed`` and writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from buildtree import SMALL  # noqa: E402  (the tests' small target: a clean build takes seconds)

SMALL_TEXT = SMALL.replace("rounds = 3", "rounds = 1")
KILL_PHASES = ("lower_model", "compile_kernels", "plan_package", "place_storage", "optimize_exchange_placement",
               "prepare_tile_code", "build_tile_images", "write_package", "run_device", "check_numerics")
TIMEOUT = 900


class Harness:
    def __init__(self, work: Path, target: str):
        self.work, self.target = work, target
        self.env = dict(os.environ, IPUBUILD_CONSOLE="tasks", IPUBUILD_LOG="debug", PYTHONUNBUFFERED="1",
                        IPUBUILD_DEVICE_LOCK_DIR=str(work))
        for k in [k for k in self.env if k.startswith("IPUBUILD_REMOTE_CACHE") or k == "IPUBUILD_CACHE_DIR"]:
            self.env.pop(k)
        self.n = 0

    def source_tree(self, name: str) -> Path:
        tree = self.work / name / "tree"
        (tree / "targets").mkdir(parents=True)
        shutil.copy(REPO / "dodo.py", tree / "dodo.py")
        if self.target == "small":
            (tree / "targets" / "small.toml").write_text(SMALL_TEXT)
        else:
            shutil.copy(REPO / "targets" / f"{self.target}.toml", tree / "targets")
        return tree

    def doit(self, tree: Path, env: dict | None = None, timeout: float = TIMEOUT) -> tuple[int, str]:
        p = subprocess.run([sys.executable, "-m", "doit", f"build:{self.target}"], cwd=tree, env=env or self.env,
                           capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    def package(self, tree: Path) -> bytes | None:
        p = tree / "artifacts" / self.target / f"{self.target}.ipuexe"
        return p.read_bytes() if p.exists() else None

    def built_copy(self, base: Path, name: str) -> Path:
        self.n += 1
        dest = self.work / f"{self.n:03d}-{re.sub(r'[^a-z0-9]+', '-', name.lower())}"
        shutil.copytree(base.parent, dest, symlinks=True)
        return dest / "tree"

    def judge(self, tree: Path, reference: bytes, env: dict | None = None) -> tuple[str, str]:
        try:
            rc, out = self.doit(tree, env)
        except subprocess.TimeoutExpired:
            return "FAILED", "the build hung"
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        if "Traceback" in out:
            return "FAILED", "traceback: " + out[out.index("Traceback"):][:200].replace("\n", " | ")
        if rc == 0 and "numericalTest=PASS" in out:
            if self.package(tree) != reference:
                return "FAILED", "passed with a package that differs from a clean build's"
            rc2, again = self.doit(tree, env)
            ran = re.findall(r"^\.  (\S+)", again, re.M)
            if rc2 != 0 or ran:
                return "FAILED", f"healed, but the next build ran {ran or 'and failed'}"
            return "healed", ""
        if rc != 0 and len(errors) == 1:
            return "clean error", errors[0][:160]
        return "FAILED", f"exit {rc}, {len(errors)} error lines: {out[-300:]!r}"


# attacks: each takes (harness, tree) and damages it; it may return an environment for the build ------
def _kill_during(phase: str):
    def attack(h: Harness, tree: Path):
        # a fresh tree: its build runs every phase, and is killed when doit starts this one
        shutil.rmtree(tree / "artifacts")
        shutil.rmtree(tree / ".ipubuild")
        (tree / ".doit.db").unlink()
        log = tree.parent / "killed.log"
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, "-m", "doit", f"build:{h.target}"], cwd=tree, env=h.env,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.time() + TIMEOUT
            while p.poll() is None and time.time() < deadline:
                if re.search(rf"^\.  {phase}:", log.read_text(errors="replace"), re.M):
                    time.sleep(random.Random(phase).uniform(0.0, 0.3))
                    break
                time.sleep(0.02)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return attack


def _flip_blob(kind: str):
    def attack(h: Harness, tree: Path):
        db = tree / ".ipubuild" / "cache" / ("cas" if kind != "pinned" else "actions") / "cache.db"
        con = sqlite3.connect(db)
        try:
            if kind == "file":
                (name,) = con.execute("select filename from Cache where filename is not null order by key limit 1 "
                                      "offset 3").fetchone()
                path = db.parent / name
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            else:
                where = "key like 'pin:%'" if kind == "pinned" else "filename is null"
                key, value = con.execute(f"select key, value from Cache where {where} order by key limit 1 "
                                         "offset 2").fetchone()
                data = bytearray(value)
                data[len(data) // 2] ^= 0x01
                con.execute("update Cache set value = ? where key = ?", (bytes(data), key))
                con.commit()
        finally:
            con.close()
    return attack


def _refs(damage: str):
    def attack(h: Harness, tree: Path):
        refs = sorted((tree / ".ipubuild" / "refs" / h.target).glob("*.ref"))
        for ref in refs[::3]:
            if damage == "deleted":
                ref.unlink()
            else:
                ref.write_bytes(b"\x00not a digest\xff")
    return attack


def _garbage(rel: str):
    def attack(h: Harness, tree: Path):
        (tree / rel).write_bytes(os.urandom(4096))
        # and a change that needs the cache, so the damaged file is read
        (tree / "artifacts" / h.target / f"{h.target}.ipuexe").unlink()
    return attack


def _delete(rel: str):
    def attack(h: Harness, tree: Path):
        shutil.rmtree(tree / rel)
    return attack


def _search_state(h: Harness, tree: Path):
    state = tree / ".ipubuild" / "search" / f"{h.target}.state.json"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x04
    state.write_bytes(bytes(data))
    shutil.rmtree(tree / ".ipubuild" / "cache")      # so that the search runs again and reads it


def _tamper_output(h: Harness, tree: Path):
    p = tree / "artifacts" / h.target / f"{h.target}.ipuexe"
    data = bytearray(p.read_bytes())
    data[1000] ^= 0xFF
    p.write_bytes(bytes(data))


def _cache_elsewhere(h: Harness, tree: Path):
    return dict(h.env, IPUBUILD_CACHE_DIR=str(tree.parent / "other-cache"))


def _tiny_cache(h: Harness, tree: Path):
    (tree / "targets" / f"{h.target}.toml").write_text(
        (tree / "targets" / f"{h.target}.toml").read_text() + "\n[numerics]\nmin_cosine = 0.995\n")
    return dict(h.env, IPUBUILD_CACHE_SIZE="1000000")


def _no_compiler(h: Harness, tree: Path):
    cc = Path(h.env["IPUBUILD_CC"])           # the compiler every tree was built with, uninstalled
    cc.rename(cc.with_name("cc.gone"))
    h.cleanups.append(["mv", str(cc.with_name("cc.gone")), str(cc)])


def _mount(*args) -> bool:
    return os.geteuid() == 0 and subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _full_disk(h: Harness, tree: Path):
    disk = tree.parent / "disk"
    disk.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)):
        raise Skip("needs permission to mount a tmpfs")
    h.cleanups.append(["umount", "-l", str(disk)])
    return dict(h.env, IPUBUILD_CACHE_DIR=str(disk / "cache"))


def _read_only_cache(change: str):
    def attack(h: Harness, tree: Path):
        cache = tree / ".ipubuild" / "cache"
        if not (_mount("--bind", str(cache), str(cache)) and _mount("-o", "remount,ro,bind", str(cache))):
            raise Skip("needs permission to bind-mount the cache read-only")
        h.cleanups.append(["umount", "-l", str(cache)])
        if change == "artifacts":
            shutil.rmtree(tree / "artifacts")
        else:
            target = tree / "targets" / f"{h.target}.toml"
            target.write_text(target.read_text() + "\n[numerics]\nmin_cosine = 0.995\n")
    return attack


class Skip(Exception):
    pass


ATTACKS = [(f"kill -9 during {p}", _kill_during(p)) for p in KILL_PHASES] + [
    ("flipped byte in a cache blob file", _flip_blob("file")),
    ("flipped bit in a small cache blob", _flip_blob("row")),
    ("flipped bit in a pinned blob", _flip_blob("pinned")),
    ("damaged references", _refs("garbage")),
    ("deleted references", _refs("deleted")),
    ("damaged doit database", _garbage(".doit.db")),
    ("damaged blob index", _garbage(".ipubuild/cache/cas/cache.db")),
    ("damaged action index", _garbage(".ipubuild/cache/actions/cache.db")),
    ("damaged search state", _search_state),
    ("tampered package file", _tamper_output),
    ("deleted cache", _delete(".ipubuild/cache")),
    ("deleted artifacts", _delete("artifacts")),
    ("cache folder changed", _cache_elsewhere),
    ("tiny cache (1 MB)", _tiny_cache),
    ("compiler uninstalled", _no_compiler),
    ("full disk", _full_disk),
    ("read-only cache, deleted artifacts", _read_only_cache("artifacts")),
    ("read-only cache, a change to build", _read_only_cache("target")),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="attacks on a built tree, and what the next build does")
    p.add_argument("--target", default="small", help="small (the tests' small ViT) or a target in targets/")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "reliability.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ipubuild-reliability-"))
    h = Harness(work, args.target)
    h.cleanups = []
    try:
        base = h.source_tree("base")
        cc = work / "bin" / "cc"
        cc.parent.mkdir()
        cc.write_text('#!/bin/sh\nexec gcc "$@"\n')
        cc.chmod(0o755)
        h.env["IPUBUILD_CC"] = str(cc)
        rc, out = h.doit(base)
        if rc != 0:
            print(out[-3000:])
            return 1
        reference = h.package(base)
        rows = []
        for name, attack in ATTACKS:
            tree = h.built_copy(base, name)
            try:
                env = attack(h, tree) or h.env
                outcome, detail = h.judge(tree, reference, env)
            except Skip as why:
                outcome, detail = "skipped", str(why)
            finally:
                for cmd in h.cleanups:
                    subprocess.run(cmd, capture_output=True)
                h.cleanups.clear()
            rows.append({"attack": name, "outcome": outcome, "detail": detail})
            print(f"[reliability] {name}: {outcome} {detail}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"{'attack':<40} {'tried':>5} {'healed':>6} {'clean error':>11} {'failed':>6}"]
    for r in rows:
        tried = r["outcome"] != "skipped"
        lines.append(f"{r['attack']:<40} {int(tried):>5} {int(r['outcome'] == 'healed'):>6} "
                     f"{int(r['outcome'] == 'clean error'):>11} {int(r['outcome'] == 'FAILED'):>6}"
                     + (f"  ({r['detail']})" if r["outcome"] in ("skipped", "clean error", "FAILED") else ""))
    total = {k: sum(r["outcome"] == k for r in rows) for k in ("healed", "clean error", "FAILED", "skipped")}
    lines.append(f"{'total':<40} {len(rows) - total['skipped']:>5} {total['healed']:>6} {total['clean error']:>11} "
                 f"{total['FAILED']:>6}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": args.target, "rows": rows, "total": total}, indent=1) + "\n")
    print("\n".join(lines))
    return 1 if total["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
