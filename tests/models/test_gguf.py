"""GGUF reading: every supported tensor type dequantizes to the right values and shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fivefold.models.gguf_file import gguf_config, gguf_tensors, open_gguf
from fivefold.models.int8_linear import GroupQuantized

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 1, 64


def _sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    return float(10 * np.log10((ref ** 2).sum() / ((ref - test) ** 2).sum()))


def _random_k_quant_bytes(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with sane float16 super-block scales (gguf-py cannot quantize K types)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    # a different d (and dmin) per block, so a block read with another's scale shows
    scale = rng.uniform(0.005, 0.02, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)  # 2 bytes
    if qtype == GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        data[..., 0:2] = scale
        data[..., 2:4] = rng.uniform(0.005, 0.02, size=(rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    else:  # Q6_K: d trails the block
        data[..., -2:] = scale
    return data.reshape(rows, -1)


def write_tiny_gguf(path, types: dict[str, str], with_tokenizer: bool = True, arch: str = "llama"):
    """A one-layer Llama GGUF whose tensor types are chosen per tensor; returns the float tensors."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
        "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN // 2, HIDDEN),
        "blk.0.attn_v.weight": (HIDDEN // 2, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (INTER, HIDDEN), "blk.0.ffn_up.weight": (INTER, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTER),
    }
    originals = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[types.get(name, "F32")]
        if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            raw = _random_k_quant_bytes(qtype, shape[0], shape[1], rng)
            x = gguf.quants.dequantize(raw, qtype)
        elif qtype == gguf.GGMLQuantizationType.F32:
            raw = x
        elif qtype == gguf.GGMLQuantizationType.F16:
            raw = x.astype(np.float16)
        else:
            raw = gguf.quants.quantize(x, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        originals[name] = x
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


# Lower bounds for the round trip float -> type -> float on Gaussian data.
MIN_SQNR_DB = {"F16": 60, "BF16": 40, "Q8_0": 40, "Q4_1": 18, "Q4_0": 17}


# What each type is read as: float types as stored, Q8_0 kept int8 with a scale per 32, the rest
# dequantized to float32 (until 4-bit kernels serve them).
READ_AS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "Q8_0": torch.int8}


def _as_float(t) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, GroupQuantized) else t.float()


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_tensor_types_dequantize(qtype, tmp_path):
    name = "blk.0.ffn_down.weight"
    originals = write_tiny_gguf(tmp_path / "m.gguf", {name: qtype, "blk.0.attn_q.weight": qtype})
    reader = open_gguf(tmp_path / "m.gguf")
    config = gguf_config(reader, tmp_path / "m.gguf")
    tensors = dict(gguf_tensors(reader, config))
    read = tensors["model.layers.0.mlp.down_proj.weight"]
    if qtype in ("Q8_0", "Q6_K"):  # kept int8: Q8_0 with a scale per 32, Q6_K's codes - 32 with one per 16
        group = 32 if qtype == "Q8_0" else 16
        assert isinstance(read, GroupQuantized) and read.group_size == group
        assert read.scale.shape == (HIDDEN, INTER // group) and read.q.dtype == torch.int8
        # the int8 values and scales are the file's: they dequantize to exactly what gguf computes
        # (Q6_K: its d x sc_j rounded to float16, see the Q6_K branch below)
        import gguf

        raw = next(t for t in reader.tensors if t.name == name)
        if qtype == "Q8_0":
            assert np.array_equal(read.dequantize(torch.float32).numpy(),
                                  gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(HIDDEN, INTER))
        assert torch.equal(read.scale.half().float(), read.scale)  # held by the kernels in float16
    else:
        assert read.dtype == READ_AS.get(qtype, torch.float32)
    ours = {k: _as_float(v) for k, v in tensors.items()}["model.layers.0.mlp.down_proj.weight"]
    tensors = {k: _as_float(v) for k, v in tensors.items()}
    assert tuple(ours.shape) == (HIDDEN, INTER)
    if qtype == "F32":
        assert np.array_equal(ours.numpy(), originals[name])
    elif qtype == "Q4_K":
        # Values generated by dequantizing known raw blocks: they must come back exactly.
        assert np.array_equal(ours.numpy(), originals[name])
        assert np.abs(originals[name]).max() > 0
    elif qtype == "Q6_K":  # the file's codes; each scale d sc_j rounded to float16 (relative 2^-12)
        np.testing.assert_allclose(ours.numpy(), originals[name], rtol=2 ** -11, atol=0)
        assert not np.array_equal(ours.numpy(), originals[name])  # the rounding is real: this can fail
    else:
        assert _sqnr_db(originals[name], ours.numpy()) > MIN_SQNR_DB[qtype]
    # q rows come back in Hugging Face order: un-permuting then re-permuting is the identity.
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    head_rows = HIDDEN // HEADS
    repermuted = q.reshape(HEADS, 2, head_rows // 2, HIDDEN).transpose(1, 2).reshape(HIDDEN, HIDDEN)
    if qtype in ("F32", "Q4_K"):
        assert np.array_equal(repermuted.numpy(), originals["blk.0.attn_q.weight"])
    elif qtype == "Q6_K":
        np.testing.assert_allclose(repermuted.numpy(), originals["blk.0.attn_q.weight"], rtol=2 ** -11, atol=0)
    elif qtype == "Q8_0":  # int8 rows and their scales move together
        import gguf

        raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        assert np.array_equal(repermuted.numpy(), gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(HIDDEN, HIDDEN))


def test_config_from_metadata(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", {})
    config = gguf_config(open_gguf(tmp_path / "m.gguf"), tmp_path / "m.gguf")
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (HIDDEN, HEADS, KV_HEADS, 64)
    assert config.is_tied_embeddings and config.vocab_size == VOCAB and config.max_position_embeddings == 128
