"""An LSTM voice-activity model in the manner of Silero VAD, for tests and benchmarks: a scripted
module whose front end branches on the sample rate (an ONNX If), with the LSTM state in and out.
Random weights; nothing binary is committed."""
from __future__ import annotations

from pathlib import Path

import torch


class VoiceActivity(torch.nn.Module):
    """Silero-VAD-like: a learned filterbank (strided conv), an LSTM cell stepped once per chunk, a
    sigmoid. 8 kHz audio is first brought to the 16 kHz frame rate by a branch on the sample rate."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.filters16 = torch.nn.Conv1d(1, 24, 64, stride=32)
        self.filters8 = torch.nn.Conv1d(1, 24, 32, stride=16)
        self.encoder = torch.nn.Conv1d(24, hidden, 3, padding=1)
        self.lstm = torch.nn.LSTM(hidden, hidden)
        self.decoder = torch.nn.Linear(hidden, 1)

    def forward(self, audio, sr, h, c):
        if bool(sr == 16000):
            x = self.filters16(audio.unsqueeze(1))
        else:
            x = self.filters8(audio.unsqueeze(1))
        x = torch.relu(self.encoder(torch.log1p(x.abs())))    # [B, H, frames]
        y, (h, c) = self.lstm(x.permute(2, 0, 1), (h, c))
        return torch.sigmoid(self.decoder(y[-1])).squeeze(-1), h, c


def export(module, args, names, outputs, path: Path, script: bool = False, dynamic_axes=None):
    """Give module random weights (seed 0; BatchNorm statistics too), in place, and export it as ONNX
    (opset 17, TorchScript exporter; scripted first where `script`, which keeps control flow)."""
    import onnx
    module.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for name, b in module.named_buffers():
            if name.endswith("running_var"):
                b.copy_(torch.rand_like(b) + 0.5)
            elif name.endswith("running_mean"):
                b.copy_(torch.randn_like(b) * 0.1)
    target = torch.jit.script(module) if script else module
    torch.onnx.export(target, args, str(path), input_names=names, output_names=outputs, opset_version=17, dynamo=False,
                      dynamic_axes=dynamic_axes)
    return onnx.load(str(path))


def export_voice_activity(path: Path, batch: int = 2, samples: int = 512, hidden: int = 32):
    """(the module with the exported weights, the ONNX model): inputs audio [batch, samples], sr, h, c."""
    module = VoiceActivity(hidden)
    state = torch.zeros(1, batch, hidden)
    model = export(module, (torch.zeros(batch, samples), torch.tensor(16000), state, state),
                   ["audio", "sr", "h", "c"], ["prob", "h_out", "c_out"], path, script=True,
                   dynamic_axes={"audio": {1: "samples"}})
    return module, model
