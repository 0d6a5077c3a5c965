"""Sampler and StopChecker."""
import numpy as np
import pytest

from ingot import IngotError
from ingot.llm.sampling import Sampler, StopChecker


def _logits(n=50, seed=0):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32) * 2


def _draws(sampler, logits, n=2000, previous=None):
    return np.array([sampler(logits, previous) for _ in range(n)])


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_greedy_is_argmax_with_ties_to_lowest_id():
    s = Sampler()
    x = _logits()
    assert s(x, []) == int(np.argmax(x))
    tie = np.zeros(10, np.float32)
    tie[[3, 7]] = 5.0
    assert s(tie, []) == 3
    # greedy ignores top-k/top-p and the seed
    assert Sampler(top_k=3, top_p=0.5, seed=1)(x, []) == int(np.argmax(x))


def test_seeded_sampling_is_deterministic():
    x = _logits(1000)
    a = _draws(Sampler(temperature=0.9, top_p=0.95, seed=1234), x, 200)
    b = _draws(Sampler(temperature=0.9, top_p=0.95, seed=1234), x, 200)
    c = _draws(Sampler(temperature=0.9, top_p=0.95, seed=4321), x, 200)
    assert (a == b).all()
    assert (a != c).any()
    s = Sampler(temperature=0.9, seed=7)
    first = _draws(s, x, 50)
    s.reset()
    assert (first == _draws(s, x, 50)).all()


def test_temperature_matches_softmax():
    x = _logits(8, seed=3)
    for t in (0.5, 1.0, 2.0):
        ids, probs = Sampler(temperature=t).distribution(x)
        assert ids.tolist() == list(range(8))
        np.testing.assert_allclose(probs, _softmax(x.astype(np.float64) / t), rtol=1e-5)
    d = _draws(Sampler(temperature=2.0, seed=0), x, 5000)  # the draws follow it
    assert np.abs(np.bincount(d, minlength=x.size) / d.size - _softmax(x / 2.0)).max() < 0.03
    # a very small temperature is greedy in effect
    assert set(_draws(Sampler(temperature=1e-30, seed=0), x, 20).tolist()) == {int(np.argmax(x))}


def test_long_vector_draws_follow_the_distribution():
    x = np.full(5000, -np.inf, np.float32)  # long enough for the blocked draw
    x[[10, 1500, 1501, 4999]] = np.log([0.1, 0.2, 0.3, 0.4])
    d = _draws(Sampler(temperature=1.0, seed=0), x, 2000)
    assert set(d.tolist()) == {10, 1500, 1501, 4999}
    np.testing.assert_allclose(np.bincount(d, minlength=5000)[[10, 1500, 1501, 4999]] / d.size,
                               [0.1, 0.2, 0.3, 0.4], atol=0.03)


def test_top_k_restricts_support():
    x = _logits(100, seed=5)
    top5 = np.sort(np.argsort(-x)[:5])
    ids, probs = Sampler(temperature=1.5, top_k=5).distribution(x)
    assert ids.tolist() == top5.tolist()
    np.testing.assert_allclose(probs, _softmax(x[top5].astype(np.float64) / 1.5), rtol=1e-5)
    d = _draws(Sampler(temperature=1.5, top_k=5, seed=0), x, 1000)
    assert set(d.tolist()) == set(top5.tolist())  # all of them drawn, nothing else
    assert set(_draws(Sampler(temperature=1.0, top_k=1, seed=0), x, 50).tolist()) == {int(np.argmax(x))}
    tie = np.array([1.0, 3.0, 2.0, 2.0, 0.0], np.float32)  # ties at the k-th logit are kept
    assert Sampler(temperature=1.0, top_k=2).distribution(tie)[0].tolist() == [1, 2, 3]


def test_top_p_keeps_smallest_nucleus():
    x = np.log(np.array([0.5, 0.05, 0.25, 0.15, 0.05], np.float32))
    # cumulative in order 0, 2, 3, 1, 4: 0.5, 0.75, 0.9, 0.95, 1.0
    for p, support in ((0.4, [0]), (0.5, [0]), (0.7, [0, 2]), (0.75, [0, 2]), (0.85, [0, 2, 3]),
                       (0.99, [0, 2, 3, 1, 4]), (1.0, [0, 1, 2, 3, 4])):
        ids, probs = Sampler(temperature=1.0, top_p=p).distribution(x)
        assert ids.tolist() == support, p
        assert abs(probs.sum() - 1) < 1e-6
    d = _draws(Sampler(temperature=1.0, top_p=0.7, seed=1), x, 4000)
    assert set(d.tolist()) == {0, 2}
    assert abs(np.mean(d == 0) - 2 / 3) < 0.03  # renormalised inside the nucleus: 0.5 / 0.75


def test_top_p_large_vocabulary_matches_full_sort():
    x = _logits(50000, seed=9) * 3  # peaked: the nucleus is found among the first candidates
    s = Sampler(temperature=0.8, top_p=0.9, seed=0)
    ids, probs = s.distribution(x)
    order = np.argsort(-x.astype(np.float64) / 0.8, kind="stable")
    p = _softmax(x.astype(np.float64) / 0.8)[order]
    keep = int(np.searchsorted(np.cumsum(p), 0.9)) + 1
    assert ids.tolist() == order[:keep].tolist()
    np.testing.assert_allclose(probs, p[:keep] / p[:keep].sum(), rtol=1e-6)
    flat = np.zeros(50000, np.float32)  # flat: the nucleus needs the whole sort
    ids, _ = Sampler(temperature=1.0, top_p=0.5, seed=0).distribution(flat)
    assert ids.tolist() == list(range(ids.size))  # ties: lowest ids first
    assert abs(ids.size - 25000) <= 1  # 0.5 in float32 steps of 1/50000


def test_top_k_then_top_p():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    # top-k 3 leaves 0.4/0.9, 0.3/0.9, 0.2/0.9; top-p 0.7 then needs the first two (0.44, 0.78)
    ids, probs = Sampler(temperature=1.0, top_k=3, top_p=0.7).distribution(x)
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7], rtol=1e-6)


def test_repetition_penalty():
    x = np.array([2.0, 1.9, -1.0, -1.1, 0.0], np.float32)
    s = Sampler(repetition_penalty=2.0)
    out = s.apply_penalty(x, [0, 0, 2])
    np.testing.assert_allclose(out, [1.0, 1.9, -2.0, -1.1, 0.0])  # divide positive, multiply negative
    assert x[0] == 2.0  # the caller's logits are left alone
    assert s(x, []) == 0 and s(x, [0]) == 1  # greedy moves off the repeated token
    assert s(x, np.array([0, 1])) == 0  # 1.0 > 0.95
    assert Sampler(repetition_penalty=0.5)(x, [1]) == 1  # a penalty below 1 favours repeats
    assert Sampler(repetition_penalty=1.0).apply_penalty(x, [0]) is x
    # sampled: the repeated token's share falls
    free = _draws(Sampler(temperature=1.0, seed=0), x, 1500)
    penalised = _draws(Sampler(temperature=1.0, repetition_penalty=1.5, seed=0), x, 1500, previous=[0])
    assert np.mean(penalised == 0) < np.mean(free == 0) - 0.1
    with pytest.raises(IngotError, match="previous_ids holds id 5"):
        s(x, [5])


@pytest.mark.parametrize("kwargs, pattern", [
    ({"temperature": -0.1}, "temperature must be >= 0, not -0.1"),
    ({"temperature": float("nan")}, "temperature must be finite"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\], not 0.0"),
    ({"top_p": 1.5}, "top_p must be in \\(0, 1\\], not 1.5"),
    ({"top_k": -1}, "top_k must be an integer >= 0, not -1"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0, not 2.5"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, not 0.0"),
    ({"repetition_penalty": -1}, "repetition_penalty must be > 0, not -1.0"),
    ({"seed": -3}, "seed must be a non-negative integer or None, not -3"),
    ({"temperature": "hot"}, "temperature must be a number, not 'hot'"),
])
def test_invalid_parameters(kwargs, pattern):
    with pytest.raises(IngotError, match=pattern):
        Sampler(**kwargs)


def test_bad_logits():
    s = Sampler(temperature=1.0, seed=0)
    with pytest.raises(IngotError, match="shape"):
        s(np.zeros((2, 3), np.float32), [])
    with pytest.raises(IngotError, match="NaN"):
        s(np.array([0.0, np.nan], np.float32), [])
    with pytest.raises(IngotError, match="maximum is -inf"):
        s(np.full(4, -np.inf, np.float32), [])
    masked = np.array([-np.inf, 0.0, -np.inf, 1.0], np.float32)  # -inf masks tokens out
    assert set(_draws(s, masked, 300).tolist()) == {1, 3}


# ------------------------------------------------------------------------------------------------ stop strings


def _run(stops, pieces):
    c = StopChecker(stops)
    out = []
    for p in pieces:
        out.append(c.feed(p))
        if c.stopped:
            break
    else:
        out.append(c.flush())
    return "".join(out), c


def test_stop_string_within_one_piece():
    text, c = _run(["###"], ["Hello ", "world ### more", "never"])
    assert text == "Hello world " and c.stopped and c.matched == "###"


def test_stop_string_split_across_pieces():
    c = StopChecker(["\nUser:"])
    assert c.feed("Sure.") == "Sure."
    assert c.feed("\n") == ""        # could be the start of the stop string: held back
    assert c.feed("Us") == ""
    assert c.feed("er") == ""
    assert c.feed(": hi") == "" and c.stopped and c.matched == "\nUser:"
    assert c.feed("more") == "" and c.flush() == ""


def test_held_text_released_when_the_stop_does_not_complete():
    c = StopChecker(["\nUser:"])
    assert c.feed("a\nUs") == "a"
    assert c.feed("ually") == "\nUsually"
    assert not c.stopped
    assert c.feed("\nU") == ""
    assert c.flush() == "\nU"  # the stream ended: show what was held


def test_stop_strings_one_character_per_piece():
    text = "The answer is 42.<|end|>ignored"
    for stops, expected in ((["<|end|>"], "The answer is 42."), (["42", "<|end|>"], "The answer is "),
                            (["answer is 43"], text), (["s 4", "is"], "The answer "),
                            (["The"], "")):
        out, c = _run(stops, list(text))
        assert out == expected, stops
        assert c.stopped == (expected != text)


def test_stop_earliest_match_wins():
    out, c = _run(["world", "lo w"], ["Hello world"])
    assert out == "Hel" and c.matched == "lo w"
    out, c = _run(["ab", "abc"], ["xabc"])
    assert out == "x" and c.matched == "abc"  # same start: the longer one


def test_no_stop_strings_and_bad_ones():
    out, c = _run(None, ["a", "b"])
    assert out == "ab" and not c.stopped
    assert StopChecker("x").stop_strings == ("x",)
    with pytest.raises(IngotError, match="non-empty"):
        StopChecker(["ok", ""])


# == DeviceSampler on torch tensors (the same choice, made where the logits lie) ========================

def _dense(sampler, x):
    ids, probs = sampler.distribution(x)
    out = np.zeros(x.size)
    out[ids] = probs
    return out


SAMPLING_CASES = [dict(temperature=t, top_k=k, top_p=p) for t in (0.3, 1.0, 1.7) for k in (0, 1, 7, 40, 10**6)
                  for p in (1.0, 0.95, 0.6, 0.05)]


@pytest.mark.parametrize("n", [1, 2, 33, 1823, 50000])
def test_device_greedy_equals_numpy_with_ties(n):
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    rng = np.random.default_rng(n)
    for trial in range(20):
        x = rng.normal(size=n).astype(np.float32) * 3
        if trial % 2:
            x = np.round(x)  # many ties: the lowest id wins in both
        x[rng.integers(n, size=min(n, 3))] = x.max()  # a tie at the maximum
        assert DeviceSampler()(torch.from_numpy(x)) == Sampler()(x)
        assert DeviceSampler(top_k=3, top_p=0.5, seed=1)(torch.from_numpy(x)) == Sampler()(x)  # greedy ignores them


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=[f"t{c['temperature']}-k{c['top_k']}-p{c['top_p']}" for c in SAMPLING_CASES])
def test_device_distribution_equals_numpy(case):
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    rng = np.random.default_rng(abs(hash(tuple(case.values()))) % (1 << 31))
    for n in (5, 131, 4999, 32000):
        for peaked in (False, True):
            x = (rng.normal(size=n) * (6 if peaked else 1.5)).astype(np.float32)
            if n > 100:
                x[rng.integers(n, size=n // 10)] = -np.inf  # masked tokens
            want = _dense(Sampler(**case), x)
            got = DeviceSampler(**case).distribution_tensor(torch.from_numpy(x)).numpy()
            assert got.dtype == np.float64 and got.shape == (n,)
            assert np.flatnonzero(got).tolist() == np.flatnonzero(want).tolist()  # the same support set
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_device_distribution_ties_at_the_kth_and_nucleus_edges():
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    tie = np.array([1.0, 3.0, 2.0, 2.0, 0.0], np.float32)  # ties at the k-th logit are kept
    got = DeviceSampler(temperature=1.0, top_k=2).distribution_tensor(torch.from_numpy(tie)).numpy()
    assert np.flatnonzero(got).tolist() == [1, 2, 3]
    x = np.log(np.array([0.5, 0.05, 0.25, 0.15, 0.05], np.float32))
    for p in (0.4, 0.5, 0.7, 0.75, 0.85, 0.99, 1.0):
        got = DeviceSampler(temperature=1.0, top_p=p).distribution_tensor(torch.from_numpy(x)).numpy()
        want = _dense(Sampler(temperature=1.0, top_p=p), x)
        assert np.flatnonzero(got).tolist() == np.flatnonzero(want).tolist(), p
        np.testing.assert_allclose(got, want, atol=1e-6)
    flat = np.zeros(50000, np.float32)  # flat: ties, lowest ids first, in both
    got = DeviceSampler(temperature=1.0, top_p=0.5).distribution_tensor(torch.from_numpy(flat)).numpy()
    assert np.flatnonzero(got).tolist() == np.flatnonzero(_dense(Sampler(temperature=1.0, top_p=0.5), flat)).tolist()


def test_device_draws_are_seeded_and_follow_the_distribution():
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    x = torch.from_numpy(_logits(1000))
    draws = lambda s, n=200: np.array([s(x) for _ in range(n)])  # noqa: E731
    a = draws(DeviceSampler(temperature=0.9, top_p=0.95, seed=1234))
    b = draws(DeviceSampler(temperature=0.9, top_p=0.95, seed=1234))
    c = draws(DeviceSampler(temperature=0.9, top_p=0.95, seed=4321))
    assert (a == b).all() and (a != c).any()
    s = DeviceSampler(temperature=0.9, seed=7)
    first = draws(s, 50)
    s.reset()
    assert (first == draws(s, 50)).all()
    small = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    s = DeviceSampler(temperature=1.0, seed=0)
    d = np.array([s(torch.from_numpy(small)) for _ in range(4000)])
    np.testing.assert_allclose(np.bincount(d, minlength=4) / d.size, [0.1, 0.2, 0.3, 0.4], atol=0.03)
    s = DeviceSampler(temperature=1.5, top_k=5, seed=0)  # draws stay inside the support
    y = _logits(100, seed=5)
    assert set(s(torch.from_numpy(y)) for _ in range(1000)) == set(np.argsort(-y)[:5].tolist())


def test_device_repetition_penalty_equals_numpy():
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    rng = np.random.default_rng(11)
    for penalty in (0.5, 1.1, 1.3, 2.0, 7.7):
        x = (rng.normal(size=3001) * 4).astype(np.float32)
        prev = rng.integers(3001, size=400)  # repeats included
        want = Sampler(repetition_penalty=penalty).apply_penalty(x, prev)
        logits = torch.from_numpy(x.copy())
        got, bad = DeviceSampler(repetition_penalty=penalty).penalize(logits, torch.from_numpy(prev))
        assert not bool(bad)
        np.testing.assert_array_equal(got.numpy(), want)  # exact: one IEEE division or multiplication each
        assert torch.equal(logits, torch.from_numpy(x))  # the caller's logits are left alone
        for t in (0.0, 1.0):  # the greedy choice and the support move the same way
            case = dict(temperature=t, top_k=20, repetition_penalty=penalty)
            if t == 0.0:
                assert DeviceSampler(**case)(logits, prev.tolist()) == Sampler(**case)(x, prev)
            else:
                dense = DeviceSampler(**case).distribution_tensor(got).numpy()
                np.testing.assert_allclose(dense, _dense(Sampler(**case), want), atol=1e-6)


def test_device_sampler_raises_the_numpy_errors():
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    s = DeviceSampler(temperature=1.0, seed=0)
    with pytest.raises(IngotError, match="shape"):
        s(torch.zeros((2, 3)))
    with pytest.raises(IngotError, match="NaN"):
        s(torch.tensor([0.0, float("nan")]))
    with pytest.raises(IngotError, match="NaN"):
        DeviceSampler()(torch.tensor([0.0, float("nan")]))
    with pytest.raises(IngotError, match="maximum is -inf"):
        s(torch.full((4,), float("-inf")))
    with pytest.raises(IngotError, match="previous_ids holds id 5"):
        DeviceSampler(repetition_penalty=2.0)(torch.zeros(5), torch.tensor([1, 5]))
    assert DeviceSampler()(torch.full((4,), float("-inf"))) == Sampler()(np.full(4, -np.inf, np.float32)) == 0
    masked = torch.tensor([float("-inf"), 0.0, float("-inf"), 1.0])
    assert {s(masked) for _ in range(300)} == {1, 3}
    assert DeviceSampler()(torch.tensor([0.0, 2.0, 2.0], dtype=torch.bfloat16)) == 1  # half logits: float32 inside


def test_min_p_keeps_tokens_near_the_best():
    x = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float32))
    ids, probs = Sampler(temperature=1.0, min_p=0.15).distribution(x)  # keeps p >= 0.075
    assert ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9], rtol=1e-5)
    ids, _ = Sampler(temperature=1.0, top_p=0.85, min_p=0.15).distribution(x)  # after top-p, in its order
    assert ids.tolist() == [0, 1, 2]
    ids, _ = Sampler(temperature=1.0, top_k=4, min_p=0.5).distribution(x)
    assert ids.tolist() == [0, 1]
    assert set(_draws(Sampler(temperature=1.0, min_p=0.5, seed=0), x, 300).tolist()) == {0, 1}
    assert Sampler(temperature=1.0, min_p=0.0).distribution(x)[0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IngotError, match="min_p must be in"):
        Sampler(min_p=1.5)


def test_repetition_penalty_over_the_last_n_ids():
    x = np.array([2.0, 1.9, 1.8, 0.0], np.float32)
    s = Sampler(repetition_penalty=2.0, repeat_last_n=2)
    np.testing.assert_allclose(s.apply_penalty(x, [0, 1, 3]), [2.0, 0.95, 1.8, 0.0])  # id 0 is out of the window
    assert s(x, [1, 2, 0]) == 1  # 0 and 2 penalised, 1 (older than the window) not
    assert Sampler(repetition_penalty=2.0)(x, [1, 2, 0]) == 0  # no window: all three penalised, 0 still best
    with pytest.raises(IngotError, match="repeat_last_n"):
        Sampler(repeat_last_n=-1)


def test_sampling_defaults_from_the_file_else_llama_cpp():
    from ingot.llm.sampling import DEFAULTS, sampling_defaults

    assert sampling_defaults({}) == DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                                 "repetition_penalty": 1.1, "repeat_last_n": 64}
    got = sampling_defaults({"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                             "general.sampling.penalty_last_n": -1})
    assert got["temperature"] == 0.6 and got["top_k"] == 20 and got["repeat_last_n"] == 0 and got["top_p"] == 0.95
    with pytest.raises(IngotError, match="general.sampling.top_k is 'many'"):
        sampling_defaults({"general.sampling.top_k": "many"})
    with pytest.raises(IngotError, match="general.sampling.*top_p"):
        sampling_defaults({"general.sampling.top_p": 7.0})


@pytest.mark.parametrize("min_p", [0.02, 0.1, 0.5])
def test_device_min_p_and_penalty_window_equal_numpy(min_p):
    torch = pytest.importorskip("torch")
    from ingot.llm.sampling import DeviceSampler
    rng = np.random.default_rng(int(min_p * 100))
    for case in (dict(temperature=0.8), dict(temperature=1.0, top_k=40, top_p=0.95), dict(temperature=1.3, top_p=0.6)):
        x = (rng.normal(size=4999) * 2).astype(np.float32)
        want = _dense(Sampler(min_p=min_p, **case), x)
        got = DeviceSampler(min_p=min_p, **case).distribution_tensor(torch.from_numpy(x)).numpy()
        assert np.flatnonzero(got).tolist() == np.flatnonzero(want).tolist(), case
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    prev = rng.integers(4999, size=300)
    want = Sampler(repetition_penalty=1.3, repeat_last_n=64).apply_penalty(x, prev)
    got, _ = DeviceSampler(repetition_penalty=1.3, repeat_last_n=64).penalize(torch.from_numpy(x), torch.from_numpy(prev))
    np.testing.assert_array_equal(got.numpy(), want)
    assert not np.array_equal(want, Sampler(repetition_penalty=1.3).apply_penalty(x, prev))  # the window matters


@pytest.mark.parametrize("spread", [0.3, 1.0, 3.0, 12.0])
def test_top_p_nucleus_is_the_full_sorts_whatever_the_spread(spread):
    """The nucleus, looked for among the tokens near the best one, then the most likely ones, then all,
    is the full sort's for flat and peaked logits alike."""
    x = _logits(50000, seed=3) * spread
    for top_p in (0.3, 0.9, 0.999):
        ids, probs = Sampler(temperature=0.7, top_p=top_p).distribution(x)
        scaled = (x - x.max()) * np.float32(1 / 0.7)      # the sampler's float32 order (ties among them)
        order = np.argsort(-scaled, kind="stable")
        p = _softmax(scaled.astype(np.float64))[order]
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        assert abs(ids.size - keep) <= 1, (spread, top_p)   # float32 probabilities at the edge
        n = min(ids.size, keep)
        assert ids[:n].tolist() == order[:n].tolist(), (spread, top_p)


def test_sample_rows_draws_what_each_sampler_draws():
    """sample_rows over a batch (greedy, top-p, plain, min-p, top-k, tied and one-hot rows) picks what
    each row's Sampler picks alone, draw for draw over several steps."""
    from ingot.llm.sampling import sample_rows

    def make():
        return [Sampler(), Sampler(temperature=0.8, top_p=0.9, seed=1), Sampler(temperature=1.3, seed=2),
                Sampler(temperature=0.5, min_p=0.1, seed=3), Sampler(temperature=1.0, top_k=5, seed=4),
                Sampler(temperature=2.0, top_p=0.5, seed=5), Sampler(temperature=1e-30, top_p=0.9, seed=6)]
    batched, alone = make(), make()
    rng = np.random.default_rng(0)
    for step in range(6):
        x = (rng.standard_normal((len(batched), 3000)) * rng.choice([0.2, 2.0, 8.0])).astype(np.float32)
        x[0, 10:13] = x[0].max() + 1          # a tie: the lowest id wins
        got = sample_rows(batched, x)
        assert got.tolist() == [s(row) for s, row in zip(alone, x)], step
    with pytest.raises(IngotError, match="NaN"):
        sample_rows(batched, np.full((len(batched), 4), np.nan, np.float32))
    with pytest.raises(IngotError, match="vocab"):
        sample_rows(batched, x[:2])


def test_serve_device_choice_draws_the_nucleus_distribution():
    """serve/sampling.py's batched choice: greedy rows take the first maximum; a sampled row's frequencies
    over many keys match the softmax at its temperature kept to its top-p (Sampler's own distribution);
    a row's draw depends only on its key, not on the rows beside it."""
    torch = pytest.importorskip("torch")
    from ingot.serve.sampling import choose, row_key

    rng = np.random.default_rng(3)
    x = (rng.normal(size=(3, 23)) * 2).astype(np.float32)
    x[0, [4, 9]] = x[0].max() + 1                                 # a tie at the maximum: the lowest id
    n = 20000
    logits = torch.from_numpy(np.repeat(x, n, axis=0))
    temperature = torch.tensor([0.0, 0.7, 1.6], dtype=torch.float32).repeat_interleave(n)
    top_p = torch.tensor([1.0, 0.8, 0.97], dtype=torch.float32).repeat_interleave(n)
    keys = torch.tensor([row_key(9, p) for _ in range(3) for p in range(n)], dtype=torch.int64)
    got = choose(logits, temperature, top_p, keys).numpy().reshape(3, n)
    assert (got[0] == 4).all()
    for r, (t, p) in enumerate([(0.7, 0.8), (1.6, 0.97)], 1):
        want = _dense(Sampler(temperature=t, top_p=p), x[r])
        freq = np.bincount(got[r], minlength=x.shape[1]) / n
        assert not freq[want == 0].any()                            # nothing outside the nucleus
        np.testing.assert_allclose(freq, want, atol=0.015)
    alone = choose(logits[n + 5:n + 6], temperature[n + 5:n + 6], top_p[n + 5:n + 6], keys[n + 5:n + 6])
    assert int(alone) == got[1, 5]
