"""The C++ decode loop (fivefold::decode_layers): decode steps against transformers and against
the Python layer loop on the same weights, float32 and W8A16; models it cannot run keep the
Python loop and say why."""

from __future__ import annotations

import pytest
import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.model_runner import ModelRunner
from fivefold.engine.sequence import Sequence
from fivefold.models import load_model
from fivefold.models.native_decode import NativeDecoder
from fivefold.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, save_random_hf_model


def _decode_logits(loaded, runner, step, native: bool):
    input_ids, positions, meta = runner.prepare(step)
    assert NativeDecoder.can_run(meta)
    with torch.inference_mode():
        if native:
            hidden = runner.native_decoder(input_ids, positions, meta, runner.kv_caches)
        else:
            hidden = loaded.model(input_ids, positions, meta, runner.kv_caches)
        return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("arch,layout", [("llama", "packed"), ("llama", "dense"), ("qwen2", "packed")])
def test_decode_steps_match_transformers_and_the_python_loop(arch, layout, tmp_path):
    ref = save_random_hf_model(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded.model, EngineConfig(block_size=4, kv_cache_memory_bytes=8 << 20, weight_layout=layout))
    assert runner.native_decoder is not None
    blocks = KVCacheManager(runner.num_blocks, 4)
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 14]  # unequal contexts: block tables of different lengths in one step
    seqs = [Sequence(f"s{i}", torch.randint(3, TINY_VOCAB, (n + 12,), generator=gen).tolist(), SamplingParams())
            for i, n in enumerate(lengths)]
    prefill = [(s, n) for s, n in zip(seqs, lengths)]
    for seq, n in prefill:
        assert blocks.allocate_slots(seq, n)
    input_ids, positions, meta = runner.prepare(prefill)
    with torch.inference_mode():
        loaded.model(input_ids, positions, meta, runner.kv_caches)
    for seq, n in prefill:
        seq.num_computed_tokens += n
    for step_no in range(6):  # 6 decode steps; batches of 3, then 2, then 1 (every row count path)
        step = [(s, 1) for s in seqs[: 3 - step_no // 2]]
        for seq, _ in step:
            assert blocks.allocate_slots(seq, 1)
        caches_before = [c.clone() for c in runner.kv_caches]
        python = _decode_logits(loaded, runner, step, native=False)
        caches_python = [c.clone() for c in runner.kv_caches]
        for c, before in zip(runner.kv_caches, caches_before):
            c.copy_(before)
        native = _decode_logits(loaded, runner, step, native=True)
        for c, expected in zip(runner.kv_caches, caches_python):  # the same keys and values at the same slots
            torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            for i, (seq, _) in enumerate(step):
                full = ref(torch.tensor([seq.token_ids[: seq.num_computed_tokens + 1]])).logits[0, -1]
                diff = (native[i] - full).abs().max().item()
                assert diff < 1e-4, f"{arch}: {seq.request_id} decode {step_no} differs from transformers by {diff}"
        for seq, _ in step:
            seq.num_computed_tokens += 1


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16", "w4a8", "q4_k_m"])
def test_quantized_decode_loop_matches_the_python_loop(scheme, tmp_path):
    """W8A16, and 4-bit weights with float or int8 activations (the loop passes the choice to
    fivefold::int4_linear: with the wrong one the logits differ by far more than the tolerance);
    a Q4_K_M-like GGUF served as stored, whose qkv is two blocks (q, k 4-bit; v Q6_K int8)."""
    from fivefold.models.layers import SplitLinear
    from fivefold.quant.config import Int8Config
    from fivefold.quant.quantize import quantize_

    save_random_hf_model("llama", tmp_path)
    if scheme == "q4_k_m":
        from tests.models.test_gguf import write_tiny_gguf

        projections = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")
        write_tiny_gguf(tmp_path / "m.gguf", {**{f"blk.0.{p}.weight": "Q4_K" for p in projections},
                                              "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K"})
        loaded = load_model(str(tmp_path / "m.gguf"), quantization="gguf")
        assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, SplitLinear)
    elif scheme == "w8a16":
        loaded = load_model(str(tmp_path))
        quantize_(loaded.model, Int8Config(scheme="w8a16"))
    else:
        loaded = load_model(str(tmp_path), quantization=scheme)
    runner = ModelRunner(loaded.model, EngineConfig(block_size=4, kv_cache_memory_bytes=8 << 20))
    assert runner.native_decoder is not None
    seqs = [Sequence("a", list(range(3, 20)), SamplingParams()), Sequence("b", list(range(40, 51)), SamplingParams())]
    blocks = KVCacheManager(runner.num_blocks, 4)
    for seq in seqs:
        assert blocks.allocate_slots(seq, len(seq.token_ids) - 1)
    prefill = [(s, len(s.token_ids) - 1) for s in seqs]
    input_ids, positions, meta = runner.prepare(prefill)
    with torch.inference_mode():
        loaded.model(input_ids, positions, meta, runner.kv_caches)
    for seq, n in prefill:
        seq.num_computed_tokens += n
        assert blocks.allocate_slots(seq, 1)
    step = [(s, 1) for s in seqs]
    saved = [c.clone() for c in runner.kv_caches]
    python = _decode_logits(loaded, runner, step, native=False)
    for c, before in zip(runner.kv_caches, saved):
        c.copy_(before)
    native = _decode_logits(loaded, runner, step, native=True)
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-4)
    if scheme == "w4a16":  # one model with both activation kinds keeps the Python loop
        next(m for m in loaded.model.modules() if hasattr(m, "set_activations_")).set_activations_("int8")
        assert "float and int8 activations" in NativeDecoder.unsupported_reason(loaded.model)


def test_models_the_loop_cannot_run_keep_the_python_loop(tmp_path):
    save_random_hf_model("qwen3", tmp_path / "q3")
    loaded = load_model(str(tmp_path / "q3"))
    assert "q/k RMSNorm" in NativeDecoder.unsupported_reason(loaded.model)
    assert ModelRunner(loaded.model, EngineConfig(kv_cache_memory_bytes=8 << 20)).native_decoder is None
    save_random_hf_model("llama", tmp_path / "l")
    bf16 = load_model(str(tmp_path / "l"), "bfloat16")
    assert "bfloat16" in NativeDecoder.unsupported_reason(bf16.model)
    f32 = load_model(str(tmp_path / "l"))
    assert ModelRunner(f32.model, EngineConfig(kv_cache_memory_bytes=8 << 20, decode_loop="python")).native_decoder is None
    assert ModelRunner(f32.model, EngineConfig(kv_cache_memory_bytes=8 << 20, hot_path="eager")).native_decoder is None
    with pytest.raises(Exception, match="decode_loop must be one of cpp, python"):
        EngineConfig(decode_loop="graph")


def test_decode_step_inputs_equal_the_general_preparation(tmp_path):
    """prepare's decode-only path (plain lists) builds what the general path builds: token ids,
    positions, slots and their (block, offset) parts, block tables, lengths; randomized batches
    of contexts crossing block boundaries, sequences in any order, many steps."""
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    runner = ModelRunner(loaded.model, EngineConfig(block_size=4, kv_cache_memory_bytes=8 << 20))
    gen = torch.Generator().manual_seed(11)
    blocks = KVCacheManager(runner.num_blocks, 4)
    seqs = []
    for i in range(6):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        seq = Sequence(f"s{i}", torch.randint(3, TINY_VOCAB, (n + 40,), generator=gen).tolist(), SamplingParams())
        assert blocks.allocate_slots(seq, n)
        seq.num_computed_tokens = n
        seqs.append(seq)
    for _ in range(40):
        order = torch.randperm(len(seqs), generator=gen)[: int(torch.randint(1, len(seqs) + 1, (1,), generator=gen))]
        step = [(seqs[i], 1) for i in order.tolist()]
        for seq, _ in step:
            assert blocks.allocate_slots(seq, 1)
        fast, general = runner._prepare_decode(step), runner._prepare_any(step)
        assert runner.prepare(step)[2].slot_mapping.tolist() == fast[2].slot_mapping.tolist()
        for a, b in zip(fast[:2], general[:2]):
            assert a.dtype == b.dtype == torch.long and a.tolist() == b.tolist()
        fm, gm = fast[2], general[2]
        assert fm.query_start_loc == gm.query_start_loc and fm.seq_lens == gm.seq_lens
        assert torch.equal(fm.slot_mapping, gm.slot_mapping) and torch.equal(fm.block_tables, gm.block_tables)
        for a, b in zip(fm.slot_blocks_and_offsets(), gm.slot_blocks_and_offsets()):
            assert torch.equal(a, b)
        for seq, _ in step:
            seq.num_computed_tokens += 1
