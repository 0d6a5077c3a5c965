"""4-bit weights held tile by tile (dt.TiledWeight, the CPU LLM loaders' form): the same array as its
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


@pytest.mark.parametrize("bits,dtype", [(4, np.uint8), (8, np.int8), (8, np.uint8)])
def test_tiles_stand_for_the_k_major_array(bits, dtype):
    width = 16 if bits == 4 else 32                        # bytes of 32 columns
    q = RNG.integers(-128 if dtype == np.int8 else 0, 128 if dtype == np.int8 else 256, (96, 3 * width)).astype(dtype)
    t = dt.TiledWeight.from_k_major(q, bits)                # K = 96, N = 96: 3 x 3 tiles
    assert t.tiles.shape == (3, 3, 32 * width) and t.shape == q.shape and t.dtype == dtype and t.nbytes == q.nbytes
    assert t.bits == bits
    np.testing.assert_array_equal(t.tiles[1, 2].reshape(32, width), q[32:64, 2 * width:])   # tile (1, 2): one run
    np.testing.assert_array_equal(np.asarray(t), q)
    assert t.tobytes() == q.tobytes()
    columns, rows = np.array([5, 0, 3 * width - 1, 5]), np.array([95, 0, 33])
    np.testing.assert_array_equal(t[:, columns], q[:, columns])
    np.testing.assert_array_equal(t[rows], q[rows])
    np.testing.assert_array_equal(t[3:7, 1], q[3:7, 1])    # anything else: through the whole array
    assert dt.TiledWeight.fits(q, bits) and dt.TiledWeight.fits(np.zeros((0, width), dtype), bits)
    for shape in ((80, 3 * width), (96, 3 * width - 8), (96, 8)):   # K or N not a multiple of 32: stays k-major
        assert not dt.TiledWeight.fits(np.zeros(shape, dtype), bits)
    with pytest.raises(ingot.IngotError):
        dt.TiledWeight(np.zeros((2, 2, 256), np.uint8))
    with pytest.raises(ingot.IngotError):
        dt.TiledWeight(np.zeros((2, 2, 512), np.int8))     # 4-bit tiles are bytes of two nibbles


def graph(q, qdtype, scale, bias, block, rows, gather=False):
    g = ingot.Graph()
    x = g.placeholder((rows, q.shape[0]), name="x")
    w = g.dequantize(g.constant(q, dtype=qdtype if qdtype.packed else None), axis=0, block_size=block,
                     scale=g.constant(scale), bias=g.constant(bias) if bias is not None else None)
    targets = [x @ w]
    if gather:   # other readers of the same weight (a tied embedding's lookup: columns; rows)
        targets.append(g.gather(w, g.constant(np.array([3, 0, 95], np.int32)), axis=1))
        targets.append(g.gather(w, g.constant(np.array([2, 40], np.int32)), axis=0))
    return g, targets


def weight(k, n, qdtype):
    if qdtype.packed:
        return RNG.integers(0, 256, (k, n // 2), dtype=np.uint8)
    low, high = (-128, 128) if qdtype.kind == "i" else (0, 256)
    return RNG.integers(low, high, (k, n)).astype(qdtype.numpy)


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int4], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40])        # 17 and 40: the prefill GEMM
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("k,n,block", [(96, 96, 32), (192, 160, 64)])
def test_tiled_4bit_weight_gives_the_k_major_results(qdtype, rows, params, has_bias, k, n, block):
    q = weight(k, n, qdtype)
    scale = (RNG.random((k // block, n)) + 0.1).astype(params)
    bias = RNG.standard_normal((k // block, n)).astype(params) if has_bias else None
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    results = []
    for w in (q, dt.TiledWeight.from_k_major(q, 4)):
        g, targets = graph(w, qdtype, scale, bias, block, rows)
        exe = g.compile(targets=targets)
        results.append(exe.run({"x": a})[0])
    np.testing.assert_array_equal(results[1], results[0])
    node = next(nd for nd in exe.program.nodes() if nd.op.name == "QUANTIZED_MATMUL")
    want = quantized_matmul_reference([a, q] + [exe.program.constants[s.attrs["key"]] for s in node.src[2:]],
                                      node.attrs)
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("qdtype", [dt.int8, dt.uint8], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 40])         # 40: the prefill GEMM
@pytest.mark.parametrize("params", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("k,n,block", [(96, 96, 32), (192, 160, 64), (96, 64, 96)])   # one block: int8_matmul's
def test_tiled_8bit_weight_against_numpy_and_each_row_alone(qdtype, rows, params, has_bias, k, n, block):
    """On AVX-512 the 8-bit tiles go through rows_gemv.gemv_rows_float8 (other sums than the k-major
    kernel's, within float rounding; each row bit for bit what it gives that row alone); elsewhere
    through the k-major kernel (np.asarray); past 16 rows the GEMM (or, one block along k, int8_matmul's
    kernel) gives the k-major results exactly. Up to 16 rows a row never depends on the rows beside it,
    one block along k included (a served int8 head)."""
    q = weight(k, n, qdtype)
    scale = (RNG.random((k // block, n)) + 0.1).astype(params)
    bias = RNG.standard_normal((k // block, n)).astype(params) if has_bias else None
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    a[0, 40] = 50.0
    g, targets = graph(dt.TiledWeight.from_k_major(q, 8), qdtype, scale, bias, block, rows)
    got = g.compile(targets=targets).run({"x": a})[0]
    w = q.astype(np.float64) * np.repeat(scale.astype(np.float64), block, axis=0)
    if has_bias:
        w += np.repeat(bias.astype(np.float64), block, axis=0)
    want = a.astype(np.float64) @ w
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    g1, targets1 = graph(dt.TiledWeight.from_k_major(q, 8), qdtype, scale, bias, block, 1)
    one = g1.compile(targets=targets1)
    if rows <= kernels.GEMV_MAX_ROWS:   # one block along k too: int8_matmul leaves tiles to the GEMV
        for m in range(rows):
            np.testing.assert_array_equal(one.run({"x": a[m:m + 1]})[0][0], got[m])
    else:
        g2, targets2 = graph(q, qdtype, scale, bias, block, rows)
        np.testing.assert_array_equal(got, g2.compile(targets=targets2).run({"x": a})[0])


@pytest.mark.parametrize("qdtype", [dt.uint4, dt.int8], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_tiled_weight_over_threads_and_activations(qdtype, rows, threads, activations):
    """Column splits of the team and of the GEMM's pool (3 parts of 272 or 544 byte columns: not whole
    tiles), int8 activations (the VNNI layout made from the tiles), and gathers of the weight's
    columns and rows (the NumPy reference reading only those from the tiles): the k-major results,
    bit for bit (8-bit float32 GEMVs: each row the one-thread result)."""
    k, n, block = 256, 544, 32
    q = weight(k, n, qdtype)
    scale = (RNG.random((k // block, n)) + 0.1).astype(np.float16)
    bias = RNG.standard_normal((k // block, n)).astype(np.float16)
    a = RNG.standard_normal((rows, k)).astype(np.float32)
    results = []
    for w, t in ((q, threads), (dt.TiledWeight.from_k_major(q, qdtype.bits), threads),
                 (dt.TiledWeight.from_k_major(q, qdtype.bits), 1)):
        options = CompileOptions(cpu=CpuOptions(threads=t, gemv_activations=activations))
        g, targets = graph(w, qdtype, scale, bias, block, rows, gather=True)
        results.append(g.compile(targets=targets, options=options).run({"x": a}))
    exact = qdtype.packed or activations == "int8" or rows > kernels.GEMV_MAX_ROWS or not vnni.AVAILABLE
    for i, (kmajor, tiled, alone) in enumerate(zip(*results)):
        if i > 0 or (rows <= kernels.GEMV_MAX_ROWS and vnni.AVAILABLE):   # the GEMVs split columns only
            np.testing.assert_array_equal(tiled, alone)
        if exact or i > 0:
            np.testing.assert_array_equal(tiled, kmajor)
        else:
            np.testing.assert_allclose(tiled, kmajor, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not vnni.AVAILABLE, reason="the CPU has no AVX-512 VNNI: the weights stay k-major")
def test_the_rows_gemv_reads_the_tiles(monkeypatch):
    k, n = 64, 96
    t = dt.TiledWeight.from_k_major(RNG.integers(0, 256, (k, n // 2), dtype=np.uint8), 4)
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
    g, targets = graph(dt.TiledWeight.from_k_major(q, 4), dt.uint4, scale, None, 32, 2)
    exe = g.compile(targets=targets)
    exe.save(str(tmp_path / "m.ingot"))
    loaded = ingot.load(str(tmp_path / "m.ingot"))
    stored = [v for v in loaded.program.constants.values() if v.shape == q.shape and v.dtype == np.uint8]
    assert len(stored) == 1 and isinstance(stored[0], np.ndarray)
    np.testing.assert_array_equal(stored[0], q)
    a = RNG.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(loaded.run({"x": a})[0], exe.run({"x": a})[0])


def test_tile_weight_converts_what_the_tiled_gemv_multiplies(monkeypatch):
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
    tensors = {name: kernels.tile_weight(t) for name, t in tensors.items()}
    tiled = {name for name, t in tensors.items() if isinstance(t, QuantizedTensor) and isinstance(t.q, dt.TiledWeight)}
    assert tiled == {"a", "signed", "wide_blocks", "int8"}
    for name in tiled:
        np.testing.assert_array_equal(np.asarray(tensors[name].q), kept[name])
    monkeypatch.setattr(vnni, "AVAILABLE", False)
    assert not isinstance(kernels.tile_weight(weight(64, 96)).q, dt.TiledWeight)


def test_tile_weight_keeps_4bit_parameters_as_float16_where_exact(monkeypatch):
    """A GGUF's Q4_1 scale and min come as float32 widened from float16: tile_weight holds them as float16
    (half the bytes), the same numbers, and the product is unchanged; parameters float16 cannot hold stay
    float32, and 8-bit weights' parameters stay as they are (their kernel takes float32)."""
    monkeypatch.setattr(vnni, "AVAILABLE", True)
    k, n = 96, 64
    exact = RNG.standard_normal((k // 32, n)).astype(np.float16).astype(np.float32)
    inexact = exact.copy()
    inexact[1, 5] = np.float32(1 + 2 ** -20)
    q4 = RNG.integers(0, 256, (k, n // 2), dtype=np.uint8)
    halved = kernels.tile_weight(QuantizedTensor(q4, dt.uint4, (k, n), 32, exact, exact * 0.5, block_axis=0))
    assert halved.scale.dtype == halved.bias.dtype == np.float16 and isinstance(halved.q, dt.TiledWeight)
    np.testing.assert_array_equal(halved.scale.astype(np.float32), exact)
    kept = kernels.tile_weight(QuantizedTensor(q4, dt.uint4, (k, n), 32, exact, inexact, block_axis=0))
    assert kept.scale.dtype == kept.bias.dtype == np.float32   # one of the two cannot: both stay
    q8 = RNG.integers(0, 256, (k, n), dtype=np.uint8)
    assert kernels.tile_weight(QuantizedTensor(q8, dt.uint8, (k, n), 32, exact, block_axis=0)).scale.dtype == np.float32
    x = RNG.standard_normal((3, k)).astype(np.float32)
    before = graph(q4, dt.uint4, exact, exact * 0.5, 32, 3)
    after = graph(halved.q, dt.uint4, halved.scale, halved.bias, 32, 3)
    results = [g.compile(targets=t).run({"x": x})[0] for g, t in (before, after)]
    np.testing.assert_array_equal(results[0], results[1])


def test_storage_form_finishes_each_weight_before_reading_the_next():
    """llm.package.storage_form(finish=): a lazily read file's weights each finished (tiled) as they come,
    so the loader holds one weight in two forms at a time; the result is the same as finishing after."""
    from collections.abc import Mapping

    from ingot.llm.package import storage_form
    from ingot.models import llama

    cfg = llama.LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128,
                            context_length=16)
    tensors = llama.random_weights(cfg, qdtype=dt.uint4)
    events = []

    class Lazy(Mapping):   # LazyTensors' contract: converted when looked up
        def __getitem__(self, name):
            events.append(("read", name))
            return tensors[name]

        def __iter__(self):
            return iter(tensors)

        def __len__(self):
            return len(tensors)

    def finish(t):
        events.append(("finish",))
        return t

    stored = storage_form(cfg, Lazy(), finish=finish)
    assert stored.keys() == storage_form(cfg, tensors).keys()
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    finishes = [i for i, e in enumerate(events) if e[0] == "finish"]
    assert len(finishes) == len(stored)
    # between two finishes, only the reads of one stored weight (a fused group's parts, or one tensor)
    widest = max(sum(1 for r in reads if a < r < b) for a, b in zip([-1] + finishes, finishes))
    assert widest <= 3
