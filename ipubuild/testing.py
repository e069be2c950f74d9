"""Test helpers for ipubuild and its plugins (installed with the package).

**Kernels.** :func:`load_variant` compiles a kernel variant — a plugin's or a built-in one — as
a build compiles it (``$IPUBUILD_CC`` and ``$IPUBUILD_CFLAGS``, by default ``cc -O2 -std=c11
-Wall -fPIC -shared``, plus ``-Werror`` unless asked not to; the source in a scratch folder
with the headers it includes beside it) and loads the shared object with ctypes. Call the
:class:`Kernel` on a :class:`TileMemory` with raw u32 arguments, or let :func:`run_vertex`
place numpy arrays and resolve ``("r", i, offset)`` / ``("w", i, offset)`` arguments exactly
as a vertex of ``Operator.lower`` names them::

    from ipubuild import testing
    k = testing.load_variant("rmsnorm_f32")          # by name, from the registered operators
    run = testing.run_vertex(k, [("r", 0, 0), ("r", 1, 0), ("w", 0, 0), rows, cols, testing.f32_bits(eps)],
                             reads=[x, gamma], writes=[((rows, cols), "f32")])
    assert run.status == 0
    y = run.outputs[0]

**Builds.** :func:`build_target` builds a target — a file, TOML text, or the name of a target a
plugin ships — in a folder of its own (a temporary tree), in-process, with table overrides
(a smaller model for a quick test), and returns its verdict.
"""
from __future__ import annotations

import copy
import dataclasses
import tomllib
from pathlib import Path

from .engine.errors import UserError
from .graph.operators import KernelVariant, f32_bits  # noqa: F401 - for plugins' tests: vertex arguments
# the kernel helpers (kept importable from here: docs/plugins.md, docs/reference.md)
from .compiler.harness import (STORAGE, TYPE_CODES, Kernel, TileMemory, VertexRun,  # noqa: F401
                               compile_builtin, compile_source, load_variant, run_vertex)


# builds ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Built:
    """A target built by :func:`build_target`: its tree, the digests of its artifacts, and its
    verdict (``check_numerics``'s: ``pass``, ``min_cosine``, ``max_abs_error``, ``device_ok``,
    ``cost`` …)."""
    name: str
    tree: Path
    artifacts: dict
    verdict: dict

    @property
    def passed(self) -> bool:
        return bool(self.verdict["pass"] and self.verdict["device_ok"])


def target_text(target) -> str:
    """The TOML text of ``target``: a path to a file, TOML text itself, or the name of a target
    a plugin ships (``ipubuild_targets``)."""
    if isinstance(target, Path) or (isinstance(target, str) and target.endswith(".toml") and "\n" not in target):
        return Path(target).read_text()
    if "\n" in target or "[" in target:
        return target
    from .plugins import get_plugin_manager
    from .compiler.targets import plugin_targets
    found = {t.name: t for t in plugin_targets(get_plugin_manager())}
    if target not in found:
        raise UserError(f"target {target!r}", "no installed plugin ships it; known: "
                        f"{', '.join(sorted(found)) or '(none)'}; give a file or TOML text")
    return found[target].path.read_text()


def merged(table: dict, overrides: dict) -> dict:
    """``table`` with ``overrides`` merged in, table by table."""
    out = copy.deepcopy(table)
    for k, v in overrides.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_target(target, tree, *, name: str | None = None, overrides: dict | None = None) -> Built:
    """Build ``target`` (see :func:`target_text`) in-process in ``tree`` (a folder, made if
    missing: give a temporary one), as ``doit build:<name>`` would — every phase through the
    action cache (``$IPUBUILD_CACHE_DIR``, else ``<tree>/.ipubuild/cache``), the device run and
    the numerical test — with ``overrides`` merged into its tables (``{"model": {"width": 64},
    "search": {"rounds": 1}}``). ``name`` defaults to the target's name or ``target``."""
    import tomli_w

    from .build.build import build_in_process
    from .build.pipeline import Workspace
    text = target_text(target)
    data = merged(tomllib.loads(text), overrides or {})
    if name is None:
        name = Path(target).stem if isinstance(target, Path) or str(target).endswith(".toml") else \
            (target if "\n" not in target and "[" not in target else "target")
    tree = Path(tree).resolve()
    (tree / "targets").mkdir(parents=True, exist_ok=True)
    path = tree / "targets" / f"{name}.toml"
    path.write_bytes(tomli_w.dumps(data).encode())
    out = build_in_process(tree, path)
    ws = Workspace.at(tree)
    try:
        verdict = ws.engine.decoded(out[f"{name}/verdict"])
    finally:
        ws.close()
        with Workspace._lock:
            Workspace._open.pop(ws.root, None)
    return Built(name, tree, out, verdict)
