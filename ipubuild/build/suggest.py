"""``doit``'s ``run`` command with a suggestion for a misspelt task or target: ``doit
build:vit_f8`` fails with ``no task or target "build:vit_f8"; did you mean build:vit_fp8?``
instead of doit's generic "Invalid parameter". Registered through the ``doit.COMMAND`` entry
point (as ``ipubuild.commands.Clean`` is); otherwise doit's own command, unchanged."""
from __future__ import annotations

import difflib
import functools

import doit.plugin
from doit.cmd_run import Run as DoitRun
from doit.exceptions import InvalidCommand


@functools.lru_cache(maxsize=None)
def _all_entry_points():
    from importlib.metadata import entry_points
    return entry_points()


def _entry_points(group: str):
    return _all_entry_points().select(group=group)


# doit reads the installed distributions' entry points once for each kind of plugin (commands,
# reporters, backends), ~5 ms each with a few hundred installed: it loads this module with its
# commands, so the reporters and the backends are found in one read
if getattr(doit.plugin, "entry_points_impl", None) is not None:
    doit.plugin.entry_points_impl = lambda: _entry_points


def did_you_mean(name: str, known) -> list[str]:
    """The names of ``known`` closest to ``name`` (difflib), best first, at most three; a name
    with a ``basename:`` prefix is matched against the known names of that group first."""
    known = sorted(set(known))
    base, _, rest = name.partition(":")
    if rest:
        same = [k for k in known if k.partition(":")[0] == base]
        close = difflib.get_close_matches(name, same, n=3, cutoff=0.6)
        if close:
            return close
    return difflib.get_close_matches(name, known, n=3, cutoff=0.6)


def unknown_task_message(name: str, known) -> str:
    """One line for a task or target no task of the tree has, with what it may have meant."""
    close = did_you_mean(name, known)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f'no task or target "{name}"{hint} (`doit list --all` shows them)'


class Run(DoitRun):
    """doit's ``run``, suggesting the closest task names for one it does not know."""

    def execute(self, params, args):
        try:
            return super().execute(params, args)
        except InvalidCommand as exc:
            if exc.not_found is None or not getattr(self, "task_list", None):
                raise
            known = [t.name for t in self.task_list if not t.name.startswith("_")]
            raise InvalidCommand(unknown_task_message(exc.not_found, known)) from None
