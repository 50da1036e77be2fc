"""The owner of the model's tensors: weights and the KV cache pool.

Turns the scheduler's decision into one flat batch (token ids, positions, slot
mapping, block tables), runs the model and returns logits for the sequences that
sample this step (those whose prompt is fully computed after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.sampler import token_logprobs
from fivefold.engine.sequence import Sequence
from fivefold.errors import FivefoldError
from fivefold.kernels import fused_ops, paged_attention_ops
from fivefold.models import kv_quant
from fivefold.models.attention import AttentionMetadata
from fivefold.models.llama import LlamaForCausalLM
from fivefold.models.native_decode import NativeDecoder
from fivefold.platform import keep_step_heap


@dataclass
class StepResult:
    """What one model step gives the engine."""

    logits: torch.Tensor  # [sum(1 + len(seq.spec_token_ids) for seq in sampling), vocab]
    sampling: list[Sequence]  # the sequences that sample a token this step
    # request id -> (first prompt position covered, [(logprob, top pairs)] of the following prompt tokens)
    prompt_logprobs: dict = field(default_factory=dict)


def kv_cache_torch_dtype(model: LlamaForCausalLM, kv_cache_dtype: str = "auto") -> torch.dtype:
    """The cache tensors' dtype for ``EngineConfig.kv_cache_dtype``: the model's, or int8."""
    return torch.int8 if kv_cache_dtype == "int8" else model.dtype


def kv_bytes_per_token(model: LlamaForCausalLM, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's keys and values take in the pool, every layer: ``head_dim`` elements of
    the model's dtype per row, or for int8 ``head_dim + 4`` bytes (the values and their scale)."""
    c = model.config
    if kv_cache_dtype == "int8":
        return 2 * c.num_layers * c.num_kv_heads * kv_quant.row_bytes(c.head_dim)
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize


def kv_pool_num_blocks(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Blocks of the KV pool ``config`` gives ``model`` (what :class:`ModelRunner` allocates)."""
    return config.kv_cache_bytes() // (kv_bytes_per_token(model, config.kv_cache_dtype) * config.block_size)


def serving_view(model: LlamaForCausalLM, config: EngineConfig) -> LlamaForCausalLM:
    """The model as this runner serves it, prepared once, here, and never in place: a copy of the
    module tree sharing every weight, whose projections are packed (``weight_layout="packed"``:
    each weight's packed copy made once and shared by every runner, models.layers.packed_linear;
    with the streaming kernel's copy too where memory_plan.wants_stream_copy says so) and whose
    hot-path ops run fused or eager as ``hot_path`` says. Another runner of the same loaded model,
    with other options, sees the model as it was loaded. A model loaded packed (the engine loading
    it itself: one copy of every weight) is served as it was loaded."""
    from fivefold.engine.memory_plan import wants_stream_copy
    from fivefold.models.layers import PackedLinear, module_tree_copy

    loaded_packed = any(isinstance(m, PackedLinear) for m in model.modules())
    if config.weight_layout == "dense" and loaded_packed:
        raise FivefoldError("weight_layout='dense' needs the model's dense weights, but it was loaded packed "
                            "(one copy of every weight): load it again with weight_layout='dense'")
    view = module_tree_copy(model)
    if config.weight_layout == "packed" and not loaded_packed:
        # on the copy: only plain nn.Linear modules are swapped
        view.pack_for_serving(stream_copy=wants_stream_copy(model.config, model.dtype, config))
    view.set_fused_ops(config.hot_path == "fused")
    return view


class ModelRunner:
    """Owns the served model view and the KV pool; :meth:`execute` runs one scheduled step.

    ``kv_cache_dtype`` (torch.int8 or the model's dtype) and ``kv_bytes_per_token`` describe the
    pool as allocated: ``num_blocks * block_size`` tokens of ``kv_bytes_per_token`` bytes each.
    """

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        if config.kv_cache_dtype == "int8":
            kv_quant.check_head_dim(model.config.head_dim)  # before any copy or kernel build
        self.model = serving_view(model, config)
        keep_step_heap()  # after loading: the steps' outputs reuse freed heap instead of faulting in fresh pages
        from fivefold.models.layers import resident_weight_bytes

        # the loaded model's weights and the view's packed layouts (shared ones counted once)
        self.weight_bytes = resident_weight_bytes(model, self.model)
        model = self.model
        if config.hot_path == "fused":
            fused_ops()  # build or load now, not during the first request
        self.use_decode_kernel = config.decode_attention == "kernel"
        self.use_tiled_prefill = config.prefill_attention == "tiled"
        if self.use_decode_kernel:
            paged_attention_ops()  # load (or build) the decode kernel now, not during the first request
        # The C++ layer loop runs the fused kernels and the paged decode kernel: only with both on.
        use_native = (config.decode_loop == "cpp" and config.hot_path == "fused" and self.use_decode_kernel
                      and NativeDecoder.unsupported_reason(model) is None)
        self.native_decoder = NativeDecoder(model) if use_native else None
        self.block_size = config.block_size
        c = model.config
        self.kv_cache_dtype = kv_cache_torch_dtype(model, config.kv_cache_dtype)
        self.kv_bytes_per_token = kv_bytes_per_token(model, config.kv_cache_dtype)
        self.num_blocks = kv_pool_num_blocks(model, config)
        if self.num_blocks < 1:
            raise FivefoldError(f"kv_cache_memory_bytes {config.kv_cache_bytes()} bytes is less than one block "
                                f"({self.kv_bytes_per_token * config.block_size} bytes)")
        # Zero-filled once: padded decode reads hit finite values only (see attention.py); an int8
        # row of zeros is values 0 with scale 0.
        row_size = kv_quant.row_bytes(c.head_dim) if self.kv_cache_dtype == torch.int8 else c.head_dim
        self.kv_caches = [
            torch.zeros(2, self.num_blocks, c.num_kv_heads, config.block_size, row_size, dtype=self.kv_cache_dtype)
            for _ in range(c.num_layers)
        ]

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Flat inputs of one step: token ids, positions and attention metadata.

        Python loops run over sequences only; per-token work (positions, slots) is
        done with tensor ops. A decode-only step (one token per sequence, no proposals) takes
        :meth:`_prepare_decode`, the same values from plain lists.
        """
        if all(n == 1 and not seq.spec_token_ids for seq, n in scheduled):
            return self._prepare_decode(scheduled)
        return self._prepare_any(scheduled)

    def _prepare_any(self, scheduled: list[tuple[Sequence, int]]):
        """:meth:`prepare` for any step: prompts, chunks, proposals, decode rows mixed."""
        num_new = torch.tensor([n for _, n in scheduled], dtype=torch.long)
        starts = torch.tensor([seq.num_computed_tokens for seq, _ in scheduled], dtype=torch.long)
        query_start = torch.zeros(len(scheduled) + 1, dtype=torch.long)
        torch.cumsum(num_new, 0, out=query_start[1:])
        num_tokens = int(query_start[-1])
        input_ids: list[int] = []
        for seq, n in scheduled:
            input_ids += seq.token_ids[seq.num_computed_tokens: seq.num_computed_tokens + n]
            if seq.spec_token_ids:
                input_ids += seq.spec_token_ids  # the scheduler counted them in n
        row_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), num_new)  # [T]
        positions = torch.arange(num_tokens) - query_start[:-1][row_of_token] + starts[row_of_token]
        max_blocks = max(len(seq.block_ids) for seq, _ in scheduled)
        tables = torch.tensor([seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq, _ in scheduled],
                              dtype=torch.long)
        bs = self.block_size
        slots = tables[row_of_token, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            query_start_loc=query_start.tolist(),
            seq_lens=(starts + num_new).tolist(),
            slot_mapping=slots,
            block_tables=tables,
            block_size=bs,
            use_decode_kernel=self.use_decode_kernel,
            use_tiled_prefill=self.use_tiled_prefill,
        )
        return torch.tensor(input_ids, dtype=torch.long), positions, meta

    def _prepare_decode(self, scheduled: list[tuple[Sequence, int]]):
        """:meth:`prepare` for a step where each sequence adds its next token: every value is
        one list element per sequence, so the lists become tensors directly (at batch 1 the
        tensor ops of the general path cost more than the rest of the step's Python)."""
        bs = self.block_size
        positions = [seq.num_computed_tokens for seq, _ in scheduled]
        blocks = [seq.block_ids[p // bs] for (seq, _), p in zip(scheduled, positions)]
        offsets = [p % bs for p in positions]
        max_blocks = max(len(seq.block_ids) for seq, _ in scheduled)
        blocks_t, offsets_t = torch.tensor(blocks, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)
        meta = AttentionMetadata(
            query_start_loc=list(range(len(scheduled) + 1)),
            seq_lens=[p + 1 for p in positions],
            slot_mapping=blocks_t * bs + offsets_t,
            block_tables=torch.tensor([seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq, _ in scheduled],
                                      dtype=torch.long),
            block_size=bs,
            use_decode_kernel=self.use_decode_kernel,
            use_tiled_prefill=self.use_tiled_prefill,
            _slot_parts=(blocks_t, offsets_t),
        )
        input_ids = [seq.token_ids[p] for (seq, _), p in zip(scheduled, positions)]
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepResult:
        """Run one step: logits of the sequences that sample, and the prompt logprobs computed."""
        input_ids, positions, meta = self.prepare(scheduled)
        if self.native_decoder is not None and self.native_decoder.can_run(meta):
            hidden = self.native_decoder(input_ids, positions, meta, self.kv_caches)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        rows, sampling = [], []
        for i, (seq, num_new) in enumerate(scheduled):
            num_proposed = len(seq.spec_token_ids)
            if seq.num_computed_tokens + num_new == seq.num_tokens + num_proposed:
                # The last token's logits, and with proposals each proposal's (to verify them).
                end = meta.query_start_loc[i + 1]
                rows.extend(range(end - 1 - num_proposed, end))
                sampling.append(seq)
        prompt_logprobs = self._prompt_logprobs(scheduled, meta, hidden)
        if not rows:
            return StepResult(torch.empty(0, self.model.config.vocab_size), [], prompt_logprobs)
        # consecutive rows (every decode step) as a view: list indexing gathers a copy
        picked = hidden[rows[0]: rows[-1] + 1] if rows[-1] - rows[0] + 1 == len(rows) else hidden[rows]
        return StepResult(self.model.compute_logits(picked), sampling, prompt_logprobs)

    def _prompt_logprobs(self, scheduled, meta: AttentionMetadata, hidden: torch.Tensor) -> dict:
        """{request id: [(logprob, top pairs) of prompt tokens start+1 .. ]} for the sequences that
        asked (SamplingParams.prompt_logprobs), over the prompt positions this step computed: the
        hidden state at position p gives the distribution of token p + 1."""
        found = {}
        for i, (seq, num_new) in enumerate(scheduled):
            n = seq.params.prompt_logprobs
            start = seq.num_computed_tokens
            stop = min(start + num_new, seq.num_prompt_tokens - 1)  # the last prompt token predicts output
            if n is None or start >= stop:
                continue
            first = meta.query_start_loc[i]
            logits = self.model.compute_logits(hidden[first: first + stop - start])
            targets = seq.prompt_token_ids[start + 1: stop + 1]
            found[seq.request_id] = (start, token_logprobs(logits, targets, [n] * len(targets)))
        return found
