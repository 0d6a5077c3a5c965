"""lut4:bB:offset:k, a table with two-level block scales and offsets (w = table[q] * scale + offset, scale =
d * code, offset = -dmin * code, 6-bit codes, float16 units per super-block: uint4:B:k's parameters): the format
string, the weight against a NumPy reconstruction, the error against uint4:32:k on weights that lie on its grid
and on Student-t weights, the CPU and CUDA pipelines, a package round trip and bad package fields."""
import json
import os
import sys

import numpy as np
import pytest

import ingot
from ingot.errors import IngotError
from ingot.ir import Op, Program
from ingot.quant import parse_format, quantize
from ingot.quant.formats import QuantizedTensor, two_level_split

sys.path.insert(0, os.path.dirname(__file__))

FMT = "lut4:b32:offset:k"


def _written_out(t: QuantizedTensor) -> np.ndarray:
    """The weight from codes, table, scales and offsets, independently of QuantizedTensor."""
    rows, cols = t.shape
    tables = np.repeat(t.lut[:, 0, :].astype(np.float64), rows // t.lut.shape[0], axis=0)
    looked_up = np.take_along_axis(tables, t.values().astype(np.intp), axis=1)
    per_weight = lambda p: np.repeat(np.asarray(p, np.float64), t.block_size, axis=1)  # noqa: E731
    return looked_up * per_weight(t.scale) + per_weight(t.bias)


def _on_k_grid(rows=48, cols=512, seed=0, block=32, super_block=256):
    """Weights exactly on a block-32 affine grid whose scales and mins are 6-bit codes times a float16 unit per
    super-block of 256 columns (what a dequantized Q4_K tensor is): w = q * d * sc - dmin * m."""
    rng = np.random.default_rng(seed)
    nb, ns = cols // block, cols // super_block
    unit = lambda size: (rng.uniform(0.5, 1, size) * 2.0 ** rng.integers(-9, -6, size)).astype(np.float16)  # noqa: E731
    d, dmin = (np.repeat(unit((rows, ns)).astype(np.float64), super_block // block, axis=1) for _ in range(2))
    sc, m = rng.integers(1, 64, (rows, nb)), rng.integers(0, 64, (rows, nb))
    q = rng.integers(0, 16, (rows, cols))
    return (q * np.repeat(d * sc, block, axis=1) - np.repeat(dmin * m, block, axis=1)).astype(np.float32)


def _error(w, t, importance=None):
    weights = np.ones(w.shape[1]) if importance is None else importance
    return float((((w - t.dequantize_rows()) ** 2) * weights).sum())


# -- the format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["lut4:b32:offset:k", "lut4:g8:b32:offset:k", "lut4:b64:offset:k8", "lut8:b32:offset:k"])
def test_format_string_round_trips(fmt):
    f = parse_format(fmt)
    assert str(f) == fmt and f.kind == "lut" and f.offset and f.code_bits in (6, 8)


@pytest.mark.parametrize("fmt", ["lut4:b32:k", "lut4:k", "lut4:b32:offset:k:uniform", "lut4:b32:offset:k7"])
def test_k_without_offset_or_with_uniform_is_one_sentence(fmt):
    with pytest.raises(IngotError, match="format .* is not valid"):
        parse_format(fmt)


@pytest.mark.parametrize("fmt, importance", [(FMT, False), (FMT, True), ("lut4:g16:b32:offset:k", True),
                                             ("lut4:b64:offset:k8", False)])
def test_parameters_are_two_level_and_give_the_weight(fmt, importance):
    rng = np.random.default_rng(1)
    w = (rng.standard_t(5, (64, 512)) * np.exp(rng.standard_normal((64, 1))) + rng.standard_normal((64, 1))).astype(np.float32)
    imp = np.linspace(0.2, 3, 512).astype(np.float32) if importance else None
    t = quantize(w, fmt, importance=imp)
    f = parse_format(fmt)
    assert t.two_level == (256, f.code_bits) and t.scale.dtype == np.float16 and t.bias.dtype == np.float16
    per_super = 256 // t.block_size
    for p, sign in ((t.scale, 1), (t.bias, -1)):   # codes times a float16 unit per super-block, exactly
        units, codes = two_level_split(p, per_super, f.code_bits, sign)
        assert codes.max() < 2 ** f.code_bits
    assert np.all(t.scale > 0) and np.all(t.bias <= 0)
    np.testing.assert_allclose(t.dequantize_rows(), _written_out(t), rtol=1e-6, atol=1e-6)
    # codes are the nearest entries of (w - offset) / scale
    tables = np.repeat(t.lut[:, 0, :], 64 // t.lut.shape[0], axis=0).astype(np.float64)
    rep = lambda p: np.repeat(p.astype(np.float64), t.block_size, axis=1)  # noqa: E731
    normalized = (w - rep(t.bias)) / rep(t.scale)
    nearest = np.abs(normalized[:, :, None] - tables[:, None, :]).min(axis=2)
    chosen = np.abs(normalized - np.take_along_axis(tables, t.values().astype(np.intp), axis=1))
    np.testing.assert_array_less(chosen, nearest + 1e-4)
    # bytes as stored: 4 bits a weight, 2 x 6 bits a block of 32, 2 x 16 bits a super-block of 256, the table
    if fmt == FMT:
        assert t.two_level_nbytes == t.q.nbytes + 2 * (w.size // 32 * 6 // 8 + 2 * w.size // 256) + t.lut.nbytes


# -- the quantizer against uint4:32:k -----------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("importance", [False, True])
def test_on_uint4_32_k_grid_weights_not_worse_than_uint4_32_k(seed, importance):
    w = _on_k_grid(seed=seed)
    imp = np.random.default_rng(seed).uniform(0.1, 4, w.shape[1]).astype(np.float32) if importance else None
    affine, table = quantize(w, "uint4:32:k", importance=imp), quantize(w, FMT, importance=imp)
    # the error the quantizer weighs: the importance's, or without one each column's mean square weight
    weigh = imp if importance else np.square(w, dtype=np.float64).mean(axis=0)
    assert _error(w, table, weigh) <= _error(w, affine, weigh)
    assert _error(w, table) <= 1.05 * _error(w, affine)
    assert _error(w, quantize(w, "lut4:b64:offset")) > 4 * _error(w, table)   # (what the :k form is for: 7x here)


@pytest.mark.parametrize("importance", [False, True])
def test_on_student_t_weights_beats_uint4_32_k(importance):
    rng = np.random.default_rng(3)
    w = rng.standard_t(4, (128, 512)).astype(np.float32)
    imp = rng.uniform(0.1, 4, 512).astype(np.float32) if importance else None
    affine, table = quantize(w, "uint4:32:k", importance=imp), quantize(w, FMT, importance=imp)
    assert _error(w, table, imp) < 0.95 * _error(w, affine, imp)


def test_gptq_keeps_the_two_level_parameters():
    from ingot.quant.gptq import gptq

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 16)) @ rng.standard_normal((16, 256)) + 0.1 * rng.standard_normal((2048, 256))
    h = x.T @ x / len(x)
    w = (rng.standard_normal((32, 256)) + 0.5).astype(np.float32)
    t = gptq(w, FMT, h)
    plain = quantize(w, FMT, importance=np.diag(h).astype(np.float32))
    assert t.two_level == plain.two_level
    np.testing.assert_array_equal(t.scale, plain.scale)
    np.testing.assert_array_equal(t.bias, plain.bias)
    out_err = lambda a: float(np.trace((w - a) @ h @ (w - a).T))  # noqa: E731
    assert out_err(t.dequantize_rows()) < out_err(plain.dequantize_rows())


# -- the pipelines ------------------------------------------------------------------------------
def _graph_of(t: QuantizedTensor):
    """x @ w and a gather of w's columns for a quantized [N, K] weight, w its k-major [K, N] dequantize."""
    km = t.to_k_major()
    g = ingot.Graph()
    x = g.placeholder((2, km.shape[0]), name="x")
    idx = g.placeholder((2,), ingot.int32, name="idx")
    w = g.dequantize(g.constant(km.q, dtype=km.qdtype), lut=km.lut, scale=km.scale, bias=km.bias, axis=0,
                     block_size=km.block_size)
    return g, g.matmul(x, w), g.gather(w, idx, axis=1), km.dequantize_rows()


def test_cpu_runs_it_and_the_cuda_pipeline_leaves_the_offsets_to_its_kernels():
    from ingot.compiler import run_pipeline
    from ingot.passes import evaluate

    rng = np.random.default_rng(4)
    w = rng.standard_t(4, (40, 256)).astype(np.float32)
    g, y, rows, dense = _graph_of(quantize(w, FMT))
    feeds = {"x": rng.standard_normal((2, 256)).astype(np.float32), "idx": np.array([3, 39], np.int32)}
    exe = g.compile(targets=[y, rows], device="cpu")
    (node,) = [nd for nd in exe.program.nodes() if nd.op == Op.QUANTIZED_MATMUL]
    assert node.attrs.get("mode") == "scaled_lut" and node.attrs.get("has_bias")
    got_y, got_rows = exe.run(feeds)
    np.testing.assert_allclose(got_y, feeds["x"] @ dense, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_rows, dense[:, feeds["idx"]], rtol=1e-6, atol=1e-6)
    program = Program([y.node, rows.node], [], dict(g.constants))
    types = {"x": ingot.TensorType((2, 256), ingot.float32), "idx": ingot.TensorType((2,), ingot.int32)}
    after, _ = run_pipeline(program, device="cuda", feed_types=types)
    # the GPU's table kernels add the offsets themselves (gguf_kernels.py): the matmul and gather keep them
    assert all(nd.attrs.get("has_bias") for nd in after.nodes() if nd.op in (Op.QUANTIZED_MATMUL, Op.QUANTIZED_GATHER))
    for a, b in zip(evaluate(program, feeds), evaluate(after, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4)


# -- packages -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from quant_helpers import tiny_config, tiny_tensors, tokenizer_metadata

    from ingot.llm.package import save_llm

    cfg = tiny_config()
    tensors = {n: quantize(w, FMT) if np.ndim(w) == 2 else w for n, w in tiny_tensors(cfg).items()}
    path = tmp_path_factory.mktemp("lutk") / "q.ingot"
    save_llm(path, cfg, tensors, tokenizer_metadata())
    return path, cfg, tensors


@pytest.mark.parametrize("two_level_codes", [False, True])
def test_package_round_trip(saved, two_level_codes):
    from quant_helpers import logits

    from ingot.llm.package import read_llm

    path, cfg, tensors = saved
    info = json.loads((path / "llm.json").read_text())
    assert info["tensors"]["token_embd.weight"]["two_level"] == [256 if cfg.dim % 256 == 0 else
                                                                  tensors["token_embd.weight"].two_level[0], 6]
    encoded = json.loads((path / "graph.json").read_text())["two_level"]   # stored as codes and units
    assert "token_embd.weight.scale" in encoded and encoded["token_embd.weight.bias"][2] == -1
    back = read_llm(path, two_level_codes=two_level_codes)
    for name, t in tensors.items():
        if isinstance(t, QuantizedTensor):
            got = back.tensors[name]
            assert isinstance(got.scale, np.ndarray) and got.scale.dtype == np.float16 and got.two_level == t.two_level
            np.testing.assert_array_equal(got.dequantize_rows(), t.to_k_major().dequantize_rows())
    tokens = [1, 40, 41, 60, 61, 80]
    np.testing.assert_array_equal(logits(cfg, back.tensors, tokens), logits(cfg, tensors, tokens))
    exe = ingot.load(path)   # the stored decode executable opens on its own
    assert exe.output_types[0].shape == (1, cfg.vocab_size)


def test_quantize_cli_package_loads_and_generates(tmp_path, capsys):
    from quant_helpers import save_tiny

    from ingot.cli import main
    from ingot.llm.package import read_llm

    save_tiny(tmp_path / "tiny.ingot")
    out = tmp_path / "q.ingot"
    assert main(["quantize", str(tmp_path / "tiny.ingot"), "-o", str(out), "--format", FMT, "--no-calibration", "--no-eval"]) == 0
    info = json.loads((out / "llm.json").read_text())
    assert info["extra"]["quantized"]["format"] == FMT
    t = read_llm(out, two_level_codes=True).tensors["blk.1.ffn_down.weight"]   # (the head stays int8)
    assert t.lut is not None and t.two_level == (96, 6) and t.scale.dtype == np.float16 and np.all(np.asarray(t.bias) <= 0)
    assert ingot.load(out).output_types[0].shape == (1, 296)
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--no-chat", "--max-tokens", "4", "--json", "hello world"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) >= 1


def _copy(path, tmp_path):
    import shutil

    out = tmp_path / "bad.ingot"
    shutil.copytree(path, out)
    return out


@pytest.mark.parametrize("two_level", [[256, 5], [256], ["256", 6], [48, 6], [256, 6, 1], True])
def test_bad_two_level_field_is_one_sentence(saved, tmp_path, two_level):
    from ingot.llm.package import read_llm

    path = _copy(saved[0], tmp_path)
    info = json.loads((path / "llm.json").read_text())
    info["tensors"]["token_embd.weight"]["two_level"] = two_level
    (path / "llm.json").write_text(json.dumps(info))
    with pytest.raises(IngotError, match="token_embd.weight") as e:
        read_llm(path)
    assert str(e.value).count(". ") == 0


def test_table_two_level_without_its_offsets_is_one_sentence(saved, tmp_path):
    from ingot.llm.package import read_llm

    path = _copy(saved[0], tmp_path)
    info = json.loads((path / "llm.json").read_text())
    info["tensors"]["token_embd.weight"]["params"] = ["scale", "lut"]
    (path / "llm.json").write_text(json.dumps(info))
    with pytest.raises(IngotError, match="token_embd.weight' is described as uint4"):
        read_llm(path)


def test_bad_two_level_codes_are_one_sentence(saved, tmp_path):
    from ingot.llm.package import read_llm

    path = _copy(saved[0], tmp_path)
    graph = json.loads((path / "graph.json").read_text())
    graph["two_level"]["token_embd.weight.bias"][0] = 3   # blocks per super-block that the stored codes do not fit
    (path / "graph.json").write_text(json.dumps(graph))
    with pytest.raises(IngotError, match="two-level constant 'token_embd.weight.bias'"):
        read_llm(path)



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scaled_codes_count_the_midpoints_below_each_value(dtype):
    """The compiled code search against the count of each group's table midpoints below w / scale, on
    awkward shapes, with NaN, infinities and a zero scale."""
    from ingot.quant.quantize import _scaled_codes

    rng = np.random.default_rng(7)
    for rows, nb, size, group in ((12, 5, 32, 4), (7, 3, 9, 7), (6, 2, 64, 1)):
        blocks = rng.standard_t(3, (rows, nb, size)).astype(dtype)
        blocks[0, 0, :3] = [np.nan, np.inf, -np.inf]
        scale = rng.uniform(0.1, 2, (rows, nb)).astype(dtype)
        scale[-1, -1] = 0
        tables = np.sort(rng.standard_normal((rows // group, 16)), axis=1).astype(np.float32)
        mids = np.repeat((tables[:, 1:] + tables[:, :-1]) / 2, group, axis=0)[:, None, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            want = ((blocks / scale[..., None])[..., None] > mids).sum(axis=-1)
        np.testing.assert_array_equal(_scaled_codes(blocks, scale, tables, group), want)


def test_coded_lines_equal_the_nine_neighbours_searched_in_numpy():
    """_coded_lut_params' compiled search against the NumPy one it replaced: for each block the codes
    (cs + ds, cm + dm), ds, dm in 0, -1, +1, with the least weighted error, the first of equal ones."""
    from ingot.quant.quantize import _codes, _coded_lut_params, _offset_codes, _two_level_units

    rng = np.random.default_rng(11)
    rows, nb, size, group, per_super, bits = 6, 8, 32, 3, 4, 6
    blocks = rng.standard_t(4, (rows, nb, size)).astype(np.float32)
    weights = rng.uniform(0.1, 2, (1, nb, size)).astype(np.float32)
    tables = np.sort(rng.standard_normal((rows // group, 16)), axis=1).astype(np.float32)
    s = rng.uniform(0.05, 0.5, (rows, nb)).astype(np.float32)
    o = -rng.uniform(0, 2, (rows, nb)).astype(np.float32)
    got_scale, got_offset = _coded_lut_params(blocks, weights, tables, group, s, o, per_super, bits)

    row_table = np.repeat(np.arange(rows // group), group)[:, None, None]
    d, dmin = (np.repeat(u, per_super, axis=1) for u in _two_level_units(s, o, per_super, bits))
    cs, cm = _codes(s, d, bits, 1), _codes(-o, dmin, bits, 0)
    best = None
    for ds in (0, -1, 1):
        for dm in (0, -1, 1):
            scale = (np.clip(cs + ds, 1, 2 ** bits - 1) * d).astype(np.float32)
            offset = (-(np.clip(cm + dm, 0, 2 ** bits - 1) * dmin)).astype(np.float32)
            approx = tables[row_table, _offset_codes(blocks, scale, offset, tables, group)] * scale[..., None] + offset[..., None]
            e = (weights.astype(np.float64) * (blocks - approx).astype(np.float64) ** 2).sum(axis=2)
            if best is None:
                best, want_scale, want_offset = e, scale, offset
                continue
            better = e < best
            best = np.where(better, e, best)
            want_scale, want_offset = np.where(better, scale, want_scale), np.where(better, offset, want_offset)
    np.testing.assert_array_equal(got_scale, want_scale)
    np.testing.assert_array_equal(got_offset, want_offset)
