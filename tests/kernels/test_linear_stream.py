"""fivefold::stream_linear, the decode linear: against a float64 reference for every weight dtype,
row count (the row groups and their remainder) and ragged shapes (K not a multiple of the vector
width, N not a multiple of the channel tile); stream_pack's layout round-trips exactly."""

import pytest
import torch

from fivefold.kernels import stream_ops
from fivefold.models.layers import PackedLinear, linear_from


def _weights(dtype, n, k, gen):
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n, generator=gen) / 50
    return torch.randn(n, k, generator=gen).to(dtype), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 19, 33, 64, 301])
@pytest.mark.parametrize("n,k", [(64, 576), (37, 100), (5, 16), (130, 33)])
def test_stream_linear_matches_float64(dtype, rows, n, k):
    ops = stream_ops()
    assert ops is not None, "the streaming kernel must build here"
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, scale = _weights(dtype, n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed = ops.stream_pack(w)
    assert torch.equal(ops.stream_unpack(packed)[:, :k], w)  # every weight where the layout says
    y = ops.stream_linear(x, packed, scale, bias)
    ref = x.double() @ w.double().t()
    if scale is not None:
        ref = ref * scale.double()
    ref = ref + bias.double()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * k ** 0.5)


def test_stream_linear_keeps_bf16_activations_and_refuses_bad_input():
    ops = stream_ops()
    w = ops.stream_pack(torch.randn(8, 32).to(torch.bfloat16))
    x = torch.randn(2, 32).to(torch.bfloat16)
    y = ops.stream_linear(x, w, None, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ ops.stream_unpack(w).float().t(), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.stream_linear(torch.randn(2, 64), w, None, None)
    with pytest.raises(RuntimeError, match="weights must be float32, bfloat16 or int8"):
        ops.stream_linear(torch.randn(2, 32), ops.stream_pack(torch.randn(8, 32).half()), None, None)
    with pytest.raises(RuntimeError, match="must come from this build's stream_pack"):
        ops.stream_linear(torch.randn(2, 32), torch.randn(8, 32), None, None)  # a row-major weight


@pytest.mark.parametrize("rows", [1, 4, 8, 9, 64])
def test_packed_linear_streams_small_batches_and_packs_large_ones(rows):
    """Both of PackedLinear's kernels (streaming up to STREAM_MAX_ROWS rows, oneDNN above) give
    F.linear's result; its state dict is the plain weight."""
    gen = torch.Generator().manual_seed(rows)
    dense = linear_from(torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen))
    packed = PackedLinear(dense)
    x = torch.randn(rows, 80, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), dense(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.state_dict()["weight"], dense.weight.detach())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 19, 45])
@pytest.mark.parametrize("n,k,group", [(64, 576, 32), (37, 96, 32), (6, 256, 64), (130, 128, 128)])
def test_group_scales_match_float64(rows, n, k, group):
    """Int8 weights with one scale per group of columns (GGUF's Q8_0: 32): sum_g s[n, g] * (x . w)_g,
    computed in float64 from the same int8 values and scales."""
    ops = stream_ops()
    gen = torch.Generator().manual_seed(rows * 7 + n + k + group)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) / 50
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    dense = (w.double().view(n, k // group, group) * scale.double()[:, :, None]).view(n, k)
    want = x.double() @ dense.t() + bias.double()
    y = ops.stream_linear(x, ops.stream_pack(w), scale, bias)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(ops.int8_weight_linear(x, ops.stream_pack(w), scale, bias), y)  # the profiler's name


def test_group_scales_refuse_what_they_cannot_compute():
    ops = stream_ops()
    w = torch.randint(-127, 128, (8, 96), dtype=torch.int8)
    x = torch.randn(1, 96)
    with pytest.raises(RuntimeError, match="group scales need int8 weights"):
        ops.stream_linear(x, ops.stream_pack(w), torch.rand(8, 5), None)  # 96 columns in 5 groups
    with pytest.raises(RuntimeError, match="group scales need int8 weights"):
        ops.stream_linear(x, ops.stream_pack(w.float()), torch.rand(8, 3), None)  # float weights
