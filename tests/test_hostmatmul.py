"""The host reference is the same on every CPU: its matrix products (ipubuild.hostmatmul) do
not depend on the BLAS kernel numpy picks (OPENBLAS_CORETYPE), and are exact for FP8 operands."""
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from ipubuild.graph import fp8, hostmatmul

from buildtree import SMALL

HERE = Path(__file__).resolve().parent

# the small ViT's float32 model and its host reference, digested (in a subprocess per core type)
DIGEST = f"""
import hashlib, sys
from pathlib import Path
from ipubuild.graph import reference
from ipubuild.frontend import build_model
from ipubuild.plugins import get_plugin_manager
from ipubuild.targets import load_target
Path("t.toml").write_text({SMALL!r})
m = build_model(get_plugin_manager(), load_target("t.toml"))
h = hashlib.sha256()
for v, a in sorted(m.float_outputs.items()):
    h.update(a.tobytes())
for v, a in sorted(reference.evaluate(m.graph, m.constants, m.inputs, threads=2).items()):
    h.update(a.tobytes())
print(h.hexdigest())
"""


def test_the_reference_is_bit_identical_under_every_openblas_core_type(tmp_path):
    from threadpoolctl import threadpool_info
    here = {i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"} - {None}
    digests = {}
    for core in sorted({"Prescott", "Haswell", "SkylakeX", *here}):
        env = dict(os.environ, OPENBLAS_CORETYPE=core, IPUBUILD_LOG="quiet")
        run = subprocess.run([sys.executable, "-c", DIGEST], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        digests[core] = run.stdout.split()[-1]
    assert len(set(digests.values())) == 1, digests


def _exact(a, b):
    return [[sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(row, col)), Fraction(0))
             for col in b.T] for row in a]


def test_products_of_fp8_values_are_exact_and_float32_ones_within_a_rounding():
    rng = np.random.default_rng(1)
    for dtype in ("f143", "f152"):
        a = fp8.decode(fp8.encode(rng.standard_normal((3, 40)).astype(np.float32) * 8, dtype, 0), dtype, 0)
        b = fp8.decode(fp8.encode(rng.standard_normal((40, 2)).astype(np.float32), dtype, 0), dtype, 0)
        got = hostmatmul.matmul(a, b)
        assert [[Fraction(float(x)) for x in row] for row in got] == _exact(a, b)
    a = rng.standard_normal((4, 300)).astype(np.float32)
    b = rng.standard_normal((300, 3)).astype(np.float32)
    exact = np.array([[float(x) for x in row] for row in _exact(a, b)])
    assert np.array_equal(hostmatmul.matmul(a, b).astype(np.float32), exact.astype(np.float32))


def test_degenerate_operands():
    assert hostmatmul.matmul(np.zeros((2, 0)), np.zeros((0, 3))).shape == (2, 3)
    assert np.array_equal(hostmatmul.matmul(np.zeros((2, 4)), np.ones((4, 3))), np.zeros((2, 3)))
    with pytest.raises(ValueError):
        hostmatmul.matmul(np.ones((2, 3)), np.ones((2, 3)))
