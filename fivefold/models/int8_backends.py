"""The int8 matmuls we can run on this CPU, each behind one function, and the choice among them.

All take float activations ``x`` [M, K] (or their int8 codes) and return float32 [M, N];
the int8 work and the int32 accumulation happen inside. Which library kernel a scheme
prefers is decided by ``benchmarks/int8_kernels.py`` (numbers in the README); whether it
may run is decided here, by capability (:func:`w8a8_kernel`):

- The u8 x s8 kernels of oneDNN and fbgemm (and oneDNN's s8 x s8 behind ``torch._int_mm``,
  which adds 128 to make u8) sum pairs of products in int16 on CPUs without VNNI
  (``vpmaddubsw``) and saturate: 255 * 127 * 2 > 32767. Their results are then wrong by
  up to half, silently. They run only where this CPU has VNNI (:mod:`fivefold.platform`,
  forcing honoured) *and* a one-off probe with saturating operands returns the exact
  int32 sums.
- Everywhere else W8A8 runs ``fivefold::int8_int8_matmul`` (our C++ kernel: products
  widened to int32 before they are added, exact on every CPU), with the activation zero
  point folded into a per-channel correction ``zp * sum_k w[n, k]``. Without a compiler,
  the same integer sums come from a float64 GEMM of the int8 codes (exact below 2^53).

Every kernel chosen is exact integer arithmetic, so fake quantization (calibration, QAT)
simulates what runs on every machine, and tests assert exactness, not luck.
"""

from __future__ import annotations

import functools
import warnings

import torch

from fivefold.kernels import int8_ops
from fivefold.platform import current_platform
from fivefold.models.int8_primitives import ACT_QMAX, quantize_weight

# The library kernel each W8A8 activation mode prefers on a VNNI CPU.
LIBRARY_KERNELS = {"per-token": "int_mm", "per-tensor": "fbgemm", "static": "onednn"}
EXACT_KERNEL = "fivefold-exact"  # fivefold::int8_int8_matmul
EXACT_FALLBACK = "float64-exact"  # no compiler: the same sums from a float64 GEMM of the codes


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


def _probe_operands() -> tuple[torch.Tensor, torch.Tensor]:
    """Operands whose pairwise int16 sums saturate: activations at the ends of the int8 range,
    weights at +-127 with the same sign along each row (exact sums reach 128 * 127 * K)."""
    k, n = 64, 16
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((4, k), 127, dtype=torch.int8)
    x[1], x[2, ::2] = -128, -128
    return x, w


@functools.lru_cache(maxsize=None)
def is_library_kernel_exact(kernel: str) -> bool:
    """Whether a library int8 kernel returns the exact int32 sums on this CPU (a one-off probe of
    a few microseconds; False when the kernel is missing from this torch build)."""
    x, w = _probe_operands()
    exact = x.long() @ w.long().t()  # [4, N]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kernel == "int_mm":
                got = torch._int_mm(x, w.t().contiguous()).long()
            elif kernel == "onednn":  # u8 codes = s8 + 128, zero point 128: the sums of the s8 codes
                packed = onednn_prepack(w, x.shape[0])
                ones, zeros = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.int64)
                got = w8a8_onednn((x.int() + 128).to(torch.uint8), 1.0, 128, packed, ones, zeros, None)
                got = got.round().long()
            elif kernel == "fbgemm":  # dynamic: float in, its own u8 grid; saturation costs ~half the sum
                xf = x.float() / 128.0
                qw = torch._make_per_channel_quantized_tensor(w, torch.ones(w.shape[0], dtype=torch.double),
                                                              torch.zeros(w.shape[0], dtype=torch.int64), 0)
                y = torch.ops.quantized.linear_dynamic(xf, torch.ops.quantized.linear_prepack(qw, None))
                ref = xf.double() @ w.double().t()
                return bool(((y.double() - ref).abs() <= 0.01 * ref.abs() + 1.0).all())
            else:
                raise ValueError(f"unknown int8 kernel '{kernel}'")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(got, exact))


def w8a8_kernel(mode: str) -> str:
    """The kernel W8A8 runs here for an activation ``mode`` ("per-token", "per-tensor" dynamic, or
    "static"): the library's where it is exact on this CPU, else ours (see the module docstring)."""
    library = LIBRARY_KERNELS[mode]
    if current_platform().has_vnni and is_library_kernel_exact(library):
        return library
    return EXACT_KERNEL if int8_ops() is not None else EXACT_FALLBACK


def int8_matmul_exact(xq: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums xq [M, K] int8 @ w_q [N, K] int8 ^T -> [M, N] int32, on any CPU."""
    ops = int8_ops()
    if ops is not None:
        return ops.int8_int8_matmul(xq, w_q)
    return (xq.double() @ w_q.double().t()).to(torch.int32)


def w8a8_exact_per_token(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 with dynamic per-token activations: ``per_token_quantize(x)`` then ``w8a8_exact``, the
    codes and scales the same bit for bit; with the C++ kernels the quantization runs inside the
    one call (``fivefold::int8_dynamic_linear``)."""
    ops = int8_ops()
    if ops is not None and x.dtype == torch.float32:
        return ops.int8_dynamic_linear(x, w_q, w_scale, bias)
    xq, xs = per_token_quantize(x)
    return w8a8_exact(xq, xs, 0, w_q, None, w_scale, bias)


def w8a8_exact(xq: torch.Tensor, x_scale, x_zp: int, w_q: torch.Tensor, w_sum: torch.Tensor,
               w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(x_scale * (xq - x_zp)) @ (w_scale * w_q)^T + bias`` with the integer part exact:
    sum_k (xq - zp) w = sum_k xq w - zp * w_sum[n] (``w_sum`` int32 [N], per output channel).
    ``x_scale`` is a float or [M, 1] (per token). With the C++ kernels, one call: the scales,
    zero point and bias are applied to each block of sums while it is in cache."""
    ops = int8_ops()
    if ops is not None:
        xs = torch.as_tensor(x_scale, dtype=torch.float32).reshape(-1)
        return ops.int8_int8_linear(xq, xs, int(x_zp), w_q, w_sum if x_zp else None, w_scale, bias)
    acc = int8_matmul_exact(xq, w_q)  # [M, N] int32
    if x_zp:
        acc = acc - x_zp * w_sum
    y = acc.float() * (x_scale * w_scale)
    return y + bias if bias is not None else y


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
    w_stream = ops.stream_pack(w_q) if ops is not None else None
    out["w8a16-fivefold"] = (lambda: ops.int8_weight_linear(x, w_stream, w_s, None)) if ops is not None else None
    w_q_t = w_q.t().contiguous()

    def int_mm():
        xq, xs = per_token_quantize(x)
        return w8a8_int_mm(xq, xs, w_q_t, w_s)

    out["w8a8-int_mm"] = int_mm
    def exact():
        return w8a8_exact_per_token(x, w_q, w_s, None)

    out["w8a8-fivefold-exact"] = exact if ops is not None else None
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
