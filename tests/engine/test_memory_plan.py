"""Memory planning: the estimate's arithmetic, the one-line refusal naming sizes and the options
that fit, and a model refused before any weight is read (LLM and the CLI)."""

import subprocess
import sys

import pytest
import torch

from fivefold.engine.config import EngineConfig
from fivefold.engine.memory_plan import LOAD_MARGIN, RUNTIME_BYTES, check_fits, plan_memory
from fivefold.errors import FivefoldError
from tests.conftest import save_random_hf_model

GB = 10**9


def test_the_plan_counts_the_copies_each_layout_holds():
    config = EngineConfig(kv_cache_memory_bytes=2 * GB)
    packed = plan_memory(10**9, torch.float32, config, available_bytes=100 * GB)
    assert packed.weight_bytes == 12 * GB and packed.load_bytes == int(12 * GB * LOAD_MARGIN) and packed.fits
    assert packed.total_bytes == 12 * GB + packed.load_bytes + 2 * GB + RUNTIME_BYTES
    dense_bf16 = plan_memory(10**9, torch.bfloat16, EngineConfig(kv_cache_memory_bytes=2 * GB, weight_layout="dense"),
                             available_bytes=100 * GB)
    assert dense_bf16.weight_bytes == 4 * GB
    assert plan_memory(10**9, torch.float32, config, is_int8=True, available_bytes=GB).weight_bytes == 2 * GB
    # a KV share is of what the weights and the runtime leave (the engine sizes it after loading)
    share = plan_memory(10**9, torch.float32, EngineConfig(kv_cache_memory_fraction=0.5), available_bytes=30 * GB)
    assert share.kv_cache_bytes == int((30 * GB - 12 * GB * (1 + LOAD_MARGIN) - RUNTIME_BYTES) / 2) and share.fits


def test_a_model_too_large_is_refused_naming_the_sizes_and_what_fits(monkeypatch):
    monkeypatch.delenv("FIVEFOLD_NO_MEMORY_CHECK", raising=False)
    config = EngineConfig(kv_cache_memory_bytes=GB)
    # 7.2B float32 packed: 86.4 GB of weights against 24 GB
    with pytest.raises(FivefoldError) as err:
        check_fits("llama-8b", 7_200_000_000, torch.float32, config, available_bytes=24 * GB)
    message = str(err.value)
    assert "\n" not in message and "7.20B parameters" in message and "86.4 GB" in message and "24.0 GB" in message
    assert "loading 17.3 GB" in message
    assert "int8 weights" in message and "--dtype bfloat16" not in message  # 43.2 GB in bf16 does not fit either
    with pytest.raises(FivefoldError, match=r"would fit: --dtype bfloat16 \("):
        check_fits("llama-1b", 1_070_000_000, torch.float32, config, available_bytes=12 * GB)
    assert check_fits("llama-1b", 1_070_000_000, torch.float32, config, available_bytes=20 * GB).fits  # 17.5 GB
    monkeypatch.setenv("FIVEFOLD_NO_MEMORY_CHECK", "1")
    assert not check_fits("llama-8b", 7_200_000_000, torch.float32, config, available_bytes=24 * GB).fits


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
