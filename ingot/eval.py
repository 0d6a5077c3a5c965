"""Quality of a model against a reference, in llama.cpp's conventions (`llama-perplexity
--kl-divergence`): the text is tokenized once (BOS first), cut into chunks of `context` tokens each
run from an empty cache, and the second half of each chunk is scored (the first half is context).
For every scored position: KL(P_reference || P_model) of the next-token distributions, whether
the two top-1 tokens agree, and the log-probability each model gives the actual next token.

    mean KLD = mean over positions of sum_v p_ref(v) (log p_ref(v) - log p_model(v))
    top-1 agreement = share of positions whose argmax tokens are equal
    perplexity = exp(-mean log p(actual next token))

    >>> from ingot.eval import KLDResult
    >>> KLDResult(0.01, 0.95, 10.0, 10.5, 128).row()
    'mean KLD 0.010000  top-1 95.00%  PPL ref 10.000  PPL model 10.500  (128 tokens)'
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import IngotError

DEFAULT_CONTEXT = 256


@dataclass
class KLDResult:
    mean_kld: float
    top1: float
    ppl_reference: float
    ppl_model: float
    tokens: int
    kld_p99: float = float("nan")

    def row(self) -> str:
        return (f"mean KLD {self.mean_kld:.6f}  top-1 {100 * self.top1:.2f}%  PPL ref {self.ppl_reference:.3f}  "
                f"PPL model {self.ppl_model:.3f}  ({self.tokens} tokens)")


@dataclass
class Scored:
    """A model's log-probabilities at the scored positions and the actual next tokens."""
    logprobs: np.ndarray     # float32 [positions, vocab]
    targets: np.ndarray      # int [positions]


def read_text(path) -> str:
    """A text file's contents; IngotError when missing or empty."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise IngotError(f"text file {p} does not exist.")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise IngotError(f"text file {p} is not UTF-8 text.") from None
    if not text.strip():
        raise IngotError(f"text file {p} is empty.")
    return text


def chunks(ids: list[int], context: int) -> list[list[int]]:
    """Whole chunks of `context` tokens (llama.cpp drops the tail); at least one, possibly short."""
    if len(ids) < 4:
        raise IngotError(f"the text has {len(ids)} tokens; at least 4 are needed to score a next token.")
    n = len(ids) // context
    return [ids[i * context:(i + 1) * context] for i in range(n)] or [ids]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x.astype(np.float32)


def score(model, token_chunks: list[list[int]], device: str = "cpu", progress=None, options=None) -> Scored:
    """Run a StoredModel (ingot.llm.package) over each chunk from an empty cache and keep the
    log-probabilities of the second half of each chunk's positions; progress() is called after each chunk;
    options: the `ingot.CompileOptions` (None: INGOT_OPTIONS's, else the defaults)."""
    from .adapters import binder
    from . import models

    cfg = model.config
    longest = max(len(c) for c in token_chunks)
    if longest > cfg.context_length:
        raise IngotError(f"eval: chunks of {longest} tokens exceed the model's context of {cfg.context_length}.")
    graph = models.build(cfg, model.tensors, model.path, adapter_sites=model.adapters.names, all_logits=True)
    if model.adapters:
        graph.callables_for = binder(cfg, model.adapters)
    logprobs, targets = [], []
    for chunk in token_chunks:
        exe = graph.compile(len(chunk), device, options)
        state = exe.new_state()  # an empty cache per chunk
        (logits,) = exe.run({"tokens": np.asarray(chunk, np.int32), "pos": np.int32(0)}, state=state)
        logits = exe.backend.to_host(logits)
        first = len(chunk) // 2
        logprobs.append(log_softmax(logits[first:len(chunk) - 1]))
        targets.append(np.asarray(chunk[first + 1:], np.int64))
        if progress is not None:
            progress()
    return Scored(np.concatenate(logprobs), np.concatenate(targets))


def compare(reference: Scored, model: Scored) -> KLDResult:
    """KL divergence, top-1 agreement and perplexities of two scorings of the same chunks."""
    if reference.logprobs.shape != model.logprobs.shape:
        raise IngotError(f"eval: the models score {reference.logprobs.shape} and {model.logprobs.shape} "
                         "(different vocabularies?).")
    lp_ref = reference.logprobs.astype(np.float64)
    lp = model.logprobs.astype(np.float64)
    kld = (np.exp(lp_ref) * (lp_ref - lp)).sum(axis=1)
    top1 = float(np.mean(lp_ref.argmax(axis=1) == lp.argmax(axis=1)))
    rows = np.arange(len(reference.targets))
    ppl_ref = float(np.exp(-lp_ref[rows, reference.targets].mean()))
    ppl = float(np.exp(-lp[rows, reference.targets].mean()))
    return KLDResult(float(kld.mean()), top1, ppl_ref, ppl, len(rows), float(np.percentile(kld, 99)))


def kld(reference_path, model_path, text: str, context: int = DEFAULT_CONTEXT, device: str = "cpu",
        options=None) -> KLDResult:
    """`ingot eval kld`: the model at model_path against the one at reference_path (GGUF files or
    Ingot LLM packages) over text, both compiled with options (an `ingot.CompileOptions`)."""
    from .llm.package import open_model
    from .llm.tokenizer import tokenize
    from .progress import progress_bar

    reference = open_model(reference_path)
    model = open_model(model_path)  # both opened (checked) before the long work
    if model.config.vocab_size != reference.config.vocab_size:
        raise IngotError(f"eval: {model_path} has a vocabulary of {model.config.vocab_size} tokens, "
                         f"the reference {reference.config.vocab_size}.")
    token_chunks = chunks(tokenize(reference, text), context)
    with progress_bar("eval kld", total=2 * len(token_chunks)) as advance:
        scored_ref = score(reference, token_chunks, device, lambda: advance("reference"), options)
        del reference
        return compare(scored_ref, score(model, token_chunks, device, lambda: advance("model"), options))
