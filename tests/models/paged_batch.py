"""One step's flat batch over a paged KV cache, for attention tests: random queries, keys and
values of several sequences, the context of earlier steps already written to scattered blocks."""

from __future__ import annotations

import torch


def paged_step(cache: torch.Tensor, cases, free: list[int], num_heads: int, head_dim: int, write_row=None):
    """``cases``: (tokens already cached, new tokens) per sequence. Writes each sequence's cached
    context into blocks popped from ``free`` (``write_row(k, v) -> (k row, v row)`` as the cache
    holds them; plain copies by default). Returns ((q, k, v) of the new tokens, the
    AttentionMetadata keyword arguments, and (q_all, k_all, v_all, num_new) per sequence)."""
    num_kv_heads, block_size = cache.shape[2], cache.shape[3]
    if write_row is None:
        write_row = lambda k, v: (k, v)  # noqa: E731
    qs, ks, vs, slots, tables, qsl, lens, full = [], [], [], [], [], [0], [], []
    for cached, new in cases:
        L = cached + new
        q_all = torch.randn(L, num_heads, head_dim)
        k_all, v_all = torch.randn(L, num_kv_heads, head_dim), torch.randn(L, num_kv_heads, head_dim)
        blocks = [free.pop() for _ in range(-(-L // block_size))]
        for p in range(cached):  # pretend earlier steps wrote the context
            rk, rv = write_row(k_all[p], v_all[p])
            cache[0, blocks[p // block_size], :, p % block_size] = rk
            cache[1, blocks[p // block_size], :, p % block_size] = rv
        qs.append(q_all[cached:]); ks.append(k_all[cached:]); vs.append(v_all[cached:])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, L)]
        tables.append(blocks)
        qsl.append(qsl[-1] + new)
        lens.append(L)
        full.append((q_all, k_all, v_all, new))
    width = max(len(t) for t in tables)
    meta_args = dict(query_start_loc=qsl, seq_lens=lens, slot_mapping=torch.tensor(slots),
                     block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]), block_size=block_size)
    return (torch.cat(qs), torch.cat(ks), torch.cat(vs)), meta_args, full
