import pytest
import torch

from fivefold.models.tiled_attention import naive_attention, tiled_attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("len_q, len_k, block_q, block_k", [
    (37, 37, 16, 16),    # odd length, blocks that do not divide it
    (64, 64, 64, 64),    # one block
    (50, 50, 7, 13),     # different, odd block sizes
    (5, 77, 4, 32),      # a chunk of queries after a cached context (causal offset)
    (1, 33, 128, 8),     # a single decode-like query
])
def test_tiled_equals_naive(causal, heads, kv_heads, len_q, len_k, block_q, block_k):
    g = torch.Generator().manual_seed(len_q * 100 + len_k)
    q = torch.randn(heads, len_q, 32, generator=g)
    k = torch.randn(kv_heads, len_k, 32, generator=g)
    v = torch.randn(kv_heads, len_k, 32, generator=g)
    expected = naive_attention(q, k, v, causal)
    got = tiled_attention(q, k, v, causal, block_q=block_q, block_k=block_k)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite_thanks_to_the_running_max():
    q = torch.randn(2, 40, 16) * 30  # exp of raw scores would overflow float32
    k = torch.randn(2, 40, 16) * 30
    v = torch.randn(2, 40, 16)
    got = tiled_attention(q, k, v, causal=True, block_q=8, block_k=8)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, naive_attention(q, k, v, True), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        tiled_attention(torch.randn(5, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="len_q <= len_k"):
        tiled_attention(torch.randn(2, 9, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8))
