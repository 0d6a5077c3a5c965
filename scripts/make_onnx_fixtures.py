"""Export the small ONNX models the tests convert: a BERT-like encoder, a CNN classifier and an STFT
front end, each with random weights (fixed seed), written to tests/fixtures/onnx/.

    python scripts/make_onnx_fixtures.py            # needs torch (CPU) and onnxscript

The tests compare Ingot against onnxruntime on these files, so they need no torch themselves;
tests/test_onnx_models.py also re-exports the encoder when torch is installed.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "onnx"


class SelfAttention(nn.Module):
    """BERT's self-attention as the Hugging Face eager code writes it: matmul, scale, mask, softmax, matmul."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.output = nn.Linear(hidden, hidden)

    def split(self, x):  # [B, T, H*D] -> [B, H, T, D]
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        context = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, H, T, D]
        b, _, t, _ = context.shape
        return self.output(context.transpose(1, 2).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.norm1, self.norm2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x, mask):
        x = self.norm1(x + self.attention(x, mask))
        return self.norm2(x + self.down(nn.functional.gelu(self.up(x))))


class Encoder(nn.Module):
    """A BERT-like encoder: token + position + type embeddings, LayerNorm, N layers, pooler."""

    def __init__(self, vocab: int = 512, hidden: int = 64, heads: int = 4, ffn: int = 256, layers: int = 2, max_len: int = 128):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.types = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device).unsqueeze(0)
        x = self.norm(self.tokens(input_ids) + self.positions(positions) + self.types(torch.zeros_like(input_ids)))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0  # [B, 1, 1, T]
        for layer in self.layers:
            x = layer(x, mask)
        return x, torch.tanh(self.pooler(x[:, 0]))


class Cnn(nn.Module):
    """A small image classifier: conv-BN-ReLU blocks, max and average pooling, a linear head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, stride=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(32, 32, 1), nn.Sigmoid())
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Spectrogram(nn.Module):
    """An audio front end: STFT with a Hann window, power, log."""

    def __init__(self, n_fft: int = 256, hop: int = 64):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, audio):  # [B, samples]
        spec = torch.stft(audio, self.n_fft, self.hop, window=self.window, center=False, return_complex=False)
        power = spec[..., 0] ** 2 + spec[..., 1] ** 2  # [B, bins, frames]
        return torch.log(power + 1e-6)


def eval_mode(model: nn.Module) -> nn.Module:
    """Random weights, also for the BatchNorm statistics, in inference mode."""
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def export(model: nn.Module, args: tuple, path: Path, input_names: list[str], output_names: list[str],
           dynamic_shapes=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(model, args, str(path), input_names=input_names, output_names=output_names,
                      opset_version=18, dynamo=True, external_data=False, optimize=True, dynamic_shapes=dynamic_shapes)
    return path


def encoder_inputs(batch: int = 1, length: int = 16):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[:, length - 3:] = 0
    return ids, mask


def export_encoder(path: Path, batch: int = 1, length: int = 16, dynamic: bool = False, **config) -> Path:
    """dynamic: batch and sequence length symbolic (the graph then computes shapes: Shape, Range, Expand)."""
    torch.manual_seed(0)
    dims = None
    if dynamic:
        batch_dim, seq_dim = torch.export.Dim("batch"), torch.export.Dim("seq", max=config.get("max_len", 128))
        dims = {"input_ids": {0: batch_dim, 1: seq_dim}, "attention_mask": {0: batch_dim, 1: seq_dim}}
    return export(Encoder(**config).eval(), encoder_inputs(batch, length), path,
                  ["input_ids", "attention_mask"], ["last_hidden_state", "pooled"], dims)


def main() -> int:
    torch.manual_seed(0)
    export_encoder(OUT / "encoder.onnx")
    export_encoder(OUT / "encoder_dynamic.onnx", batch=2, dynamic=True, vocab=64, hidden=32, heads=2, ffn=64, layers=1)
    torch.manual_seed(0)
    export(eval_mode(Cnn()), (torch.randn(1, 3, 32, 32),), OUT / "cnn.onnx", ["image"], ["logits"])
    export(Spectrogram().eval(), (torch.randn(1, 4000),), OUT / "stft.onnx", ["audio"], ["log_power"])
    for p in sorted(OUT.glob("*.onnx")):
        print(f"{p.relative_to(OUT.parent.parent.parent)}: {p.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
