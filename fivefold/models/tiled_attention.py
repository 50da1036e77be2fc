"""Tiled attention: blockwise, with an online softmax, never holding the N x N scores.

For each block of queries, keys and values are visited a block at a time while a
running maximum ``m``, a running normaliser ``l`` and an unnormalised output ``acc``
are kept per query row; when a new block raises the maximum, what was accumulated is
rescaled by ``exp(m_old - m_new)`` (the FlashAttention recurrence). The extra memory is
one ``[heads, block_q, block_k]`` score tile plus the per-row state, linear in N, where
naive attention holds ``[heads, N, N]``.

Grouped-query attention is handled by viewing the query heads as
``[kv_heads, group, ...]`` against their shared key/value head, without repeating K/V.
Causal masking follows the prefill convention: query i of ``Lq`` sits at position
``Lk - Lq + i`` and sees keys up to it; key blocks entirely in a query block's future
are skipped, not computed and masked.
"""

from __future__ import annotations

import math

import torch


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, block_q: int = 128, block_k: int = 128) -> torch.Tensor:
    """q: [H, Lq, D]; k, v: [KVH, Lk, D] with H a multiple of KVH. Returns [H, Lq, D]."""
    num_heads, len_q, dim = q.shape
    num_kv_heads, len_k, _ = k.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    if block_q < 1 or block_k < 1:
        raise ValueError("block sizes must be >= 1")
    if causal and len_q > len_k:
        raise ValueError(f"causal attention needs len_q <= len_k, got {len_q} > {len_k}")
    group = num_heads // num_kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    qg = q.reshape(num_kv_heads, group, len_q, dim)  # [KVH, G, Lq, D]
    kg, vg = k.unsqueeze(1), v.unsqueeze(1)  # [KVH, 1, Lk, D]
    out = torch.empty_like(qg)
    offset = len_k - len_q  # position of query 0 among the keys
    for q0 in range(0, len_q, block_q):
        q1 = min(q0 + block_q, len_q)
        q_blk = qg[:, :, q0:q1] * scale  # [KVH, G, bq, D]
        rows = q1 - q0
        m = torch.full((num_kv_heads, group, rows, 1), -math.inf, dtype=torch.float32)
        l = torch.zeros((num_kv_heads, group, rows, 1), dtype=torch.float32)
        acc = torch.zeros((num_kv_heads, group, rows, dim), dtype=torch.float32)
        k_end = min(len_k, offset + q1) if causal else len_k  # keys beyond the block's last query are future
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, k_end)
            s = (q_blk @ kg[:, :, k0:k1].transpose(-1, -2)).float()  # [KVH, G, bq, bk]
            if causal and k1 - 1 > offset + q0:  # the tile crosses the diagonal: mask the future keys
                q_pos = torch.arange(q0, q1).unsqueeze(1) + offset
                k_pos = torch.arange(k0, k1).unsqueeze(0)
                s = s.masked_fill(k_pos > q_pos, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            correction = torch.exp(m - m_new)
            l = l * correction + p.sum(dim=-1, keepdim=True)
            acc = acc * correction + p.to(v.dtype) @ vg[:, :, k0:k1]
            m = m_new
        out[:, :, q0:q1] = (acc / l).to(out.dtype)
    return out.reshape(num_heads, len_q, dim)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """The reference: the full [H, Lq, Lk] score matrix, softmax, then V (same conventions)."""
    num_heads, len_q, dim = q.shape
    group = num_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(dim))
    if causal:
        offset = k.shape[1] - len_q
        mask = torch.arange(k.shape[1]).unsqueeze(0) > torch.arange(len_q).unsqueeze(1) + offset
        s = s.masked_fill(mask, -math.inf)
    return torch.softmax(s, dim=-1) @ v
