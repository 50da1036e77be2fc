"""Calibration observers: record activations, then decide the clipping range.

As in torchao and PyTorch's ao: ``observer(x)`` records (and returns ``x``), then
``clip_range()`` decides and ``calculate_qparams(symmetric)`` turns the range into a
scale and zero point. Four ways to decide:

- ``minmax``: the largest magnitude seen. Keeps every outlier, so one extreme value
  stretches the step size for all the others.
- ``percentile``: the magnitude below which ``percentile`` % of the values lie.
- ``entropy``: the threshold whose int8 version of the histogram is closest to the
  float one in KL divergence (the search of TensorRT's entropy calibrator: outliers
  folded into the last kept bin, 128 quantization levels, smallest KL wins).
- ``mse``: the threshold minimising the expected squared error (rounding inside,
  clipping outside), computed from the histogram.

The histogram observers bin the non-zero |x| into 2048 bins over [0, max]; when a larger value
arrives the range doubles as often as needed and bins are merged pairwise, which
keeps the histogram exact without storing the data. The decision is on |x|; the clip
range is [max(min, -t), min(max, t)], so an asymmetric range keeps its asymmetry.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fivefold.models.int8_primitives import ACT_QMAX, activation_qparams

NUM_BINS = 2048
NUM_LEVELS = 128  # int8 levels on one side of zero


class Observer:
    """Records min, max (and, in subclasses, a histogram); decides a clipping threshold."""

    name = "observer"

    def __init__(self) -> None:
        self.min_val = math.inf
        self.max_val = -math.inf
        self.num_values = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float()
        if x.numel():
            self.min_val = min(self.min_val, float(x.min()))
            self.max_val = max(self.max_val, float(x.max()))
            self.num_values += x.numel()
            self._record(x)
        return x

    def _record(self, x: torch.Tensor) -> None:
        pass

    @property
    def absmax(self) -> float:
        return max(abs(self.min_val), abs(self.max_val))

    def threshold(self) -> float:
        """The magnitude above which values are clipped."""
        raise NotImplementedError

    def clip_range(self) -> tuple[float, float]:
        if not self.num_values:
            raise RuntimeError(f"{self.name} observer saw no data: run calibration first")
        t = self.threshold()
        return max(self.min_val, -t), min(self.max_val, t)

    def calculate_qparams(self, symmetric: bool = True) -> tuple[float, int]:
        return activation_qparams(*self.clip_range(), symmetric)


class MinMaxObserver(Observer):
    name = "minmax"

    def threshold(self) -> float:
        return self.absmax


class HistogramObserver(Observer):
    """Keeps an exact 2048-bin histogram of |x| over [0, hist_max]."""

    def __init__(self) -> None:
        super().__init__()
        self.hist: np.ndarray | None = None
        self.hist_max = 0.0

    def _record(self, x: torch.Tensor) -> None:
        a = x.abs().flatten()
        # Exact zeros (half of every post-ReLU tensor) are exact in int8 at any scale: leaving
        # them out keeps one spike from dominating the KL and percentile decisions.
        a = a[a != 0]
        if not a.numel():
            return
        top = float(a.max())
        if self.hist is None:
            self.hist_max = top if top > 0 else 1.0
            self.hist = np.zeros(NUM_BINS, dtype=np.float64)
        elif top > self.hist_max:
            doublings = math.ceil(math.log2(top / self.hist_max))
            factor = 2 ** min(doublings, 11)
            merged = self.hist.reshape(NUM_BINS // factor, factor).sum(axis=1)
            self.hist = np.concatenate([merged, np.zeros(NUM_BINS - merged.size)])
            self.hist_max *= 2 ** doublings
        self.hist += torch.histc(a, NUM_BINS, 0.0, self.hist_max).double().numpy()

    @property
    def bin_width(self) -> float:
        return self.hist_max / NUM_BINS

    def centers(self) -> np.ndarray:
        return (np.arange(NUM_BINS) + 0.5) * self.bin_width


class PercentileObserver(HistogramObserver):
    name = "percentile"

    def __init__(self, percentile: float = 99.99) -> None:
        super().__init__()
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile

    def threshold(self) -> float:
        cdf = np.cumsum(self.hist) / self.hist.sum()
        index = int(np.searchsorted(cdf, self.percentile / 100.0))
        return min((index + 1) * self.bin_width, self.absmax)


class EntropyObserver(HistogramObserver):
    name = "entropy"

    def __init__(self, stride: int = 4) -> None:
        super().__init__()
        self.stride = stride

    def threshold(self) -> float:
        hist = self.hist
        best_i, best_kl = NUM_BINS, math.inf
        for i in range(NUM_LEVELS, NUM_BINS + 1, self.stride):
            p = hist[:i].copy()
            p[-1] += hist[i:].sum()  # outliers clipped into the last kept bin
            kl = _kl_of_quantized(p, hist[:i])
            if kl < best_kl:
                best_i, best_kl = i, kl
        return min((best_i + 0.5) * self.bin_width, self.absmax)


def _kl_of_quantized(p: np.ndarray, src: np.ndarray) -> float:
    """KL(P || Q) where Q is ``src`` merged into NUM_LEVELS levels and spread back over
    the bins that were non-zero (empty bins stay empty, as int8 cannot create mass)."""
    n = p.size
    edges = (np.arange(NUM_LEVELS + 1) * n) // NUM_LEVELS
    level = np.repeat(np.arange(NUM_LEVELS), np.diff(edges))
    nonzero = src > 0
    level_mass = np.bincount(level, weights=src, minlength=NUM_LEVELS)
    level_count = np.bincount(level, weights=nonzero.astype(np.float64), minlength=NUM_LEVELS)
    q = np.where(nonzero, level_mass[level] / np.maximum(level_count[level], 1), 0.0)
    p_sum, q_sum = p.sum(), q.sum()
    if p_sum == 0 or q_sum == 0:
        return math.inf
    p, q = p / p_sum, q / q_sum
    mask = p > 0
    q = np.where(mask & (q == 0), 1e-10, q)  # a clipped bin with no quantized mass: heavily penalised
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


class MSEObserver(HistogramObserver):
    name = "mse"

    def __init__(self, num_candidates: int = 256) -> None:
        super().__init__()
        self.num_candidates = num_candidates

    def threshold(self) -> float:
        c = self.centers()[None, :]  # [1, bins]
        t = np.linspace(self.absmax / self.num_candidates, self.absmax, self.num_candidates)[:, None]  # [cands, 1]
        step = t / ACT_QMAX
        inside = (c - np.round(c / step) * step) ** 2
        outside = (c - t) ** 2
        err = np.where(c <= t, inside, outside) @ self.hist  # [cands]
        return float(t[int(np.argmin(err)), 0])


OBSERVERS = {"minmax": MinMaxObserver, "percentile": PercentileObserver, "entropy": EntropyObserver,
             "mse": MSEObserver}


def make_observer(method: str, percentile: float = 99.99) -> Observer:
    if method not in OBSERVERS:
        raise ValueError(f"calibration must be one of {', '.join(OBSERVERS)}, got '{method}'")
    return PercentileObserver(percentile) if method == "percentile" else OBSERVERS[method]()
