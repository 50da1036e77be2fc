"""Random-weight Llama / Qwen2 / Qwen3 checkpoints: our flat-batch, paged-KV forward
against transformers on the same weights, logits within 1e-4 (max abs)."""

from __future__ import annotations

import pytest
import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.kv_cache_manager import KVCacheManager
from fivefold.engine.model_runner import ModelRunner
from fivefold.engine.sequence import Sequence
from fivefold.models import load_model
from fivefold.sampling_params import SamplingParams
from tests.conftest import TINY_VOCAB, save_random_hf_model

ATOL = 1e-4


def _all_logits(loaded, runner, scheduled):
    input_ids, positions, meta = runner.prepare(scheduled)
    with torch.inference_mode():
        hidden = runner.model(input_ids, positions, meta, runner.kv_caches)  # the model as the runner serves it
        return runner.model.compute_logits(hidden), meta


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_prefill_decode_batch_matches_transformers(arch, tmp_path):
    ref = save_random_hf_model(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == arch
    runner = ModelRunner(loaded.model, EngineConfig(block_size=4, kv_cache_memory_bytes=8 << 20))
    blocks = KVCacheManager(runner.num_blocks, 4)

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 11, 17, 1]
    tokens = [torch.randint(3, TINY_VOCAB, (n + 5,), generator=gen).tolist() for n in lengths]
    seqs = [Sequence(f"s{i}", t, SamplingParams()) for i, t in enumerate(tokens)]

    # Step 1: prefills of sequences 0 and 1 (all but their last 3 tokens), and the first 6 of seq 2.
    step1 = [(seqs[0], lengths[0]), (seqs[1], lengths[1]), (seqs[2], 6)]
    # Step 2 mixes everything: decodes of 0 and 1, the rest of 2's chunked prefill,
    # a fresh prefill of seq 3, and a 3-token continuation of seq 1 is done in step 3.
    step2 = [(seqs[0], 1), (seqs[1], 1), (seqs[2], lengths[2] - 6), (seqs[3], lengths[3])]
    step3 = [(seqs[3], 1), (seqs[1], 2), (seqs[0], 1), (seqs[2], 3)]
    step4 = [(seqs[3], 1)]  # a lone decode: the batched-decode path without a padding mask
    step5 = [(seqs[0], 1), (seqs[3], 1)]  # decodes of unequal context: with a padding mask
    for step in (step1, step2, step3, step4, step5):
        for seq, n in step:
            assert blocks.allocate_slots(seq, n)
        logits, meta = _all_logits(loaded, runner, step)
        with torch.no_grad():
            for i, (seq, n) in enumerate(step):
                start = seq.num_computed_tokens
                full = ref(torch.tensor([seq.token_ids[: start + n]])).logits[0, start:]
                ours = logits[meta.query_start_loc[i]: meta.query_start_loc[i + 1]]
                diff = (ours - full).abs().max().item()
                assert diff < ATOL, f"{arch}: seq {seq.request_id} tokens {start}:{start + n} differ by {diff}"
        for seq, n in step:
            seq.num_computed_tokens += n
    blocks.check_integrity()


def test_fused_projections_replace_separate_ones(tmp_path):
    save_random_hf_model("qwen2", tmp_path)
    model = load_model(str(tmp_path)).model
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.self_attn.qkv_proj.weight" in names and "layers.0.self_attn.qkv_proj.bias" in names
    assert "layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj" in n or ".gate_proj" in n for n in names)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied


def test_bfloat16_load_close_to_float32(tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded32 = load_model(str(tmp_path), "float32")
    loaded16 = load_model(str(tmp_path), "bfloat16")
    assert loaded16.model.dtype == torch.bfloat16
    seq_tokens = list(range(3, 40))
    outs = []
    for loaded in (loaded32, loaded16):
        runner = ModelRunner(loaded.model, EngineConfig(block_size=16, kv_cache_memory_bytes=4 << 20))
        seq = Sequence("a", seq_tokens, SamplingParams())
        KVCacheManager(runner.num_blocks, 16).allocate_slots(seq, len(seq_tokens))
        outs.append(_all_logits(loaded, runner, [(seq, len(seq_tokens))])[0])
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=-1).min().item()
    assert cos > 0.99


def _run_two_steps(loaded, **engine_options):
    """A prefill of two prompts, then a decode of both: (logits of every step, kernel counts of the last)."""
    from fivefold.fuse.graph_fuse import KernelCounter

    runner = ModelRunner(loaded.model, EngineConfig(block_size=4, kv_cache_memory_bytes=8 << 20, **engine_options))
    blocks = KVCacheManager(runner.num_blocks, 4)
    seqs = [Sequence(f"s{i}", list(range(3 + i, 3 + i + n)), SamplingParams()) for i, n in enumerate((10, 5))]
    logits = []
    for step in ([(seqs[0], 9), (seqs[1], 4)], [(seqs[0], 1), (seqs[1], 1)]):
        for seq, n in step:
            assert blocks.allocate_slots(seq, n)
        with KernelCounter() as counter:
            logits.append(_all_logits(loaded, runner, step)[0])
        for seq, n in step:
            seq.num_computed_tokens += n
    return torch.cat(logits), counter.counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_hot_path_equals_eager(arch, tmp_path):
    """hot_path="fused" (C++ add+RMSNorm, SiLU*up, RoPE) vs "eager" on the same steps: 1e-5."""
    save_random_hf_model(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    eager, eager_counts = _run_two_steps(loaded, hot_path="eager")
    fused, fused_counts = _run_two_steps(loaded, hot_path="fused")
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    num_layers = loaded.config.num_layers
    # Every residual add + norm after the first layer's input norm, plus the final norm.
    assert fused_counts["fivefold.fused_add_rms_norm_"] == 2 * num_layers
    assert fused_counts["fivefold.silu_and_mul"] == fused_counts["fivefold.rotary_qk_"] == num_layers
    assert "fivefold.silu_and_mul" not in eager_counts
    assert sum(fused_counts.values()) < sum(eager_counts.values())


def test_tiled_prefill_attention_equals_sdpa(tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    sdpa, _ = _run_two_steps(loaded, prefill_attention="sdpa")
    tiled, _ = _run_two_steps(loaded, prefill_attention="tiled")
    torch.testing.assert_close(tiled, sdpa, atol=1e-5, rtol=1e-5)
