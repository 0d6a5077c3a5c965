"""matmul_avx512 (float32 x @ w by constant weights in AVX-512 registers) against NumPy on awkward shapes:
M, K, N that fill no tile (one row, K = 1, N below a vector, a large K), through the kernel and through
the compiler (as the graph's output and as an intermediate value); and the gate: the lowering takes it
only where the host has AVX-512 and no AMX, for one thread and shapes `fits` accepts. The kernel tests
are skipped where the host has no AVX-512."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import conv_amx
from ingot.options import CompileOptions, CpuOptions

matmul_avx512 = pytest.importorskip("ingot.backends.cpu.matmul_avx512")
avx512 = pytest.mark.skipif(not matmul_avx512.AVAILABLE, reason="no AVX-512 on this host")

# M, K, N
SHAPES = [(1, 1, 1), (1, 128, 128), (5, 1, 70), (6, 64, 64), (7, 3, 17), (13, 129, 65), (25, 1031, 130),
          (128, 128, 512), (128, 512, 128), (61, 77, 200), (3, 4099, 33), (200, 16, 1000)]


def _reference(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x @ w in float64, and the bound on a float32 sum's error: 1e-6 K^0.5 of the sum of |products|
    (float32's rounding, ~6e-8 a step, summed over K steps in an order that differs from NumPy's)."""
    want = x.astype(np.float64) @ w.astype(np.float64)
    bound = 1e-6 * max(1.0, x.shape[1] ** 0.5) * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)) + 1e-30
    return want, bound


@avx512
@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_kernel_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    guard = np.full(m * n + 64, np.nan, np.float32)     # the output, then 64 floats no store may reach
    guard[m * n:] = 12345.0
    out = guard[:m * n].reshape(m, n)
    matmul_avx512.step(m, k, n)(x, w, out)
    want, bound = _reference(x, w)
    assert np.all(np.abs(out - want) <= bound), float(np.abs(out - want).max())
    assert np.all(guard[m * n:] == 12345.0)


@avx512
@pytest.mark.parametrize("rows,vectors", [(1, 1), (3, 2), (8, 3)])
def test_other_tiles(rows, vectors):
    """Tiles other than the default (the lab probe's): every row count of the remainder, one vector."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((2 * rows + rows // 2 + 1, 37)).astype(np.float32)
    w = rng.standard_normal((37, 16 * vectors + 5)).astype(np.float32)
    out = np.empty((x.shape[0], w.shape[1]), np.float32)
    matmul_avx512.step(*x.shape, w.shape[1], rows, vectors)(x, w, out)
    want, bound = _reference(x, w)
    assert np.all(np.abs(out - want) <= bound)


def _lowered(lead, k, n, threads):
    g = ingot.Graph()
    xi = g.placeholder(lead + (k,), name="x")
    w = np.random.default_rng(k).standard_normal((k, n)).astype(np.float32)
    y = g.matmul(xi, g.constant(w))
    return g, xi, y, w, CompileOptions(cpu=CpuOptions(threads=threads))


def _steps(exe) -> list[str]:
    return [getattr(step[0], "__name__", "") for step in exe.plan.steps]


@avx512
@pytest.mark.skipif(conv_amx.available(), reason="AMX's tiles take these products")
@pytest.mark.parametrize("lead,k,n", [((37,), 200, 90), ((2, 17), 64, 300), ((128,), 515, 80), ((16,), 128, 128)])
def test_through_the_compiler(lead, k, n):
    g, xi, y, w, options = _lowered(lead, k, n, threads=1)
    x = np.random.default_rng(n).standard_normal(lead + (k,)).astype(np.float32)
    want, bound = _reference(x.reshape(-1, k), w)
    for intermediate in (False, True):
        target = g.tanh(y) if intermediate else y
        exe = g.compile(targets=[target], options=options)
        assert "panels" in _steps(exe)
        got = exe.run({"x": x})[0].reshape(-1, n)
        if intermediate:
            assert np.all(np.abs(got - np.tanh(want)) <= bound + 1e-6)   # (tanh is 1-Lipschitz)
        else:
            assert np.all(np.abs(got - want) <= bound)


def test_gate(monkeypatch):
    """Not taken without AVX-512, with AMX, with more than one thread, or for a product BLAS does as fast."""
    def taken(lead=(128,), k=128, n=128, threads=1) -> bool:
        g, xi, y, w, options = _lowered(lead, k, n, threads)
        return "panels" in _steps(g.compile(targets=[y], options=options))

    monkeypatch.setattr(conv_amx, "available", lambda: False)
    monkeypatch.setattr(matmul_avx512, "AVAILABLE", False)
    assert not matmul_avx512.fits(128, 128, 128)
    assert not taken()
    if not matmul_avx512.host_has("avx512f"):
        return   # the checks below would build the kernel, which needs AVX-512
    monkeypatch.setattr(matmul_avx512, "AVAILABLE", True)
    assert taken() and taken(k=32, n=512)
    assert not taken(threads=2)
    assert not taken(lead=(4,)) and not taken(lead=(64,), k=64, n=64)
    monkeypatch.setattr(conv_amx, "available", lambda: True)
    assert not taken(k=32, n=512)   # K < 64: not AMX's either (matmul_amx.fits), so BLAS's
