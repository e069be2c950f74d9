"""The tile machine's description, read from ``ipubuild/machines/<name>.toml``."""
from __future__ import annotations

import functools
import tomllib
from pathlib import Path

from ..engine.errors import UserError

MACHINES = Path(__file__).parent.parent / "machines"


@functools.lru_cache(maxsize=None)
def load_machine(name: str, where: str = "target.machine") -> dict:
    path = MACHINES / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MACHINES.glob("*.toml")))
        raise UserError(where, f"unknown machine {name!r}; known: {known}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(str(path), f"the machine description is not valid TOML: {exc}") from None
