"""C kernels (codelets): compiling kernel variants with the system C compiler.

The C ABI is documented in ``README.md`` beside the sources. ``compile_kernels`` runs once per
target: it compiles the variants the target's graph can use (``Operator.variants``) — the others
stay declared and compile when a target needs them — each through the ``compile_kernel``
sub-phase, as the *checked build* (``-DIPU_CHECKED=1``: the kernels check their arguments and
say why they refuse them; see ``ipu_kernel.h``). Its action key is the variant's source, every
header it includes, its defines (the checked build's among them), the compiler's flags and the
compiler's identity (its version, target triple and the bytes of its executables: a changed
wrapper script or an upgraded ``cc1`` is a changed compiler). Nothing else: no machine
description, no path of the checkout. Variants compile concurrently.

A variant's code space is reserved in whole quanta (``machine.code.reservation_quantum``) with at
least one byte of slack, so that an edit which keeps the code inside its reservation leaves the
tile memory plan, and so every planning phase, untouched (as an incremental linker would).
"""
from __future__ import annotations

import errno
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
from pathlib import Path, PurePosixPath

from ..engine import canonical
from ..engine.engine import phase
from ..engine.errors import UserError
from ..engine.executors import run_phases
from ..engine.log import log

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
DEFAULT_CFLAGS = "-O2 -std=c11 -Wall -fPIC -shared"
# every variant is compiled as the checked build (ipu_kernel.h); the define is in its compile key
CHECKED = ("IPU_CHECKED", 1)
SOURCE_SUFFIXES = (".c", ".h")
COUNTER = KERNEL_DIR / "counter" / "block_counter.c"
COUNTER_NAME = "ipu_block_counter.c"     # its name beside the kernel source in the scratch folder
COUNT_FLAGS = "-fsanitize-coverage=trace-pc"
#: the counted builds compile beside the link, the images and the package (``compile_kernels``),
#: at a lower priority than the build's own thread, which would otherwise wait for a core
COUNTED_NICE = 10

#: the largest tile count whose kernels ``[profile] kernel_counts = "auto"`` counts: counting
#: compiles every variant twice and runs the program a second time, on the simulator's lanes
#: (vit_fp8, 64 tiles: 0.6 s at first; ViT-B/16 on 1472 tiles: 31 s, as long as its device run)
AUTO_MAX_TILES = 256


def counting(config: dict) -> bool:
    """Whether a target (its resolved ``config``) counts its kernels' basic blocks."""
    setting = config["profile"]["kernel_counts"]
    return setting == "on" or (setting == "auto" and config["target"]["tile_count"] <= AUTO_MAX_TILES)




def compiler() -> tuple[str, str]:
    """The C compiler and flags: ``$IPUBUILD_CC`` (else ``$CC``, else ``cc``) and
    ``$IPUBUILD_CFLAGS`` (default ``-O2 -std=c11 -Wall -fPIC -shared``)."""
    return (os.environ.get("IPUBUILD_CC") or os.environ.get("CC") or "cc",
            os.environ.get("IPUBUILD_CFLAGS") or DEFAULT_CFLAGS)


#: CPU seconds the compiler may use per process (a limit of CPU, not of wall time: a loaded
#: machine, or a clock that runs fast, gives the same build as a quiet one)
COMPILER_CPU_SECONDS = 300


#: sh's exit status for a command it cannot find or cannot execute
_NOT_FOUND, _NOT_EXECUTABLE = 127, 126


def limited(cmd: list[str], seconds: int = COMPILER_CPU_SECONDS, nice: int = 0) -> list[str]:
    """``cmd`` under a limit of CPU ``seconds`` (inherited by cc1, as and ld) and, with ``nice``,
    at a lower priority: set in the child by sh's ``ulimit`` and nice(1), never by a
    ``preexec_fn``. A preexec_fn makes Python fork() rather than vfork(), which runs every
    ``pthread_atfork`` handler of this process; OpenBLAS's stops its thread pool, and a product
    running on another thread then waits for it for ever (the numerics check hung so while the
    counted builds compiled behind it)."""
    niced = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    return [*niced, "/bin/sh", "-c", f'ulimit -S -t {seconds} && ulimit -H -t {seconds + 5} && exec "$@"',
            "sh", *cmd]


def _started(proc: subprocess.CompletedProcess, program: str) -> subprocess.CompletedProcess:
    """``proc``, or the OSError of a ``program`` that sh could not start."""
    if proc.returncode in (_NOT_FOUND, _NOT_EXECUTABLE) and "sh: " in (proc.stderr or ""):
        code = errno.ENOENT if proc.returncode == _NOT_FOUND else errno.EACCES
        raise OSError(code, os.strerror(code), program)
    return proc


def _run(cmd: list[str]) -> str:
    return _started(subprocess.run(limited(cmd, 30), capture_output=True, text=True), cmd[0]).stdout


def compiler_files(cc: str) -> list[str]:
    """The executables that make up the compiler: the resolved command, the programs a wrapper
    script names, and (for gcc-like drivers) the compiler proper, ``cc1``."""
    argv0 = shlex.split(cc)[0]
    exe = shutil.which(argv0)
    if exe is None:
        raise UserError(f"C compiler {cc!r}", "not found; install a C compiler or set IPUBUILD_CC")
    exe = os.path.realpath(exe)
    files = [exe]
    try:
        with open(exe, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        head = b""
    if head.startswith(b"#!"):        # a wrapper script: the programs it runs are the compiler too
        for word in re.findall(rb"[A-Za-z0-9_./+-]+", head):
            found = shutil.which(word.decode())
            if found and os.path.realpath(found) not in files and not word.startswith(b"/bin/") \
                    and os.path.basename(found) not in ("sh", "bash", "dash", "env", "exec"):
                files.append(os.path.realpath(found))
    try:
        cc1 = _run([*shlex.split(cc), "-print-prog-name=cc1"]).strip()
    except (OSError, subprocess.TimeoutExpired):
        cc1 = ""
    if os.path.isabs(cc1) and os.path.isfile(cc1):
        files.append(os.path.realpath(cc1))
    return files


def compiler_identity(cc: str, memo=None) -> tuple[dict, list[str]]:
    """What the compile key knows of the compiler — its ``--version`` line, its target triple and
    the sha256 of each of ``compiler_files(cc)`` — and those files. ``memo`` (a
    ``files.StatMemo``) saves re-hashing unchanged executables."""
    from ..engine.files import file_digest
    files = compiler_files(cc)
    try:
        version = _run([*shlex.split(cc), "--version"]).splitlines()[:1]
        machine = _run([*shlex.split(cc), "-dumpmachine"]).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"C compiler {cc!r}", f"cannot run it ({exc}); install a C compiler or set "
                        "IPUBUILD_CC") from None
    digest = memo.digest if memo is not None else file_digest
    return {"version": version[0] if version else cc, "machine": machine,
            "files": {os.path.basename(f): digest(f) for f in files}}, files


_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


#: the slot folder of ipubuild's own kernel headers (``ipu_kernel.h``), on every kernel's include
#: path: a plugin kernel's ``#include "ipu_kernel.h"`` finds the installed header
HEADER_SLOT = "ipubuild/kernels"


def header_sources() -> dict[str, Path]:
    """``{slot: file}`` of ipubuild's installed kernel headers (``ipu_kernel.h``)."""
    return {f"{HEADER_SLOT}/{f.name}": f for f in sorted(KERNEL_DIR.glob("*.h"))}


def included(source_slot: str, sources: dict[str, bytes]) -> list[str]:
    """The slots of every local header a source includes, transitively (quoted includes,
    resolved beside the including file, else among ipubuild's headers: ``HEADER_SLOT``)."""
    seen: list[str] = []
    todo = [source_slot]
    while todo:
        slot = todo.pop()
        for name in _INCLUDE.findall(sources[slot]):
            h = str(PurePosixPath(slot).parent / name.decode())
            if h not in sources:
                h = f"{HEADER_SLOT}/{name.decode()}"
            if h in sources and h not in seen:
                seen.append(h)
                todo.append(h)
    return sorted(seen)


def source_slot(path: Path) -> str:
    """``path`` relative to the folder holding its top-level Python package, e.g.
    ``ipubuild/kernels/matmul.c``: meaningful in messages, and the same in every checkout."""
    top = Path(path).parent
    while (top.parent / "__init__.py").exists():
        top = top.parent
    return Path(path).relative_to(top.parent).as_posix()


def kernel_sources(registry) -> dict[str, Path]:
    """``{slot: file}`` for every C source and header in the folders of the registered kernel
    variants (a target's compile step reads them all; it compiles only what its graph uses)."""
    out = {}
    for folder in sorted({Path(kv.source).resolve().parent for kv in registry.kernels.values()}):
        for f in sorted(folder.iterdir()):
            if f.suffix in SOURCE_SUFFIXES and f.is_file():
                out[source_slot(f)] = f
    return {**header_sources(), **out}


def text_bytes(elf: bytes) -> int:
    """Bytes of executable sections (SHF_EXECINSTR) in an ELF64 little-endian object."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        return len(elf)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    total = 0
    for i in range(shnum):
        _, _, flags, _, _, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        if flags & 0x4:
            total += size
    return total


def reserve(code: int, quantum: int) -> int:
    """Code space reserved for ``code`` bytes: whole quanta with at least one byte of slack."""
    return (code // quantum + 1) * quantum


def run_compiler(name: str, source_name: str, files: dict[str, bytes], where: str, defines: list, cc: str,
                 cflags: str, extra: tuple[str, ...] = (), nice: int = 0) -> tuple[int, bytes, str]:
    """Compile kernel ``name``'s source ``where`` (one of ``files``, ``{slot: bytes}``, with the
    files ``extra`` names beside it) in a scratch folder: ``(return code, object, diagnostics)``,
    no object on failure; a compiler that cannot run raises a one-line error. ``nice``: the
    compiler's niceness increment (work that runs beside the build's own)."""
    with tempfile.TemporaryDirectory(prefix="ipubuild-cc-") as tmp:
        # the source and its headers at their slots' paths, so quoted includes resolve as beside
        # the real files; the compiler runs in the source's folder
        for slot, data in files.items():
            (Path(tmp) / slot).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / slot).write_bytes(data)
        cwd = (Path(tmp) / where).parent
        # ipubuild's headers on the include path (after the source's own folder)
        include = ["-iquote", str(Path(tmp) / HEADER_SLOT)] if (Path(tmp) / HEADER_SLOT).is_dir() else []
        cmd = [*shlex.split(cc), *shlex.split(cflags), *include, *[f"-D{k}={v}" for k, v in defines],
               "-o", str(Path(tmp) / "kernel.so"), source_name, *extra, "-lm"]
        try:
            proc = _started(subprocess.run(limited(cmd, nice=nice), cwd=cwd, capture_output=True, text=True),
                            cmd[0])
        except OSError as exc:
            raise UserError(f"kernel {name}", f"cannot run the C compiler {cc!r}: {exc.strerror}") from None
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) or "CPU time limit" in proc.stderr:
            raise UserError(f"kernel {name} ({where})", f"the C compiler used more than {COMPILER_CPU_SECONDS} s "
                            "of CPU; check the source or IPUBUILD_CFLAGS")
        diagnostics = proc.stderr.replace(f"{tmp}/", "").replace(source_name, where)
        obj = (Path(tmp) / "kernel.so").read_bytes() if proc.returncode == 0 else b""
        return proc.returncode, obj, diagnostics


def compile_kernel(name: str, source_name: str, source: bytes, headers: dict[str, bytes],
                   defines: list, cc: str, cflags: str, where: str, *, record: bool = True) -> tuple[bytes, str]:
    """Compile one variant in a scratch folder: ``(object, diagnostics)``. A failure raises a
    one-line error naming the kernel, with the compiler's output in its ``diagnostics``
    (``record``: also kept for ``compile_kernels`` to print, once per source)."""
    code, obj, diagnostics = run_compiler(name, source_name, {where: source, **headers}, where, defines, cc, cflags)
    if code != 0:
        first = next((ln for ln in diagnostics.splitlines() if "error" in ln), "see the diagnostics above")
        exc = UserError(f"kernel {name} ({where})", "compile failed: " + first.strip())
        exc.diagnostics, exc.variant, exc.source = diagnostics, name, where
        if record:
            with _failed_lock:      # compile_kernels prints them once per source (variants named)
                _failed.append(exc)
        raise exc
    return obj, diagnostics


# the compile failures of this process not yet reported (compile_kernels groups them by source)
_failed: list = []
_failed_lock = threading.Lock()


def by_source(items) -> dict[tuple[str, str], list[str]]:
    """``{(source slot, diagnostics): [variant, ...]}`` of ``(variant, slot, text)`` items: the
    variants of one source usually say the same thing, which is then shown once."""
    out: dict = {}
    for name, slot, text in items:
        out.setdefault((slot, text), []).append(name)
    return out


def report_failures(failure: Exception) -> Exception:
    """The compile failures recorded since the last call: their diagnostics printed once per
    source and text, naming the variants; and the error to raise, naming every variant of the
    first failing source."""
    with _failed_lock:
        failed, _failed[:] = list(_failed), []
    if not failed:
        return failure
    groups = by_source((e.variant, e.source, e.diagnostics) for e in failed)
    for (slot, text), names in groups.items():
        log.diagnostics(f"kernel {', '.join(names)} ({slot}): compiler diagnostics:\n{text}")
    (slot, _), names = next(iter(groups.items()))
    exc = UserError(f"kernel {', '.join(names)} ({slot})", failed[0].message)
    exc.diagnostics = failed[0].diagnostics
    return exc


@phase("compile_kernel", inputs=("source", "header/*"), outputs=("object", "code_size", "diagnostics"),
       config=("kernel", "compiler"))
def compile_kernel_phase(ctx):
    """One kernel variant's shared object, its exact code size and the compiler's warnings."""
    k, c = ctx.config["kernel"], ctx.config["compiler"]
    headers = {name: ctx.engine.fetch(d) for name, d in ctx.family("header").items()}
    obj, diagnostics = compile_kernel(k["name"], k["source_name"], ctx.bytes("source"), headers,
                                      k["defines"], c["cc"], c["cflags"], k["where"])
    return {"object": obj, "code_size": canonical.dumps({"code_bytes": text_bytes(obj)}),
            "diagnostics": diagnostics.encode()}


@phase("compile_counted_kernel", inputs=("source", "header/*", "counter"), outputs=("object", "note"),
       config=("kernel", "compiler"))
def compile_counted_kernel(ctx):
    """One variant's counted build: compiled with ``COUNT_FLAGS`` and ``counter/block_counter.c``
    (which counts the basic blocks it executes; see ``ipubuild.kernel_profile``). A compiler
    without the flag gives no object and a one-line note instead of an error: the counts are an
    extra, the build goes on without them."""
    k, c = ctx.config["kernel"], ctx.config["compiler"]
    files = {k["where"]: ctx.bytes("source"),
             **{name: ctx.engine.fetch(d) for name, d in ctx.family("header").items()},
             str(PurePosixPath(k["where"]).parent / COUNTER_NAME): ctx.bytes("counter")}
    code, obj, diagnostics = run_compiler(k["name"], k["source_name"], files, k["where"], k["defines"], c["cc"],
                                          f"{c['cflags']} {COUNT_FLAGS}", extra=(COUNTER_NAME,), nice=COUNTED_NICE)
    if code == 0:
        return {"object": obj, "note": b""}
    first = next((ln for ln in diagnostics.splitlines() if "error" in ln), f"exit status {code}").strip()
    return {"object": b"", "note": f"{c['cc']} {COUNT_FLAGS} failed: {first}".encode()}


def used_variants(graph, registry) -> list[str]:
    """The kernel variants some plan of some operation of ``graph`` may call."""
    names = set()
    for op in graph.ops:
        names.update(registry.get(op.type).variants(graph, op))
    unknown = sorted(names - set(registry.kernels))
    if unknown:
        raise UserError("operators", f"kernel variants {unknown} are named by variants() but no "
                        "operator's kernels() declares them")
    return sorted(names)


def compile_jobs(ctx) -> dict[str, tuple[dict, dict]]:
    """``{variant: (inputs, config)}`` of a compile of each variant the graph can use, for a phase
    with inputs ``graph`` and ``source/*`` and config ``compiler``."""
    from ..graph.artifacts import graph_of
    from ..graph.operators import registry
    reg = registry()
    slots = ctx.family("source")
    sources = {slot: ctx.engine.fetch(d) for slot, d in slots.items()}
    jobs = {}
    for name in used_variants(graph_of(ctx), reg):
        kv = reg.kernels[name]
        slot = source_slot(Path(kv.source))
        if slot not in slots:
            raise UserError(f"kernel {name}", f"its source {slot} is not among the build's kernel sources; "
                            "reinstall the plugin that declares it")
        jobs[name] = ({"source": slots[slot], **{f"header/{h}": slots[h] for h in included(slot, sources)}},
                      {"kernel": {"name": name, "source_name": PurePosixPath(slot).name,
                                  "defines": [list(d) for d in kv.defines] + [list(CHECKED)], "where": slot},
                       "compiler": ctx.config["compiler"]})
    return jobs


@phase("compile_kernels", inputs=("graph", "source/*", "counter"),
       outputs=("objects", "code_sizes", "reservations", "diagnostics"),
       config=("compiler", "kernel_quantum", "profile.kernel_counts", "target.tile_count"),
       hooks=("ipubuild_operators",))
def compile_kernels(ctx):
    """Compile the kernel variants the target's graph can use; their objects (a family index),
    exact code sizes, reservations (the only part planning reads) and the compiler's warnings
    (``{"kernel <variant>: compiler diagnostics": text}``, shown again when this phase's result
    comes from the cache: see ``ipubuild.tasks``). Where the target counts its kernels
    (``counting``), their counted builds are started behind them and left compiling while the
    build goes on: ``compile_kernels_counted`` collects them."""
    jobs = compile_jobs(ctx)
    names = sorted(jobs)        # compiled concurrently here, or on a cluster
    try:
        results = run_phases(ctx.engine, [("compile_kernel", *jobs[n]) for n in names], threads=os.cpu_count() or 1,
                             then=counted_calls(ctx, jobs) if counting(ctx.config) else ())
    except UserError as exc:        # every failed variant has finished: their diagnostics once per source
        raise report_failures(exc) from None
    quantum = ctx.config["kernel_quantum"]
    objects, sizes, reserved, warnings = {}, {}, {}, {}
    said = []
    for name, r in zip(names, results):
        if not r.hit:
            log.info("compiled kernel variant", variant=name, elapsed_ms=r.elapsed_ms)
        diagnostics = ctx.engine.fetch(r.outputs["diagnostics"]).decode()
        if diagnostics.strip():         # replayed on a cache hit too (once a run), as Bazel replays stderr
            said.append((name, jobs[name][1]["kernel"]["where"], diagnostics, r.hit))
        objects[name] = r.outputs["object"]
        sizes[name] = ctx.engine.decoded(r.outputs["code_size"])["code_bytes"]
        reserved[name] = reserve(sizes[name], quantum)
    hits = {name for name, _, _, hit in said if hit}
    for (slot, text), variants in by_source((n, w, d) for n, w, d, _ in said).items():
        what = f"kernel {', '.join(variants)} ({slot}): compiler diagnostics"
        warnings[what] = text
        cached = " (cached)" if set(variants) <= hits else ""
        log.diagnostics(f"{what}{cached}:\n{text}", once=(what, text))
    return {"objects": canonical.dumps(objects), "code_sizes": canonical.dumps(sizes),
            "reservations": canonical.dumps(reserved), "diagnostics": canonical.dumps(warnings)}


def counted_calls(ctx, jobs: dict[str, tuple[dict, dict]]) -> list[tuple]:
    """The ``compile_counted_kernel`` call of each of ``jobs`` (``compile_jobs``), by variant name."""
    return [("compile_counted_kernel", {**jobs[n][0], "counter": ctx.digest("counter")}, jobs[n][1])
            for n in sorted(jobs)]


@phase("compile_kernels_counted", inputs=("graph", "source/*", "counter"), outputs=("counted_objects",),
       config=("compiler", "profile.kernel_counts", "target.tile_count"), hooks=("ipubuild_operators",))
def compile_kernels_counted(ctx):
    """Each variant's counted build (``{"objects": {variant: digest}, "notes": {variant: why it
    has none}}``), which only ``measure_kernels`` reads; none where the target does not count
    its kernels (``counting``). The compiles ``compile_kernels`` started are waited for, not
    run again; its build step runs after the device run, so that they compiled meanwhile."""
    if not counting(ctx.config):
        return {"counted_objects": canonical.dumps({"objects": {}, "notes": {}})}
    jobs = compile_jobs(ctx)
    results = run_phases(ctx.engine, counted_calls(ctx, jobs), threads=os.cpu_count() or 1)
    counted, notes = {}, {}
    for name, r in zip(sorted(jobs), results):
        note = ctx.engine.fetch(r.outputs["note"]).decode()
        if note:
            notes[name] = note
        else:
            counted[name] = r.outputs["object"]
    return {"counted_objects": canonical.dumps({"objects": counted, "notes": notes})}
