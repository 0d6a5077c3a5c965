"""The Hopper word GEMV in Gluon (`gemv_sm90`) against a float64 reference and the Triton kernel (marker
`cuda`; sm_90 only: Triton's interpreter does not run Gluon).

Awkward shapes: K not a multiple of the 128-k tile (the last tile's blocks past K masked), N not a
multiple of the 256-column chunk (TMA zero-fills the columns past N, the atomics skip them), shares of
tiles that span column chunks (few programs), a ring that wraps many times (2 stages), scales in float16
and float32, with and without bias, x in 1, 2 and 3 bytes; a CUDA graph replay with the loader not
waiting on the kernel ahead (EARLY), the output zeroed by the quantize launch, the next GEMV's output
zeroed by this one, and the weights the Hopper kernel declines (N rows not 16-byte aligned, blocks of
64) taken by the Triton kernel.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

sys.path.insert(0, os.path.dirname(__file__))
from cuda_env import require_cuda  # noqa: E402

if require_cuda():
    pytest.skip("Gluon kernels do not run under Triton's interpreter", allow_module_level=True)
import torch  # noqa: E402

if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("the Gluon GEMV compiles for sm_90 only", allow_module_level=True)

from test_cuda import DEVICE, FORMATS, rel_err, rng_for  # noqa: E402
from test_cuda_gemv_xq import check, words_weight  # noqa: E402

from ingot import dtypes as dt  # noqa: E402
from ingot.backends.cuda import gemv_sm90  # noqa: E402
from ingot.backends.cuda import quantized_matmul as qmm  # noqa: E402

NO_BIAS = (dt.uint4, False, False, False)       # uint4 without bias or zero point: HAS_BIAS False
CASES = [  # (format, (K, N, block))
    (FORMATS[0], (1000, 296, 32)), (FORMATS[1], (4096, 1000, 32)), (NO_BIAS, (230, 520, 32)),
    (FORMATS[3], (2080, 256, 32)), (FORMATS[2], (96, 8, 32)),
]


def f16_weight(rng, k, n, bias=True):
    """GGUF-like weights: float16-exact scales and biases (stored as float16, as the models have them)."""
    q = rng.integers(0, 256, size=(k, n // 2), dtype=np.uint8)
    scale = (rng.random((k // 32, n), dtype=np.float32) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    attrs = dict(qdtype=dt.uint4, mode="affine", has_zero_point=False, has_bias=bias)
    w = qmm.prepare_weight(q, [scale] + ([-8 * scale] if bias else []), attrs, DEVICE, words=True)
    assert w.scale.dtype == torch.float16
    return w


@pytest.fixture
def calls(monkeypatch):
    """The launches of the Hopper kernel, counted."""
    seen = []
    launch = gemv_sm90.gemv_sm90
    monkeypatch.setattr(gemv_sm90, "gemv_sm90", lambda *a, **kw: seen.append(kw) or launch(*a, **kw))
    return seen


@pytest.mark.parametrize("limbs", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[1][0]}x{c[1][1]}-{'bias' if c[0] != NO_BIAS else 'nobias'}"
                                             for c in CASES])
def test_against_reference_and_triton(case, limbs, calls):
    fmt, shape = case
    k, n, _ = shape
    rng = rng_for(f"sm90gemv{case}{limbs}")
    w = words_weight(rng, fmt, shape)
    assert gemv_sm90.supported(w, 1, DEVICE)
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32) * 3).to(DEVICE)
    triton_y = qmm.quantized_matmul(x, w, config=dict(LIMBS=limbs, XQ=True, GLUON=False))
    assert not calls
    for config in (dict(), dict(PROGRAMS=3), dict(PROGRAMS=7, STAGES=2), dict(STAGES=3)):
        got = qmm.quantized_matmul(x, w, config=dict(config, LIMBS=limbs, XQ=True))
        assert len(calls) == 1, "the Hopper kernel ran"
        calls.clear()
        check(got, x, w, limbs, what=str(config))
        assert rel_err(got.cpu(), triton_y.cpu()) < 1e-6, (config, rel_err(got.cpu(), triton_y.cpu()))


@pytest.mark.parametrize("bias", [True, False])
def test_float16_parameters_llama_shape(bias, calls):
    """Llama-3-8B's o projection shape, scales (and biases) in float16, every program's share in one chunk
    or across two."""
    rng = rng_for(f"sm90gemv-f16{bias}")
    w = f16_weight(rng, 4096, 4096, bias)
    x = torch.from_numpy(rng.standard_normal((1, 4096)).astype(np.float32)).to(DEVICE)
    for config in (dict(), dict(PROGRAMS=48)):
        got = qmm.quantized_matmul(x, w, config=dict(config, LIMBS=2))
        check(got, x, w, 2, what=str(config))
    assert len(calls) == 2


def test_glu_and_norm_prologues_through_the_quantize_launch(calls):
    """silu(gate) * x and rms_norm(x + add) * g are the quantize launch's; the Hopper kernel reads its output."""
    rng = rng_for("sm90gemv-prologues")
    w = words_weight(rng, FORMATS[0], (1000, 296, 32))
    x, gate, add = (torch.from_numpy(rng.standard_normal((1, 1000)).astype(np.float32)).to(DEVICE) for _ in range(3))
    y = torch.empty(1, 296, device=DEVICE)
    qmm._words_gemv(x, w, y, dict(LIMBS=2), x_gate=gate)
    check(y, (gate.double() * torch.sigmoid(gate.double())) * x.double(), w, 2, what="glu")
    g = torch.from_numpy(rng.random(1000).astype(np.float32) + 0.5).to(DEVICE)
    h, y = qmm.rms_norm_matmul(x, w, g, 1e-5, add=add)
    s = (x + add).double()
    torch.testing.assert_close(h, (x + add))
    check(y, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double(), w, 2, what="norm")
    assert len(calls) == 2


def test_declined_weights_take_the_triton_kernel(calls):
    """Rows of N float16 scales not 16-byte aligned (N = 300: 600 bytes) and parameter blocks of 64: the
    Triton kernel."""
    rng = rng_for("sm90gemv-declined")
    for w in (f16_weight(rng, 256, 300), words_weight(rng, FORMATS[0], (256, 256, 64))):
        assert not gemv_sm90.supported(w, 1, DEVICE)
        x = torch.from_numpy(rng.standard_normal((1, w.k)).astype(np.float32)).to(DEVICE)
        got = qmm.quantized_matmul(x, w, config=dict(LIMBS=2, XQ=True))
        check(got, x, w, 2, what=f"{w.k}x{w.n} group {w.group}")
    assert not calls


def test_graph_replay_early_loads_and_zeroing(calls):
    """In a captured graph the loader starts before the wait (EARLY): replays with new x give new sums; the
    quantize launch zeroes y, and the GEMV zeroes the next one's output (NaN before)."""
    rng = rng_for("sm90gemv-graph")
    w = f16_weight(rng, 2048, 1024)
    x = torch.zeros(1, 2048, device=DEVICE)
    y = torch.full((1, 1024), float("nan"), device=DEVICE)
    nxt = torch.full((5000,), float("nan"), device=DEVICE)
    qmm._words_gemv(x, w, y, dict(LIMBS=2), zero=nxt)            # warm-up: compiles, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qmm._words_gemv(x, w, y, dict(LIMBS=2), zero=nxt)
    assert calls[-1]["early"] is True and calls[0]["early"] is False
    for i in range(3):
        x.copy_(torch.from_numpy(rng.standard_normal((1, 2048)).astype(np.float32)))
        y.fill_(float("nan"))
        nxt.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(y, x, w, 2, what=f"replay {i}")
        assert torch.count_nonzero(nxt).item() == 0
