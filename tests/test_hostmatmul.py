"""The host reference is the same on every CPU: its matrix products (ipubuild.hostmatmul) do
not depend on the BLAS kernel numpy picks (OPENBLAS_CORETYPE), and are exact for FP8 operands;
its exp and tanh (ipubuild.graph.hostmath) do not depend on the loops numpy picks."""
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


def _umath():
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:                     # numpy 1
        from numpy.core import _multiarray_umath as umath
    return umath


def _numpy_dispatch() -> list[str]:
    """The instruction sets numpy picks loops by at run time on this machine (past its baseline)."""
    umath = _umath()
    return [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]


#: OpenBLAS core types the test forces, and the instruction sets (numpy's names) each needs: a
#: core type this CPU lacks would die of an illegal instruction (SkylakeX on an AVX2-only EPYC)
CORE_TYPES = {"Prescott": ["SSE3"], "Haswell": ["AVX2", "FMA3"], "SkylakeX": ["AVX512_SKX"]}


def _runnable_core_types() -> list[str]:
    """The ``CORE_TYPES`` this CPU can run."""
    features = _umath().__cpu_features__
    return [core for core, needs in CORE_TYPES.items() if all(features.get(f) for f in needs)]


def test_the_reference_is_bit_identical_under_every_openblas_core_type_and_numpy_dispatch(tmp_path):
    """The BLAS kernel (OPENBLAS_CORETYPE) and numpy's own loops (exp, tanh: AVX2 and AVX-512
    ones differ from the baseline one in the last bit) leave the reference's bytes alone. Each
    core type this CPU can run is forced (on an AVX2-only CPU, not SkylakeX), and the one
    OpenBLAS picks here."""
    from threadpoolctl import threadpool_info
    here = {i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"} - {None}
    runs = {core: {"OPENBLAS_CORETYPE": core} for core in sorted({*_runnable_core_types(), *here})}
    dispatch = _numpy_dispatch()
    if dispatch:
        runs["numpy baseline loops"] = {"NPY_DISABLE_CPU_FEATURES": " ".join(dispatch)}
    if len(runs) < 2:
        pytest.skip(f"this CPU runs one BLAS kernel and one set of numpy loops only: {sorted(runs)}")
    digests = {}
    for name, extra in runs.items():
        env = dict(os.environ, IPUBUILD_LOG="quiet", **extra)
        run = subprocess.run([sys.executable, "-c", DIGEST], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        digests[name] = run.stdout.split()[-1]
    assert len(set(digests.values())) == 1, digests


def test_exp_and_tanh_are_the_correctly_rounded_values_on_every_kind_of_input():
    from ipubuild.graph import hostmath
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-110, 90, 20000), rng.standard_normal(20000) * 3,
                        rng.standard_normal(2000) * 1e-5, [0.0, -0.0, 88.7, 88.8, -103.9, -104.0]]).astype(np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(hostmath.exp(x), np.exp(x.astype(np.float64)).astype(np.float32))
    assert np.array_equal(hostmath.tanh(x), np.tanh(x.astype(np.float64)).astype(np.float32))
    special = np.array([np.inf, -np.inf, np.nan, 200.0, -200.0, -0.0], np.float32)
    assert np.array_equal(hostmath.exp(special), [np.inf, 0, np.nan, np.inf, 0, 1], equal_nan=True)
    t = hostmath.tanh(special)
    assert np.array_equal(t, [1, -1, np.nan, 1, -1, -0.0], equal_nan=True) and np.signbit(t[-1])


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
