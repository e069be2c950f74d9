"""Reading a build's verdict (``<target>.verdict.json``): why it failed, in one line each.

Pure functions of the verdict's JSON value (no numpy: ``build:<target>`` prints them without
importing anything heavy).
"""
from __future__ import annotations


def gate_failures(verdict: dict) -> list[str]:
    """The gates the graph's outputs failed, each as ``name value vs threshold``."""
    th = verdict["thresholds"]
    out = []
    for gate in verdict.get("failed_gates", []):
        out.append(f"{gate.replace('_', ' ')} {verdict[gate]} vs {th[gate]}")
    return out


def diverged(first: dict) -> str:
    """The first diverging operation, its worst element and who computed it."""
    w = first["worst"]
    at = ", ".join(str(x) for x in w["element"])
    how = (f"{w['ulps']} ulp{'' if w['ulps'] == '1' else 's'} of {first['dtype']} outside its tolerance" if "ulps" in w
           else f"error {w['error']} > tolerance {w['tolerance']}")
    vertex = w.get("vertex")
    vertex = f"vertices {vertex[0]}-{vertex[1]}" if isinstance(vertex, list) else f"vertex {vertex}"
    where = f"kernel {w['kernel']} ({vertex} on tile {w['tile']}, step {w['step']})" if "tile" in w else "an unknown kernel"
    return (f"operation {first['op']} ({first['type']}) diverges first: {first['value']}[{at}] expected "
            f"{w['expected']} got {w['got']} ({how}; {first['failed']} of {first['elements']} elements fail), "
            f"computed by {where}")


def device_failure(f: dict) -> str:
    """One device failure: a vertex that failed, or an exchange outside a tile's data memory."""
    if f["kind"] == "exchange":
        return f"step {f['step']} ({f['name']}): {f['reason']}"
    return (f"tile {f['tile']}, step {f['step']} ({f['name']}), vertex {f['vertex']} ({f['kernel']}): "
            f"{f['reason']}")


def device_word(verdict: dict) -> str:
    """The closing line's ``deviceTest=`` value: PASS or FAIL, and the kernel variants that ran
    without the checked build's buffer checks, if any (``PASS (2 kernel variants unchecked: a, b)``)."""
    word = "PASS" if verdict["device_ok"] else "FAIL"
    unchecked = verdict.get("unchecked") or []
    if unchecked:
        n = len(unchecked)
        word += f" ({n} kernel variant{'s' if n != 1 else ''} unchecked: {', '.join(unchecked)})"
    return word


def failure_line(verdict: dict, target_path: str, device: str) -> str | None:
    """Why the build failed, in one line (None if it passed): the device's first failure, else
    the first diverging operation, else the gates the outputs failed."""
    if not verdict["device_ok"]:
        failures = verdict.get("device_failures", [])
        if not failures:
            return f"device {device}: a vertex reported an error"
        more = verdict.get("device_failure_count", len(failures)) - 1
        return (f"device {device}: " + device_failure(failures[0])
                + (f" (and {more} more failure{'s' if more > 1 else ''})" if more > 0 else ""))
    if verdict["pass"]:
        return None
    ops = verdict.get("operations", {})
    if ops.get("first"):
        more = len(ops["diverged"]) - 1
        return (f"{target_path}: numerics: " + diverged(ops["first"])
                + (f"; {more} more operation{'s diverge' if more > 1 else ' diverges'}" if more > 0 else ""))
    gates = gate_failures(verdict)
    return (f"{target_path}: numerics: numerical test failed ({', '.join(gates) or 'no finite result'})")
