"""Token choice on the device for `ingot serve`'s GPU steps: greedy rows and sampled rows (temperature,
top-p) of a decode step chosen where the logits are, so only the token ids come back to the host. The
batched form of llm.sampling.DeviceSampler's temperature and top-p path (the same kept set: the most
likely tokens whose probabilities before each sum to less than top_p), a few launches for all rows.

A sampled row draws by the exponential race: the token maximising p_i / E_i with E_i ~ Exp(1) is a
draw from p (the Gumbel-max trick). Each E_i comes from a counter hash (SplitMix64) of the row's key
and the token id i, the key made from the request's seed and the row's position: a row's choice
depends on nothing else in the batch and repeats for the same seed. The draws are not the host
Sampler's (NumPy's generator): a seed repeats the server's own answers, not `ingot generate`'s.

    >>> import torch
    >>> logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    >>> choose(logits, torch.tensor([0.0, 0.7]), torch.tensor([1.0, 0.1]), torch.tensor([row_key(1, 0), row_key(2, 0)])).tolist()
    [1, 0]
"""
from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix(z: int) -> int:
    """SplitMix64's finaliser on Python ints (the host's half of the key)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    """The key of a row drawing the token after `position` for a request seeded `seed` (int64)."""
    return _signed(_mix(_mix(seed) ^ (position * GOLDEN)))


def _shift_right(z, bits: int):
    """Logical right shift of int64 tensors (torch shifts arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(keys, vocab: int):
    """[rows, vocab] float64 uniforms in (0, 1]: SplitMix64 of each row's key plus the token id times the
    golden ratio, the top 53 bits. keys: int64 [rows] on the device."""
    import torch

    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + ids[None, :] * _signed(GOLDEN)        # int64 arithmetic wraps modulo 2**64
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11) + 1).to(torch.float64) * 2.0 ** -53


def choose(logits, temperature, top_p, keys):
    """Each row's token: the arg-max where temperature is 0 (the first maximum), else a draw from the
    softmax of logits / temperature kept to its top-p (the most likely tokens whose probabilities before
    each sum to less than top_p: at least one). logits [rows, vocab] float (torch); temperature, top_p
    [rows] float32 and keys [rows] int64 (`row_key`), on the logits' device. Returns int64 [rows], queued
    on the device with no host sync (a batch of greedy rows alone needs only x.argmax: the caller's case)."""
    import torch

    x = logits.float()
    greedy = temperature <= 0     # (no test of it on the host: that would wait for the step that made x)
    best = x.argmax(dim=-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax((x - x.amax(dim=-1, keepdim=True)) * (1.0 / t)[:, None], dim=-1).double()
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)   # ties: the lowest id first
    keep_sorted = (ordered.cumsum(dim=-1) - ordered) < top_p.double()[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    race = torch.where(keep, probs / -torch.log(uniforms(keys, x.shape[-1])), -1.0)
    return torch.where(greedy, best, race.argmax(dim=-1))
