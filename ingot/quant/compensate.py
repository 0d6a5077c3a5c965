"""Error-compensation adapters: low-rank factors of the quantization error W - W_hat.

    W - W_hat ~= B @ A   (B [out, rank], A [rank, in])

found by a truncated SVD, optionally of the error weighted by the calibration activations: by their
RMS per input column (a diagonal model of x), or by the whole second-moment matrix H = E[x x^T]
(H = L L^T: the best rank-r B A' of E L, then A = A' L^-1 minimises E ||(W - W_hat - B A) x||^2
exactly), so the directions that meet large activations are corrected first. The factors run beside the quantized weight as a
called adapter (ingot.adapters).

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> error = rng.standard_normal((64, 8)) @ rng.standard_normal((8, 32))
    >>> a, b = low_rank(error.astype(np.float32), 8)
    >>> bool(np.allclose(b @ a, error, atol=1e-3))
    True
"""
from __future__ import annotations

import numpy as np


def low_rank(error: np.ndarray, rank: int, importance: np.ndarray | None = None,
             oversample: int = 10, power_iterations: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(A [rank, in], B [out, rank]) with B @ A the best rank-`rank` approximation of error [out, in]
    in the norm weighted by sqrt(importance) per column, or, for importance a matrix H [in, in], in
    the norm E ||e x||^2 with E[x x^T] = H (randomized SVD: a few matmuls and a QR)."""
    e = np.asarray(error, np.float64)
    out, inp = e.shape
    rank = max(1, min(rank, out, inp))
    if importance is not None and np.ndim(importance) == 2:
        from scipy.linalg import cholesky, solve_triangular

        h = np.array(importance, np.float64)
        h += (1e-4 * np.mean(np.diag(h)) + 1e-12) * np.eye(inp)      # damped: rarely used inputs keep a floor
        lower = cholesky(h, lower=True)
        a, b = low_rank(e @ lower, rank, None, oversample, power_iterations, seed)
        return solve_triangular(lower, a.astype(np.float64).T, lower=True, trans="T").T.astype(np.float32), b
    d = np.ones(inp) if importance is None else np.sqrt(np.maximum(np.asarray(importance, np.float64), 0)) + 1e-8
    ed = e * d[None, :]
    k = min(rank + oversample, out, inp)
    rng = np.random.default_rng(seed)
    y = ed @ rng.standard_normal((inp, k))
    for _ in range(power_iterations):  # sharpen the spectrum (orthonormalised each time for stability)
        y, _ = np.linalg.qr(y)
        y = ed @ (ed.T @ y)
    basis, _ = np.linalg.qr(y)                           # [out, k]
    u, s, vt = np.linalg.svd(basis.T @ ed, full_matrices=False)
    b = (basis @ u[:, :rank]) * s[:rank]                 # [out, rank]
    a = vt[:rank] / d[None, :]                           # [rank, in]
    return a.astype(np.float32), b.astype(np.float32)
