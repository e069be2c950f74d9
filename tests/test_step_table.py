"""benchmarks/step_table.py, the plan-work loop's table: its figures add up, so a reader can
trust which part of the gap to the lower bound a layout could still recover."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gap_to_the_lower_bound_splits_into_sequence_and_imbalance(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_table.py"), "vit_fp8", "--exact"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    cost = dict(re.findall(r"(final_cycles|lower_bound)=(\d+)", out))
    final, lower = int(cost["final_cycles"]), int(cost["lower_bound"])
    floor, over, seq_total, imb_total = map(int, re.search(
        r"balanced floor=(\d+) .*? of the (\d+) cycles over the lower bound, (\d+) are .*?, (\d+) imbalance", out).groups())
    rows = [list(map(int, m.groups())) for m in
            re.finditer(r"^\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s+(\d+)\s+(-?\d+)$", out, re.M)]
    assert len(rows) >= 10                                   # vit_fp8's program has 15 steps
    assert over == final - lower and floor == lower + seq_total and over == seq_total + imb_total
    assert lower < floor <= final
    assert sum(r[4] for r in rows) == seq_total and sum(r[5] for r in rows) == imb_total
    for exchange, compute, sync, gap, seq, imb in rows:
        assert gap == seq + imb and 0 <= seq <= min(exchange, compute)
    assert sum(e + c + s for e, c, s, *_ in rows) == final
