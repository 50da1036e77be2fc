"""Memory planning: the estimate's arithmetic, the one-line refusal naming sizes and the options
that fit, and a model refused before any weight is read (LLM and the CLI)."""

import subprocess
import sys

import pytest
import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.memory_plan import LOAD_COPIES, RUNTIME_BYTES, check_fits, plan_memory, wants_stream_copy
from fivefold.errors import FivefoldError
from fivefold.models.config import ModelConfig
from tests.conftest import save_random_hf_model

GB = 10**9


def llama(hidden: int, layers: int, mlp: int, heads: int, kv_heads: int, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=8192, is_tied_embeddings=True)


LLAMA_1B = llama(2048, 16, 8192, 32, 8)
LLAMA_8B = llama(4096, 32, 14336, 32, 8)


def test_the_plan_counts_one_copy_and_the_int8_embedding_apart():
    config = EngineConfig(kv_cache_memory_bytes=2 * GB)
    n = LLAMA_1B.num_parameters()
    embed = LLAMA_1B.vocab_size * LLAMA_1B.hidden_size
    packed = plan_memory(LLAMA_1B, torch.float32, config, available_bytes=100 * GB)
    assert not packed.stream_copy and packed.weight_bytes == 4 * n  # one copy: 4.3 GB of projections > 1 GiB
    assert packed.load_bytes == LOAD_COPIES * 49152 * 2048 * 4  # the embedding is the largest tensor
    assert packed.total_bytes == packed.weight_bytes + packed.load_bytes + 2 * GB + RUNTIME_BYTES and packed.fits
    dense_bf16 = plan_memory(LLAMA_1B, torch.bfloat16, EngineConfig(kv_cache_memory_bytes=2 * GB, weight_layout="dense"),
                             available_bytes=100 * GB)
    assert dense_bf16.weight_bytes == 2 * n
    # int8: every projection and the (tied) LM head one byte, the embedding float32
    int8 = plan_memory(LLAMA_1B, torch.float32, config, is_int8=True, available_bytes=GB)
    assert int8.weight_bytes == (n - embed) + embed + 4 * embed
    grouped = plan_memory(LLAMA_1B, torch.float32, config, is_int8=True, bits=9, available_bytes=GB)
    assert grouped.weight_bytes == int(n * (1 + 4 / 32) + 4 * embed)
    # 4-bit projections (Q4_0: 4.5 bits with the scales), the LM head counted at 8 bits
    four = plan_memory(LLAMA_1B, torch.float32, config, is_int8=True, bits=4.5, available_bytes=GB)
    assert four.weight_bytes == int((n - embed) * 4.5 / 8 + embed + 4 * embed)
    # a KV share is of what the weights, loading and the runtime leave (the engine sizes it after loading)
    share = plan_memory(LLAMA_1B, torch.float32, EngineConfig(kv_cache_memory_fraction=0.5), available_bytes=30 * GB)
    assert share.kv_cache_bytes == int((30 * GB - packed.weight_bytes - packed.load_bytes - RUNTIME_BYTES) / 2)


def test_the_streaming_copy_only_for_small_models():
    small = llama(576, 30, 1536, 9, 3)  # SmolLM2-135M: 0.43 GB of float32 projections
    auto = EngineConfig()
    assert wants_stream_copy(small, torch.float32, auto, available_bytes=20 * GB)
    assert not wants_stream_copy(small, torch.float32, auto, available_bytes=2 * GB)  # over an eighth
    assert not wants_stream_copy(LLAMA_1B, torch.float32, auto, available_bytes=100 * GB)  # over 1 GiB
    assert wants_stream_copy(LLAMA_1B, torch.float32, EngineConfig(stream_copy="on"), available_bytes=GB)
    assert not wants_stream_copy(small, torch.float32, EngineConfig(stream_copy="off"), available_bytes=20 * GB)
    assert not wants_stream_copy(small, torch.float32, auto, is_int8=True, available_bytes=20 * GB)
    with_copy = plan_memory(small, torch.float32, auto, available_bytes=20 * GB)
    assert with_copy.stream_copy and with_copy.weight_bytes > 4 * small.num_parameters()


def test_a_model_too_large_is_refused_naming_the_sizes_and_what_fits(monkeypatch):
    monkeypatch.delenv("FIVEFOLD_NO_MEMORY_CHECK", raising=False)
    config = EngineConfig(kv_cache_memory_bytes=GB)
    # 8B shape in float32: 30 GB of weights against 24 GB; bfloat16 (15 GB) and int8 (7.6 GB) fit
    with pytest.raises(FivefoldError) as err:
        check_fits("llama-8b", LLAMA_8B, torch.float32, config, available_bytes=24 * GB)
    message = str(err.value)
    assert "\n" not in message and "7.18B parameters" in message and "weights 28.7 GB" in message
    assert "24.0 GB" in message and "--dtype bfloat16 (" in message and "--quantization w8a16 (" in message
    with pytest.raises(FivefoldError) as err:
        check_fits("llama-8b", LLAMA_8B, torch.float32, config, available_bytes=14 * GB)
    assert "--dtype bfloat16" not in str(err.value) and "--quantization w8a16 (12.5 GB)" in str(err.value)
    assert check_fits("llama-8b", LLAMA_8B, torch.float32, config, is_int8=True, available_bytes=14 * GB).fits
    monkeypatch.setenv("FIVEFOLD_NO_MEMORY_CHECK", "1")
    assert not check_fits("llama-8b", LLAMA_8B, torch.float32, config, available_bytes=12 * GB).fits


def test_llm_and_the_cli_refuse_before_reading_weights(tmp_path, monkeypatch):
    monkeypatch.delenv("FIVEFOLD_NO_MEMORY_CHECK", raising=False)
    save_random_hf_model("llama", tmp_path / "m")
    for shard in (tmp_path / "m").glob("*.safetensors"):
        shard.write_bytes(b"not a safetensors file")  # reading a weight would fail with another error
    from fivefold.llm import LLM

    with pytest.raises(FivefoldError, match="does not fit"):
        LLM(str(tmp_path / "m"), kv_cache_memory_bytes=10**15)
    proc = subprocess.run([sys.executable, "-m", "fivefold", "generate", "--model", str(tmp_path / "m"),
                           "--kv-cache-memory-bytes", "1e15", "--prompt", "hi"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "does not fit" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_threads_and_max_model_len_reach_the_engine(tmp_path):
    save_random_hf_model("llama", tmp_path / "m")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fivefold", "generate", "--model", str(tmp_path / "m"), *args],
                              capture_output=True, text=True, timeout=300)

    bad = cli("--threads", "0", "--prompt", "hi")
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --threads must be >= 1, got 0"
    capped = cli("--threads", "1", "--max-model-len", "4", "--prompt", "a b c d e f", "--max-tokens", "2")
    assert capped.returncode == 1 and "maximum context length is 4" in capped.stderr
    ok = cli("--threads", "1", "--max-model-len", "64", "--prompt", "a b", "--max-tokens", "2")
    assert ok.returncode == 0, ok.stderr[-500:]
