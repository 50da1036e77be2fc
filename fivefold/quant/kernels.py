"""The int8 matmuls we can run on this CPU, each behind one function.

All take float activations ``x`` [M, K] and return float32 [M, N]; the int8 work and
the int32 accumulation happen inside. Which one a scheme uses is decided by
``benchmarks/int8_kernels.py`` (numbers in the README).
"""

from __future__ import annotations

import torch

from fivefold.kernels import int8_ops
from fivefold.quant.primitives import ACT_QMAX, quantize_weight


def per_token_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row: (codes [M, K], scales [M, 1])."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / ACT_QMAX
    return torch.round(x / scale).to(torch.int8), scale


def w8a16_int8pack(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """aten._weight_int8pack_mm: int8 weights [N, K] dequantized in the kernel, float maths."""
    return torch.ops.aten._weight_int8pack_mm(x, w_q, w_scale)


def w8a8_int_mm(xq: torch.Tensor, x_scale: torch.Tensor, w_q_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """torch._int_mm (int8 x int8 -> int32) then rescale: ``w_q_t`` is [K, N]."""
    return torch._int_mm(xq, w_q_t).float() * (x_scale * w_scale)


def onednn_prepack(w_q: torch.Tensor, m_hint: int = 1) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(w_q, [m_hint, w_q.shape[1]])


def w8a8_onednn(xq_u8: torch.Tensor, x_scale: float, x_zp: int, w_packed: torch.Tensor, w_scale: torch.Tensor,
                w_zp: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """onednn.qlinear_pointwise: u8 activations (per-tensor scale and zero point), s8 weights,
    int32 accumulation, float32 out with the bias added."""
    return torch.ops.onednn.qlinear_pointwise(xq_u8, x_scale, x_zp, w_packed, w_scale, w_zp, bias, 1.0, 0,
                                              torch.float32, "none", [], "")


def candidates(w: torch.Tensor, x: torch.Tensor) -> dict:
    """Closures computing ``x @ w.T`` with every available kernel (None where unavailable)."""
    from fivefold.models.layers import PackedLinear

    out: dict = {}
    n, k = w.shape
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data.copy_(w)
    packed = PackedLinear(lin) if PackedLinear.is_available() else lin
    out["fp32-packed"] = lambda: packed(x)
    w_q, w_s = quantize_weight(w)
    out["w8a16-int8pack"] = lambda: w8a16_int8pack(x, w_q, w_s)
    ops = int8_ops()
    out["w8a16-fivefold"] = (lambda: ops.int8_weight_linear(x, w_q, w_s, None)) if ops is not None else None
    w_q_t = w_q.t().contiguous()

    def int_mm():
        xq, xs = per_token_quantize(x)
        return w8a8_int_mm(xq, xs, w_q_t, w_s)

    out["w8a8-int_mm"] = int_mm
    try:
        w_packed = onednn_prepack(w_q, x.shape[0])
        w_zp = torch.zeros(n, dtype=torch.int64)

        def onednn():
            lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
            scale = (hi - lo) / 255 or 1.0
            zp = int(round(-lo / scale))
            xq = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
            return w8a8_onednn(xq, scale, zp, w_packed, w_s, w_zp, None)

        onednn()
        out["w8a8-onednn"] = onednn
    except (RuntimeError, AttributeError):
        out["w8a8-onednn"] = None
    try:
        qw = torch.quantize_per_channel(w, w_s.double(), torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
        params = torch.ops.quantized.linear_prepack(qw, None)
        out["w8a8-fbgemm"] = lambda: torch.ops.quantized.linear_dynamic(x, params)
    except (RuntimeError, AttributeError):
        out["w8a8-fbgemm"] = None
    return out
