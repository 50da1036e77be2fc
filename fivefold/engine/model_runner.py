"""The owner of the model's tensors: weights and the KV cache pool.

Turns the scheduler's decision into one flat batch (token ids, positions, slot
mapping, block tables), runs the model and returns logits for the sequences that
sample this step (those whose prompt is fully computed after it).
"""

from __future__ import annotations

import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.sequence import Sequence
from fivefold.errors import FivefoldError
from fivefold.models.attention import AttentionMetadata
from fivefold.models.llama import LlamaForCausalLM


def kv_bytes_per_token(model: LlamaForCausalLM) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        self.model = model
        model.pack_for_serving()  # idempotent: only plain nn.Linear modules are swapped
        self.block_size = config.block_size
        c = model.config
        bytes_per_block = kv_bytes_per_token(model) * config.block_size
        self.num_blocks = config.kv_cache_bytes() // bytes_per_block
        if self.num_blocks < 1:
            raise FivefoldError(
                f"kv_cache_memory {config.kv_cache_bytes()} bytes is less than one block ({bytes_per_block} bytes)"
            )
        # Zero-filled once: padded decode reads hit finite values only (see attention.py).
        self.kv_caches = [
            torch.zeros(2, self.num_blocks, c.num_kv_heads, config.block_size, c.head_dim, dtype=model.dtype)
            for _ in range(c.num_layers)
        ]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
        max_blocks = max(len(seq.block_ids) for seq, _ in scheduled)
        tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.long)
        for row, (seq, _) in enumerate(scheduled):
            tables[row, : len(seq.block_ids)] = torch.tensor(seq.block_ids)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=tables,
            block_size=bs,
        )
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step; return logits [num_sampling, vocab] and the sequences they belong to."""
        input_ids, positions, meta = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        rows, sampling = [], []
        for i, (seq, num_new) in enumerate(scheduled):
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                rows.append(meta.query_start_loc[i + 1] - 1)
                sampling.append(seq)
        if not rows:
            return torch.empty(0, self.model.config.vocab_size), []
        return self.model.compute_logits(hidden[rows]), sampling
