"""Graph passes: ordered, named rewrites of a model's graph, declared by plugins.

``lower_model`` builds the target's model with its family's builder, then runs the *float*
passes on the float32 graph (before casts: the float32 reference is the graph they leave), then
the target's cast policy, then the *cast* passes on the graph with its casts. Within a stage,
passes run by ``order``, then by name. A pass with ``default=True`` runs for every target; any
other runs only for the targets that list it in ``[model] passes``. Every plugin implementing
``ipubuild_graph_passes`` enters ``lower_model``'s action key, so installing, upgrading or
editing a pass re-runs exactly that phase (and what its graph feeds, if the graph changed).

A pass rewrites the :class:`ipubuild.frontend.Model` it is given in place; the helpers here and
on :class:`ipubuild.ir.Graph` (``insert``, ``replace_uses``, ``infer``) keep the graph in
topological, SSA form. The graph is validated after every pass.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from ..engine.errors import UserError
from ..engine.log import log

#: the stages a pass can run in, in the order lower_model runs them
STAGES = ("float", "cast")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """A named rewrite of a model's graph, declared by ``ipubuild_graph_passes``.

    ``run(model, target)`` rewrites ``model`` (an :class:`ipubuild.frontend.Model`: its graph,
    constants and inputs) in place and returns None; ``target`` holds the target's tables
    ``lower_model`` reads (``model``, ``casts``), read-only. Raise ``ValueError`` with a message
    for a graph the pass cannot rewrite (reported as ``graph pass <name>: <message>``).

    ``stage`` is ``"float"`` (the float32 graph, before the cast policy) or ``"cast"`` (after
    it: FP8 values and ``cast`` operations present). ``order`` places the pass within its stage
    (lower first; the built-in ``prune`` runs at 1000, last of the float stage). ``default``
    passes run for every target — keep those to rewrites that do not change what the model
    computes —; the others only where a target lists them in ``[model] passes``.
    """
    name: str
    run: Callable
    stage: str = "float"
    order: int = 100
    default: bool = False

    @property
    def doc(self) -> str:
        """The first sentence of ``run``'s docstring (what ``doit plugins`` shows)."""
        text = " ".join((self.run.__doc__ or "").split())
        return text.split(". ")[0].rstrip(".")


def graph_passes(pm) -> dict[str, GraphPass]:
    """Every plugin's passes by name (a name declared twice is an error naming both plugins)."""
    found: dict[str, GraphPass] = {}
    owners: dict[str, str] = {}
    for plugin, p in pm.collect("ipubuild_graph_passes", _well_formed, "a list of ipubuild.passes.GraphPass "
                                f"with a name matching {_NAME.pattern}, a callable run and a stage in {STAGES}"):
        if p.name in owners:
            raise UserError(f"plugin {plugin}", f"hook ipubuild_graph_passes: graph pass {p.name!r} is already "
                            f"registered by {owners[p.name]}")
        owners[p.name] = plugin
        found[p.name] = p
    return found


def _well_formed(p) -> bool:
    return (isinstance(p, GraphPass) and isinstance(p.name, str) and bool(_NAME.fullmatch(p.name))
            and callable(p.run) and p.stage in STAGES and isinstance(p.order, int))


def selected(passes: dict[str, GraphPass], enabled: list[str], where: str) -> list[GraphPass]:
    """The passes a target runs, in running order: every default pass and those it lists."""
    unknown = [n for n in enabled if n not in passes]
    if unknown:
        raise UserError(f"{where}: model.passes", f"unknown graph pass {unknown[0]!r}; known: "
                        f"{', '.join(sorted(passes)) or '(none)'}")
    chosen = [p for p in passes.values() if p.default or p.name in enabled]
    return sorted(chosen, key=lambda p: (STAGES.index(p.stage), p.order, p.name))


def run(pm, model, passes: list[GraphPass], stage: str, target: dict) -> None:
    """Run the passes of ``stage`` on ``model``, in order; validate the graph after each."""
    for p in passes:
        if p.stage != stage:
            continue
        before = len(model.graph.ops)
        try:
            got = p.run(model, target)
        except UserError:
            raise
        except ValueError as exc:
            raise UserError(f"graph pass {p.name}", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a plugin's bug, named
            raise UserError(f"plugin {_owner(pm, p.name)}", f"graph pass {p.name} raised "
                            f"{type(exc).__name__}: {exc}") from None
        if got is not None:
            raise UserError(f"graph pass {p.name}", "run must rewrite the model in place and return None")
        try:
            model.graph.validate()
        except ValueError as exc:
            raise UserError(f"graph pass {p.name}", f"left an invalid graph: {exc}") from None
        log.info("ran graph pass", name=p.name, stage=stage, operations_before=before,
                 operations_after=len(model.graph.ops))


def _owner(pm, name: str) -> str:
    """The plugin that declares the pass ``name`` (for an error message)."""
    for impl in (pm.hook.ipubuild_graph_passes.get_hookimpls() if pm is not None else ()):
        try:
            if any(getattr(p, "name", None) == name for p in impl.function()):
                return impl.plugin_name
        except Exception:  # noqa: BLE001 - its error was reported when passes were collected
            continue
    return "(unknown)"


def remove(model, ops) -> None:
    """Remove ``ops`` from the model's graph (a fold that moved their work into other
    operations), then ``prune`` what they leave unused; with no ``ops``, nothing."""
    if not ops:
        return
    gone = {id(op) for op in ops}
    model.graph.ops = [op for op in model.graph.ops if id(op) not in gone]
    prune(model)


def prune(model) -> int:
    """Remove the operations nothing reads (whose outputs are no graph output), then the
    constants and values nothing uses, renumbering values in their order (graph inputs stay);
    ``model.constants``, ``model.inputs`` and ``model.float_outputs`` follow. Returns how many
    operations went."""
    g = model.graph
    before = len(g.ops)
    renumbered = g.remove_unused()
    for table in (model.constants, model.inputs, model.float_outputs):
        kept = {renumbered[v]: a for v, a in table.items() if v in renumbered}
        table.clear()
        table.update(kept)
    return before - len(g.ops)
