"""Small convolutional networks in the shapes people export to ONNX, with random weights: a
MobileNetV3-style classifier (depthwise convolutions, squeeze-excite, hard-swish), a YOLOv8-style
detector (conv + BN + SiLU, C2f blocks, SPPF max pools, nearest upsampling, sigmoid heads), a
DBNet-style text detector (ResNet blocks, an FPN, transposed convolutions) and a CRNN text recogniser
(convolutions, then a two-layer bidirectional LSTM). benchmarks/onnx_vision.py
times them against onnxruntime; tests/test_onnx_vision.py checks them against it.

    python scripts/vision_models.py OUT_DIR      # writes mobilenet.onnx, yolo.onnx, dbnet.onnx, crnn.onnx
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn


def conv_bn(cin: int, cout: int, k: int = 3, s: int = 1, groups: int = 1, act: type | None = nn.SiLU) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act is not None else nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, max(8, c // 4), 1), nn.Conv2d(max(8, c // 4), c, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, k: int, s: int, se: bool):
        super().__init__()
        self.block = nn.Sequential(conv_bn(cin, expand, 1, act=nn.Hardswish),
                                   conv_bn(expand, expand, k, s, groups=expand, act=nn.Hardswish),
                                   SqueezeExcite(expand) if se else nn.Identity(),
                                   conv_bn(expand, cout, 1, act=None))
        self.residual = s == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    """MobileNetV3-small's layout (input 224 x 224)."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        cfg = [(16, 16, 3, 2, True), (16, 72, 24, 3, 2, False), (24, 88, 24, 3, 1, False), (24, 96, 40, 5, 2, True),
               (40, 240, 40, 5, 1, True), (40, 120, 48, 5, 1, True), (48, 288, 96, 5, 2, True), (96, 576, 96, 5, 1, True)]
        layers = [conv_bn(3, 16, 3, 2, act=nn.Hardswish)]
        for c in cfg:
            cin, expand, cout, k, s, se = (c[0], c[0], c[1], c[2], c[3], c[4]) if len(c) == 5 else c
            layers.append(InvertedResidual(cin, expand, cout, k, s, se))
        layers.append(conv_bn(96, 576, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, classes))

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class Bottleneck(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.a, self.b = conv_bn(c, c, 3), conv_bn(c, c, 3)

    def forward(self, x):
        return x + self.b(self.a(x))


class C2f(nn.Module):
    def __init__(self, cin: int, cout: int, n: int = 1):
        super().__init__()
        self.c = cout // 2
        self.cv1, self.cv2 = conv_bn(cin, 2 * self.c, 1), conv_bn((2 + n) * self.c, cout, 1)
        self.m = nn.ModuleList(Bottleneck(self.c) for _ in range(n))

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            y.append(m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.cv1, self.cv2, self.pool = conv_bn(c, c // 2, 1), conv_bn(2 * c, c, 1), nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        x = self.cv1(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        return self.cv2(torch.cat([x, y1, y2, self.pool(y2)], 1))


class Yolo(nn.Module):
    """YOLOv8n's layout at a quarter of its widths (input 320 x 320): backbone, neck, one head per scale."""

    def __init__(self, classes: int = 20):
        super().__init__()
        w = [16, 32, 64, 128]
        self.stem = nn.Sequential(conv_bn(3, w[0], 3, 2), conv_bn(w[0], w[1], 3, 2), C2f(w[1], w[1]))
        self.p3 = nn.Sequential(conv_bn(w[1], w[2], 3, 2), C2f(w[2], w[2], 2))
        self.p4 = nn.Sequential(conv_bn(w[2], w[3], 3, 2), C2f(w[3], w[3], 2), SPPF(w[3]))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.neck = C2f(w[3] + w[2], w[2])
        self.heads = nn.ModuleList(nn.Sequential(conv_bn(c, c, 3), nn.Conv2d(c, 4 + classes, 1)) for c in (w[2], w[3]))

    def forward(self, x):
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        n3 = self.neck(torch.cat([self.up(p4), p3], 1))
        outs = [h(f).flatten(2) for h, f in zip(self.heads, (n3, p4))]
        return torch.sigmoid(torch.cat(outs, 2))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, s: int):
        super().__init__()
        self.a, self.b = conv_bn(cin, cout, 3, s, act=nn.ReLU), conv_bn(cout, cout, 3, act=None)
        self.short = conv_bn(cin, cout, 1, s, act=None) if s != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        return torch.relu(self.b(self.a(x)) + self.short(x))


class DBNet(nn.Module):
    """DBNet's layout with a small ResNet (input 320 x 320): FPN over four scales, a probability map
    upsampled by two transposed convolutions."""

    def __init__(self):
        super().__init__()
        w = [16, 32, 64, 128]
        self.stem = nn.Sequential(conv_bn(3, w[0], 3, 2, act=nn.ReLU), nn.MaxPool2d(3, 2, 1))
        self.stages = nn.ModuleList()
        cin = w[0]
        for i, c in enumerate(w):
            self.stages.append(nn.Sequential(BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)))
            cin = c
        inner = 32
        self.lateral = nn.ModuleList(nn.Conv2d(c, inner, 1, bias=False) for c in w)
        self.smooth = nn.ModuleList(nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False) for _ in w)
        self.head = nn.Sequential(conv_bn(inner, inner // 4, 3, act=nn.ReLU),
                                  nn.ConvTranspose2d(inner // 4, inner // 4, 2, 2), nn.BatchNorm2d(inner // 4), nn.ReLU(),
                                  nn.ConvTranspose2d(inner // 4, 1, 2, 2), nn.Sigmoid())

    def forward(self, x):
        feats, x = [], self.stem(x)
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        lat = [l(f) for l, f in zip(self.lateral, feats)]
        for i in range(3, 0, -1):
            lat[i - 1] = lat[i - 1] + nn.functional.interpolate(lat[i], scale_factor=2.0, mode="nearest")
        outs = [nn.functional.interpolate(s(l), scale_factor=2.0 ** i, mode="nearest") if i else s(l)
                for i, (s, l) in enumerate(zip(self.smooth, lat))]
        return self.head(torch.cat(outs, 1))


class CRNN(nn.Module):
    """A CRNN text recogniser (grey line image 32 x 320): four conv + BN + ReLU blocks pooled to height 1,
    then 80 time steps through a two-layer bidirectional LSTM (hidden 128) and a per-step classifier."""

    def __init__(self, classes: int = 37, hidden: int = 128):
        super().__init__()
        self.features = nn.Sequential(                          # [B, 1, 32, 320] -> [B, 128, 1, 80]
            conv_bn(1, 32, 3, act=nn.ReLU), nn.MaxPool2d(2), conv_bn(32, 64, 3, act=nn.ReLU), nn.MaxPool2d(2),
            conv_bn(64, 128, 3, act=nn.ReLU), nn.MaxPool2d((2, 1)), conv_bn(128, 128, 3, act=nn.ReLU),
            nn.MaxPool2d((4, 1)))
        self.rnn = nn.LSTM(128, hidden, num_layers=2, bidirectional=True)
        self.classifier = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        f = self.features(x).squeeze(2).permute(2, 0, 1)        # [T, B, C]
        y, _ = self.rnn(f)
        return self.classifier(y).log_softmax(-1)              # [T, B, classes]


MODELS = {"mobilenet": (MobileNet, (1, 3, 224, 224)), "yolo": (Yolo, (1, 3, 320, 320)), "dbnet": (DBNet, (1, 3, 320, 320)),
          "crnn": (CRNN, (1, 1, 32, 320))}


def random_model(name: str, seed: int = 0) -> nn.Module:
    """The model with random weights (BatchNorm statistics too), in inference mode."""
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def export(name: str, path: Path, seed: int = 0) -> Path:
    """Write the model as ONNX (opset 17, TorchScript exporter: BatchNorm folded into the convolutions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    model = random_model(name, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(*MODELS[name][1]),), str(path), input_names=["image"], output_names=["out"],
                          opset_version=17, dynamo=False)
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name in MODELS:
        print(export(name, out / f"{name}.onnx"))
