"""fivefold/kernels/fused_ops.cpp against PyTorch on the whole float range a layer can produce
(random-weight models reach gate values of several hundred)."""

from __future__ import annotations

import torch

from fivefold.kernels import fused_ops


def test_silu_and_mul_is_finite_and_exact_for_large_gates():
    """silu(g) * up for |g| up to 1000: the vectorised division once turned g / inf into NaN for
    g < -88 (exp overflow), which the C++ decode loop then spread through a whole sequence."""
    ops = fused_ops()
    gen = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.linspace(-1000, 1000, 4001), torch.randn(3 * 4096 - 4001, generator=gen) * 300])
    gate = gate.reshape(3, -1)  # 3 tokens, a multiple of the SIMD width and a tail
    up = torch.randn(gate.shape, generator=gen) * 10
    out = ops.silu_and_mul(torch.cat([gate, up], dim=1))
    want = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    assert bool(out.isfinite().all())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-30)
