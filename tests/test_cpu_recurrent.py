"""The CPU backend's compiled LSTM (backends/cpu/recurrent.py) against the op's NumPy reference
(ops/recurrent.py) on awkward sizes: every direction, short sequences, initial states, peepholes,
clip, input_forget; other activations keep the reference."""
import numpy as np
import pytest

from ingot import dtypes as dt
from ingot.backends.cpu import LOWERINGS, _reference
from ingot.ir import Node, Op, TensorType
from ingot.ops import infer_type, reference

T, B, I, H = 9, 3, 5, 7


def lstm_node(direction: str, attrs=None, sizes=(T, B, I, H)):
    T, B, I, H = sizes
    d = 2 if direction == "bidirectional" else 1
    types = [TensorType((T, B, I)), TensorType((d, 4 * H, I)), TensorType((d, 4 * H, H)), TensorType((d, 8 * H)),
             TensorType((B,), dt.int64), TensorType((d, B, H)), TensorType((d, B, H)),
             TensorType((d, 3 * H))]
    srcs = tuple(Node(Op.PLACEHOLDER, t, (), {}, name=f"in{i}") for i, t in enumerate(types))
    a = {"direction": direction, "activations": ("Sigmoid", "Tanh", "Tanh") * d, "alphas": (None,) * 3 * d,
         "betas": (None,) * 3 * d, "clip": None, "input_forget": False} | (attrs or {})
    return Node(Op.LSTM, infer_type(Op.LSTM, types, a), srcs, a)


def inputs(direction: str, seed: int, lengths=(T, T, T), sizes=(T, B, I, H)):
    T, B, I, H = sizes
    rng = np.random.default_rng(seed)
    d = 2 if direction == "bidirectional" else 1
    f = lambda *s, k=1.0: (rng.standard_normal(s) * k).astype(np.float32)  # noqa: E731
    return [f(T, B, I), f(d, 4 * H, I, k=0.6), f(d, 4 * H, H, k=0.6), f(d, 8 * H, k=0.3),
            np.array(lengths, np.int64), f(d, B, H), f(d, B, H), f(d, 3 * H, k=0.3)]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("attrs", [{}, {"clip": 0.7}, {"input_forget": True}])
@pytest.mark.parametrize("lengths", [(T, T, T), (T, 2, 5), (0, 1, T)])
def test_compiled_lstm_equals_reference(direction, attrs, lengths):
    node = lstm_node(direction, attrs)
    step = LOWERINGS[Op.LSTM](node, None)
    xs = inputs(direction, hash((direction, lengths)) % 1000, lengths)
    want = reference(Op.LSTM, xs, node.attrs)
    got = step(*xs)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(1, 1, 128, 128), (6, 5, 33, 37), (3, 9, 1, 16), (4, 4, 70, 1)])
def test_compiled_lstm_panels(sizes):
    """Batches past the kernel's 4-row panels, several panels of gate columns (4H > 64) and a padded
    last one, k of one, a hidden size of one."""
    node = lstm_node("bidirectional", sizes=sizes)
    step = LOWERINGS[Op.LSTM](node, None)
    seq, batch = sizes[:2]
    xs = inputs("bidirectional", sum(sizes), tuple(seq - i % 3 for i in range(batch)), sizes)
    want = reference(Op.LSTM, xs, node.attrs)
    for _ in range(2):   # the second run reuses the packed weights and the scratch
        for g, w in zip(step(*xs), want):
            assert g.shape == w.shape and g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (4, 3, 64), (7, 129, 65), (13, 40, 200), (2, 17, 330), (20, 300, 70)])
def test_panel_accumulate(rows, k, n):
    """accumulate adds x W^T into a strided accumulator (rows in sixes then ones, k in chunks of 128, padded
    columns zero)."""
    from ingot.backends.cpu.recurrent import WIDTH, accumulate, pack
    rng = np.random.default_rng(rows * 1000 + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((rows, k + 2)).astype(np.float32)   # a row stride past k
    panels = -(-n // WIDTH)
    acc = rng.standard_normal((rows, panels * WIDTH + 8)).astype(np.float32)
    want = acc.copy()
    want[:, :n] += x[:, :k].astype(np.float64) @ w.T.astype(np.float64)
    accumulate(acc.reshape(-1), 0, acc.shape[1], pack(w), k, x.reshape(-1), 0, k + 2, rows, panels)
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-4)


def test_other_activations_run_the_reference():
    from ingot.backends.cpu import recurrent
    node = lstm_node("forward", {"activations": ("HardSigmoid", "Tanh", "Tanh")})
    assert recurrent.lstm_step(node, None) is None
    xs = inputs("forward", 3)
    for g, w in zip(LOWERINGS[Op.LSTM](node, None)(*xs), _reference(node, None)(*xs)):
        np.testing.assert_array_equal(g, w)
