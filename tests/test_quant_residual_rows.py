"""Residual-row compensation (ingot.adapters AdapterSet.rows, ingot.quant.pipeline compensate_form):
the error of the rows of the output head the calibration ranks first, kept as int8 rows and added as
gather(x @ R.T): the called executable against NumPy, the quantizer's choice within rank N's bytes,
quantize -> save -> load equal to the head W_hat + residual as a dense weight, and a package whose
rows do not fit refused in one sentence."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import FIXTURES, logits, save_tiny, tiny_config  # noqa: E402

from ingot.adapters import AdapterSet  # noqa: E402
from ingot.errors import IngotError  # noqa: E402


def _int8_rows(r):
    from ingot.adapters import _int8_columns

    q, s = _int8_columns(r.T)
    return (q.astype(np.float32) * s).T


@pytest.mark.parametrize("length", [1, 5])
def test_rows_executable_equals_numpy_beside_low_rank_on_a_side_by_side_site(length):
    rng = np.random.default_rng(1)
    width, outs = 24, [37, 11]
    r0, r1 = rng.standard_normal((5, width)).astype(np.float32), rng.standard_normal((1, width)).astype(np.float32)
    a, b = rng.standard_normal((3, width)).astype(np.float32), rng.standard_normal((37, 3)).astype(np.float32)
    adapters = AdapterSet({"n0": [(a, b)]}, rows={"n0": (np.array([36, 0, 7, 20, 3], np.int32), r0),
                                                  "n1": (np.array([10], np.int32), r1)})
    x = rng.standard_normal((length, width)).astype(np.float32)
    got = adapters.executable(["n0", "n1"], outs, length).run([x])[0]
    want = np.zeros((length, 48))
    want[:, :37] = x @ (b @ a).T
    for offset, idx, r in ((0, [36, 0, 7, 20, 3], r0), (37, [10], r1)):
        want[:, offset + np.array(idx)] += x @ _int8_rows(r).T   # the rows are stored int8, a scale per row
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the rows alone, no low-rank factors at the site
    only = AdapterSet(rows={"n1": (np.array([2, 9], np.int32), r0[:2])}).executable(["n1"], [11], length).run([x])[0]
    want = np.zeros((length, 11))
    want[:, [2, 9]] = x @ _int8_rows(r0[:2]).T
    np.testing.assert_allclose(only, want, rtol=1e-4, atol=1e-4)
    assert np.allclose(AdapterSet(rows={"n1": (np.array([2, 9]), r0[:2])}).delta("n1", 11)[[2, 9]], r0[:2])


@pytest.mark.parametrize("int8", [True, False])
def test_lookup_executable_equals_numpy_rows_of_the_delta(int8):
    """The embedding lookup's share of a tied head's adapter: tokens -> rows of B @ A + S R, stored
    as the head's executable stores them (int8 factors: the head's int8 values)."""
    from ingot.adapters import _int8_columns

    rng = np.random.default_rng(5)
    vocab, width = 53, 24
    idx = np.array([52, 0, 7, 20, 3], np.int32)
    r = rng.standard_normal((5, width)).astype(np.float32)
    a, b = rng.standard_normal((3, width)).astype(np.float32), rng.standard_normal((vocab, 3)).astype(np.float32)
    tokens = np.array([7, 1, 52, 52, 0, 19, 3], np.int32)
    if int8:
        qa, sa = _int8_columns(a.T)
        qb, sb = _int8_columns(b.T)
        low = (qb.astype(np.float32) * sb).T @ (qa.astype(np.float32) * sa).T
    else:
        low = b @ a
    for adapters, want in ((AdapterSet({"token_embd.weight": [(a, b)]}, int8=int8, rows={"token_embd.weight": (idx, r)}),
                            None),
                           (AdapterSet(rows={"token_embd.weight": (idx, r)}, int8=int8), 0 * low),
                           (AdapterSet({"token_embd.weight": [(a, b)]}, int8=int8), low),
                           (AdapterSet({"other": [(a, b)]}, int8=int8), 0 * low)):
        full = np.array(low if want is None else want, np.float64)
        if "token_embd.weight" in adapters.rows:
            full[idx] += _int8_rows(r)
        got = adapters.lookup_executable("token_embd.weight", vocab, width, len(tokens)).run([tokens])[0]
        np.testing.assert_allclose(got, full[tokens], rtol=1e-4, atol=1e-4)


def test_rows_that_do_not_fit_are_one_sentence():
    r = np.ones((2, 8), np.float32)
    for idx in ([0, 0], [0, 11], [-1, 2]):
        with pytest.raises(IngotError, match="residual rows of n"):
            AdapterSet(rows={"n": (np.array(idx), r)}).executable(["n"], [11], 1)
    with pytest.raises(IngotError, match="two sets of residual rows"):
        AdapterSet(rows={"n": (np.array([1]), r[:1])}).merged(AdapterSet(rows={"n": (np.array([2]), r[:1])}))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from ingot.llm.package import open_model
    from ingot.llm.tokenizer import tokenize
    from ingot.quant.pipeline import calibrate, default_calibration_text

    path = tmp_path_factory.mktemp("rows") / "tiny.ingot"
    save_tiny(path)
    model = open_model(path)
    stats = calibrate(model, tokenize(model, default_calibration_text()), context=64)
    return model, stats


def test_head_rows_within_rank_bytes_ranked_by_probability_and_chosen_by_weighted_error(quantized):
    from ingot.quant.pipeline import OUTPUT_PROBABILITY, float_weights, quantize_model

    model, stats = quantized
    common = dict(stats=stats, compensate=4, compensate_sites=["token_embd.weight"])
    rows = quantize_model(model, "uint4:16:k", compensate_form="rows", **common)
    low = quantize_model(model, "uint4:16:k", compensate_form="low_rank", **common)
    auto = quantize_model(model, "uint4:16:k", **common)
    idx, r = rows.adapters.rows["token_embd.weight"]
    assert not rows.adapters.factors and not low.adapters.rows
    assert rows.adapter_bytes <= low.adapter_bytes and len(idx) == (low.adapter_bytes - 4 * 296) // (64 + 4)
    p = stats[OUTPUT_PROBABILITY]
    w = dict(float_weights(model))["token_embd.weight"]
    e = (w - rows.tensors["token_embd.weight"].dequantize_rows()).astype(np.float64)
    np.testing.assert_allclose(r, e[idx], atol=np.abs(e[idx]).max() / 200)   # the error, int8 per row
    h = stats["token_embd.weight"].astype(np.float64)
    share = (p + 1e-3 / len(p)) * np.einsum("ri,ij,rj->r", e, h, e)   # each row's probability-weighted output error
    assert share[idx].min() >= np.delete(share, idx).max() * (1 - 1e-6)      # the rows holding the most of it
    weighted = lambda c: float(np.einsum("r,ri,ij,rj->", p + 1e-3 / len(p), e - c, h, e - c))  # noqa: E731
    by_rows, by_low = weighted(rows.adapters.delta("token_embd.weight", 296)), weighted(low.adapters.delta("token_embd.weight"))
    assert min(by_rows, by_low) < 0.9 * weighted(0 * e)
    chose_rows = by_rows < by_low
    assert bool(auto.adapters.rows) == chose_rows and bool(auto.adapters.factors) == (not chose_rows)
    assert any("residual rows" in n for n in auto.notes)


def test_rows_survive_save_and_load_and_equal_the_dense_head(quantized, tmp_path):
    import dataclasses

    from ingot.llm.package import open_model, save_llm
    from ingot.quant.pipeline import float_weights, quantize_model

    model, stats = quantized
    result = quantize_model(model, "uint4:16:k", stats=stats, compensate=4, compensate_sites=["token_embd.weight"],
                            compensate_form="rows")
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata, result.adapters)
    loaded = open_model(tmp_path / "q.ingot")
    idx, r = result.adapters.rows["token_embd.weight"]
    got_idx, got_r = loaded.adapters.rows["token_embd.weight"]
    np.testing.assert_array_equal(got_idx, idx)
    np.testing.assert_allclose(got_r, r, rtol=1e-6, atol=1e-7)
    tokens = [1, 40, 41, 60, 61, 80, 200]
    got = logits(loaded.config, loaded.tensors, tokens, loaded.adapters)
    # reference: the tied matrix a dense float W_hat + S R, read by the embedding lookup and the head alike
    head = dict(float_weights(loaded))["token_embd.weight"].astype(np.float64)
    dense = dict(loaded.tensors)
    dense["token_embd.weight"] = (head + loaded.adapters.delta("token_embd.weight", head.shape[0])).astype(np.float32)
    want = logits(loaded.config, dense, tokens)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    without = logits(loaded.config, loaded.tensors, tokens)
    assert np.abs(got - without).max() > 100 * np.abs(got - want).max()   # the rows do change the logits
    # the head alone corrected (the embedding W_hat) differs: the lookup of a corrected token reads the rows too
    assert set(tokens) & set(idx.tolist())
    untied = dict(dense, **{"token_embd.weight": head.astype(np.float32), "output.weight": dense["token_embd.weight"]})
    head_only = logits(dataclasses.replace(loaded.config, tied_embeddings=False), untied, tokens)
    assert np.abs(head_only - want).max() > 100 * np.abs(got - want).max()


@pytest.mark.parametrize("corrupt", ["index out of range", "index twice", "float rows", "short map"])
def test_package_whose_residual_rows_do_not_fit_is_refused(quantized, tmp_path, corrupt):
    from safetensors.numpy import load_file, save_file

    from ingot.llm.package import open_model, save_llm
    from ingot.quant.pipeline import quantize_model

    model, stats = quantized
    result = quantize_model(model, "uint4:16:k", stats=stats, compensate=4, compensate_sites=["token_embd.weight"],
                            compensate_form="rows")
    save_llm(tmp_path / "q.ingot", model.config, result.tensors, model.metadata, result.adapters)
    files = list((tmp_path / "q.ingot" / "callables").rglob("*.safetensors"))
    assert len(files) == 1
    arrays = load_file(files[0])
    key = next(k for k in arrays if k.endswith("R_map"))
    m = arrays[key]
    if corrupt == "index out of range":
        m[np.flatnonzero(m)[0]] = m.max() + 5
    elif corrupt == "index twice":
        nz = np.flatnonzero(m)
        m[nz[0]] = m[nz[1]]
    elif corrupt == "short map":
        arrays[key] = m[:-1]
    else:
        q = next(k for k in arrays if k.endswith("R_t"))
        arrays[q] = arrays[q].astype(np.float32)
    save_file(arrays, files[0])
    with pytest.raises(IngotError) as err:
        open_model(tmp_path / "q.ingot")
    # the indices by rows_of; a stored array unlike the callable's graph by the package loader already
    assert "\n" not in str(err.value)
    assert ("residual rows" if "index" in corrupt else "declares constant") in str(err.value)


def test_serve_rows_decoder_adds_the_base_models_residual_rows():
    """`ingot serve`'s rows decoders compute adapters inline (serve.adapters.RowAdapters): a package's
    residual rows reach every row, as the batch-1 decoder's called adapter adds them."""
    from quant_helpers import tiny_tensors

    from ingot import dtypes as dt
    from ingot.ir import TensorType
    from ingot.models import llama
    from ingot.serve.adapters import RowAdapters

    cfg = tiny_config()
    tensors = tiny_tensors(cfg)
    rng = np.random.default_rng(4)
    base = AdapterSet(rows={"token_embd.weight": (np.array([5, 9, 100], np.int32), rng.standard_normal((3, 64)).astype(np.float32))})
    lora = AdapterSet({"blk.0.attn_q.weight": [(rng.standard_normal((2, 64)).astype(np.float32), np.zeros((64, 2), np.float32))]})
    rows = 2
    sites = RowAdapters(cfg, [base, base.merged(lora)]).for_rows(rows)
    m = llama.build(cfg, tensors, rows=rows, pool=3, adapter_sites=sites)
    exe = m.graph.compile(feeds={m.tokens: TensorType((rows,), dt.int32)}, targets=[m.logits])
    feeds = {"tokens": np.array([5, 9], np.int32), "positions": np.zeros(rows, np.int32), "slots": np.array([0, 1], np.int32)}
    got = exe.run(dict(feeds, adapter_rows=np.array([0, 1], np.int32)), state=exe.new_state())[0]
    for r, token in enumerate([5, 9]):
        want = logits(cfg, tensors, [token], base)[0]
        np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(IngotError, match="differ in residual rows"):
        RowAdapters(cfg, [base, lora])._residual_rows(["token_embd.weight"])


def test_quantize_cli_compensate_form_rows(tmp_path, capsys):
    import json

    from ingot.cli import main
    from ingot.llm.package import read_llm

    save_tiny(tmp_path / "tiny.ingot")
    out = tmp_path / "q.ingot"
    text = tmp_path / "cal.txt"
    text.write_text((FIXTURES / "calibration_text.txt").read_text()[:600])   # the tiny vocabulary: many tokens a word
    assert main(["quantize", str(tmp_path / "tiny.ingot"), "-o", str(out), "--format", "uint4:16:k", "--compensate", "4",
                 "--compensate-only", "token_embd.weight", "--compensate-form", "rows", "--calibration", str(text),
                 "--context", "64", "--tensor-format", "token_embd.weight=uint4:16:k"]) == 0
    report = capsys.readouterr()
    assert "of which adapters" in report.out and "residual rows" in report.err
    assert json.loads((out / "llm.json").read_text())["extra"]["quantized"]["compensate_form"] == "rows"
    model = read_llm(out)
    assert set(model.adapters.rows) == {"token_embd.weight"} and not model.adapters.factors


@pytest.fixture(scope="module", params=["rows", "low_rank"])
def compensated_package(quantized, tmp_path_factory, request):
    """A package quantized with compensation on every weight, its tied head's by `form`."""
    from ingot.llm.package import save_llm
    from ingot.quant.pipeline import quantize_model

    model, stats = quantized
    result = quantize_model(model, "uint4:16:k", stats=stats, compensate=4, compensate_form=request.param)
    assert ("token_embd.weight" in result.adapters.rows) == (request.param == "rows")
    assert "token_embd.weight" in result.adapters.names and len(result.adapters.factors) > 1
    path = tmp_path_factory.mktemp("compensated") / "q.ingot"
    save_llm(path, model.config, result.tensors, model.metadata, result.adapters)
    return path, result.adapters


def test_loaded_package_runs_its_decoder_as_generate_does(compensated_package):
    """`ingot.load(package).run` binds the tied head's embedding lookup (which the package does not
    store) from the head's adapter: the stored decoder's logits are `ingot generate`'s."""
    import ingot
    from ingot.adapters import LOOKUP
    from ingot.llm.generate import LLM

    path, adapters = compensated_package
    assert not (path / "callables" / f"{LOOKUP}.ingot").exists()   # stored once, at the head's site
    exe = ingot.load(path)
    llm = LLM(str(path))
    state = exe.new_state()
    idx = adapters.rows["token_embd.weight"][0] if "token_embd.weight" in adapters.rows else np.arange(3)
    tokens = [int(idx[0]), 40, int(idx[-1]), 61, int(idx[1])]   # corrected rows read by the lookup
    for pos, token in enumerate(tokens):
        got = exe.run({"tokens": np.array([token], np.int32), "pos": np.int32(pos), "last": np.int32(0)}, state=state)[0][0]
        np.testing.assert_allclose(got, llm.step(token), rtol=1e-5, atol=1e-5)
    # the lookup's delta is the head adapter's rows
    lookup = exe.callables[LOOKUP].run([np.array([tokens[0]], np.int32)])[0]
    np.testing.assert_allclose(lookup[0], adapters.delta("token_embd.weight", 296)[tokens[0]], atol=0.02)
    assert np.abs(lookup).max() > 0


@pytest.mark.parametrize("compensated_package", ["rows"], indirect=True)
@pytest.mark.parametrize("corrupt", ["index out of range", "no map"])
def test_loaded_package_whose_head_rows_do_not_fit_is_refused(compensated_package, tmp_path, corrupt):
    import shutil

    from safetensors.numpy import load_file, save_file

    import ingot

    path, _ = compensated_package
    copy = tmp_path / "q.ingot"
    shutil.copytree(path, copy)
    (weights,) = (copy / "callables" / "token_embd.weight.ingot").glob("*.safetensors")
    arrays = load_file(weights)
    key = next(k for k in arrays if k.endswith("R_map"))
    if corrupt == "no map":
        del arrays[key]
    else:
        arrays[key][np.flatnonzero(arrays[key])[0]] = arrays[key].max() + 5
    save_file(arrays, weights)
    with pytest.raises(IngotError) as err:
        ingot.load(copy)
    message = str(err.value)
    assert "\n" not in message and "token_embd.weight.ingot" in message
    assert ("residual rows" if "index" in corrupt else "R_map") in message


@pytest.mark.parametrize("compensated_package", ["rows"], indirect=True)
def test_rebinding_a_loaded_head_rebuilds_its_lookup(compensated_package):
    """After `ingot.load`, binding another adapter to the tied head rebuilds the embedding lookup from
    it (both uses read the same matrix); binding an executable that holds no adapter leaves the lookup
    unbound, so a run says so instead of using the old one."""
    import ingot
    from ingot.adapters import LOOKUP, AdapterSet

    path, adapters = compensated_package
    exe = ingot.load(path)
    head = exe.callables["token_embd.weight"]
    length, width = head.feed_types[head.feed_order[0]].shape
    vocab = head.output_types[0].shape[1]
    idx, r = adapters.rows["token_embd.weight"]
    doubled = AdapterSet(rows={"token_embd.weight": (idx, r * 2)})
    exe.bind("token_embd.weight", doubled.executable(["token_embd.weight"], [vocab], length, "cpu", width))
    token = np.array([int(idx[0])], np.int32)
    got = exe.callables[LOOKUP].run([token])[0][0]
    np.testing.assert_allclose(got, doubled.delta("token_embd.weight", vocab)[idx[0]], atol=0.04)
    np.testing.assert_allclose(got, 2 * adapters.delta("token_embd.weight", vocab)[idx[0]], atol=0.04)

    g = ingot.Graph()
    x = g.placeholder((length, width), name="x")
    plain = g.compile(targets=[g.matmul(x, g.constant(np.zeros((width, vocab), np.float32)))])
    exe.bind("token_embd.weight", plain)
    assert LOOKUP not in exe.callables
    with pytest.raises(ingot.IngotError, match="no executable is bound"):
        exe.run({"tokens": token, "pos": np.int32(0), "last": np.int32(0)}, state=exe.new_state())
