"""Attention over a paged KV cache, for a flat batch that mixes prefills and decodes.

The batch is a concatenation of the new tokens of many sequences. Sequence ``i``
owns flat rows ``query_start_loc[i]:query_start_loc[i+1]`` and, after this step,
has ``seq_lens[i]`` tokens of context; its keys and values live in the cache blocks
listed in ``block_tables[i]``. New keys/values are written at ``slot_mapping``
(``block_id * block_size + offset``) before attention reads them back, so a chunk
of a prompt attends to the chunks computed in earlier steps.

A layer's cache is ``[2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]``:
head-major inside a block, so one head's rows of a block are contiguous (what the
decode kernel streams) and a gathered context is already in SDPA's [KVH, L, D].
With ``kv_cache_dtype="int8"`` it is int8 ``[..., head_dim + 4]``, each row its values and
its float32 scale (fivefold.models.kv_quant); keys and values are quantized when written.

Three kinds of sequence in a step, and what reads their context:

- decode (one new token over a cached context): the C++ paged decode kernel
  (``use_decode_kernel``), else gather + SDPA;
- chunk (several new tokens after a cached context: chunked prefill, a prefix-cache hit,
  speculative verification): the C++ paged prefill kernel, which reads the blocks in place
  (``use_decode_kernel``, unless ``use_tiled_prefill``), else gather + SDPA (or tiled attention);
- whole prompt (every token new): attends to this step's keys and values directly, SDPA (or
  tiled attention). With an int8 cache it attends to their quantize-dequantize round trip, the
  keys and values as the cache holds them: a prompt then sees the same keys whether it ran in one
  step or in chunks, and a perplexity measured on whole prompts includes the int8 cache's cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fivefold.kernels import paged_attention_ops
from fivefold.models import kv_quant
from fivefold.models.tiled_attention import tiled_attention



@dataclass
class AttentionMetadata:
    """Where each sequence's queries, context and cache slots are in this step."""

    query_start_loc: list[int]  # [num_seqs + 1] offsets into the flat token batch
    seq_lens: list[int]  # [num_seqs] context length after this step's tokens are added
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    block_size: int
    use_decode_kernel: bool = True  # False: gather + SDPA even where the C++ kernel is available
    use_tiled_prefill: bool = False  # True: prompts and chunks through fivefold.models.tiled_attention
    _decode_plan: "_DecodePlan | None" = field(default=None, repr=False)
    _chunk_plan: "_ChunkPlan | None" = field(default=None, repr=False)
    _slot_parts: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def slot_blocks_and_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of every new token, computed once per step."""
        if self._slot_parts is None:
            self._slot_parts = (self.slot_mapping // self.block_size, self.slot_mapping % self.block_size)
        return self._slot_parts

    def decode_plan(self) -> "_DecodePlan | None":
        """Index tensors for the batched decode path, built once per step, shared by all layers."""
        if self._decode_plan is None:
            rows = [i for i in range(self.num_seqs) if self.query_len(i) == 1 and self.seq_lens[i] > 1]
            if not rows:
                return None
            seq_lens = [self.seq_lens[i] for i in rows]
            max_len = max(seq_lens)
            num_blocks = -(-max_len // self.block_size)
            lens = torch.tensor(seq_lens, dtype=torch.long)
            # Unequal lengths need a padding mask; equal ones (e.g. a single stream) do not.
            mask = None
            if min(seq_lens) != max_len:
                mask = (torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [B, 1, 1, L]
            self._decode_plan = _DecodePlan(
                rows=set(rows),
                token_rows=torch.tensor([self.query_start_loc[i] for i in rows]),
                tables=self.block_tables[rows, :num_blocks],
                max_len=max_len,
                mask=mask,
                seq_lens=lens,
            )
        return self._decode_plan

    def chunk_plan(self) -> "_ChunkPlan | None":
        """Index tensors for the paged prefill kernel (sequences with 1 < query_len < seq_len),
        built once per step, shared by all layers; None when the step has no such sequence."""
        if self._chunk_plan is None:
            rows = [i for i in range(self.num_seqs) if 1 < self.query_len(i) < self.seq_lens[i]]
            if not rows:
                return None
            lens = [self.query_len(i) for i in rows]
            starts = [0]
            for n in lens:
                starts.append(starts[-1] + n)
            num_blocks = -(-max(self.seq_lens[i] for i in rows) // self.block_size)
            self._chunk_plan = _ChunkPlan(
                rows=set(rows),
                token_rows=torch.cat([torch.arange(self.query_start_loc[i], self.query_start_loc[i + 1]) for i in rows]),
                query_start_loc=torch.tensor(starts, dtype=torch.long),
                tables=self.block_tables[rows, :num_blocks],
                seq_lens=torch.tensor([self.seq_lens[i] for i in rows], dtype=torch.long),
            )
        return self._chunk_plan


@dataclass
class _ChunkPlan:
    rows: set[int]  # sequence indices served by the paged prefill kernel
    token_rows: torch.Tensor  # [N] flat token indices of their queries, sequence after sequence
    query_start_loc: torch.Tensor  # [len(rows) + 1] int64 offsets into token_rows
    tables: torch.Tensor  # [len(rows), n] block tables cut to the longest context
    seq_lens: torch.Tensor  # [len(rows)] int64


@dataclass
class _DecodePlan:
    rows: set[int]  # sequence indices served by the batched decode path
    token_rows: torch.Tensor  # [B] flat token index of each decode query
    tables: torch.Tensor  # [B, n] block tables cut to the longest context
    max_len: int
    mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is real, None if no padding
    seq_lens: torch.Tensor  # [B] int64


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, is_causal: bool, scale: float):
    """q: [H, Lq, D], k/v: [KVH, Lk, D] -> [H, Lq, D].

    KV heads are repeated to the query heads and a batch dim is added: on CPU that
    selects the flash kernel (enable_gqa, or 3-d inputs, fall back to the math path,
    3.3x slower for a 512-token causal prefill here).
    """
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                         is_causal=is_causal, scale=scale)
    return out.squeeze(0)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: "AttentionMetadata"):
    """Store this step's keys and values ([T, KVH, D]) at their slots; return them as the cache
    holds them: ``k, v`` themselves, or with an int8 cache their int8 rows [T, KVH, D + 4]."""
    if kv_quant.is_int8_cache(kv_cache):
        k, v = kv_quant.quantize_rows(k), kv_quant.quantize_rows(v)
    blocks, offsets = meta.slot_blocks_and_offsets()
    kv_cache[0, blocks, :, offsets] = k
    kv_cache[1, blocks, :, offsets] = v
    return k, v


def paged_attention(
    q: torch.Tensor,  # [num_tokens, H, D]
    k: torch.Tensor,  # [num_tokens, KVH, D]
    v: torch.Tensor,  # [num_tokens, KVH, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, KVH, block_size, D], or int8 [..., D + 4]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's whole context (see the module
    docstring for which path serves which sequence)."""
    is_int8 = kv_quant.is_int8_cache(kv_cache)
    if is_int8:  # an int8 cache holds rotated keys; rotated queries meet them (kv_quant.key_rotation)
        rotation = kv_quant.key_rotation(q.shape[-1]).to(q.dtype)
        q, k = q @ rotation, k @ rotation
    k_stored, v_stored = write_kv_cache(k, v, kv_cache, meta)
    out = torch.empty_like(q)
    plan = meta.decode_plan()
    ops = paged_attention_ops() if meta.use_decode_kernel and kv_cache.device.type == "cpu" else None
    chunks = meta.chunk_plan() if ops is not None and not meta.use_tiled_prefill else None
    for i in range(meta.num_seqs):
        if (plan is not None and i in plan.rows) or (chunks is not None and i in chunks.rows):
            continue
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        query_len, seq_len = end - start, meta.seq_lens[i]
        if query_len == seq_len:
            # A whole prompt in one step: its keys are the ones just computed (as the cache holds them).
            ki, vi = k_stored[start:end], v_stored[start:end]
            if is_int8:
                ki, vi = kv_quant.dequantize(ki, q.dtype), kv_quant.dequantize(vi, q.dtype)
            ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)  # [KVH, L, D]
            mask, is_causal = None, query_len > 1
        else:
            ki, vi = _gather_context(kv_cache, meta.block_tables[i], seq_len, q.dtype)  # [KVH, L, D]
            # Query j sits at position seq_len - query_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
            mask, is_causal = torch.arange(seq_len).unsqueeze(0) <= q_pos, False
        if meta.use_tiled_prefill:
            # Its causal convention (query j at position seq_len - query_len + j) needs no mask.
            o = tiled_attention(q[start:end].transpose(0, 1), ki, vi, causal=True, scale=scale)
        else:
            o = _sdpa(q[start:end].transpose(0, 1), ki, vi, mask, is_causal, scale)
        out[start:end] = o.transpose(0, 1)
    if chunks is not None:
        out[chunks.token_rows] = ops.paged_prefill_attention(q[chunks.token_rows], kv_cache, chunks.tables,
                                                             chunks.query_start_loc, chunks.seq_lens, scale)
    if plan is not None:
        _batched_decode(q, kv_cache, plan, scale, out, meta.use_decode_kernel)
    return out


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype):
    """A sequence's keys and values, [KVH, L, D] each, of ``dtype`` (an int8 cache dequantized)."""
    num_blocks = -(-seq_len // kv_cache.shape[3])
    blocks = kv_cache[:, block_table[:num_blocks]]  # [2, n, KVH, block_size, D (+ 4)]
    blocks = blocks.transpose(1, 2).flatten(2, 3)[:, :, :seq_len]  # [2, KVH, L, D (+ 4)]
    if kv_quant.is_int8_cache(kv_cache):
        blocks = kv_quant.dequantize(blocks, dtype)  # [2, KVH, L, D]
    return blocks[0], blocks[1]


def _batched_decode(q, kv_cache, plan: _DecodePlan, scale: float, out, use_kernel: bool = True) -> None:
    """Attention of every single-token query over its paged context.

    With the compiled kernel (fivefold/kernels), keys and values are read in place
    from their blocks: 3-5x faster than gather + SDPA at batch 64 (see the kernel's
    header). Without it: one SDPA call, the context gathered and padded to the longest.

    Padded key slots read whatever block the padding points at (the cache is
    zero-initialised, so the values are finite: an int8 row of zeros has scale 0 and
    dequantizes to 0) and are masked out.
    """
    ops = paged_attention_ops() if use_kernel and kv_cache.device.type == "cpu" else None
    if ops is not None:
        out[plan.token_rows] = ops.paged_decode_attention(q[plan.token_rows], kv_cache, plan.tables, plan.seq_lens, scale)
        return
    kv = kv_cache[:, plan.tables].transpose(2, 3).flatten(3, 4)[..., : plan.max_len, :]  # [2, B, KVH, L, D (+ 4)]
    if kv_quant.is_int8_cache(kv_cache):
        kv = kv_quant.dequantize(kv, q.dtype)  # [2, B, KVH, L, D]
    group = q.shape[1] // kv.shape[2]
    keys = kv[0].repeat_interleave(group, dim=1)  # [B, H, L, D]
    values = kv[1].repeat_interleave(group, dim=1)
    queries = q[plan.token_rows].unsqueeze(2)  # [B, H, 1, D]
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, scale=scale)  # [B, H, 1, D]
    out[plan.token_rows] = o.squeeze(2)
