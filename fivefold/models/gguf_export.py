"""Write a loaded Llama-family model as a GGUF file llama.cpp loads: F32, Q8_0, Q4_0 or Q4_1.

4-bit layers (:class:`~fivefold.models.int4_linear.Int4Linear`, from RTN, GPTQ, AWQ or a GGUF's own
blocks) are written exactly: a group of G >= 32 weights with one scale (and minimum) is G / 32
llama.cpp blocks sharing it, so the symmetric form becomes Q4_0 (w = d (q - 8)) and the minimum
form Q4_1 (w = d q + m) with the same codes. Float layers are quantized here (round to nearest per
block of 32, llama.cpp's rules: Q4_0 d = extreme / -8, Q4_1 d = (max - min) / 15 with m = min,
Q8_0 d = absmax / 127). Int8 layers (the 8-bit LM head) and the embedding go as Q8_0 (F32 when the
whole file is F32): llama.cpp looks rows of the embedding up in any block type. Norms stay F32.
Rows of q and k are permuted back into llama.cpp's interleaved RoPE order (the loader undoes it).

The tokenizer and chat template are copied from the source when it was a GGUF file; a model loaded
from a Hugging Face directory is refused (one line): its tokenizer would need llama.cpp's converter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fivefold.errors import FivefoldError
from fivefold.models.int4_linear import Int4Linear, Int4Quantized, quantize_int4, Int4Format

EXPORT_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1")
BLOCK = 32
_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
          "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def _permute_rope(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (the inverse of gguf_file._unpermute_rope)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def q4_bytes(qz: Int4Quantized) -> np.ndarray:
    """Q4_0 (symmetric) or Q4_1 blocks of 4-bit codes, [rows, K / 32 * (18 or 20)] uint8: each group's
    scale (and minimum) repeated over its blocks of 32; byte j of a block holds code j (low nibble)
    and code j + 16 (high)."""
    n, k = qz.q.shape
    if k % BLOCK or qz.group_size % BLOCK:
        raise FivefoldError(f"GGUF 4-bit blocks need K and the group size to be multiples of {BLOCK}")
    per = qz.group_size // BLOCK
    blocks = k // BLOCK
    scale = qz.scale.to(torch.float16).repeat_interleave(per, dim=1)[:, :blocks]
    codes = qz.q.reshape(n, blocks, BLOCK)
    nibbles = (codes[:, :, :16] | (codes[:, :, 16:] << 4)).to(torch.uint8)
    parts = [scale.contiguous().view(torch.uint8).reshape(n, blocks, 2)]
    if qz.offset is not None:
        parts.append(qz.offset.to(torch.float16).repeat_interleave(per, dim=1)[:, :blocks].contiguous()
                     .view(torch.uint8).reshape(n, blocks, 2))
    parts.append(nibbles)
    return torch.cat(parts, dim=2).reshape(n, -1).numpy()


def q8_0_bytes(w: torch.Tensor) -> np.ndarray:
    """Q8_0 blocks of a float [rows, cols] tensor: an fp16 scale absmax / 127, then 32 int8 values."""
    rows, cols = w.shape
    blocks = w.float().reshape(rows, cols // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / 127).half()
    s = scale.float()
    q = torch.where(s > 0, blocks / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(blocks))
    q = q.round().clamp(-127, 127).to(torch.int8)
    return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows, -1).numpy()


def _float_rows(module) -> torch.Tensor:
    from fivefold.models.int8_linear import Int8Linear, dense_weight
    from fivefold.models.layers import SplitLinear

    if isinstance(module, SplitLinear):  # a Q4_K_M's qkv held in two blocks
        return torch.cat([_float_rows(p) for p in module.parts])

    if isinstance(module, Int4Linear):
        return module.dequantized_weight()
    if isinstance(module, Int8Linear):
        from fivefold.models.int8_primitives import dequantize_weight

        return dequantize_weight(module.int8_weight(), module.weight_scales())
    return dense_weight(module)


def _encode(value, qtype: str):
    """(raw array, ggml type name) of one 2-D tensor: Int4Quantized written exactly, floats quantized."""
    if isinstance(value, Int4Quantized):
        return q4_bytes(value), "Q4_0" if value.offset is None else "Q4_1"
    if qtype == "F32":
        return value.float().contiguous().numpy(), "F32"
    if qtype == "Q8_0":
        return q8_0_bytes(value), "Q8_0"
    qz = quantize_int4(value, Int4Format(group_size=BLOCK, symmetric=qtype == "Q4_0"))
    return q4_bytes(qz), qtype


def _projection_tensors(loaded, qtype: str):
    """(gguf name, value) of every projection, split into llama.cpp's q, k, v, gate, up."""
    c = loaded.config
    for i, layer in enumerate(loaded.model.layers):
        for path, names in _PARTS.items():
            module = layer.get_submodule(path)
            if isinstance(module, Int4Linear):
                q, scale, offset = module.codes()
                whole = Int4Quantized(q, scale, offset, module.format.group_size)
            else:
                whole = _float_rows(module)
            sizes = ((c.q_size, c.kv_size, c.kv_size) if len(names) == 3 else
                     (c.intermediate_size, c.intermediate_size) if len(names) == 2 else (whole.shape[0],))
            start = 0
            for name, size in zip(names, sizes):
                part = _rows(whole, start, size)
                if c.architecture == "llama" and name in ("attn_q", "attn_k"):
                    part = _apply(part, lambda t: _permute_rope(t, c.num_heads if name == "attn_q" else c.num_kv_heads))
                yield f"blk.{i}.{name}.weight", part
                start += size
            bias = getattr(module, "bias", None)
            if bias is not None:
                start = 0
                for name, size in zip(names, sizes):
                    b = bias.detach().float()[start:start + size]
                    if c.architecture == "llama" and name in ("attn_q", "attn_k"):
                        b = _permute_rope(b, c.num_heads if name == "attn_q" else c.num_kv_heads)
                    yield f"blk.{i}.{name}.bias", b.contiguous()
                    start += size


def _rows(value, start: int, size: int):
    if isinstance(value, Int4Quantized):
        return value.map_rows(lambda t: t[start:start + size])
    return value[start:start + size]


def _apply(value, fn):
    if isinstance(value, Int4Quantized):
        return value.map_rows(fn)
    return fn(value).contiguous()


def export_gguf(loaded, out: str | Path, qtype: str = "Q4_0") -> Path:
    """Write ``loaded`` (a Fivefold Llama-family LLM loaded from a GGUF file) as ``out`` with its
    projections in ``qtype`` (4-bit layers keep their own codes and block type). Returns the path."""
    import gguf

    if qtype not in EXPORT_TYPES:
        raise FivefoldError(f"GGUF export writes {', '.join(EXPORT_TYPES)}, got '{qtype}'")
    if loaded.format != "gguf":
        raise FivefoldError(f"GGUF export copies the tokenizer of a GGUF source; {loaded.path} is a "
                            f"{loaded.format} checkpoint (convert it with llama.cpp's convert_hf_to_gguf.py)")
    c = loaded.config
    if c.has_qk_norm or c.architecture not in ("llama", "qwen2"):
        raise FivefoldError(f"GGUF export supports llama and qwen2 models, got {c.architecture}")
    source = gguf.GGUFReader(str(loaded.path))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), c.architecture)
    writer.add_name(f"fivefold-export-{qtype.lower()}")
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value, types = field.contents(), field.types
        if types[0] == gguf.GGUFValueType.ARRAY:
            if types[-1] == gguf.GGUFValueType.STRING:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, types[0], sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])
    model = loaded.model
    side = "F32" if qtype == "F32" else "Q8_0"  # the embedding and an 8-bit head
    tensors = [("token_embd.weight", model.embed_tokens.weight.detach().float(), side)]
    for i, layer in enumerate(model.layers):
        tensors += [(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight.detach().float(), "F32"),
                    (f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight.detach().float(), "F32")]
    tensors += [(name, value, qtype) for name, value in _projection_tensors(loaded, qtype)]
    tensors.append(("output_norm.weight", model.norm.weight.detach().float(), "F32"))
    if not c.is_tied_embeddings:
        head = model.lm_head
        tensors.append(("output.weight", _float_rows(head) if not isinstance(head, Int4Linear) else
                        Int4Quantized(*head.codes(), head.format.group_size), side))
    for name, value, kind in tensors:
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            writer.add_tensor(name, value.float().contiguous().numpy())
            continue
        raw, ggml = _encode(value, kind)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[ggml])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out
