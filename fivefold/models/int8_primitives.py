"""Quantization arithmetic: scales, zero points, (fake) quantize, dequantize, SQNR.

Conventions (those of torchao and TensorRT):
- weights are symmetric int8 in [-127, 127] (no -128, so that negation is exact and
  the range is symmetric), one scale per output channel or one per tensor;
- activations are int8 in [-128, 127], symmetric (zero point 0) or asymmetric
  (``q = round(x / scale) + zero_point``, the zero point chosen so 0.0 is exact);
- ``x ≈ (q - zero_point) * scale``;
- block-wise int8 activations (W4A8, a GGUF served as stored): one scale per row and block of 32
  columns, symmetric, codes in [-127, 127] (``quantize_activations``).
"""

from __future__ import annotations

import torch

from fivefold.errors import FivefoldError

WEIGHT_QMAX = 127
ACT_QMIN, ACT_QMAX = -128, 127
_EPS = 1e-12


def weight_scales(w: torch.Tensor, per_channel: bool = True, absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric scales for a [N, K] weight: one per output row (per-channel) or one shared ([N] either way).

    ``absmax`` (e.g. a clipped range) overrides the weight's own maximum."""
    if absmax is None:
        absmax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    return (absmax.float().clamp(min=_EPS) / WEIGHT_QMAX).contiguous()


def quantize_weight(w: torch.Tensor, per_channel: bool = True, group_size: int | None = None,
                    float16_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]): round to nearest, symmetric. With ``group_size`` G (K a
    multiple of it), one scale per G consecutive weights of a row: scales [N, K / G];
    ``float16_scales``: each group's scale rounded to a float16 value first (the codes rounded
    against it), so that the int8 kernels hold it in 2 bytes, as a GGUF block's."""
    if group_size is not None:
        n, k = w.shape
        groups = w.float().reshape(n, k // group_size, group_size)
        scales = (groups.abs().amax(dim=2).clamp(min=_EPS) / WEIGHT_QMAX).contiguous()
        if float16_scales:  # never 0: the smallest float16 subnormal at least
            scales = scales.half().float().clamp(min=2.0 ** -24)
        q = torch.clamp(torch.round(groups / scales[:, :, None]), -WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)
        return q.reshape(n, k).contiguous(), scales
    scales = weight_scales(w, per_channel)
    q = torch.clamp(torch.round(w.float() / scales[:, None]), -WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)
    return q.contiguous(), scales


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of int8 ``q`` with per-row [N] or per-group [N, groups] scales."""
    if scales.dim() == 2:
        n, k = q.shape
        return (q.float().reshape(n, scales.shape[1], -1) * scales[:, :, None]).reshape(n, k)
    return q.float() * scales[:, None]


def activation_qparams(lo: float, hi: float, symmetric: bool) -> tuple[float, int]:
    """(scale, zero_point) mapping the clip range [lo, hi] onto int8."""
    if symmetric:
        return max(abs(lo), abs(hi), _EPS) / ACT_QMAX, 0
    lo, hi = min(lo, 0.0), max(hi, 0.0)  # 0.0 must be representable exactly
    scale = max(hi - lo, _EPS) / (ACT_QMAX - ACT_QMIN)
    zero_point = int(round(ACT_QMIN - lo / scale))
    return scale, max(ACT_QMIN, min(ACT_QMAX, zero_point))


def quantize_activation(x: torch.Tensor, scale, zero_point) -> torch.Tensor:
    """int8 codes of ``x``; values outside the range saturate (this is the clipping)."""
    return torch.clamp(torch.round(x / scale) + zero_point, ACT_QMIN, ACT_QMAX).to(torch.int8)


def dequantize_activation(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    return (q.float() - zero_point) * scale


def fake_quantize(x: torch.Tensor, scale, zero_point, qmin: int, qmax: int) -> torch.Tensor:
    """Quantize-dequantize with a straight-through estimator.

    Forward: the value int8 arithmetic would see. Backward: gradient 1 inside the
    representable range and 0 outside it (the clipped STE), so training learns to stay
    in range rather than being pushed by values that saturate.
    """
    lo, hi = (qmin - zero_point) * scale, (qmax - zero_point) * scale
    clipped = torch.maximum(torch.minimum(x, torch.as_tensor(hi, dtype=x.dtype)), torch.as_tensor(lo, dtype=x.dtype))
    q = (torch.clamp(torch.round(clipped / scale) + zero_point, qmin, qmax) - zero_point) * scale
    return clipped + (q - clipped).detach()


ACT_BLOCK = 32  # columns per scale of block-wise int8 activations (llama.cpp's Q8_0 block)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of float32 ``x`` [M, K] (K a multiple of 32) -> (codes int8 [M, K], scales float32
    [M, K / 32]): per block of 32 columns, scale = amax / 127 and code = round(x / scale), ties to
    even (what the kernel computes, byte for byte); an all-zero block has scale 0 and codes 0."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise FivefoldError(f"int8 activations need in_features to be a multiple of {ACT_BLOCK}, got {k}")
    blocks = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp_(-127, 127)
    return q.to(torch.int8).reshape(m, k), scale.reshape(m, -1)


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_activations`: float32 [M, K]."""
    m, k = q.shape
    return (q.float().reshape(m, -1, ACT_BLOCK) * scale[:, :, None]).reshape(m, k)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.double()
    noise = (ref - approximation.double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))
