"""GGUF's 2/3-bit K-quants, ternary, IQ and MXFP4 types: converted bit-exactly against
gguf.quants.dequantize into Ingot's formats, multiplied from the packed form on the CPU backend, and
a tiny Llama whose weights use them generating the same tokens as its F32 twin through ingot.llm."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from quant_helpers import tokenizer_metadata

from ingot import dtypes as dt
from ingot.graph import Graph
from ingot.importers import gguf as ig
from ingot.importers import gguf_blocks
from ingot.importers import read_gguf
from ingot.ir import Op
from ingot.ops.quant import dequantize_values, unpack
from ingot.quant.formats import QuantizedTensor

# type -> (Ingot dtype, block size of the scales, has bias, scaled lookup table)
EXPECTED = {
    T.Q2_K: (dt.uint4, 16, True, False),
    T.Q3_K: (dt.int4, 16, False, False),
    T.TQ1_0: (dt.int4, 256, False, False),
    T.TQ2_0: (dt.int4, 256, False, False),
    T.IQ4_NL: (dt.uint4, 32, False, True),
    T.IQ4_XS: (dt.uint4, 32, False, True),
    T.IQ2_XXS: (dt.uint4, 32, False, True),
    T.IQ2_XS: (dt.uint4, 16, False, True),
    T.IQ2_S: (dt.uint4, 16, False, True),
    T.IQ3_XXS: (dt.uint4, 32, False, True),
    T.IQ3_S: (dt.uint4, 32, False, True),
    T.IQ1_S: (dt.uint4, 32, False, True),
    T.IQ1_M: (dt.uint4, 16, False, True),
    T.MXFP4: (dt.uint4, 32, False, True),
}
QUANTIZABLE = (T.TQ1_0, T.TQ2_0, T.MXFP4)  # gguf.quants.quantize implements these; the rest: random blocks
# byte offsets of each block's f16 scales (set finite; every other byte stays random)
F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,),
              T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,)}


def random_blocks(rng, qtype, rows, cols, spread=0.02):
    """Valid block bytes [rows, row_bytes]: quantized floats where gguf can quantize, else random
    bytes with finite f16 scales of about `spread`."""
    if qtype in QUANTIZABLE:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        x[0, :4] = [0.0, -3.5, 2.0, 1e-3]
        return gguf.quants.quantize(x, qtype)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    d = (rng.standard_normal((rows, cols // bs)) * spread).astype(np.float16)
    for off in F16_FIELDS.get(qtype, ()):
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // bs, 2)
    if qtype == T.IQ1_M:  # its f16 scale is spread over the top nibbles of four u16 scale words
        bits = d.view(np.uint16)
        words = raw[:, :, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            words[..., i] |= ((bits >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, :, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, tensors, kv=None):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype, *sub) in (kv or {}).items():
        w.add_key_value(key, value, vtype, *sub)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def unit(qtype) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per type: tensors of awkward shapes (rows not a multiple of 8; 1, 2 and 3 GGUF blocks) and their
    raw bytes; every type in one file."""
    rng = np.random.default_rng(33)
    shapes = {"a": (7, 3), "b": (10, 2), "c": (1, 1)}  # rows, GGUF blocks per row
    tensors, raws = [], {}
    for qtype in EXPECTED:
        for name, (rows, nb) in shapes.items():
            raw = random_blocks(rng, qtype, rows, nb * unit(qtype))
            raws[(qtype, name)] = (raw, (rows, nb * unit(qtype)))
            tensors.append((f"{qtype.name}.{name}", raw, qtype))
    path = write_gguf(tmp_path_factory.mktemp("quants") / "q.gguf", tensors)
    return path, raws


@pytest.mark.parametrize("qtype", list(EXPECTED), ids=lambda t: t.name)
def test_conversion_is_bit_exact(converted, qtype, monkeypatch):
    path, raws = converted
    for chunk in (gguf_blocks._CHUNK_ELEMS, 300):  # 300: one row per chunk
        monkeypatch.setattr(gguf_blocks, "_CHUNK_ELEMS", chunk)
        m = read_gguf(path)
        qdtype, block, has_bias, table = EXPECTED[qtype]
        for name in "abc":
            raw, (rows, cols) = raws[(qtype, name)]
            qt = m.tensors[f"{qtype.name}.{name}"]
            assert isinstance(qt, QuantizedTensor) and qt.source == qtype.name
            assert qt.qdtype == qdtype and qt.shape == (rows, cols) and qt.block_size == block
            assert qt.q.shape == (rows, cols // 2) and qt.q.dtype == np.uint8     # 4 bits a weight, packed
            assert qt.scale.shape == (rows, cols // block) and qt.scale.dtype == np.float32
            assert (qt.bias is not None) == has_bias and (qt.lut is not None) == table
            if table:
                assert qt.lut.shape == (1, 1, 16) and qt.lut.dtype == np.float32
            ref = gguf.quants.dequantize(raw, qtype)
            with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow in both
                np.testing.assert_array_equal(bits(qt.dequantize_rows()), bits(ref))
                np.testing.assert_array_equal(bits(qt.dequantize_rows(rows - 1, rows)), bits(ref[rows - 1:]))
                # the DEQUANTIZE op's reference on the graph's form gives the same bits
                k_major = qt.to_k_major() if rows % 2 == 0 else None
                if k_major is not None:
                    attrs = graph_attrs(k_major)
                    got = dequantize_values(unpack(k_major.q, qdtype), params(k_major), attrs)
                    np.testing.assert_array_equal(bits(got.T), bits(ref))


def graph_attrs(t: QuantizedTensor) -> dict:
    if t.lut is not None:
        return {"mode": "scaled_lut", "qdtype": t.qdtype, "dtype": dt.float32}
    return {"mode": "affine", "qdtype": t.qdtype, "dtype": dt.float32, "has_bias": t.bias is not None}


def params(t: QuantizedTensor) -> list:
    return [t.lut, t.scale] if t.lut is not None else [p for p in (t.scale, t.bias) if p is not None]


def test_iq_values_use_every_table_entry(converted):
    """The codes reach every value of their type (signs, grid levels, IQ1's two deltas)."""
    path, raws = converted
    m = read_gguf(path)
    levels = {T.IQ2_XXS: 6, T.IQ2_XS: 6, T.IQ2_S: 6, T.IQ3_XXS: 16, T.IQ3_S: 16, T.IQ1_S: 6, T.IQ1_M: 6,
              T.IQ4_NL: 16, T.IQ4_XS: 16}
    for qtype, n in levels.items():
        codes = np.concatenate([m.tensors[f"{qtype.name}.{x}"].values().reshape(-1) for x in "ab"])
        assert set(np.unique(codes)) == set(range(n)), qtype.name


def quantized_matmul_graph(t: QuantizedTensor, x: np.ndarray, transpose: bool, options=None):
    """y = x @ W.T through a graph the compiler fuses into quantized_matmul; W k-major unless transpose."""
    g = Graph()
    w = t if transpose else t.to_k_major()
    q = g.constant(w.q, dtype=w.qdtype, name="w")
    axis = 1 if transpose else 0
    if w.lut is not None:
        deq = g.dequantize(q, lut=g.constant(w.lut), scale=g.constant(w.scale), axis=axis, block_size=w.block_size)
    else:
        extra = {"bias": g.constant(w.bias)} if w.bias is not None else {}
        deq = g.dequantize(q, scale=g.constant(w.scale), axis=axis, block_size=w.block_size, **extra)
    xin = g.placeholder(x.shape, dt.float32, name="x")
    y = g.matmul(xin, g.transpose(deq, (1, 0)) if transpose else deq)
    exe = g.compile(targets=[y], options=options)
    ops = [n.op for n in exe.program.nodes()]
    assert Op.QUANTIZED_MATMUL in ops and Op.DEQUANTIZE not in ops and Op.MATMUL not in ops
    return exe.run({"x": x})[0]


def check_close(got, x, w):
    """float32 accumulation in any order: |error| <= K * eps(float32) * sum_k |x||w| (the classic
    bound of a float32 dot product of length K) against the float64 product."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    err = np.abs(got.astype(np.float64) - want)
    tol = x.shape[-1] * float(np.finfo(np.float32).eps)
    assert np.all(err <= tol * bound + 1e-30), float((err / np.maximum(bound, 1e-30)).max())


@pytest.mark.parametrize("m", [1, 3, 20])  # 20 rows: the tiled GEMM path; fewer: the GEMV kernels
@pytest.mark.parametrize("qtype", list(EXPECTED), ids=lambda t: t.name)
def test_quantized_matmul_matches_dequantized(converted, qtype, m):
    path, raws = converted
    model = read_gguf(path)
    rng = np.random.default_rng(m)
    for name in "ab":                          # 10 x 2 blocks (k-major, kernels) and 7 x 3 (odd rows)
        t = model.tensors[f"{qtype.name}.{name}"]
        w = t.dequantize_rows()
        x = rng.standard_normal((m, t.shape[1])).astype(np.float32)
        if qtype == T.MXFP4:                   # random exponents span 2**-127..2**127: compare finite rows
            keep = np.isfinite(w).all(axis=1) & (np.abs(w).max(axis=1) < 1e30)
            w, t = w[keep], None if keep.sum() % 2 else select_rows(t, keep)
            if t is None:
                continue
        if t.shape[0] % 2 == 0:                # 4-bit k-major packing needs an even number of outputs
            check_close(quantized_matmul_graph(t, x, transpose=False), x, w)
        check_close(quantized_matmul_graph(t, x, transpose=True), x, w)


def select_rows(t: QuantizedTensor, keep) -> QuantizedTensor:
    return QuantizedTensor(t.q[keep], t.qdtype, (int(keep.sum()), t.shape[1]), t.block_size, t.scale[keep],
                           None if t.bias is None else t.bias[keep], source=t.source, lut=t.lut)


def test_scaled_lut_kernel_split_over_threads(converted, monkeypatch):
    """The GEMV split along K over worker threads adds up to the one-thread result."""
    from ingot.backends.cpu import team
    from ingot.options import CompileOptions, CpuOptions
    path, raws = converted
    t = read_gguf(path).tensors["IQ4_XS.b"]
    x = np.random.default_rng(0).standard_normal((2, t.shape[1])).astype(np.float32)
    one = quantized_matmul_graph(t, x, transpose=False)
    monkeypatch.setattr(team, "PARALLEL_MIN_WEIGHTS", 1)
    two = quantized_matmul_graph(t, x, transpose=False, options=CompileOptions(cpu=CpuOptions(threads=2)))
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6 * float(np.abs(one).max()))
    check_close(two, x, t.dequantize_rows())


def test_dequantize_refuses_scaled_lut_with_zero_point():
    g = Graph()
    q = g.constant(np.zeros((4, 2), np.uint8), dtype=dt.uint4)
    with pytest.raises(Exception, match="takes no zero_point"):
        g.dequantize(q, lut=np.zeros((1, 1, 16), np.float32), scale=np.ones((4, 1), np.float32),
                     zero_point=np.ones((4, 1), np.float32))
    # (a bias is the lut4:bB:offset form: tests/test_quant_lut_offset.py)


# ---------------------------------------------------------------------------------------------
# A tiny Llama whose weights are Q3_K, IQ4_XS, Q2_K and IQ3_S, through ingot.llm (the IQ4_XS
# embedding goes through quantized_gather, the rest through quantized_matmul).

LAYOUT = {"token_embd.weight": T.IQ4_XS, "output.weight": T.Q3_K, "attn_q.weight": T.IQ4_XS,
          "attn_k.weight": T.IQ4_XS, "attn_v.weight": T.IQ3_S, "attn_output.weight": T.IQ4_XS,
          "ffn_gate.weight": T.Q3_K, "ffn_up.weight": T.Q3_K, "ffn_down.weight": T.Q2_K}
SPREAD = {T.Q3_K: 4e-4, T.IQ4_XS: 1.5e-5, T.IQ3_S: 4e-4, T.Q2_K: 1e-3}   # weights of about 0.05


def write_model(tmp_path, rng, dequantized: bool) -> str:
    dim, ffn, heads, kv_heads, layers = 256, 512, 4, 2, 2
    meta = tokenizer_metadata()
    vocab = len(meta["tokenizer.ggml.tokens"])
    V = gguf.GGUFValueType
    kv = {f"llama.{k}": (v, V.UINT32) for k, v in (("block_count", layers), ("embedding_length", dim),
                                                     ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                                                     ("feed_forward_length", ffn), ("context_length", 64))}
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            kv[key] = (value, V.ARRAY, V.STRING if isinstance(value[0], str) else V.INT32)
        else:
            kv[key] = (value, V.STRING if isinstance(value, str) else V.BOOL if isinstance(value, bool) else V.UINT32)
    shapes = {"token_embd.weight": (vocab, dim), "output.weight": (vocab, dim), "attn_q.weight": (dim, dim),
              "attn_k.weight": (dim // 2, dim), "attn_v.weight": (dim // 2, dim), "attn_output.weight": (dim, dim),
              "ffn_gate.weight": (ffn, dim), "ffn_up.weight": (ffn, dim), "ffn_down.weight": (dim, ffn)}
    tensors = []
    for name, qtype in LAYOUT.items():
        for layer in [None] if name in ("token_embd.weight", "output.weight") else range(layers):
            full = name if layer is None else f"blk.{layer}.{name}"
            raw = random_blocks(rng, qtype, *shapes[name], spread=SPREAD[qtype])
            tensors.append((full, gguf.quants.dequantize(raw, qtype) if dequantized else raw, None if dequantized else qtype))
    for layer in range(layers):
        for norm in ("attn_norm.weight", "ffn_norm.weight"):
            tensors.append((f"blk.{layer}.{norm}", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), None))
    tensors.append(("output_norm.weight", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32), None))
    return write_gguf(tmp_path / ("f32.gguf" if dequantized else "quantized.gguf"), tensors, kv)


def test_llama_with_iq_and_k_quant_weights_generates_like_f32(tmp_path):
    from ingot.llm import load
    quantized = write_model(tmp_path, np.random.default_rng(0), dequantized=False)
    f32 = write_model(tmp_path, np.random.default_rng(0), dequantized=True)   # the same draws, dequantized
    types = read_gguf(quantized, lazy=True).tensor_types
    assert {types["blk.1.attn_q.weight"], types["blk.0.ffn_gate.weight"], types["token_embd.weight"]} == {"IQ4_XS", "Q3_K"}
    from ingot.convert import convert
    package = str(tmp_path / "quantized.ingot")
    convert(quantized, package)            # an LLM package stores the same table, codes and scales
    prompt = [5, 17, 42, 99, 7, 250, 3]
    tokens, logits = [], []
    for path in (quantized, f32, package):
        llm = load(path)
        list(llm.generate(prompt, max_tokens=16))
        tokens.append(llm.stats.tokens)
        if path == quantized:  # kept quantized: scaled-table and affine quantized matmuls, no float weight
            program = llm.model.compile(1).program
            modes = {n.attrs["mode"] for n in program.nodes() if n.op == Op.QUANTIZED_MATMUL}
            assert modes == {"scaled_lut", "affine"}
            big = [k for k, v in program.constants.items() if np.asarray(v).dtype == np.float32 and np.asarray(v).size >= 256 * 128]
            assert not big, big
        llm.reset()
        logits.append(llm.prefill(prompt[:5]))
    assert len(set(tokens[0])) > 1      # (a random model soon repeats itself or stops)
    assert tokens[0] == tokens[1] == tokens[2]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4 * float(np.abs(logits[1]).max()))
    np.testing.assert_array_equal(logits[2], logits[0])


@pytest.mark.parametrize("kernel", ["permute", "pshufb", "lookup"])
@pytest.mark.parametrize("table_kind", ["int8", "eighths", "float"])
@pytest.mark.parametrize("n,k,block", [(40, 96, 6), (10, 64, 32), (66, 48, 16), (98, 99, 33)])
@pytest.mark.parametrize("m", [1, 3, 20])
def test_scaled_lut_kernels_match_reference(kernel, table_kind, n, k, block, m):
    """The three CPU kernels (AVX-512 permutes of any table; PSHUFB decode to int8 where the CPU and
    table allow; per-row product lookups) and the tiled GEMM: row tails of under 16 bytes, blocks not
    a multiple of 4 rows and of odd length, tables of integers, of eighths (IQ1) and of arbitrary floats."""
    from ingot.backends.cpu import lut_kernels
    from ingot.ir import Node, TensorType
    from ingot.ops.quant import quantized_matmul_reference

    rng = np.random.default_rng(n + k + m)
    table = {"int8": rng.integers(-128, 128, 16), "eighths": rng.integers(-60, 60, 16) / 8,
             "float": rng.standard_normal(16)}[table_kind].astype(np.float32).reshape(1, 1, 16)
    q = rng.integers(0, 256, (k, n // 2), dtype=np.uint8)
    scale = rng.random((k // block, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    attrs = {"qdtype": dt.uint4, "dtype": dt.float32, "mode": "scaled_lut", "transpose": False}
    node = Node(Op.QUANTIZED_MATMUL, TensorType((m, n), dt.float32), (), attrs)
    if kernel == "permute" and not lut_kernels.PERMUTE:
        pytest.skip("no AVX-512 on this CPU")
    got = lut_kernels.scaled_lut_matmul_step(node, None, shuffle=kernel == "pshufb",
                                             permute=kernel == "permute")(x, q, table, scale)
    want = quantized_matmul_reference((x, q, table, scale), attrs)
    w = dequantize_values(unpack(q, dt.uint4), [table, scale], attrs)
    check_close(got, x, w.T)
    check_close(want, x, w.T)
