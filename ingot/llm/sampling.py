"""Choosing the next token from logits, and stopping on stop strings.

    sampler = Sampler(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                      repeat_last_n=64, seed=0)
    next_id = sampler(logits, previous_ids)          # logits: float32 [vocab]

The steps run in transformers' order: repetition penalty (over the last repeat_last_n ids),
temperature, top-k, top-p, min-p, then a draw from the remaining distribution with a NumPy Generator
(deterministic for a given seed). Temperature 0 is greedy: the arg-max after the repetition penalty,
ties going to the lowest id.

What `ingot generate` uses when a flag is not given: `sampling_defaults(metadata)`, the model file's
own `general.sampling.*` keys where it carries them, otherwise llama.cpp's defaults (DEFAULTS).

    stop = StopChecker(["\\nUser:", "###"])
    for piece in pieces:                             # text pieces as they stream out of the decoder
        print(stop.feed(piece), end="")              # text safe to show; a stop string split across
        if stop.stopped:                             # pieces is held back until it is decided
            break
    else:
        print(stop.flush(), end="")

On a GPU the same choice runs on torch tensors where the logits lie, and only the chosen id comes back:

    sampler = DeviceSampler(temperature=0.7, top_k=40, seed=0)
    next_id = sampler(logits, history)               # logits: torch [vocab] on the device; history: int64
                                                     # ids on the device; one .item() is the only sync
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import IngotError

# top-p: the nucleus is first looked for among the tokens whose scaled logit is within this much of
# the best one (a comparison, no partial sort), then among this many most likely tokens (a partial
# sort), and the whole vocabulary is sorted only when they do not reach p. Each candidate set is a
# prefix of the sorted order, so the nucleus found in it is the full sort's.
_NUCLEUS_MARGINS = (8.0, 16.0)
_NUCLEUS_CANDIDATES = (256, 4096)
# draws over long vectors find the block first, then the token inside it
_BLOCK = 1024

# llama.cpp's defaults (common/common.h), used where a model file carries none of its own
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
            "repeat_last_n": 64}
# the GGUF keys a model file may carry them under (gguf-py's Keys.General.SAMPLING_*)
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
             "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat",
             "repeat_last_n": "general.sampling.penalty_last_n"}


def sampling_defaults(metadata) -> dict:
    """The sampling settings a model asks for: each of DEFAULTS taken from the model's metadata
    (GGUF `general.sampling.*`) where present, else llama.cpp's default. A value of the wrong type or
    out of range raises IngotError naming the key.

        >>> sampling_defaults({"general.sampling.temp": 0.6})["temperature"]
        0.6
    """
    out = dict(DEFAULTS)
    for name, key in GGUF_KEYS.items():
        value = metadata.get(key) if metadata else None
        if value is None:
            continue
        integer = isinstance(DEFAULTS[name], int)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
                (integer and not float(value).is_integer()):
            raise IngotError(f"model metadata {key} is {value!r}, not {'an integer' if integer else 'a number'}.")
        out[name] = int(value) if integer else float(value)
    if out["repeat_last_n"] == -1:  # llama.cpp: -1 is the whole context
        out["repeat_last_n"] = 0
    try:
        Sampler(**out)
    except IngotError as e:
        raise IngotError(f"model metadata general.sampling.*: {e}") from None
    return out


class Sampler:
    """Picks one token id from a vector of logits.

    temperature: 0 is greedy; otherwise logits are divided by it before the softmax.
    top_k: keep the k most likely tokens (0 keeps all; ties at the k-th logit are kept too).
    top_p: keep the smallest set of most likely tokens whose probabilities sum to at least p (at least one).
    min_p: keep the tokens at least min_p times as likely as the most likely one (0 keeps all).
    repetition_penalty: for every id in previous_ids, a positive logit is divided by it and a negative one
        multiplied (llama.cpp's and transformers' rule); 1.0 is off.
    repeat_last_n: the penalty looks at the last this many of previous_ids (0: all of them).
    seed: seed of the NumPy Generator used for the draws; None draws from fresh entropy.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int | None = None, min_p: float = 0.0,
                 repeat_last_n: int = 0):
        def number(name, value):
            try:
                f = float(value)
            except (TypeError, ValueError):
                raise IngotError(f"Sampler {name} must be a number, not {value!r}.") from None
            if not np.isfinite(f):
                raise IngotError(f"Sampler {name} must be finite, not {value!r}.")
            return f

        temperature = number("temperature", temperature)
        top_p = number("top_p", top_p)
        min_p = number("min_p", min_p)
        repetition_penalty = number("repetition_penalty", repetition_penalty)
        if temperature < 0:
            raise IngotError(f"Sampler temperature must be >= 0, not {temperature!r}.")
        if not 0.0 < top_p <= 1.0:
            raise IngotError(f"Sampler top_p must be in (0, 1], not {top_p!r}.")
        if not 0.0 <= min_p <= 1.0:
            raise IngotError(f"Sampler min_p must be in [0, 1], not {min_p!r}.")
        if isinstance(repeat_last_n, bool) or not isinstance(repeat_last_n, (int, np.integer)) or repeat_last_n < 0:
            raise IngotError(f"Sampler repeat_last_n must be an integer >= 0, not {repeat_last_n!r}.")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise IngotError(f"Sampler top_k must be an integer >= 0, not {top_k!r}.")
        if repetition_penalty <= 0:
            raise IngotError(f"Sampler repetition_penalty must be > 0, not {repetition_penalty!r}.")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise IngotError(f"Sampler seed must be a non-negative integer or None, not {seed!r}.")
        self.temperature = temperature
        self.top_k = int(top_k)
        self.top_p = top_p
        self.min_p = min_p
        self.repetition_penalty = repetition_penalty
        self.repeat_last_n = int(repeat_last_n)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def reset(self, seed: int | None = None) -> None:
        """Restart the random stream (from `seed`, or from the seed given at construction)."""
        self.rng = np.random.default_rng(self.seed if seed is None else seed)

    def __call__(self, logits: np.ndarray, previous_ids: Iterable[int] | None = None) -> int:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise IngotError(f"Sampler takes logits of shape [vocab], not {tuple(logits.shape)}.")
        logits = self.apply_penalty(logits, previous_ids)
        if np.isnan(logits).any():
            raise IngotError(f"Sampler got NaN logits (at ids {np.flatnonzero(np.isnan(logits))[:5].tolist()}).")
        if self.greedy:
            return int(np.argmax(logits))  # the first maximum: ties go to the lowest id
        ids, probs = self._distribution(logits)
        if probs.size == 1:
            return int(ids[0])
        return self._pick(ids, probs)

    def _draw(self, probs: np.ndarray) -> int:
        """An index drawn with the given (non-negative) weights: one uniform number, inverse CDF."""
        u = self.rng.random()
        n = probs.size
        if n <= 2 * _BLOCK:
            cdf = np.cumsum(probs, dtype=np.float64)
            i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
            return min(i, int(np.flatnonzero(probs)[-1]))
        # a long vector: the block holding the draw from block sums, then the place within that block
        starts = np.arange(0, n, _BLOCK)
        block_cdf = np.cumsum(np.add.reduceat(probs, starts), dtype=np.float64)
        target = u * block_cdf[-1]
        b = min(int(np.searchsorted(block_cdf, target, side="right")), starts.size - 1)
        block = probs[starts[b]:starts[b] + _BLOCK]
        cdf = np.cumsum(block, dtype=np.float64)
        i = int(np.searchsorted(cdf, target - (block_cdf[b - 1] if b else 0.0), side="right"))
        return int(starts[b]) + min(i, int(np.flatnonzero(block)[-1]))

    def apply_penalty(self, logits: np.ndarray, previous_ids: Iterable[int] | None) -> np.ndarray:
        """logits with the repetition penalty applied over previous_ids (a new float32 array when it applies)."""
        if self.repetition_penalty == 1.0 or previous_ids is None:
            return logits
        prev = np.asarray(list(previous_ids) if not isinstance(previous_ids, np.ndarray) else previous_ids,
                          dtype=np.int64).ravel()
        prev = np.unique(prev[-self.repeat_last_n:] if self.repeat_last_n else prev)
        if prev.size == 0:
            return logits
        if prev[0] < 0 or prev[-1] >= logits.size:
            bad = prev[0] if prev[0] < 0 else prev[-1]
            raise IngotError(f"Sampler previous_ids holds id {int(bad)}, outside the {logits.size} logits.")
        out = np.array(logits, dtype=np.float32, copy=True)
        sel = out[prev]
        out[prev] = np.where(sel > 0, sel / self.repetition_penalty, sel * self.repetition_penalty)
        return out

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) the draw chooses from after temperature, top-k and top-p (no penalty).

        With top-p the ids come most likely first (ties: lowest id first); otherwise in id order.
        """
        ids, probs = self._distribution(np.asarray(logits))
        return (np.arange(probs.size) if ids is None else ids), probs

    def _distribution(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        ids, probs = self._nucleus(logits)
        if self.min_p > 0.0:
            ids, probs = self._min_p(ids, probs)
        return ids, probs

    def _min_p(self, ids: np.ndarray | None, probs: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        keep = probs >= self.min_p * probs.max()
        if not keep.all():
            ids = np.flatnonzero(keep) if ids is None else ids[keep]
            probs = probs[keep]
            probs = probs / probs.sum(dtype=np.float64)
        return ids, probs

    def _pick(self, ids: np.ndarray | None, probs: np.ndarray) -> int:
        i = self._draw(probs)
        return i if ids is None else int(ids[i])

    def _nucleus(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        x = np.asarray(logits, dtype=np.float32)
        n = x.size
        m = np.max(x)
        if not np.isfinite(m):
            raise IngotError(f"Sampler got logits whose maximum is {float(m)}, so no token can be drawn.")
        with np.errstate(over="ignore"):
            # shifted so the best token is at 0; a tiny temperature sends the others to -inf, never to NaN
            scaled = (x - m) * self.scale
        if 0 < self.top_k < n:
            kth = np.partition(scaled, n - self.top_k)[n - self.top_k]
            ids = np.flatnonzero(scaled >= kth)  # ties at the k-th value stay, as in transformers
            probs = np.exp(scaled[ids])
            probs /= probs.sum(dtype=np.float64)
            if self.top_p >= 1.0:
                return ids, probs
            return self._top_p(scaled[ids], ids, probs)
        return self._softmax_top_p(scaled, np.exp(scaled))

    @property
    def scale(self) -> np.float32:
        """What the logits, less their maximum, are multiplied by: 1 / temperature (capped)."""
        return np.float32(min(1.0 / self.temperature, 1e38))

    def _softmax_top_p(self, scaled: np.ndarray, p_all: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, probs) of the whole vocabulary's scaled logits, p_all = exp(scaled) (normalised in place)."""
        p_all /= p_all.sum(dtype=np.float64)
        if self.top_p >= 1.0:
            return None, p_all  # None: every id, in order
        n = scaled.size
        ids = None
        # the nucleus is usually small: look for it among the most likely tokens before sorting them all
        for margin in _NUCLEUS_MARGINS:
            cand = np.flatnonzero(scaled > np.float32(-margin))
            if cand.size > _NUCLEUS_CANDIDATES[-1]:
                break
            if p_all[cand].sum(dtype=np.float64) >= self.top_p:
                ids = cand
                break
        for c in _NUCLEUS_CANDIDATES if ids is None else ():
            if c >= n:
                break
            threshold = -np.partition(-scaled, c)[c]
            cand = np.flatnonzero(scaled > threshold)
            if p_all[cand].sum(dtype=np.float64) >= self.top_p:
                ids = cand
                break
        if ids is None:
            ids = np.arange(n)
        return self._top_p(scaled[ids], ids, p_all[ids])

    def _top_p(self, scaled: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The nucleus of candidates ids (ascending) with these scaled logits and probabilities."""
        # ids ascend here, so a stable sort puts ties lowest id first
        order = np.argsort(-scaled, kind="stable")
        ids, probs = ids[order], probs[order]
        keep = int(np.searchsorted(np.cumsum(probs, dtype=np.float64), self.top_p, side="left")) + 1
        ids, probs = ids[:keep], probs[:keep]
        return ids, probs / probs.sum(dtype=np.float64)


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray) -> np.ndarray:
    """Each sampler's choice from its row of logits [rows, vocab]: what `[s(row) for s, row in
    zip(samplers, logits)]` returns, draw for draw, with the work that grows with the vocabulary done
    for all rows at once (the greedy rows' arg-max, the sampled rows' maximum, temperature and exp).
    No repetition penalty is applied (a sampler with one is called on its row). A row with a NaN or
    no finite maximum raises IngotError; `ingot serve` then samples row by row to find it.

        >>> sample_rows([Sampler(), Sampler()], np.array([[0, 2, 1], [3, 0, 3]], np.float32)).tolist()
        [1, 0]
    """
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[0] != len(samplers) or x.shape[1] == 0:
        raise IngotError(f"sample_rows takes logits [{len(samplers)}, vocab], not {list(x.shape)}.")
    if np.isnan(x).any():
        raise IngotError("sample_rows got NaN logits.")
    out = np.zeros(len(samplers), np.int64)
    greedy = [i for i, s in enumerate(samplers) if s.greedy and s.repetition_penalty == 1.0]
    if greedy:
        rows = x if len(greedy) == len(samplers) else x[greedy]
        out[greedy] = np.argmax(rows, axis=1)  # the first maximum: ties go to the lowest id
    plain = [i for i, s in enumerate(samplers) if not s.greedy and s.repetition_penalty == 1.0 and s.top_k == 0]
    for i, s in enumerate(samplers):
        if i not in greedy and i not in plain:
            out[i] = s(x[i])
    if plain:
        rows = np.asarray(x if len(plain) == len(samplers) else x[plain], np.float32)
        m = rows.max(axis=1, keepdims=True)
        if not np.isfinite(m).all():
            raise IngotError("sample_rows got logits whose maximum is not finite.")
        with np.errstate(over="ignore"):
            scaled = (rows - m) * np.array([[samplers[i].scale] for i in plain], np.float32)
        exp = np.exp(scaled)
        for j, i in enumerate(plain):
            s = samplers[i]
            ids, probs = s._softmax_top_p(scaled[j], exp[j])
            if s.min_p > 0.0:
                ids, probs = s._min_p(ids, probs)
            out[i] = (ids[0] if ids is not None else 0) if probs.size == 1 else s._pick(ids, probs)
    return out


class DeviceSampler(Sampler):
    """Sampler over torch tensors: penalty, temperature, top-k, top-p and the draw all run on the logits'
    device, and `__call__` makes one `.item()` (the only host sync) to return the id.

    Same steps, order, ties and errors as Sampler (an error found on the device comes back with the id as
    a negative code, and is then re-raised with Sampler's own message). The draw comes from a
    torch.Generator on the logits' device, seeded with `seed`, so it is reproducible for a seed but is not
    the NumPy Sampler's draw.

        >>> import torch                                                     # doctest: +SKIP
        >>> DeviceSampler()(torch.tensor([0.0, 2.0, 2.0]))                   # doctest: +SKIP
        1
    """
    # negative ids that report an error found on the device
    _BAD_ID, _NAN, _NO_MAXIMUM = -3, -1, -2

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, seed: int | None = None, min_p: float = 0.0,
                 repeat_last_n: int = 0):
        super().__init__(temperature, top_k, top_p, repetition_penalty, seed, min_p, repeat_last_n)
        self._draw_seed = seed
        self._generator = None

    def reset(self, seed: int | None = None) -> None:
        super().reset(seed)
        self._draw_seed = self.seed if seed is None else seed
        self._generator = None

    def generator(self, device):
        """The torch.Generator of the draws on `device` (made, from the seed, on first use)."""
        import torch
        device = torch.device(device)
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self._draw_seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(int(self._draw_seed))
        return self._generator

    def __call__(self, logits, previous_ids=None) -> int:
        token = int(self.choose(logits, previous_ids).item())  # the one host sync
        if token < 0:
            self._raise_host_error(logits, previous_ids)
        return token

    def _raise_host_error(self, logits, previous_ids) -> None:
        """The device flagged an error: let the NumPy Sampler find it again and raise its message."""
        import torch
        host = logits.detach().float().cpu().numpy()
        if isinstance(previous_ids, torch.Tensor):
            previous_ids = previous_ids.detach().cpu().numpy()
        Sampler.__call__(Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                 repetition_penalty=self.repetition_penalty, seed=0, min_p=self.min_p,
                                 repeat_last_n=self.repeat_last_n), host, previous_ids)
        raise IngotError("DeviceSampler: the device flagged logits the NumPy Sampler accepts.")

    def choose(self, logits, previous_ids=None):
        """The chosen id as a 0-d int64 tensor on the logits' device (no host sync); a negative value
        reports an error (a previous id out of range, NaN logits, no finite maximum)."""
        import torch
        if not isinstance(logits, torch.Tensor):
            logits = torch.as_tensor(np.asarray(logits))
        if logits.ndim != 1 or logits.numel() == 0:
            raise IngotError(f"Sampler takes logits of shape [vocab], not {tuple(logits.shape)}.")
        x, bad_ids = self.penalize(logits, previous_ids)
        nan = torch.isnan(x).any()
        if self.greedy:
            token = torch.argmax(x)  # the first maximum: ties go to the lowest id (as np.argmax)
            no_maximum = None
        else:
            probs, no_maximum = self.probabilities(x)
            token = self._draw_tensor(probs)
        if no_maximum is not None:
            token = torch.where(no_maximum, self._NO_MAXIMUM, token)
        token = torch.where(nan, self._NAN, token)
        if bad_ids is not None:
            token = torch.where(bad_ids, self._BAD_ID, token)
        return token

    def penalize(self, logits, previous_ids):
        """(float32 logits with the repetition penalty over previous_ids, a 0-d bool tensor saying an id
        was out of range, or None). The caller's tensor is left alone."""
        import torch
        x = logits.float()
        if self.repetition_penalty == 1.0 or previous_ids is None:
            return x, None
        if isinstance(previous_ids, torch.Tensor):
            prev = previous_ids.reshape(-1).to(device=x.device, dtype=torch.int64)
        else:
            prev = np.asarray(list(previous_ids) if not isinstance(previous_ids, np.ndarray) else previous_ids, np.int64)
            prev = torch.as_tensor(prev.reshape(-1), device=x.device)
        if self.repeat_last_n:
            prev = prev[-self.repeat_last_n:]
        if prev.numel() == 0:
            return x, None
        n = x.numel()
        bad_ids = ((prev < 0) | (prev >= n)).any()
        index = prev.clamp(0, n - 1)  # an out-of-range id must not reach gather (a device assert); it is flagged
        picked = x.gather(0, index)
        # a tensor divisor: torch divides by a Python scalar as a multiply by its reciprocal on the GPU
        penalty = torch.full((), self.repetition_penalty, dtype=torch.float32, device=x.device)
        penalized = torch.where(picked > 0, picked / penalty, picked * penalty)
        return x.clone().scatter_(0, index, penalized), bad_ids  # repeats write the same value

    def probabilities(self, x):
        """(float64 probabilities over the whole vocabulary, zero outside what temperature, top-k,
        top-p and min-p keep, and a 0-d bool tensor saying the logits have no finite maximum); Sampler's
        `_distribution` as dense device vectors, with no data-dependent shape (so no sync)."""
        probs, no_maximum = self._nucleus_probabilities(x)
        if self.min_p > 0.0:
            probs = probs.where(probs >= self.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return probs, no_maximum

    def _nucleus_probabilities(self, x):
        import torch
        n = x.numel()
        m = x.max()
        no_maximum = ~torch.isfinite(m)
        # shifted so the best token is at 0; the float32 factor is the NumPy Sampler's exactly
        scaled = (x - m) * float(np.float32(min(1.0 / self.temperature, 1e38)))
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        if 0 < self.top_k < n:
            kth = torch.topk(scaled, self.top_k, sorted=False).values.min()
            kept = scaled >= kth  # ties at the k-th value stay, as in transformers
            weights = torch.where(kept, torch.exp(scaled), zero)
            sort_key = torch.where(kept, scaled, float("-inf"))
        else:
            weights = torch.exp(scaled)
            sort_key = scaled
        # float32 probabilities rounded from a float64 division, as NumPy's in-place `probs /= sum`
        probs = (weights.double() / weights.sum(dtype=torch.float64)).float()
        if self.top_p >= 1.0:
            return probs.double(), no_maximum
        _, order = torch.sort(sort_key, descending=True, stable=True)  # ties: lowest id first
        cdf = torch.cumsum(probs[order].double(), 0)
        keep = torch.searchsorted(cdf, cdf.new_full((1,), self.top_p), side="left") + 1
        in_nucleus = torch.arange(n, device=x.device) < keep
        nucleus = torch.zeros(n, dtype=torch.bool, device=x.device).scatter_(0, order, in_nucleus)
        kept_probs = torch.where(nucleus, probs.double(), 0.0)
        return kept_probs / kept_probs.sum(), no_maximum

    def distribution_tensor(self, logits):
        """Dense float64 probabilities the draw chooses from (after temperature, top-k, top-p; no
        penalty), on the logits' device; Sampler.distribution's (ids, probs) scattered over the vocabulary."""
        return self.probabilities(logits.float())[0]

    def _draw_tensor(self, probs):
        """An id drawn with the given weights: one uniform number from the device's generator, inverse CDF."""
        import torch
        u = torch.rand((1,), generator=self.generator(probs.device), device=probs.device, dtype=torch.float64)
        cdf = torch.cumsum(probs, 0)
        i = torch.searchsorted(cdf, u * cdf[-1], right=True)[0]
        ids = torch.arange(probs.numel(), device=probs.device)
        last_nonzero = torch.where(probs > 0, ids, 0).max()
        return torch.minimum(i, last_nonzero)


class StopChecker:
    """Finds stop strings in streamed text, even when one is split across pieces.

    feed(piece) returns the text that may be shown now. Text that could be the start of a stop string
    is held back until the next pieces decide it. When a stop string completes, `stopped` becomes True,
    `matched` names it, and feed returns only the text before it. flush() returns the held-back text once
    the stream ends without a stop.
    """

    def __init__(self, stop_strings: Sequence[str] | str | None):
        if stop_strings is None:
            stop_strings = []
        elif isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        stops = []
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise IngotError(f"stop strings must be non-empty str, not {s!r}.")
            stops.append(s)
        self.stop_strings = tuple(stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        best = None
        for s in self.stop_strings:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        if best is not None:
            self.stopped, self.matched, self._held = True, best[1], ""
            return text[:best[0]]
        # hold back the longest tail of text that is a proper prefix of some stop string
        hold = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
