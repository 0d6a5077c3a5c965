"""Where the host time of `exe.run` goes on a decode step (SmolLM2 shape, CUDA): cProfile over N
replayed steps through exe.run + logits to the host, top functions by own time. Run from a tree
(PYTHONPATH=that tree) to compare two commits."""
import cProfile
import pstats

import time

import numpy as np
import torch

from benchmarks.cuda_llm import SHAPES, gguf_like_random_weights  # noqa: E402
from ingot.models import llama  # noqa: E402

cfg = llama.LlamaConfig(**SHAPES["smollm2"], context_length=2048)
model = llama.build(cfg, gguf_like_random_weights(cfg))
dec = model.compile(1, "cuda")
state = dec.new_state()
host = dec.backend.to_host


def steps(n):
    for i in range(n):
        host(dec.run({"tokens": np.array([1], np.int32), "pos": np.int32(i), "last": np.int32(0)}, state=state)[0])


steps(5)
torch.cuda.synchronize()
t = time.perf_counter()
steps(300)
print(f"{300 / (time.perf_counter() - t):.0f} steps/s through exe.run + to_host")
prof = cProfile.Profile()
prof.enable()
steps(300)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
