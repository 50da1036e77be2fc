"""Paged attention against plain causal attention on contiguous tensors, through both
decode paths (the compiled kernel and the PyTorch gather + SDPA fallback)."""

from __future__ import annotations

import pytest
import torch

import fivefold.models.attention as attention
from fivefold.kernels import paged_attention_ops
from fivefold.models.attention import AttentionMetadata, paged_attention
from tests.models.paged_batch import paged_step

H, KVH, D, BS = 6, 2, 16, 4


def reference(q_all, k_all, v_all, q_len):
    """Causal attention of the last q_len positions over the whole sequence (GQA by repetition)."""
    L = k_all.shape[0]
    k = k_all.repeat_interleave(H // KVH, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_all.repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    q = q_all[L - q_len:].transpose(0, 1)  # [H, q_len, D]
    scores = q @ k.transpose(1, 2) / D ** 0.5
    pos = torch.arange(L - q_len, L).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(L).unsqueeze(0) > pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [q_len, H, D]


@pytest.mark.parametrize("use_kernel,use_tiled_prefill", [(True, False), (False, False), (True, True)])
def test_mixed_batch_equals_reference(use_kernel, use_tiled_prefill, monkeypatch):
    if use_kernel:
        assert paged_attention_ops() is not None, "the C++ kernel must build on this machine"
    else:
        monkeypatch.setattr(attention, "paged_attention_ops", lambda: None)
    torch.manual_seed(0)
    # (context already cached, new tokens): decodes of unequal length, a fresh prompt, a chunk with context.
    cases = [(9, 1), (22, 1), (0, 7), (13, 5), (3, 1)]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks, KVH, BS, D)
    free = list(torch.randperm(num_blocks).tolist())  # scattered blocks
    (q, k, v), meta_args, full = paged_step(cache, cases, free, H, D)
    meta = AttentionMetadata(**meta_args, use_tiled_prefill=use_tiled_prefill)
    qsl = meta_args["query_start_loc"]
    out = paged_attention(q, k, v, cache, meta, D ** -0.5)
    for i, (q_all, k_all, v_all, new) in enumerate(full):
        expected = reference(q_all, k_all, v_all, new)
        assert torch.allclose(out[qsl[i]:qsl[i + 1]], expected, atol=1e-5), f"sequence {i}"


@pytest.mark.parametrize("head_dim", [16, 64, 128, 24])  # 24: not a multiple of the vector width (scalar kernel)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_kernel_head_dims_and_dtypes_against_float64(head_dim, cache_dtype):
    """paged_decode_attention's vector kernel (head_dim a multiple of 1-16 vectors) and its scalar
    fallback, on float32, bfloat16 and int8 caches: many work items per thread (so each prefetches
    the next item's rows), contexts of 1 to 9 blocks of 16 (partial last blocks), scattered blocks,
    3 query heads per KV head; against attention in float64 over what the cache holds."""
    from fivefold.models import kv_quant

    ops = paged_attention_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    lens = [1, 15, 16, 17, 40, 100, 141, 3, 77, 128]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    is_int8 = cache_dtype == torch.int8
    row = head_dim + 4 if is_int8 else head_dim
    cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, row, dtype=cache_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    q_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(q_dtype)
    tables, contexts = [], []
    for n in lens:
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        kv = torch.randn(2, n, num_kv_heads, head_dim, generator=gen) * torch.tensor([2.0, 1.0]).view(2, 1, 1, 1)
        stored = kv_quant.quantize_rows(kv) if is_int8 else kv.to(cache_dtype)
        for p in range(n):
            cache[:, blocks[p // block_size], :, p % block_size] = stored[:, p]
        held = kv_quant.dequantize(stored) if is_int8 else stored.float()  # what the kernel reads
        tables.append(blocks)
        contexts.append(held.double())
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = ops.paged_decode_attention(q, cache, table, torch.tensor(lens), head_dim ** -0.5)
    assert out.dtype == q_dtype and out.shape == q.shape
    group = num_heads // num_kv_heads
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-5
    for s, (k, v) in enumerate(contexts):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[s].double(), k) * head_dim ** -0.5
        expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
        diff = (out[s].double() - expected).abs().max().item()
        assert diff <= tol, f"sequence {s} (length {lens[s]}): {diff}"


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_decode_kernel_one_or_two_sequences(num_kv_heads, cache_dtype):
    """Fewer work items than threads and one thread's walk ending inside a sequence: one sequence
    at a time (1 token to 40 blocks) and two of unequal lengths, 1-3 KV heads; against float64."""
    from fivefold.models import kv_quant

    ops = paged_attention_ops()
    torch.manual_seed(num_kv_heads)
    head_dim, block_size, group = 64, 16, 3
    num_heads = num_kv_heads * group
    is_int8 = cache_dtype == torch.int8
    for lens in ([1], [2], [16], [17], [100], [640], [7, 300]):
        num_blocks = sum(-(-n // block_size) for n in lens) + 3
        cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_dim + 4 if is_int8 else head_dim,
                            dtype=cache_dtype)
        free = torch.randperm(num_blocks).tolist()
        tables, contexts = [], []
        for n in lens:
            blocks = [free.pop() for _ in range(-(-n // block_size))]
            kv = torch.randn(2, n, num_kv_heads, head_dim) * 2
            stored = kv_quant.quantize_rows(kv) if is_int8 else kv
            for p in range(n):
                cache[:, blocks[p // block_size], :, p % block_size] = stored[:, p]
            contexts.append((kv_quant.dequantize(stored) if is_int8 else stored).double())
            tables.append(blocks)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        q = torch.randn(len(lens), num_heads, head_dim)
        out = ops.paged_decode_attention(q, cache, table, torch.tensor(lens), head_dim ** -0.5)
        for s, (k, v) in enumerate(contexts):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[s].double(), k) * head_dim ** -0.5
            expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
            diff = (out[s].double() - expected).abs().max().item()
            assert diff <= 1e-5, f"lengths {lens}, sequence {s}: {diff}"
