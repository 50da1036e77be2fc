"""Paged attention against plain causal attention on contiguous tensors, through both
decode paths (the compiled kernel and the PyTorch gather + SDPA fallback)."""

from __future__ import annotations

import pytest
import torch

import fivefold.models.attention as attention
from fivefold.kernels import paged_attention_ops
from fivefold.models.attention import AttentionMetadata, paged_attention

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
    full = []
    qs, ks, vs, slots, tables, qsl, lens = [], [], [], [], [], [0], []
    for cached, new in cases:
        L = cached + new
        q_all, k_all, v_all = torch.randn(L, H, D), torch.randn(L, KVH, D), torch.randn(L, KVH, D)
        blocks = [free.pop() for _ in range(-(-L // BS))]
        for p in range(cached):  # pretend earlier steps wrote the context
            cache[0, blocks[p // BS], :, p % BS] = k_all[p]
            cache[1, blocks[p // BS], :, p % BS] = v_all[p]
        qs.append(q_all[cached:]); ks.append(k_all[cached:]); vs.append(v_all[cached:])
        slots += [blocks[p // BS] * BS + p % BS for p in range(cached, L)]
        tables.append(blocks)
        qsl.append(qsl[-1] + new)
        lens.append(L)
        full.append((q_all, k_all, v_all, new))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=lens, slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]), block_size=BS,
                             use_tiled_prefill=use_tiled_prefill)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, D ** -0.5)
    for i, (q_all, k_all, v_all, new) in enumerate(full):
        expected = reference(q_all, k_all, v_all, new)
        assert torch.allclose(out[qsl[i]:qsl[i + 1]], expected, atol=1e-5), f"sequence {i}"
