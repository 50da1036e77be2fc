"""Metrics the quantization decisions are judged by: held-out perplexity for LLMs.

Windows come from ``fivefold.data``: calibration windows from the calibration part
of pydoc_data, evaluation windows from the held-out part, never the same text.
"""

from __future__ import annotations

import math

import torch

from fivefold.data import corpus_ids, corpus_prompts
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


def language_metrics(model, windows: list[list[int]]) -> tuple[float, float]:
    """(perplexity, next-token accuracy in %) over every position of every window, one pass."""
    total, hits, count = 0.0, 0, 0
    for ids in windows:
        logits = sequence_logits(model, ids)[:-1]
        target = torch.as_tensor(ids[1:], dtype=torch.long)
        total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        hits += int((logits.argmax(dim=-1) == target).sum())
        count += target.numel()
    return math.exp(total / count), 100.0 * hits / count


def perplexity(model, windows: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over every position of every window."""
    return language_metrics(model, windows)[0]


def next_token_accuracy(model, windows: list[list[int]]) -> float:
    """Share (%) of positions where the most likely token is the next one."""
    return language_metrics(model, windows)[1]


def text_windows(tokenizer, part: str, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` windows of ``length`` tokens from the ``calibration`` or ``heldout`` part."""
    return corpus_prompts(corpus_ids(tokenizer, part), num, length, seed)
