"""The Llama-family decoder written for serving.

Covers Llama 2/3 (with llama3 RoPE scaling), Mistral, SmolLM2, Qwen2 (q/k/v bias)
and Qwen3 (per-head q/k RMSNorm), with grouped-query attention and tied or untied
embeddings. Differences from the transformers reference are for speed only:

- q/k/v and gate/up are fused into one matmul each at load time;
- ``forward`` takes one flat batch of tokens from many sequences (prefill chunks
  and decode tokens mixed) with their positions and an :class:`AttentionMetadata`;
  keys and values go through a paged KV cache owned by the caller;
- logits are computed only for the rows the caller asks for (the last token of
  each sequence when sampling), which avoids a [num_tokens, vocab] matmul.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from fivefold.errors import ModelLoadError
from fivefold.models.attention import AttentionMetadata, paged_attention
from fivefold.models.config import ModelConfig
from fivefold.models.layers import FusableOp, RMSNorm, RotaryEmbedding, SiluAndMul, pack_linears_


class LlamaAttention(FusableOp):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.has_qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.has_o_bias)
        if config.has_qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, meta: AttentionMetadata, kv_cache: torch.Tensor):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) D]
        q, k, v = qkv.split([self.config.q_size, self.config.kv_size, self.config.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.config.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k, ops=self._fused(q))
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.config.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.has_mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.has_mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, residual, meta, kv_cache):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. See the module docstring for the serving-specific interface."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device and then loaded (fivefold.models.assemble, loader): the table is
        # given rather than initialised, because torch's first normal_ on meta tensors costs ~1 s
        # (a lazy import), a second of every load.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    @property
    def dtype(self) -> torch.dtype:
        embed = self.embed_tokens
        return embed.dtype if hasattr(embed, "dtype") else embed.weight.dtype  # HeadRowsEmbedding holds no table

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, new tokens of every sequence, concatenated
        positions: torch.Tensor,  # [T] int64, absolute position of each token
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, KVH, block_size, D]
    ) -> torch.Tensor:
        """Final-norm hidden states, [T, hidden]."""
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(cos_sin, hidden, residual, meta, kv_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] for the given rows of hidden states."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        """Load Hugging Face-named tensors as ``dtype``, fusing q/k/v and gate/up.

        Raises ModelLoadError naming the first missing or unexpected tensor.
        """
        pending: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("lm_head") and self.config.is_tied_embeddings:
                continue
            pending[name] = tensor
        state: dict[str, torch.Tensor] = {}
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            for kind in ("weight", "bias"):
                parts = [pending.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
                if all(t is not None for t in parts):
                    state[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
                parts = [pending.pop(f"{p}mlp.{n}_proj.{kind}", None) for n in ("gate", "up")]
                if all(t is not None for t in parts):
                    state[f"{p}mlp.gate_up_proj.{kind}"] = torch.cat(parts, dim=0)
        state.update(pending)
        if self.config.is_tied_embeddings and "embed_tokens.weight" in state:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        expected = set(self.state_dict())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor '{missing[0]}' ({len(missing)} missing in all)")
        if unexpected:
            raise ModelLoadError(f"checkpoint has unexpected tensor '{unexpected[0]}' ({len(unexpected)} in all)")
        for key, value in self.state_dict().items():
            if tuple(state[key].shape) != tuple(value.shape):
                raise ModelLoadError(
                    f"tensor '{key}' has shape {tuple(state[key].shape)}, config expects {tuple(value.shape)}"
                )
        self.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
        if self.config.is_tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def set_fused_ops(self, enabled: bool) -> None:
        """Run the hot path's elementwise chains (add + RMSNorm, SiLU * up, RoPE on q and k)
        as fused C++ kernels (``enabled``) or as eager PyTorch ops (the reference)."""
        for module in self.modules():
            if isinstance(module, FusableOp):
                module.use_fused = enabled

    def pack_for_serving(self, stream_copy: bool = True) -> None:
        """Swap every projection (and the LM head) for a :class:`PackedLinear` (with the streaming
        kernel's copy too when ``stream_copy``).

        The embedding keeps its dense weight for row lookups; a tied LM head gets its
        own packed copy (+vocab x hidden floats), which halves its time at batch 64.
        """
        pack_linears_(self, stream_copy)
