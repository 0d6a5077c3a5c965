"""Decode anchors timed in the same run as Ingot: HF transformers eager and a gpt-fast-style torch.compile
decoder (bf16 and int4), all with random weights of a given Llama shape (nothing is ever downloaded).

    from cuda_anchors import anchor_decode
    r = anchor_decode(SHAPES["llama8b"], batch=16, kind="compile_int4", steps=128, prompt=32, context=2048)
    r["tok_s"], r["per_seq_tok_s"], r["ms_per_step"], r["compile_s"]

Kinds:
  hf_eager_bf16  LlamaForCausalLM(LlamaConfig(...)) random init, bf16, attn_implementation="eager",
                 a DynamicCache; forward calls in a loop with past_key_values, argmax on the device.
  compile_bf16   the decoder below (static KV cache [B, nkv, context, hd], RoPE, RMSNorm, SwiGLU, GQA
                 through F.scaled_dot_product_attention with a position mask), bf16 weights, the decode
                 step compiled with torch.compile(mode="reduce-overhead", fullgraph=True).
  compile_int4   the same with int4 group-32 weights through torch's tinygemm kernels
                 (aten._convert_weight_to_int4pack + aten._weight_int4pack_mm, as gpt-fast's int4 path;
                 their *_for_cpu variants on the CPU), bf16 activations; the embedding stays bf16.

Timing: a `prompt`-token prefill, then greedy decode steps, each step's token fed back on the device; one
untimed warm-up loop (it compiles), then the median of `repeats` timed loops of `steps` decode steps
(prefill not timed), torch.cuda.synchronize around each. tok_s counts all sequences: batch*steps/time.

    python benchmarks/cuda_anchors.py [--models llama8b] [--batch 1,16] [--kinds ...] [--steps 128]
    python benchmarks/cuda_anchors.py --device cpu --tiny --no-compile     # local smoke test
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("hf_eager_bf16", "compile_bf16", "compile_int4")
TINY = dict(n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512, tied_embeddings=True,
            rope_base=10000.0)
GROUP_SIZE = 32               # int4 weights: one scale and zero per 32 inputs
INNER_K_TILES = (8, 4, 2)     # tinygemm's packings, gpt-fast's 8 first; K must be a multiple of 16 * tiles


@dataclass
class Shape:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def of(cls, shape: dict) -> Shape:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in shape.items() if k in names})


# == the gpt-fast-style decoder ========================================================================

class Int4Linear(nn.Module):
    """y = x @ dequant(w).T with w int4 in groups of GROUP_SIZE along K (tinygemm: w = (q - 8) * scale + zero).
    A K no packing divides (SmolLM2's 576 takes 4 tiles) is padded to a multiple of 1024, as gpt-fast pads."""

    def __init__(self, out_features: int, in_features: int, device: torch.device, generator: torch.Generator):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        tiles = next((t for t in INNER_K_TILES if in_features % (16 * t) == 0 and in_features % GROUP_SIZE == 0), None)
        padded = in_features if tiles else -(-in_features // 1024) * 1024
        self.padded_features, tiles = padded, tiles or INNER_K_TILES[0]
        q = torch.randint(0, 16, (out_features, padded), dtype=torch.int32, device=device, generator=generator)
        if device.type == "cuda":
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # two int4 per byte, [N, K / 2]
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack(packed, tiles))
        else:
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles))
        del q
        groups = padded // GROUP_SIZE
        scales = torch.rand((groups, out_features), device=device, generator=generator) * 0.004 + 0.001
        zeros = (torch.rand((groups, out_features), device=device, generator=generator) - 0.5) * 0.004
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=2).to(torch.bfloat16).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.padded_features != self.in_features:
            rows = F.pad(rows, (0, self.padded_features - self.in_features))
        if x.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(rows, self.weight, GROUP_SIZE, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP_SIZE, self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.out_features)


def linear(out_features: int, in_features: int, int4: bool, device, generator) -> nn.Module:
    if int4:
        return Int4Linear(out_features, in_features, device, generator)
    layer = nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_(0, 0.02, generator=generator)
    return layer.requires_grad_(False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd] (pairs interleaved, as gpt-fast); freqs: [T, hd / 2, 2] (cos, sin)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, s: Shape, batch: int, context: int, int4: bool, device, generator):
        super().__init__()
        self.s = s
        nh, nkv, hd = s.n_heads, s.n_kv_heads, s.head_dim
        self.wqkv = linear((nh + 2 * nkv) * hd, s.dim, int4, device, generator)
        self.wo = linear(s.dim, nh * hd, int4, device, generator)
        self.w13 = linear(2 * s.ffn_dim, s.dim, int4, device, generator)  # gate and up in one matmul
        self.w2 = linear(s.dim, s.ffn_dim, int4, device, generator)
        self.attention_norm = RMSNorm(s.dim, s.norm_eps, device)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps, device)
        cache = (batch, nkv, context, hd)
        self.register_buffer("k_cache", torch.zeros(cache, dtype=torch.bfloat16, device=device))
        self.register_buffer("v_cache", torch.zeros(cache, dtype=torch.bfloat16, device=device))

    def attention(self, x: torch.Tensor, freqs: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        nh, nkv, hd = self.s.n_heads, self.s.n_kv_heads, self.s.head_dim
        q, k, v = self.wqkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = apply_rope(q.view(b, t, nh, hd), freqs).transpose(1, 2)   # q: [B, nh, T, hd]
        k = apply_rope(k.view(b, t, nkv, hd), freqs).transpose(1, 2)  # k: [B, nkv, T, hd]
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        self.k_cache[:, :, input_pos] = k                               # static cache: [B, nkv, context, hd]
        self.v_cache[:, :, input_pos] = v
        # GQA without copying the cache: the g query heads of one KV head become g * T query rows
        g = nh // nkv
        q = q.reshape(b, nkv, g * t, hd)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask.repeat(g, 1))
        y = y.reshape(b, nh, t, hd).transpose(1, 2).reshape(b, t, nh * hd)  # (SDPA's output may be strided)
        return self.wo(y)

    def forward(self, x, freqs, input_pos, mask):
        h = x + self.attention(self.attention_norm(x), freqs, input_pos, mask)
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class Decoder(nn.Module):
    """Llama with a static KV cache for `batch` sequences of up to `context` tokens (gpt-fast's model.py)."""

    def __init__(self, s: Shape, batch: int, context: int, int4: bool, device, seed: int = 0):
        super().__init__()
        generator = torch.Generator(device=device).manual_seed(seed)
        self.s, self.context = s, context
        self.embedding = nn.Parameter(torch.randn((s.vocab_size, s.dim), device=device, generator=generator,
                                                  dtype=torch.bfloat16) * 0.02, requires_grad=False)
        self.layers = nn.ModuleList(Block(s, batch, context, int4, device, generator) for _ in range(s.n_layers))
        self.norm = RMSNorm(s.dim, s.norm_eps, device)
        if int4 or not s.tied_embeddings:
            self.output = linear(s.vocab_size, s.dim, int4, device, generator)
        else:
            self.output = None  # tied: the embedding is the head
        hd = s.head_dim
        inv_freq = 1.0 / (s.rope_base ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(context, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("freqs", torch.stack([angles.cos(), angles.sin()], -1))  # [context, hd / 2, 2]
        self.register_buffer("positions", torch.arange(context, device=device))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] at positions input_pos [T] -> logits of the last position, [B, vocab]."""
        mask = self.positions[None, :] <= input_pos[:, None]  # mask: [T, context], True where attended
        freqs = self.freqs[input_pos]
        x = F.embedding(tokens, self.embedding)
        for layer in self.layers:
            x = layer(x, freqs, input_pos, mask)
        x = self.norm(x[:, -1])
        return self.output(x) if self.output is not None else F.linear(x, self.embedding)


def decode_one(model: Decoder, token: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One greedy step: [B, 1] ids at input_pos [1] -> the next [B, 1] ids (argmax on the device)."""
    return model(token, input_pos).argmax(-1, keepdim=True)


# == the loops =========================================================================================

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compiled_loop(s: Shape, batch: int, kind: str, steps: int, prompt: int, context: int, device, compile: bool):
    """(a function that prefills, decodes `steps` tokens and returns the decode seconds, the build seconds)."""
    t0 = time.perf_counter()
    model = Decoder(s, batch, context, int4=kind == "compile_int4", device=device).eval()
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True) if compile else decode_one
    prompt_ids = torch.randint(0, s.vocab_size, (batch, prompt), device=device,
                               generator=torch.Generator(device=device).manual_seed(1))
    build_s = time.perf_counter() - t0

    def run() -> float:
        with torch.no_grad():  # (gpt-fast's generate runs under no_grad too)
            token = model(prompt_ids, torch.arange(prompt, device=device)).argmax(-1, keepdim=True)  # prefill
            input_pos = torch.tensor([prompt], device=device)
            _sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                token = step(model, token, input_pos).clone()  # the graph's output is overwritten next replay
                input_pos += 1
            _sync(device)
            return time.perf_counter() - t
    return run, build_s


def _hf_loop(s: Shape, batch: int, steps: int, prompt: int, context: int, device):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    config = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.dim, intermediate_size=s.ffn_dim,
                         num_hidden_layers=s.n_layers, num_attention_heads=s.n_heads, num_key_value_heads=s.n_kv_heads,
                         max_position_embeddings=context, rms_norm_eps=s.norm_eps, rope_theta=s.rope_base,
                         tie_word_embeddings=s.tied_embeddings, attn_implementation="eager")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # random init straight in bf16 on the device (8B: 16 GB, no fp32 copy)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    prompt_ids = torch.randint(0, s.vocab_size, (batch, prompt), device=device,
                               generator=torch.Generator(device=device).manual_seed(1))
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    # transformers 5.2x renamed forward's past_key_values to cache; the cache object is updated in place
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    build_s = time.perf_counter() - t0

    def run() -> float:
        with torch.inference_mode():
            cache = DynamicCache()
            out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            t = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=token, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            return time.perf_counter() - t
    return run, build_s


def anchor_decode(shape: dict, batch: int, kind: str, steps: int, prompt: int, context: int, device: str = "cuda",
                  compile: bool = True, repeats: int = 3) -> dict:
    """Greedy decode speed of one anchor on random weights of `shape` (a cuda_llm.SHAPES entry).

    Returns dict(kind, batch, tok_s = batch * steps / seconds, per_seq_tok_s, ms_per_step, compile_s (the
    build and the untimed warm-up loop, which compiles), error=None, notes (what torch.compile skipped or
    recompiled, else None)); errors raise (the caller records them).

        >>> anchor_decode(TINY, 2, "compile_bf16", 8, 4, 32, device="cpu", compile=False)["tok_s"] > 0
        True
    """
    if kind not in KINDS:
        raise ValueError(f"anchor kind {kind!r}: one of {', '.join(KINDS)}")
    if prompt + steps > context:
        raise ValueError(f"prompt {prompt} + steps {steps} do not fit a context of {context}")
    s, dev = Shape.of(shape), torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda: torch sees no GPU")
    # each call compiles a new model through the same decode_one code object: start from an empty dynamo
    # cache, or the recompile limit (8) silently turns later anchors eager
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    try:
        if kind == "hf_eager_bf16":
            run, build_s = _hf_loop(s, batch, steps, prompt, context, dev)
        else:
            run, build_s = _compiled_loop(s, batch, kind, steps, prompt, context, dev, compile)
        t0 = time.perf_counter()
        run()  # warm-up: compiles and records the CUDA graphs
        compile_s = build_s + time.perf_counter() - t0
        seconds = statistics.median(run() for _ in range(repeats))
        notes = _compile_notes(counters) if kind != "hf_eager_bf16" and compile else None
    finally:
        run = None  # the model, its caches and the CUDA graphs' memory go back before the next anchor
        gc.collect()
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return dict(kind=kind, batch=batch, tok_s=batch * steps / seconds, per_seq_tok_s=steps / seconds,
                ms_per_step=1e3 * seconds / steps, compile_s=compile_s, error=None, notes=notes)


def _compile_notes(counters) -> str | None:
    """What torch.compile did not do as asked (graph breaks, recompiles, CUDA graphs skipped), or None."""
    found = []
    for group, key in (("inductor", "cudagraph_skips"), ("stats", "unique_graphs"), ("recompiles", None)):
        if key is None:
            total = sum(counters.get(group, {}).values())
            if total:
                found.append(f"{group} {total}")
        elif group == "stats":
            if counters.get(group, {}).get(key, 1) > 1:
                found.append(f"{counters[group][key]} graphs (graph breaks or recompiles)")
        elif counters.get(group, {}).get(key):
            found.append(f"{key} {counters[group][key]}")
    return "; ".join(found) or None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama8b", help="comma-separated cuda_llm.SHAPES names")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (smoke test)")
    ap.add_argument("--no-compile", action="store_true", help="run the compile_* decoders eagerly")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.tiny:
        shapes = {"tiny": TINY}
    else:
        from cuda_llm import SHAPES
        shapes = {name: SHAPES[name] for name in args.models.split(",")}
    results = []
    print(f"{'model':10} {'kind':14} {'batch':>5} {'tok/s':>10} {'per seq':>9} {'ms/step':>8} {'compile s':>9}", flush=True)
    for name, shape in shapes.items():
        for batch in (int(b) for b in args.batch.split(",")):
            for kind in args.kinds.split(","):
                try:
                    r = anchor_decode(shape, batch, kind, args.steps, args.prompt, args.context, device=args.device,
                                      compile=not args.no_compile)
                except Exception as e:  # one failing anchor must not hide the others
                    r = dict(kind=kind, batch=batch, tok_s=math.nan, per_seq_tok_s=math.nan, ms_per_step=math.nan,
                             compile_s=math.nan, error=f"{type(e).__name__}: {e}"[:500])
                results.append(dict(r, model=name))
                line = f"{name:10} {kind:14} {batch:5d} {r['tok_s']:10.1f} {r['per_seq_tok_s']:9.1f} " \
                       f"{r['ms_per_step']:8.2f} {r['compile_s']:9.1f}"
                print(line + (f"  error: {r['error']}" if r["error"] else "") +
                      (f"  ({r['notes']})" if r.get("notes") else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
