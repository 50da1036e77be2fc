"""Alignment: pad a linear's output features to a multiple the GEMM kernels prefer.

oneDNN's packed GEMM blocks the output dimension (16 or 64 floats per block on AVX-512);
a width that is not a multiple leaves a ragged last block with a slower code path.
Measured here (float32, 1 row, 576 inputs): 49150 outputs take 6.1 ms, 49152 take
4.1 ms; but 1000 -> 1008 is 10% slower at 1 row and 5% faster at 32. So padding is
decided per layer by timing both on the layer's real input shape, never assumed.

A padded layer computes zero rows (zero weights, zero bias) and returns a view of the
first ``out_features`` columns: no copy, the same values. A later op that needs a
contiguous tensor copies it; ``fivefold.fuse.graph_fuse.count_kernels`` counts such
copies as layout conversions.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.models.layers import linear_from


class PaddedLinear(nn.Module):
    """``inner`` computes ``padded`` >= ``out_features`` outputs; the extra ones are dropped (a view)."""

    def __init__(self, inner: nn.Module, out_features: int) -> None:
        super().__init__()
        self.inner, self.out_features = inner, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[..., : self.out_features]


def padded_copy(linear: nn.Module, multiple: int) -> nn.Module:
    """An nn.Linear copy of ``linear`` (anything with ``weight`` and ``bias``) with zero rows
    appended to its weight and bias up to a multiple of ``multiple`` output features."""
    num_pad = -linear.weight.shape[0] % multiple
    weight = F.pad(linear.weight.detach(), (0, 0, 0, num_pad))
    bias = None if linear.bias is None else F.pad(linear.bias.detach(), (0, num_pad))
    return linear_from(weight, bias).requires_grad_(False)


def median_us(fn, num_calls: int = 30) -> float:
    """Median wall time of ``fn()`` in microseconds, after 5 warm-up calls (oneDNN JITs on first use)."""
    with torch.inference_mode():
        for _ in range(5):
            fn()
        times = []
        for _ in range(num_calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6
