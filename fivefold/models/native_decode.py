"""A decode step's layer loop run in C++ (``fivefold::decode_layers``, fivefold/kernels/decode_loop.cpp).

A decode step computes one token per sequence, so its kernels are small and, at batch 1, the
Python between them (module calls, views, the KV write's index_put) costs a fifth of the step.
:class:`NativeDecoder` hands the whole layer loop to one C++ call that runs the same kernels
(fused add + RMSNorm, the streaming or packed linears, fused RoPE, paged decode attention,
SiLU * up) back to back. The embedding lookup, the RoPE table lookup and the LM head stay in
Python: one call each per step.

It serves float32 Llama-family models whose projections are ``nn.Linear``, ``PackedLinear``,
W8A16 ``Int8Linear`` or 4-bit ``Int4Linear``, a qkv projection also as a two-block
``SplitLinear`` (Qwen3's per-head q/k norm and W8A8's activation quantization are not in
the C++ loop: such models keep the Python loop, :meth:`NativeDecoder.unsupported_reason` says
why). A step runs here when each of its sequences adds at most ``MAX_QUERY_LEN`` tokens to a
context already in the cache: decode steps (the paged decode kernel), and steps verifying
speculative proposals or ending a chunked prompt (the paged prefill kernel, causal within each
sequence's tokens). Prompts keep the Python loop, whose SDPA prefill is faster for them.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.kernels import decode_loop_ops
from fivefold.models import kv_quant
from fivefold.models.attention import AttentionMetadata
from fivefold.models.layers import PackedLinear, SplitLinear, stream_max_rows
from fivefold.models.llama import LlamaForCausalLM

_NONE = torch.empty(0)  # "no tensor" in the C++ op's tensor lists
# Longest query of a sequence the C++ loop takes (speculative verification: 1 + k tokens); longer
# chunks are prompts, which the Python loop's SDPA prefill serves faster.
MAX_QUERY_LEN = 17


def _linear_tensors(linear: nn.Module) -> list[torch.Tensor] | str:
    """(streaming weight in fivefold::stream_pack's layout or empty, per-channel or group scales, bias,
    the weight for larger batches: oneDNN-packed, or row-major for at::linear), or why it cannot run."""
    from fivefold.kernels import stream_ops
    from fivefold.models.int4_linear import Int4Linear
    from fivefold.models.int8_linear import Int8Linear

    bias = getattr(linear, "bias", None)
    bias = _NONE if bias is None else bias.detach()
    if isinstance(linear, PackedLinear):
        stream = _NONE if linear.stream_weight is None else linear.stream_weight  # one copy: oneDNN's only
        return [stream, _NONE, bias, linear.packed_weight]
    if type(linear) is nn.Linear:
        weight = linear.weight.detach()
        return [stream_ops().stream_pack(weight), _NONE, bias, weight]
    if isinstance(linear, Int4Linear):  # the group offsets ride in the large-batch slot (int4 always streams)
        packed = linear.kernel_tensors()
        if packed is None:
            return "4-bit projections without the int4 kernel"
        w, scale, offset = packed
        return [w, scale, bias, _NONE if offset is None else offset]
    if isinstance(linear, Int8Linear):
        if linear.scheme != "w8a16":
            return f"{linear.scheme} quantizes activations"
        if linear.is_clipped:
            return "clipped activations"
        p = linear._prepare()
        return [p["stream"], p["stream_scale"], bias, _NONE]
    return f"{type(linear).__name__} projections"


def _qkv_blocks(qkv: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """A qkv projection as the loop takes it: itself, or its two row blocks (a SplitLinear)."""
    return (qkv.parts[0], qkv.parts[1]) if isinstance(qkv, SplitLinear) and len(qkv.parts) == 2 else (qkv, None)


def _activations(model: nn.Module, kind: str) -> set[str]:
    """The activation precisions ("float", "int8") of the decoder's 4-bit (``kind="int4"``) or int8
    projections (the C++ loop runs each kind one way; the LM head is not in the loop)."""
    from fivefold.models.int4_linear import Int4Linear
    from fivefold.models.int8_linear import Int8Linear

    cls = Int4Linear if kind == "int4" else Int8Linear
    return {"int8" if m.int8_activations else "float" for layer in model.layers for m in layer.modules()
            if isinstance(m, cls)}


class NativeDecoder:
    """Runs :meth:`LlamaForCausalLM.forward` for a decode-only step in one C++ call."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        reason = self.unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the C++ decode loop cannot run this model: {reason}")
        self.model = model
        self.ops = decode_loop_ops()
        tensors: list[torch.Tensor] = []
        for layer in model.layers:
            tensors += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            qkv, second = _qkv_blocks(layer.self_attn.qkv_proj)
            for linear in (qkv, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                tensors += _linear_tensors(linear)
            tensors += [_NONE] * 4 if second is None else _linear_tensors(second)  # see decode_loop.cpp
        self.layer_tensors = tensors
        c = model.config
        self.shape_args = (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5,
                           stream_max_rows(torch.float32), _activations(model, "int4") == {"int8"},
                           _activations(model, "int8") == {"int8"})

    @staticmethod
    def unsupported_reason(model: nn.Module) -> str | None:
        """None when the C++ loop can run ``model``, else what stands in the way."""
        if decode_loop_ops() is None:
            return "the decode_loop kernel is not built (fivefold.kernels.kernel_status())"
        if not isinstance(model, LlamaForCausalLM):
            return f"{type(model).__name__} is not a Llama-family decoder"
        if model.dtype != torch.float32:
            return f"{model.dtype} activations (the fused kernels are float32)"
        if model.config.has_qk_norm:
            return "per-head q/k RMSNorm (Qwen3)"
        for layer in model.layers:
            qkv = layer.self_attn.qkv_proj
            if isinstance(qkv, SplitLinear) and len(qkv.parts) != 2:
                return f"a qkv projection held in {len(qkv.parts)} blocks (the loop takes two)"
            for linear in (*_qkv_blocks(qkv), layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                found = _linear_tensors(linear) if linear is not None else None
                if isinstance(found, str):
                    return found
        for kind in ("int4", "int8"):
            if len(_activations(model, kind)) > 1:
                return f"{kind} projections with float and int8 activations in one model"
        return None

    @staticmethod
    def can_run(meta: AttentionMetadata) -> bool:
        """Every sequence of the step adds one token, or a few (at most MAX_QUERY_LEN, e.g. a
        row with speculative proposals), to a context it already has in the cache."""
        return all(1 <= meta.query_len(i) <= MAX_QUERY_LEN and meta.query_len(i) < meta.seq_lens[i]
                   for i in range(meta.num_seqs))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of a step :meth:`can_run` accepts."""
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.model.rotary.lookup(positions, hidden.dtype)  # [T, 1, D/2]
        blocks, offsets = meta.slot_blocks_and_offsets()
        plan = meta.decode_plan()
        if plan is not None and len(plan.rows) == meta.num_seqs:  # one token each: the decode kernel
            tables, seq_lens, query_start = plan.tables, plan.seq_lens, _NONE
        else:  # a few tokens per sequence: the paged prefill kernel, causal within each sequence's tokens
            num_blocks = -(-max(meta.seq_lens) // meta.block_size)
            tables = meta.block_tables[:, :num_blocks]
            seq_lens = torch.tensor(meta.seq_lens, dtype=torch.long)
            query_start = torch.tensor(meta.query_start_loc, dtype=torch.long)
        rotation = kv_quant.key_rotation(self.model.config.head_dim) if kv_quant.is_int8_cache(kv_caches[0]) else _NONE
        return self.ops.decode_layers(hidden, cos, sin, self.layer_tensors, kv_caches, self.model.norm.weight,
                                      tables, seq_lens, blocks, offsets, query_start, rotation, *self.shape_args)
