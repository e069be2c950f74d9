"""Strict loader for build-target files (``targets/<name>.toml``).

Every problem found in a target file is raised as one :class:`~ipubuild.errors.UserError` whose
``where`` names the file and the dotted key (``targets/bad.toml: target.tile_count``) and whose
message is a single line saying what was expected and what was found.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from ipubuild.engine.errors import UserError

__all__ = [
    "REQUIRED",
    "Field",
    "check_table",
    "CORE_SCHEMA",
    "load_target",
    "dump_resolved",
    "discover",
    "TargetFile",
    "plugin_targets",
    "find_targets",
]

DEFAULT_MAX_TILES = 1472
EXAMPLE = "targets/vit_fp8.toml"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")


class _Required:
    """Sentinel type for :data:`REQUIRED`."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
"""Default marking a :class:`Field` that must be present in the table."""

_KINDS = {int: "int", float: "float", str: "str", bool: "bool", dict: "dict", "list_str": "list_str"}
_KINDS.update({name: name for name in list(_KINDS.values())})


@dataclasses.dataclass(frozen=True)
class Field:
    """One entry of a table schema.

    ``kind`` is one of ``int``, ``float`` (integers are accepted and converted to float), ``str``,
    ``bool``, ``dict`` (a free-form table of str -> str whose values must be in ``choices`` if
    given) or ``"list_str"`` (a list of strings). ``bool`` is never accepted where an ``int`` or
    ``float`` is expected. Numbers must lie in ``[min, max]`` (or ``(min, max]`` when
    ``min_exclusive``); strings (and dict values / list items) must be in ``choices`` if given.

    ``default`` is :data:`REQUIRED` for a key that must be present. A ``dict`` field may instead
    carry a fixed sub-``schema`` (a nested table such as ``[casts.storage]``); it is then checked
    with :func:`check_table` and a missing table gets all its sub-defaults.
    """

    kind: Any
    default: Any = REQUIRED
    min: int | float | None = None
    max: int | float | None = None
    min_exclusive: bool = False
    choices: tuple[str, ...] | None = None
    doc: str = ""
    schema: dict[str, "Field"] | None = None

    def __init__(self, kind, default=REQUIRED, *, min=None, max=None, min_exclusive=False,
                 choices=None, doc="", schema=None):
        if kind not in _KINDS:
            raise TypeError(f"Field kind must be one of int, float, str, bool, dict, 'list_str'; got {kind!r}")
        set_ = object.__setattr__
        set_(self, "kind", _KINDS[kind])
        set_(self, "default", default)
        set_(self, "min", min)
        set_(self, "max", max)
        set_(self, "min_exclusive", bool(min_exclusive))
        set_(self, "choices", tuple(choices) if choices is not None else None)
        set_(self, "doc", doc)
        if schema is not None and self.kind != "dict":
            raise TypeError("only a dict Field can carry a sub-schema")
        set_(self, "schema", dict(schema) if schema is not None else None)

    @property
    def required(self) -> bool:
        """True when the key has no default and must be given."""
        return self.default is REQUIRED

    def expected(self) -> str:
        """A short phrase describing what a valid value looks like, for error messages."""
        if self.kind == "int":
            return "an integer" + self._range()
        if self.kind == "float":
            return "a number" + self._range()
        if self.kind == "bool":
            return "true or false"
        if self.kind == "str":
            return f"one of {_choices(self.choices)}" if self.choices else "a string"
        if self.kind == "list_str":
            if self.choices:
                return f"a list of strings, each one of {_choices(self.choices)}"
            return "a list of strings"
        if self.schema is not None:
            return "a table with keys " + ", ".join(_key(k) for k in self.schema)
        if self.choices:
            return f"a table of strings, each one of {_choices(self.choices)}"
        return "a table of strings"

    def _range(self) -> str:
        lo, hi = self.min, self.max
        if lo is not None and hi is not None:
            if self.min_exclusive:
                return f" greater than {lo} and at most {hi}"
            return f" from {lo} to {hi}"
        if lo is not None:
            return f" greater than {lo}" if self.min_exclusive else f" >= {lo}"
        if hi is not None:
            return f" <= {hi}"
        return ""


def _choices(choices) -> str:
    return ", ".join(repr(c) for c in choices)


def _key(key: str) -> str:
    """A key as it would be written in TOML: bare if possible, else quoted with escapes."""
    if isinstance(key, str) and _BARE_KEY_RE.fullmatch(key):
        return key
    return json.dumps(str(key))


def _join(section: str, key: str) -> str:
    return f"{section}.{_key(key)}" if section else _key(key)


def _show(value: Any, limit: int = 60) -> str:
    """A one-line rendering of a found value (TOML spelling for booleans)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = repr(value)
    elif isinstance(value, dict):
        text = "a table" if value else "an empty table"
    elif isinstance(value, list):
        text = "an array" if value else "an empty array"
    else:
        text = repr(value)
    text = text.replace("\n", "\\n").replace("\r", "\\r")
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _did_you_mean(value: Any, names) -> str:
    """`` (did you mean 'x'?)`` when ``value`` is a likely misspelling of one of ``names``."""
    import difflib
    close = difflib.get_close_matches(str(value), [str(n) for n in names], n=1, cutoff=0.66)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _in_range(field: Field, value: int | float) -> bool:
    if field.min is not None:
        if value < field.min or (field.min_exclusive and value == field.min):
            return False
    if field.max is not None and value > field.max:
        return False
    return True


def _check_value(field: Field, value: Any, where: str, dotted: str) -> Any:
    """Validate (and normalise) one value; raise UserError at ``where: dotted`` if invalid."""

    def fail(expected: str | None = None, got: Any = value):
        raise UserError(f"{where}: {dotted}", f"expected {expected or field.expected()}, got {_show(got)}")

    kind = field.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not _in_range(field, value):
            fail()
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        if isinstance(value, float) and not math.isfinite(value):
            fail()
        value = float(value)
        if not _in_range(field, value):
            fail()
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            fail()
        return value
    if kind == "str":
        if not isinstance(value, str) or (field.choices is not None and value not in field.choices):
            hint = _did_you_mean(value, field.choices) if isinstance(value, str) and field.choices else ""
            raise UserError(f"{where}: {dotted}", f"expected {field.expected()}, got {_show(value)}{hint}")
        return value
    if kind == "list_str":
        if not isinstance(value, list):
            fail()
        for i, item in enumerate(value):
            if not isinstance(item, str) or (field.choices is not None and item not in field.choices):
                raise UserError(
                    f"{where}: {dotted}[{i}]",
                    f"expected {'one of ' + _choices(field.choices) if field.choices else 'a string'}, "
                    f"got {_show(item)}",
                )
        return list(value)
    # dict
    if not isinstance(value, dict):
        fail()
    if field.schema is not None:
        return check_table(value, field.schema, where, dotted)
    out = {}
    for k, v in value.items():
        if not isinstance(v, str) or (field.choices is not None and v not in field.choices):
            expected = f"one of {_choices(field.choices)}" if field.choices else "a string"
            raise UserError(f"{where}: {_join(dotted, k)}", f"expected {expected}, got {_show(v)}")
        out[k] = v
    return out


def check_table(table: dict, schema: dict[str, Field], where: str, section: str, *,
                allow_unknown: bool = False) -> dict:
    """Validate one TOML table against ``schema`` and return a new dict with defaults filled in.

    ``where`` names the file (as given) and ``section`` the dotted name of the table
    (``"search"``, ``"casts.storage"``, ``"model"``); errors are raised as
    ``UserError(f"{where}: {section}.{key}", ...)``. Unknown keys (the message lists the known
    ones), missing required keys, wrong types and out-of-range values are all errors. The result
    has the schema's keys in schema order; with ``allow_unknown`` the extra keys are copied
    through unchecked after them (used for ``[model]``, whose family builder checks the rest).
    Model plugins call this for their own ``[model]`` keys.
    """
    if not isinstance(table, dict):
        raise UserError(f"{where}: {section}", f"expected a table, got {_show(table)}")
    if not allow_unknown:
        for key in table:
            if key not in schema:
                known = ", ".join(schema) or "(none)"
                raise UserError(f"{where}: {_join(section, key)}",
                                f"unknown key {_show(key)}{_did_you_mean(key, schema)}; known keys: {known}")
    out: dict[str, Any] = {}
    for key, field in schema.items():
        dotted = _join(section, key)
        if key in table:
            out[key] = _check_value(field, table[key], where, dotted)
        elif field.schema is not None:
            out[key] = check_table({}, field.schema, where, dotted)
        elif field.required:
            raise UserError(f"{where}: {dotted}", f"missing required key (expected {field.expected()})")
        else:
            out[key] = copy.deepcopy(field.default)
    if allow_unknown:
        for key, value in table.items():
            if key not in schema:
                out[key] = copy.deepcopy(value)
    return out


_STORAGE_MODES = ("separate", "inplace")
#: built-in operators a cast can be folded into (``casts.fuse`` chooses among them)
CAST_FUSIBLE = ("attention_context", "gelu", "layernorm", "matmul", "patchify", "slice_rows", "softmax")

CORE_SCHEMA: dict[str, dict[str, Field]] = {
    "target": {
        "tile_count": Field(int, min=1, max=DEFAULT_MAX_TILES,
                            doc="Tiles the program is partitioned over (max set by load_target's max_tiles)."),
        "machine": Field(str, "ipu21", doc="Machine description the cost model uses."),
        "device": Field(str, "ipumodel", doc="Registered device that runs the program."),
        "seed": Field(int, 0, min=0, doc="Seed for weights and inputs."),
        "default": Field(bool, True, doc="Whether bare `doit` builds it (false: only when named)."),
    },
    "model": {
        "family": Field(str, doc="Registered model family; its builder checks the other [model] keys."),
        "passes": Field("list_str", [], doc="Graph passes to run besides the default ones (by name)."),
    },
    "casts": {
        "policy": Field(str, "f143", doc="Registered FP8 cast policy."),
        "scaling": Field(str, "amax_pow2", choices=["amax_pow2", "none"], doc="How cast scales are chosen."),
        "fuse": Field("list_str", list(CAST_FUSIBLE), choices=CAST_FUSIBLE,
                      doc="Operators a cast may be folded into (the producer writes FP8 itself)."),
        "storage": Field(dict, {}, doc="Where cast results are stored.", schema={
            "default": Field(str, "separate", choices=_STORAGE_MODES, doc="Storage for all casts."),
            "operators": Field(dict, {}, choices=_STORAGE_MODES, doc="Per-operator overrides."),
            "sites": Field(dict, {}, choices=_STORAGE_MODES, doc="Per-cast-site overrides."),
        }),
    },
    "numerics": {
        # the graph outputs' gates, for deep models: clean ViT-B/16 builds measured at worst 0.99814
        # and 0.275 over five seeds (FP8 rounding carried through 12 blocks; benchmarks/README.md)
        "min_cosine": Field(float, 0.99, min=0, max=1, min_exclusive=True,
                            doc="Lowest cosine similarity of a graph output's row to the reference accepted."),
        "max_abs_error": Field(float, 0.5, min=0, min_exclusive=True,
                               doc="Largest absolute error of a graph output to the reference accepted."),
        "blas_threads": Field(int, 1, min=1, max=256, doc="Threads for the reference BLAS."),
        "compare": Field(str, "auto", choices=["auto", "operations", "outputs"],
                         doc="Also compare every operation's output, read back from the device, with its "
                             "reference on the device's inputs ('operations'), or the graph's outputs only; "
                             "'auto': operations unless their values take more than 16 MiB."),
    },
    "profile": {
        "kernel_counts": Field(str, "auto", choices=["auto", "on", "off"],
                               doc="Count the basic blocks each kernel variant executes (a second, counted "
                                   "compile of every variant and a second run of the program on one thread); "
                                   "'auto': on up to 256 tiles."),
    },
    "search": {
        "rounds": Field(int, 3, min=0, max=1000, doc="Search rounds after the initial plan."),
        "shortlist": Field(int, 3, min=1, max=64, doc="Candidates measured per round."),
        "workers": Field(int, 2, min=1, max=64, doc="Parallel measuring workers."),
        "evaluations": Field(int, 100, min=1, max=100000,
                             doc="The search's budget: exact candidate evaluations after the initial layout "
                                 "(counted, never timed, so the layout is the same on every machine at any load)."),
        "seconds": Field(float, 0.0, min=0,
                         doc="Ignored (older target files set it): a wall-clock budget made the layout depend on "
                             "the machine's load; the budget is rounds and evaluations."),
        "seed": Field(int, 0, min=0, doc="Seed for the proposal generator."),
        "proposals": Field(int, 640, min=1, max=100000, doc="Proposals scored by the cost model per round."),
    },
}
"""The sections of a target file and their keys; ``target`` and ``model`` are required."""

_REQUIRED_SECTIONS = ("target", "model")
_KNOWN_KEYS = {"device": ("target", "device"), "policy": ("casts", "policy"), "family": ("model", "family"),
               "passes": ("model", "passes")}


def _schema_for(max_tiles: int) -> dict[str, dict[str, Field]]:
    schema = dict(CORE_SCHEMA)
    target = dict(schema["target"])
    target["tile_count"] = dataclasses.replace(target["tile_count"], max=max_tiles)
    schema["target"] = target
    return schema


def load_target(path, *, max_tiles: int = DEFAULT_MAX_TILES,
                known: dict[str, list[str]] | None = None, root=None, shown: str | None = None) -> dict:
    """Read, validate and resolve the target file at ``path``.

    Returns ``{"name": <file stem>, "path": str(path), "target": ..., "model": ..., "casts": ...,
    "numerics": ..., "profile": ..., "search": ...}`` with every default filled in. ``tile_count``
    must be at most ``max_tiles``. ``known`` optionally maps ``"device"``, ``"policy"``,
    ``"family"`` and ``"passes"`` to the registered names; other values are then errors listing
    the known names (any other key of ``known`` is a programming error: ValueError). Any problem raises
    one single-line :class:`UserError` naming the file (and key). A relative ``path`` is read
    from ``root`` when given (and named as given, so messages and keys do not depend on where the
    tree lies); ``shown``, if given, names the file instead (a target a plugin ships).
    """
    where = shown or str(path)
    p = Path(path)
    source = Path(root, p) if root is not None else p
    name = p.stem if p.suffix == ".toml" else p.name
    if not _NAME_RE.fullmatch(name):
        raise UserError(where, f"target name {_show(name)} must match [A-Za-z0-9_][A-Za-z0-9_.-]*")
    try:
        raw = source.read_bytes()
    except OSError as exc:
        raise UserError(where, f"cannot read target file: {_one_line(exc.strerror or exc)}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise UserError(where, f"not valid TOML: not UTF-8: {_one_line(exc)}") from None
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
        raise UserError(where, f"not valid TOML: {_one_line(exc)}") from None
    if not data:
        raise UserError(where, f"no [target] table; see {EXAMPLE}")

    schema = _schema_for(max_tiles)
    for section in data:
        if section not in schema:
            raise UserError(f"{where}: {_key(section)}", f"unknown section {_show(section)}"
                            f"{_did_you_mean(section, schema)}; known sections: {', '.join(schema)}")
    for section in _REQUIRED_SECTIONS:
        if section not in data:
            raise UserError(f"{where}: {section}", f"missing required table [{section}]; see {EXAMPLE}")

    resolved: dict[str, Any] = {"name": name, "path": where}
    for section, fields in schema.items():
        table = data.get(section, {})
        resolved[section] = check_table(table, fields, where, section, allow_unknown=(section == "model"))
    if resolved["search"].pop("seconds"):     # no effect, so not in any action key either
        from ..engine.log import log
        log.info("ignored [search] seconds: the search's budget is rounds and evaluations, never wall time",
                 path=where)

    for kind, names in (known or {}).items():
        if kind not in _KNOWN_KEYS:
            raise ValueError(f"load_target: known= takes device, policy, family, passes; got {kind!r}")
        section, key = _KNOWN_KEYS[kind]
        values = resolved[section][key]
        for i, value in enumerate(values if isinstance(values, list) else [values]):
            if value not in names:
                listed = ", ".join(sorted(names)) or "(none)"
                hint = "; a plugin may provide it: install it (see docs/plugins.md)" if kind in ("family", "passes") else ""
                what = "graph pass" if kind == "passes" else kind
                dotted = f"{section}.{key}" + (f"[{i}]" if isinstance(values, list) else "")
                raise UserError(f"{where}: {dotted}",
                                f"unknown {what} {_show(value)}{_did_you_mean(value, names)}; known: {listed}{hint}")
    return resolved


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def dump_resolved(target: dict) -> bytes:
    """The resolved target (without ``name``/``path``) as deterministic TOML with sorted keys."""
    body = {k: v for k, v in target.items() if k not in ("name", "path")}
    return tomli_w.dumps(_sorted(body)).encode("utf-8")


def discover(root) -> list[Path]:
    """The target files ``root/targets/*.toml``, sorted."""
    return sorted(p for p in Path(root, "targets").glob("*.toml") if p.is_file())


@dataclasses.dataclass(frozen=True)
class TargetFile:
    """A target a tree can build: its ``name`` (the file's stem), the file (``path``), how
    messages and action keys name it (``shown``: ``targets/<name>.toml`` for the tree's own,
    the path inside its package for a plugin's) and the plugin that ships it (None: the tree)."""
    name: str
    path: Path
    shown: str
    plugin: str | None = None


def plugin_targets(pm) -> list[TargetFile]:
    """The targets plugins ship (``ipubuild_targets``), sorted by name; a path that is not a
    ``.toml`` file, or a name two plugins ship, is an error naming the plugin(s)."""
    from .kernels import source_slot
    out: dict[str, TargetFile] = {}
    for plugin, p in pm.collect("ipubuild_targets", lambda p: isinstance(p, (str, Path)),
                                "a list of paths to target files (<name>.toml)"):
        path = Path(p).resolve()
        if path.suffix != ".toml" or not path.is_file():
            raise UserError(f"plugin {plugin}", f"hook ipubuild_targets: {p} is not a target file (<name>.toml)")
        found = TargetFile(path.stem, path, source_slot(path), plugin)
        if found.name in out:
            other = out[found.name]
            raise UserError(f"plugin {plugin}", f"hook ipubuild_targets: target {found.name!r} ({found.shown}) is "
                            f"already shipped by plugin {other.plugin} ({other.shown}); rename one")
        out[found.name] = found
    return sorted(out.values(), key=lambda t: t.name)


def find_targets(root, pm=None) -> tuple[list[TargetFile], dict[str, str]]:
    """The targets a tree can build — its own ``targets/*.toml``, then those its plugins ship
    (with ``pm``) — and, by name, the error of each name that two of them give (naming both)."""
    own = [TargetFile(p.stem, p, f"targets/{p.name}") for p in discover(root)]
    shipped = plugin_targets(pm) if pm is not None else []
    mine = {t.name: t for t in own}
    clashes = {t.name: f"target {t.name!r} is both the tree's {mine[t.name].shown} and {t.shown} of plugin "
                       f"{t.plugin} ({t.path}); rename one" for t in shipped if t.name in mine}
    return own + [t for t in shipped if t.name not in mine], clashes
