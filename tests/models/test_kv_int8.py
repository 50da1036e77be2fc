"""The int8 KV cache's row layout (fivefold.models.kv_quant) and the paged kernels that read it
(paged_decode_attention, paged_prefill_attention) against gather + dequantize + SDPA, on float32
and int8 caches with scattered blocks, GQA and unequal lengths; and paged_attention's paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fivefold.models.attention as attention
from fivefold.errors import FivefoldError
from fivefold.kernels import fused_ops, paged_attention_ops
from fivefold.models import kv_quant
from fivefold.models.attention import AttentionMetadata, paged_attention
from tests.models.paged_batch import paged_step

H, KVH, D, BS = 4, 2, 16, 4
NUM_BLOCKS = 96


def test_quantize_rows_layout_and_round_trip_error():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10  # rows of very different ranges
    x[7, 1] = 0  # an all-zero row
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = kv_quant.scales(rows)  # [50, 3], a view of the last 4 bytes
    assert scale.shape == (50, 3) and scale.dtype == torch.float32
    expected_scale = (x.abs().amax(-1) / 127).clamp(min=kv_quant.SCALE_FLOOR)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    # The scale's bytes are the row's last 4, the values its first D.
    assert torch.equal(rows[3, 2, 64:].view(torch.float32), scale[3, 2:3])
    values = kv_quant.values(rows)
    assert values.shape == (50, 3, 64) and int(values.abs().max()) <= 127
    assert int(values.abs().amax(-1).min()) == 0 and int(values.abs().amax(-1)[0, 0]) == 127
    err = (kv_quant.dequantize(rows) - x).abs()  # [50, 3, 64]
    assert bool((err <= scale.unsqueeze(-1) / 2 * (1 + 1e-5)).all()), "round trip error above half a step"
    assert float(err[7, 1].max()) == 0 and float(kv_quant.dequantize(rows)[7, 1].abs().max()) == 0
    # Writing through the scales view writes the row's bytes.
    kv_quant.scales(rows)[0, 0] = 2.0
    assert rows[0, 0, 64:].view(torch.float32).item() == 2.0


def test_head_dim_must_be_a_multiple_of_4():
    with pytest.raises(FivefoldError, match="head_dim % 4 == 0"):
        kv_quant.quantize_rows(torch.randn(3, 2, 6))
    with pytest.raises(FivefoldError, match="head_dim % 4 == 0"):
        kv_quant.check_head_dim(30)


def _random_paged(cases, is_int8: bool, seed: int = 0):
    """A cache with the contexts of ``cases`` ([(seq_len, query_len)]) in scattered blocks; returns
    (cache, block tables [S, n], full keys and values per sequence as the cache holds them)."""
    g = torch.Generator().manual_seed(seed)
    row = D + 4 if is_int8 else D
    cache = torch.zeros(2, NUM_BLOCKS, KVH, BS, row, dtype=torch.int8 if is_int8 else torch.float32)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, contexts = [], []
    for seq_len, _ in cases:
        blocks = [free.pop() for _ in range(-(-seq_len // BS))]
        k = torch.randn(seq_len, KVH, D, generator=g) * 2
        v = torch.randn(seq_len, KVH, D, generator=g)
        if is_int8:
            k, v = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
        for p in range(seq_len):
            cache[0, blocks[p // BS], :, p % BS] = k[p]
            cache[1, blocks[p // BS], :, p % BS] = v[p]
        if is_int8:
            k, v = kv_quant.dequantize(k), kv_quant.dequantize(v)
        tables.append(blocks)
        contexts.append((k, v))
    width = max(len(t) for t in tables)
    return cache, torch.tensor([t + [0] * (width - len(t)) for t in tables]), contexts


def _gather_reference(cache, table, seq_len, q):
    """Gather + dequantize + SDPA with the causal offset mask: q [n, H, D] the last n positions."""
    k, v = attention._gather_context(cache, table, seq_len, torch.float32)  # [KVH, L, D]
    n = q.shape[0]
    k, v = k.repeat_interleave(H // KVH, dim=0), v.repeat_interleave(H // KVH, dim=0)
    mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - n, seq_len).unsqueeze(1)  # [n, L]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=D ** -0.5).transpose(0, 1)


@pytest.mark.parametrize("is_int8", [False, True])
def test_paged_decode_attention_matches_gather_reference(is_int8):
    ops = paged_attention_ops()
    assert ops is not None, "the C++ kernel must build on this machine"
    cases = [(1, 1), (5, 1), (17, 1), (40, 1), (8, 1)]
    cache, tables, contexts = _random_paged(cases, is_int8)
    q = torch.randn(len(cases), H, D)
    out = ops.paged_decode_attention(q, cache, tables, torch.tensor([n for n, _ in cases]), D ** -0.5)
    for s, (seq_len, _) in enumerate(cases):
        expected = _gather_reference(cache, tables[s], seq_len, q[s:s + 1])[0]
        diff = (out[s] - expected).abs().max().item()
        assert diff <= 1e-4, f"sequence {s}: {diff}"
        k, v = contexts[s]  # the reference reads what the cache holds
        plain = _plain_attention(q[s:s + 1], k, v)[0]
        assert (out[s] - plain).abs().max().item() <= 1e-4


def _plain_attention(q, k, v):
    """q [n, H, D] (the last n positions) over k, v [L, KVH, D], causal, by explicit softmax."""
    L, n = k.shape[0], q.shape[0]
    k, v = k.repeat_interleave(H // KVH, dim=1).transpose(0, 1), v.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * D ** -0.5  # [H, n, L]
    scores = scores.masked_fill(torch.arange(L).unsqueeze(0) > torch.arange(L - n, L).unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("is_int8", [False, True])
def test_paged_prefill_attention_matches_gather_reference(is_int8):
    ops = paged_attention_ops()
    assert ops is not None
    # (seq_len, query_len): query lengths 1..5, a chunk after a long context, a chunk longer than a
    # query tile (16) and not a multiple of the block size, a whole prompt (query_len == seq_len).
    cases = [(9, 1), (12, 2), (6, 3), (30, 4), (7, 5), (120, 37), (50, 50), (23, 17)]
    cache, tables, _ = _random_paged(cases, is_int8, seed=1)
    starts = [0]
    for _, n in cases:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], H, D) * 1.5
    out = ops.paged_prefill_attention(q, cache, tables, torch.tensor(starts), torch.tensor([n for n, _ in cases]),
                                      D ** -0.5)
    assert out.shape == q.shape
    for s, (seq_len, n) in enumerate(cases):
        expected = _gather_reference(cache, tables[s], seq_len, q[starts[s]:starts[s + 1]])
        diff = (out[starts[s]:starts[s + 1]] - expected).abs().max().item()
        assert diff <= 1e-4, f"sequence {s} (seq_len {seq_len}, query_len {n}): {diff}"


def test_kernels_refuse_mismatched_caches():
    ops = paged_attention_ops()
    q = torch.randn(1, H, D)
    bad = torch.zeros(2, 4, KVH, BS, D, dtype=torch.int8)  # int8 without room for the scale
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        ops.paged_decode_attention(q, bad, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.paged_prefill_attention(q, torch.zeros(2, 4, KVH, BS, D, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.long),
                                    torch.tensor([0, 1]), torch.tensor([1]), 1.0)


def _mixed_batch(is_int8: bool):
    """A step mixing decodes, chunks and a whole prompt, with the context of earlier steps written."""
    torch.manual_seed(0)
    cases = [(9, 1), (0, 7), (13, 5), (3, 2), (22, 1), (30, 20)]  # (context already cached, new tokens)
    cache = torch.zeros(2, NUM_BLOCKS, KVH, BS, D + 4 if is_int8 else D, dtype=torch.int8 if is_int8 else torch.float32)
    free = torch.randperm(NUM_BLOCKS).tolist()
    # An int8 cache holds rotated keys (kv_quant.key_rotation), as paged_attention writes them.
    write = ((lambda k, v: (kv_quant.quantize_rows(k @ kv_quant.key_rotation(D)), kv_quant.quantize_rows(v)))
             if is_int8 else None)
    qkv, meta_args, full = paged_step(cache, cases, free, H, D, write)
    return cache, qkv, meta_args, full


@pytest.mark.parametrize("is_int8", [False, True])
def test_paged_attention_kernel_and_torch_paths_agree_with_the_reference(is_int8):
    """paged_attention with the kernels (decode + prefill kernel) and without (gather + SDPA) against
    plain attention over the keys and values as the cache holds them (the int8 round trip, also for
    the whole prompt)."""
    outs = {}
    for use_kernel in (True, False):
        cache, (q, k, v), meta_args, full = _mixed_batch(is_int8)
        meta = AttentionMetadata(**meta_args, use_decode_kernel=use_kernel)
        if use_kernel:
            assert meta.chunk_plan() is not None and meta.chunk_plan().rows == {2, 3, 5}
        outs[use_kernel] = paged_attention(q, k, v, cache, meta, D ** -0.5)
        qsl = meta_args["query_start_loc"]
        for i, (q_all, k_all, v_all, new) in enumerate(full):
            if is_int8:  # rotated queries and keys (the scores are the same in exact arithmetic), int8 round trips
                rotation = kv_quant.key_rotation(D)
                q_all, k_all = q_all @ rotation, kv_quant.dequantize(kv_quant.quantize_rows(k_all @ rotation))
                v_all = kv_quant.dequantize(kv_quant.quantize_rows(v_all))
            expected = _plain_attention(q_all[-new:], k_all, v_all)
            diff = (outs[use_kernel][qsl[i]:qsl[i + 1]] - expected).abs().max().item()
            assert diff <= 1e-5, f"kernel={use_kernel} sequence {i}: {diff}"
    assert (outs[True] - outs[False]).abs().max().item() <= 1e-5


def test_int8_write_stores_quantized_rows():
    cache, (q, k, v), meta_args, _ = _mixed_batch(True)
    meta = AttentionMetadata(**meta_args)
    paged_attention(q, k, v, cache, meta, D ** -0.5)
    blocks, offsets = meta.slot_blocks_and_offsets()
    assert torch.equal(cache[0, blocks, :, offsets], kv_quant.quantize_rows(k @ kv_quant.key_rotation(D)))
    assert torch.equal(cache[1, blocks, :, offsets], kv_quant.quantize_rows(v))


@pytest.mark.parametrize("head_dim", [16, 64, 24])
def test_key_rotation_is_orthonormal_and_spreads_an_outlier_channel(head_dim):
    """R R^T = I (scores unchanged), and a key whose one large channel would leave the others few
    int8 levels quantizes with a much smaller score error once rotated."""
    rotation = kv_quant.key_rotation(head_dim)
    assert torch.allclose(rotation @ rotation.T, torch.eye(head_dim), atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(256, 1, head_dim, generator=gen)
    keys[..., 3] *= 40.0  # an outlier channel, as Llama keys have after RoPE
    queries = torch.randn(256, 1, head_dim, generator=gen)
    exact = (queries * keys).sum(-1)
    plain = (queries * kv_quant.dequantize(kv_quant.quantize_rows(keys))).sum(-1)
    rotated = ((queries @ rotation) * kv_quant.dequantize(kv_quant.quantize_rows(keys @ rotation))).sum(-1)
    assert (rotated - exact).abs().mean() < 0.5 * (plain - exact).abs().mean()


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # the two fixed-size loops and the general one
def test_rotate_qk_kernel_equals_the_matmul_in_float64(num_tokens, head_dim):
    """fivefold::rotate_qk_ (the C++ decode loop's key rotation) rotates q and k, views into one
    fused qkv row as the loop passes them, in place, to x @ R computed in float64; the values past
    q and k (v) are left alone. 64 tokens x 12 rows takes the multi-threaded branch."""
    ops = fused_ops()
    if ops is None:
        pytest.skip("the fused_ops extension did not build here")
    heads, kv_heads = 9, 3
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    # A seeded orthonormal matrix that is not symmetric (key_rotation's Hadamard is, and would hide
    # a transposed index): the op takes any [D, D].
    rotation = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))[0].float()
    assert not torch.allclose(rotation, rotation.T)
    expected_q, expected_k = q.double() @ rotation.double(), k.double() @ rotation.double()
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    ops.rotate_qk_(q, k, rotation)
    torch.testing.assert_close(q.double(), expected_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k.double(), expected_k, rtol=0, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)
    with pytest.raises(RuntimeError, match="rotate_qk_: r must be"):
        ops.rotate_qk_(q, k, torch.eye(head_dim + 1))
