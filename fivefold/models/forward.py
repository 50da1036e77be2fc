"""One sequence through a Fivefold LLM without the engine: a single prefill into a scratch KV
cache. What calibration (``quantize_``'s ``forward_fn``), pruning's importance scores, distillation
and the quality measures of ``fivefold.eval`` run."""

from __future__ import annotations

import torch

from fivefold.models.attention import AttentionMetadata

BLOCK = 16


def prefill_logits(model, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """float32 logits [T, vocab] of one sequence, computed as a single prefill into a scratch
    KV cache; differentiable when called outside inference mode (KD training uses it)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    num_tokens = ids.numel()
    num_blocks = -(-num_tokens // BLOCK)
    c = model.config
    meta = AttentionMetadata(query_start_loc=[0, num_tokens], seq_lens=[num_tokens],
                             slot_mapping=torch.arange(num_tokens), block_tables=torch.arange(num_blocks)[None, :],
                             block_size=BLOCK)
    caches = [torch.zeros(2, num_blocks, c.num_kv_heads, BLOCK, c.head_dim, dtype=model.dtype)
              for _ in range(c.num_layers)]
    return model.compute_logits(model(ids, torch.arange(num_tokens), meta, caches))


def sequence_logits(model, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """float32 logits [T, vocab] of one sequence, computed as a single prefill (inference mode)."""
    with torch.inference_mode():
        return prefill_logits(model, ids)


def llm_forward(model, ids) -> torch.Tensor:
    """``forward_fn`` for ``quantize_`` on a Fivefold LLM: one calibration window."""
    return sequence_logits(model, ids)
