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
