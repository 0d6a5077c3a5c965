"""4-bit weights held tile by tile (dt.TiledPacked4, the CPU LLM loaders' form): the same array as its
k-major form wherever it is read (np.asarray), and every CPU reader of the tiles (the rows GEMV, the
prefill GEMM's dequantized tiles, the VNNI repack, other ops' fallbacks) gives bit for bit what the
k-major array gives, on awkward row counts, column ranges and thread splits; a package saved from it
stores the k-major array; and the loaders tile exactly the weights the tiled GEMV multiplies."""
from __future__ import annotations

import numpy as np
import pytest

import ingot
from ingot import dtypes as dt
from ingot.backends.cpu import kernels, rows_gemv, vnni
from ingot.options import CompileOptions, CpuOptions
from ingot.ops.quant import quantized_matmul_reference
from ingot.quant.formats import QuantizedTensor

RNG = np.random.default_rng(7)


def test_tiles_stand_for_the_k_major_array():
    q = RNG.integers(0, 256, (96, 48), dtype=np.uint8)      # K = 96, N = 96: 3 x 3 tiles
    t = dt.TiledPacked4.from_k_major(q)
    assert t.tiles.shape == (3, 3, 512) and t.shape == q.shape and t.dtype == np.uint8 and t.nbytes == q.nbytes
    np.testing.assert_array_equal(t.tiles[1, 2].reshape(32, 16), q[32:64, 32:48])   # tile (1, 2): one run
    np.testing.assert_array_equal(np.asarray(t), q)
    assert t.tobytes() == q.tobytes()
    assert dt.TiledPacked4.fits(q) and dt.TiledPacked4.fits(np.zeros((0, 16), np.uint8))
    for shape in ((80, 48), (96, 40), (96, 8)):            # K or N not a multiple of 32: stays k-major
        assert not dt.TiledPacked4.fits(np.zeros(shape, np.uint8))
    with pytest.raises(ingot.IngotError):
        dt.TiledPacked4(np.zeros((2, 2, 256), np.uint8))


def graph(q, qdtype, scale, bias, block, rows, gather=False):
    g = ingot.Graph()
    x = g.placeholder((rows, q.shape[0]), name="x")
    w = g.dequantize(g.constant(q, dtype=qdtype), axis=0, block_size=block, scale=g.constant(scale),
                     bias=g.constant(bias) if bias is not None else None)
    targets = [x @ w]
    if gather:   # another reader of the same weight (a tied embedding's lookup)
        targets.append(g.gather(w, g.constant(np.array([3, 0, 95], np.int32)), axis=1))
    return g, targets


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40])        # 17 and 40: the prefill GEMM
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("k,n,block", [(96, 96, 32), (192, 160, 64)])
def test_tiled_weight_gives_the_k_major_results(qdtype, rows, params, has_bias, k, n, block):
    q = RNG.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = (RNG.random((k // block, n)) + 0.1).astype(params)
    bias = RNG.standard_normal((k // block, n)).astype(params) if has_bias else None
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    results = []
    for weight in (q, dt.TiledPacked4.from_k_major(q)):
        g, targets = graph(weight, qdtype, scale, bias, block, rows)
        exe = g.compile(targets=targets)
        results.append(exe.run({"x": a})[0])
    np.testing.assert_array_equal(results[1], results[0])
    node = next(nd for nd in exe.program.nodes() if nd.op.name == "QUANTIZED_MATMUL")
    want = quantized_matmul_reference([a, q] + [exe.program.constants[s.attrs["key"]] for s in node.src[2:]],
                                      node.attrs)
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_tiled_weight_over_threads_and_activations(rows, threads, activations):
    """Column splits of the team and of the GEMM's pool (3 parts of 272 byte columns: not whole tiles),
    and int8 activations (the VNNI layout made from the tiles)."""
    k, n, block = 256, 544, 32
    q = RNG.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = (RNG.random((k // block, n)) + 0.1).astype(np.float16)
    bias = RNG.standard_normal((k // block, n)).astype(np.float16)
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    options = CompileOptions(cpu=CpuOptions(threads=threads, gemv_activations=activations))
    results = []
    for weight in (q, dt.TiledPacked4.from_k_major(q)):
        g, targets = graph(weight, dt.uint4, scale, bias, block, rows, gather=True)
        results.append(g.compile(targets=targets, options=options).run({"x": a}))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI: the weights stay k-major")
def test_the_rows_gemv_reads_the_tiles(monkeypatch):
    k, n = 64, 96
    t = dt.TiledPacked4.from_k_major(RNG.integers(0, 256, (k, n // 2), dtype=np.uint8))
    g, targets = graph(t, dt.uint4, RNG.random((2, n)).astype(np.float32), None, 32, 4)
    read = []
    split_blocks = kernels.split_blocks
    monkeypatch.setattr(kernels, "split_blocks", lambda kernel, head, *a: (read.append((kernel, head[1])),
                                                                           split_blocks(kernel, head, *a)))
    g.compile(targets=targets).run({"x": np.ones((4, k), np.float32)})
    (kernel, weight), = read
    assert kernel is rows_gemv.gemv_rows_float4 and weight.shape == t.tiles.shape and np.shares_memory(weight, t.tiles)


def test_a_package_stores_the_k_major_array(tmp_path):
    q = RNG.integers(0, 256, (64, 48), dtype=np.uint8)
    scale = RNG.random((2, 96)).astype(np.float32)
    g, targets = graph(dt.TiledPacked4.from_k_major(q), dt.uint4, scale, None, 32, 2)
    exe = g.compile(targets=targets)
    exe.save(str(tmp_path / "m.ingot"))
    loaded = ingot.load(str(tmp_path / "m.ingot"))
    stored = [v for v in loaded.program.constants.values() if v.shape == q.shape and v.dtype == np.uint8]
    assert len(stored) == 1 and isinstance(stored[0], np.ndarray)
    np.testing.assert_array_equal(stored[0], q)
    a = RNG.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(loaded.run({"x": a})[0], exe.run({"x": a})[0])


def test_tile_weights_converts_what_the_tiled_gemv_multiplies(monkeypatch):
    monkeypatch.setattr(vnni, "AVAILABLE", True)   # the choice is by shape and form; the CPU decides only whether

    def weight(k, n, block=32, qdtype=dt.uint4, **kw):
        q = RNG.integers(0, 256, (k, n // 2 if qdtype.packed else n), dtype=np.uint8)
        return QuantizedTensor(q, qdtype, (k, n), block, RNG.random((k // block, n)).astype(np.float32),
                               block_axis=0, **kw)

    tensors = {"a": weight(64, 96), "signed": weight(64, 96, qdtype=dt.int4), "wide_blocks": weight(128, 64, 64),
               "n_odd": weight(64, 80), "block16": weight(64, 96, 16), "int8": weight(64, 96, qdtype=dt.uint8),
               "lut": weight(64, 96, lut=np.zeros((1, 1, 16), np.float32)), "norm": np.ones(8, np.float32),
               "gguf_form": QuantizedTensor(RNG.integers(0, 256, (96, 32), dtype=np.uint8), dt.uint4, (96, 64), 32,
                                            RNG.random((96, 2)).astype(np.float32))}
    kept = {name: t.q for name, t in tensors.items() if isinstance(t, QuantizedTensor)}
    assert kernels.tile_weights(tensors) is tensors
    tiled = {name for name, t in tensors.items() if isinstance(t, QuantizedTensor) and isinstance(t.q, dt.TiledPacked4)}
    assert tiled == {"a", "signed", "wide_blocks"}
    for name in tiled:
        np.testing.assert_array_equal(np.asarray(tensors[name].q), kept[name])
    monkeypatch.setattr(vnni, "AVAILABLE", False)
    plain = {"a": weight(64, 96)}
    assert not isinstance(kernels.tile_weights(plain)["a"].q, dt.TiledPacked4)
