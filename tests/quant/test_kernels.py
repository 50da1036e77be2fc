"""Every W8A8 kernel that runs on this CPU computes exact integer sums, including the operands
that make the u8 x s8 kernels of oneDNN and fbgemm saturate on CPUs without VNNI."""

import pytest
import torch
from torch import nn

from fivefold.platform import current_platform
from fivefold.quant.config import Int8Config
from fivefold.models.int8_backends import (
    EXACT_KERNEL,
    LIBRARY_KERNELS,
    int8_matmul_exact,
    is_library_kernel_exact,
    per_token_quantize,
    w8a8_kernel,
)
from fivefold.models.int8_linear import Int8Linear
from fivefold.models.int8_primitives import activation_qparams, quantize_activation, sqnr_db


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (3, 100, 17), (4, 16, 3), (5, 1536, 577), (17, 33, 8),
                                   (64, 576, 130), (8, 1000, 49), (33, 257, 24), (9, 16, 1), (12, 1536, 577), (16, 300, 40)])
def test_int8_matmul_exact_equals_int64_arithmetic(m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x[0], w[0] = -128, -127  # the largest products, all of one sign: int16 pair sums would saturate
    assert torch.equal(int8_matmul_exact(x, w).long(), x.long() @ w.long().t())


@pytest.mark.parametrize("m,k,n", [(1, 576, 130), (5, 100, 17), (16, 300, 40), (64, 576, 577)])
@pytest.mark.parametrize("zp,per_token,bias", [(0, True, False), (-7, False, True), (3, True, True)])
def test_int8_linear_applies_scales_zero_point_and_bias_to_the_exact_sums(m, k, n, zp, per_token, bias):
    """The one-call W8A8 (int32 sums and float epilogue in one pass) against float64 arithmetic on
    the int64 sums, on both of the kernel's paths (few rows; the packed panels from 16 rows)."""
    from fivefold.kernels import int8_ops

    ops = int8_ops()
    if ops is None:
        pytest.skip("no C++ compiler: w8a8_exact runs the float64 fallback, tested above")
    g = torch.Generator().manual_seed(m + k + n + zp)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x[0], w[0] = -128, -127
    xs = torch.rand(m if per_token else 1, generator=g) * 0.1 + 0.01
    ws = torch.rand(n, generator=g) * 0.01 + 0.001
    b = torch.randn(n, generator=g) if bias else None
    w_sum = w.sum(dim=1, dtype=torch.int32)
    y = ops.int8_int8_linear(x, xs, zp, w, w_sum, ws, b)
    sums = (x.long() - zp) @ w.long().t()  # exact
    expected = sums.double() * xs.double()[:, None] * ws.double() + (b.double() if bias else 0)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,k,n", [(1, 576, 130), (5, 100, 17), (16, 300, 40), (64, 576, 577), (70, 1536, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_per_token_linear_in_one_call_equals_quantizing_in_python(m, k, n, bias):
    """fivefold::int8_dynamic_linear quantizes each row in C++: the same codes and scales as
    per_token_quantize bit for bit (rows of zeros, values on the rounding ties, one huge value),
    so the outputs are equal, not close."""
    from fivefold.kernels import int8_ops
    from fivefold.models.int8_backends import w8a8_exact_per_token

    ops = int8_ops()
    if ops is None:
        pytest.skip("no C++ compiler: w8a8_exact_per_token is per_token_quantize + the float64 fallback")
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    x[0] = 0.0  # a row of zeros: scale 1e-8 / 127, codes 0
    if m > 2:
        x[1] = torch.randint(-126, 126, (k,), generator=g).float() + 0.5  # x / scale on the .5 ties
        x[1, 0] = 127.0  # amax 127: scale exactly 1, so x / scale keeps the ties
        x[2, 3] = 3e4  # one outlier: the rest of the row rounds to a few codes
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) * 0.01 + 0.001
    b = torch.randn(n, generator=g) if bias else None
    xq, xs = per_token_quantize(x)
    expected = ops.int8_int8_linear(xq, xs.reshape(-1), 0, w, None, ws, b)
    got = w8a8_exact_per_token(x, w, ws, b)
    assert torch.equal(got, expected)


def test_library_kernels_run_only_where_they_are_exact():
    for mode, library in LIBRARY_KERNELS.items():
        kernel = w8a8_kernel(mode)
        if not current_platform().has_vnni:
            assert kernel == EXACT_KERNEL  # no VNNI: oneDNN and fbgemm sum products in int16 and saturate
        else:
            assert kernel in (library, EXACT_KERNEL)
        if kernel == library:
            assert is_library_kernel_exact(library)


def _saturating_linear(bias: bool) -> nn.Linear:
    """Weights of one sign per output row at their row maximum: every int8 code is +-127."""
    lin = nn.Linear(256, 48, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.sign(torch.randn(48, 1)).expand(48, 256) * (torch.rand(48, 1) + 0.5))
    return lin


@pytest.mark.parametrize("mode", ["per-token", "per-tensor", "static"])
def test_every_w8a8_mode_is_exact_integer_arithmetic_on_saturating_operands(mode):
    torch.manual_seed(0)
    lin = _saturating_linear(bias=True)
    x = torch.rand(6, 256) * 4 + 1  # all positive and large: the top of the activation range
    x[1] = -x[1]
    lo, hi = float(x.min()), float(x.max())
    config = {"per-token": Int8Config("w8a8"), "per-tensor": Int8Config("w8a8", activation_granularity="per-tensor"),
              "static": Int8Config("w8a8", activation="static", activation_symmetric=False)}[mode]
    q = Int8Linear.from_float(lin, config, clip_range=(lo, hi))
    assert f"kernel={q.kernel}" in repr(q) and q.kernel == w8a8_kernel(mode)
    wq = q.weight.double()
    if mode == "per-token":
        xq, xs = per_token_quantize(x)
        expected = (xq.double() @ wq.t()) * xs.double()
    else:
        scale, zp = activation_qparams(lo, hi, symmetric=False)
        expected = ((quantize_activation(x, scale, zp).double() - zp) @ wq.t()) * scale
    expected = expected * q.weight_scale.double() + q.bias.double()
    with torch.no_grad():
        got = q(x).double()
    if q.kernel == "fbgemm":  # fbgemm picks its own (equivalent) grid from the batch's min and max
        assert sqnr_db(expected, got) >= 40.0
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
    assert sqnr_db(lin(x).detach(), got) >= 30.0
