"""GGUF checkpoints: metadata -> ModelConfig, tensors -> Hugging Face-named torch tensors.

Read with the ``gguf`` package through its memory map, one tensor at a time (each tensor's pages
are released once it is converted). F32, F16 and BF16 tensors come as they are (the loader casts
them to the served dtype); Q8_0 tensors stay int8 with their scale per block of 32
(:class:`~fivefold.models.int8_linear.GroupQuantized`, served by the W8A16 kernel with group
scales). Q4_0 and Q4_1 tensors, when the caller keeps 4-bit blocks (``--quantization gguf``),
become 4-bit codes with their block's float16 scale (and minimum) as they are
(:class:`~fivefold.models.int4_linear.Int4Quantized`: groups of 32, served by the int4 kernel),
never passing through float, and so do Q4_K's (its two scale levels multiplied into one float16
scale and minimum per 32); Q6_K tensors become int8 codes with a float16 scale per 16 (served like
Q8_0, always; against int8 activations, as ``--quantization gguf`` serves them, the int8 layer holds
the codes at 6 bits again: fivefold::q6_pack). Otherwise the 4-bit types, and the block types without a kernel yet (Q5_K, Q2_K,
Q3_K, ...), are dequantized to float32 with a one-line note saying so. The 4-bit and K-quant
blocks are unpacked by one C++ pass per tensor (``fivefold/kernels/gguf_blocks.cpp``) where the
kernels are built, by numpy otherwise (the same numbers, tested bit for bit).
"""

from __future__ import annotations

import mmap
import re
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from fivefold.errors import ModelLoadError
from fivefold.kernels import gguf_block_ops
from fivefold.models.config import ModelConfig
from fivefold.models.int4_linear import Int4Levels, Int4Quantized
from fivefold.models.int8_linear import GroupQuantized

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path):
    """A GGUFReader, with truncation and corruption turned into one-line errors."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError...
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {type(exc).__name__}: {exc}") from None
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(
                f"corrupt or truncated GGUF file {path}: tensor '{tensor.name}' needs {tensor.n_bytes} bytes, "
                f"file holds {tensor.data.nbytes}"
            )
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{arch}' in {path.name}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"corrupt GGUF file {path}: metadata key '{arch}.{key}' is missing")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else None))
    rope: dict = {}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"unsupported rope scaling '{scaling_type}' in {path.name}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(get("context_length", 2048)),
        is_tied_embeddings="output.weight" not in tensor_names,
        has_qkv_bias="blk.0.attn_q.bias" in tensor_names,
        has_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def _hf_name(gguf_name: str) -> str | None:
    base, _, kind = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{kind}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


# Bits per weight of the block types served as they are (codes and scales as held in memory: Q8_0
# as stored; Q6_K's 6-bit codes widened to int8 with a float16 scale per 16, or with --quantization
# gguf (int8 activations) kept at 6 bits (fivefold::q6_pack); the 4-bit kernel's float16 scale (and
# minimum) per 32, Q4_K's products of its two scale levels included, or with --quantization gguf
# its two levels as stored, sc and m a byte each per 32, d and dmin per 256 (int4_linear.py's
# pack_levels)).
SERVED_BITS = {"Q8_0": 8.5, "Q6_K": 9.0, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 5.0}
Q6_K_SIX_BITS = 7.0
Q4_K_LEVEL_BITS = 4.625
INT8_ACTIVATION_BITS = {"Q6_K": Q6_K_SIX_BITS, "Q4_K": Q4_K_LEVEL_BITS}
EIGHT_BIT = ("Q8_0", "Q6_K")  # kept int8 whatever the served dtype
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # kept 4-bit with --quantization gguf


def gguf_served_bits(reader, keep_4bit: bool) -> float | None:
    """Bits per projection weight as served, averaged over the layers' matrices (None: some are
    dequantized to float at the served dtype): Q8_0 and Q6_K are always served as they are, the
    4-bit block types with ``keep_4bit``. A Q4_K_M file mixes Q4_K and Q6_K matrices."""
    bits = count = 0
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        kind = t.tensor_type.name
        if kind not in EIGHT_BIT and not (keep_4bit and kind in FOUR_BIT):
            return None
        n = int(t.n_elements)
        served = INT8_ACTIVATION_BITS.get(kind, SERVED_BITS[kind]) if keep_4bit else SERVED_BITS[kind]
        bits, count = bits + served * n, count + n
    return bits / count if count else None


Q8_0_BLOCK = 32  # weights per Q8_0 block, after a float16 scale: 34 bytes
Q4_BLOCK = 32  # weights per Q4_0/Q4_1 block: a float16 scale (Q4_1: and minimum), then 16 bytes of nibbles


def _q4(data: np.ndarray, shape: tuple[int, ...], has_min: bool) -> Int4Quantized:
    """Q4_0 (w = d (q - 8)) or Q4_1 (w = d q + m) blocks -> codes uint8 [N, K], float16 scales (and
    minimums) [N, K / 32]. Byte j of a block holds weight j in its low nibble and j + 16 in its high.
    Unpacked by ``fivefold::gguf_q4_unpack`` where the kernels are built, else by :func:`_q4_numpy`."""
    blocks = np.asarray(data).reshape(-1, (4 if has_min else 2) + Q4_BLOCK // 2)
    ops = gguf_block_ops()
    q, scale, offset = ops.gguf_q4_unpack(_tensor(blocks), has_min) if ops is not None else _q4_numpy(blocks, has_min)
    groups = (*shape[:-1], shape[-1] // Q4_BLOCK)
    return Int4Quantized(q.reshape(shape), scale.reshape(groups), offset.reshape(groups) if has_min else None,
                         Q4_BLOCK)


def _q4_numpy(blocks: np.ndarray, has_min: bool):
    """Q4_0/Q4_1 blocks [B, 18 or 20] -> codes uint8 [B, 32], scale and minimum float16 [B] (Q4_0:
    an empty minimum), as torch tensors: the reference and fallback of ``gguf_q4_unpack``."""
    head = 4 if has_min else 2
    scale = torch.from_numpy(blocks[:, :2].copy().view(np.float16).reshape(-1))
    offset = (torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).reshape(-1)) if has_min
              else torch.empty(0, dtype=torch.float16))
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[:, head:]))  # [blocks, 16]
    return torch.cat([nibbles & 15, nibbles >> 4], dim=1), scale, offset


K_BLOCK = 256  # weights per super-block of the K-quants
Q4_K_BYTES = 144  # a Q4_K super-block: d, dmin, 12 bytes of 6-bit sc and m, 128 of nibbles
Q6_K_BYTES = 210  # a Q6_K super-block: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d


def _q4_k(data: np.ndarray, shape: tuple[int, ...]) -> Int4Quantized:
    """Q4_K super-blocks -> the int4 kernel's groups of 32, codes kept as they are. A super-block of
    256 weights (144 bytes): float16 d and dmin, twelve bytes holding eight 6-bit scales sc_j and
    minimums m_j, then 128 bytes of nibbles; sub-block j (32 weights) is w = d sc_j q - dmin m_j,
    its codes the low nibbles of bytes 32 (j // 2) .. + 31 for even j, the high ones for odd j.
    Each sub-block's scale d sc_j and minimum -dmin m_j become one float16 each: the products are
    rounded to float16 (a relative 2^-12 at most, against the 4-bit step's 1/15 of the range), the
    one place this load is not exact; the file holds 4.5 bits per weight, that form 5.0. The two
    levels ride along (``levels``): with int8 activations the kernel reads them as they are
    (4.625 bits per weight, d sc_j exact). Unpacked by ``fivefold::gguf_q4_k_unpack`` where the
    kernels are built, else by :func:`_q4_k_numpy` (the same numbers)."""
    blocks = np.asarray(data).reshape(-1, Q4_K_BYTES)
    ops = gguf_block_ops()
    q, sc, mn, scale, offset = ops.gguf_q4_k_unpack(_tensor(blocks)) if ops is not None else _q4_k_numpy(blocks)
    groups = (*shape[:-1], shape[-1] // Q4_BLOCK)
    supers = (*shape[:-1], shape[-1] // K_BLOCK)
    halves = _tensor(blocks[:, 0:4]).contiguous().view(torch.float16)  # d, dmin per super-block
    levels = Int4Levels(sc.reshape(groups), mn.reshape(groups), halves[:, 0].reshape(supers).clone(),
                        halves[:, 1].reshape(supers).clone())
    return Int4Quantized(q.reshape(shape), scale.reshape(groups), offset.reshape(groups), Q4_BLOCK, levels)


def _q4_k_numpy(blocks: np.ndarray):
    """Q4_K blocks [B, 144] -> codes [B, 256], sc and m [B, 8] (uint8), d sc and -dmin m [B, 8]
    (float16), as torch tensors: the reference and fallback of ``gguf_q4_k_unpack``."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].astype(np.uint8)
    # sub-blocks 0-3: bytes 0-3 (scale) and 4-7 (minimum), low 6 bits; 4-7: a nibble of bytes 8-11
    # below the top 2 bits of bytes 0-3 (scale) and 4-7 (minimum)
    sc = np.concatenate([packed[:, 0:4] & 63, (packed[:, 8:12] & 15) | ((packed[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # four runs of 32 bytes: sub-blocks 2i (low), 2i + 1 (high)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, K_BLOCK)
    return (torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(sc)),
            torch.from_numpy(np.ascontiguousarray(mn)), torch.from_numpy((d * sc).astype(np.float16)),
            torch.from_numpy((-(dmin * mn)).astype(np.float16)))


Q6_K_GROUP = 16  # weights per Q6_K scale


def _q6_k(data: np.ndarray, shape: tuple[int, ...]) -> GroupQuantized:
    """Q6_K super-blocks -> int8 codes (q - 32, in [-32, 31]) with a scale per 16 weights: the
    product d sc_j (a float16 times an int8) rounded to float16 (relative 2^-12 at most, as Q4_K's),
    so that the int8 kernels hold it as Q8_0's scales, 2 bytes in tile order (9 bits per weight;
    a float32 table read row-major ran the kernel at a third of Q8_0's rate). A super-block of 256 weights (210 bytes): 128 bytes
    of low nibbles, 64 of high bit pairs, sixteen int8 scales, float16 d. Each half of 128 weights
    takes 64 low-nibble bytes (weights 0-63 from their low nibbles, 64-127 from their high ones)
    and 32 bytes of pairs (weight i's two high bits at bit 2 (i // 32) of byte i % 32). Unpacked by
    ``fivefold::gguf_q6_k_unpack`` where the kernels are built, else by :func:`_q6_k_numpy`."""
    blocks = np.asarray(data).reshape(-1, Q6_K_BYTES)
    ops = gguf_block_ops()
    q, scale = ops.gguf_q6_k_unpack(_tensor(blocks)) if ops is not None else _q6_k_numpy(blocks)
    return GroupQuantized(q.reshape(shape), scale.reshape(*shape[:-1], shape[-1] // Q6_K_GROUP), Q6_K_GROUP)


def _q6_k_numpy(blocks: np.ndarray):
    """Q6_K blocks [B, 210] -> codes int8 [B, 256], scales float32 [B, 16], as torch tensors: the
    reference and fallback of ``gguf_q6_k_unpack``."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64)
    low = np.concatenate([low & 15, low >> 4], axis=2).reshape(-1, 2, 128)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 3).reshape(-1, 2, 128)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, K_BLOCK)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scale = (d * blocks[:, 192:208].view(np.int8).astype(np.float32)).astype(np.float16).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(scale))


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a (read-only) slice of the file's memory map, for ops that only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch notes the array is not writable
        return torch.from_numpy(array)


def _q8_0(data: np.ndarray, shape: tuple[int, ...]) -> GroupQuantized:
    """Q8_0 blocks -> int8 [N, K] and float32 scales [N, K / 32], no float weights in between."""
    blocks = np.asarray(data).reshape(-1, 2 + Q8_0_BLOCK)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(*shape[:-1], shape[-1] // Q8_0_BLOCK)
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(shape)
    return GroupQuantized(torch.from_numpy(q), torch.from_numpy(scale), Q8_0_BLOCK)


def _release(reader, tensor) -> None:
    """Drop the pages of ``tensor`` from the process (they were copied): a load's resident set then
    holds one source tensor at a time, not the whole file."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(tensor.data_offset + tensor.n_bytes, len(mm))
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def gguf_tensors(reader, config: ModelConfig, path: Path | None = None, keep_4bit: bool = False):
    """Yield (Hugging Face name, tensor) for every tensor of the file: a torch tensor (F32, F16,
    BF16 as stored; other block types dequantized to float32), a GroupQuantized (Q8_0) or, with
    ``keep_4bit``, an Int4Quantized (Q4_0, Q4_1 matrices)."""
    from gguf import GGMLQuantizationType, quants

    where = path.name if path is not None else "GGUF file"
    dequantized: dict[str, int] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                continue  # llama3 scaling factors; llama.cpp-only representation
            raise ModelLoadError(f"unexpected tensor '{tensor.name}' in {where}")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
        kind = tensor.tensor_type
        if kind == GGMLQuantizationType.Q8_0 and len(shape) == 2:
            weight = _q8_0(tensor.data, shape)
        elif kind == GGMLQuantizationType.Q6_K and len(shape) == 2:
            weight = _q6_k(tensor.data, shape)
        elif keep_4bit and kind == GGMLQuantizationType.Q4_K and len(shape) == 2:
            weight = _q4_k(tensor.data, shape)
        elif keep_4bit and kind.name in FOUR_BIT and len(shape) == 2:
            weight = _q4(tensor.data, shape, has_min=kind == GGMLQuantizationType.Q4_1)
        elif kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            array = np.asarray(tensor.data)
            if kind == GGMLQuantizationType.BF16:  # numpy has no bfloat16: the raw 16 bits
                weight = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)
            else:
                weight = torch.from_numpy(array.copy()).reshape(shape)
        else:
            try:
                array = quants.dequantize(tensor.data, kind)
            except NotImplementedError:
                raise ModelLoadError(f"{where}: tensor '{tensor.name}' has block type {kind.name}, which this "
                                     f"version of the gguf package cannot read") from None
            weight = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))
            dequantized[kind.name] = dequantized.get(kind.name, 0) + 1
        _release(reader, tensor)
        # llama.cpp permutes q/k rows of Llama checkpoints only (Qwen uses NeoX RoPE there).
        if config.architecture == "llama":
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                weight = _unpermute(weight, config.num_heads)
            elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
                weight = _unpermute(weight, config.num_kv_heads)
        yield name, weight
    if dequantized:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(dequantized.items()))
        served = "" if keep_4bit else "; --quantization gguf serves Q4_0/Q4_1/Q4_K in 4-bit"
        warnings.warn(f"fivefold: {where}: {kinds} dequantized to float on load (Q8_0 and Q6_K stay int8{served}; "
                      f"Q5_K and the other block types have no kernel yet)", stacklevel=2)


def _unpermute(weight, num_heads: int):
    if isinstance(weight, GroupQuantized):
        return GroupQuantized(_unpermute_rope(weight.q, num_heads), _unpermute_rope(weight.scale, num_heads),
                              weight.group_size)
    if isinstance(weight, Int4Quantized):
        return weight.map_rows(lambda t: _unpermute_rope(t, num_heads))
    return _unpermute_rope(weight, num_heads)
