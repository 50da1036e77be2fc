"""The digits task: ``sklearn.datasets.load_digits`` (8x8 images, 10 classes), on which the
CNN levers (quantization, QAT, pruning, fusion) are trained and judged; the models are
``DigitsCNN`` and ``DigitsResNet`` in fivefold/models/cnn.py.

Split (fixed seed): 60% train, 20% calibration/validation, 20% test. Calibration uses
the calibration part only; accuracy is always reported on the test part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DigitsData:
    train: tuple[torch.Tensor, torch.Tensor]
    calibration: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]


def load_digits_split(seed: int = 0) -> DigitsData:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    a, b = int(0.6 * len(y)), int(0.8 * len(y))
    return DigitsData((x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:]))


def train(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], epochs: int, lr: float = 3e-3,
          seed: int = 0, batch_size: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    x, y = data
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(batch_size):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def accuracy(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = data
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean()) * 100
