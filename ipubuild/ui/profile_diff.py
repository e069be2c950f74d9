"""What changed since the previous build of a target: the device profile's steps, the kernels'
figures and the totals that moved, with their deltas.

When a build rewrites ``<target>.profile.json`` or ``<target>.kernels.json`` with other bytes, the
file it replaces is kept as ``<target>.profile.previous.json`` / ``<target>.kernels.previous.json``
(one earlier build: ``Workspace.restore`` keeps it, see ``KEPT``). ``doit profile:<target>`` prints
the differences under the tables (``changes(...)``), and the profile page marks them (``marks``):
each moved step, kernel and figure with its old value and delta. Pure functions of the JSON files.
"""
from __future__ import annotations

import json
from pathlib import Path

#: the artifacts files of which one earlier version is kept (file name suffix -> kept suffix)
KEPT = {".profile.json": ".profile.previous.json", ".kernels.json": ".kernels.previous.json"}


def previous_path(path: Path) -> Path | None:
    """Where the earlier version of ``path`` is kept, if it is one of ``KEPT``."""
    for suffix, kept in KEPT.items():
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)] + kept)
    return None


def _load(path: Path):
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None


def _delta(old: int, new: int) -> str:
    d = new - old
    pct = f" ({100 * d / old:+.2f} %)" if old else ""
    return f"{old:,} → {new:,} ({d:+,}){pct}"


def step_cycles(profile: dict) -> list[tuple[str, int]]:
    return [(s["name"], s["exchange"] + s["slowest"] + s["sync"]) for s in profile.get("steps", [])]


def diff(old_profile, new_profile, old_kernels, new_kernels) -> dict:
    """``{"figures": [(name, old, new)], "steps": [(index, name, old, new)], "kernels": [(variant,
    figure, old, new)], "added"/"removed": [variant]}`` of what moved (steps matched by position
    when both builds have the same step names, else only the totals)."""
    out = {"figures": [], "steps": [], "kernels": [], "added": [], "removed": [], "comparable": True}
    if old_profile and new_profile:
        for key in ("total_cycles", "samples", "tiles_used"):
            a, b = old_profile.get(key), new_profile.get(key)
            if isinstance(a, int) and isinstance(b, int) and a != b:
                out["figures"].append((key, a, b))
        a, b = step_cycles(old_profile), step_cycles(new_profile)
        if [n for n, _ in a] == [n for n, _ in b]:
            out["steps"] = [(i, n, x, y) for i, ((n, x), (_, y)) in enumerate(zip(a, b)) if x != y]
        else:
            out["comparable"] = False
    if old_kernels and new_kernels:
        ok, nk = old_kernels.get("kernels", {}), new_kernels.get("kernels", {})
        out["added"], out["removed"] = sorted(set(nk) - set(ok)), sorted(set(ok) - set(nk))
        for name in sorted(set(ok) & set(nk)):
            for fig in ("calls", "estimated_cycles", "blocks"):
                a, b = ok[name].get(fig), nk[name].get(fig)
                if isinstance(a, int) and isinstance(b, int) and a != b:
                    out["kernels"].append((name, fig, a, b))
    return out


def of_target(root: Path, target: str) -> dict | None:
    """The diff of the target's last build against the one before it, or None if no earlier
    profile is kept."""
    out = Path(root) / "artifacts" / target
    old_p = _load(out / f"{target}.profile.previous.json")
    old_k = _load(out / f"{target}.kernels.previous.json")
    if old_p is None and old_k is None:
        return None
    return diff(old_p, _load(out / f"{target}.profile.json"), old_k, _load(out / f"{target}.kernels.json"))


def changes(root: Path, target: str) -> list[str]:
    """The lines of ``doit profile:<target>``'s "changes since the previous build"."""
    d = of_target(root, target)
    if d is None:
        return ["changes since the previous build: none kept yet (one earlier profile is kept once a build "
                "rewrites it)"]
    lines = ["changes since the previous build:"]
    lines += [f"  {name}: {_delta(a, b)}" for name, a, b in d["figures"]]
    lines += [f"  step {i} {name}: {_delta(a, b)} cycles" for i, name, a, b in d["steps"]]
    if not d["comparable"]:
        lines.append("  the steps differ (another program): only the totals are compared")
    lines += [f"  kernel {name} {fig.replace('_', ' ')}: {_delta(a, b)}" for name, fig, a, b in d["kernels"]]
    lines += [f"  kernel {name}: new" for name in d["added"]] + [f"  kernel {name}: gone" for name in d["removed"]]
    if len(lines) == 1:
        lines.append("  nothing moved")
    return lines


def marks(d: dict | None) -> dict:
    """What the profile page marks: ``{"steps": {index: delta}, "kernels": {variant: {figure:
    [old, new]}}, "figures": {name: [old, new]}}`` (empty without an earlier profile)."""
    if d is None:
        return {"steps": {}, "kernels": {}, "figures": {}}
    kernels: dict = {}
    for name, fig, a, b in d["kernels"]:
        kernels.setdefault(name, {})[fig] = [a, b]
    return {"steps": {str(i): b - a for i, _, a, b in d["steps"]}, "kernels": kernels,
            "figures": {name: [a, b] for name, a, b in d["figures"]}}
