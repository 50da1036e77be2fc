"""benchmarks/llamacpp_decode.py, the llama.cpp peer's measurement (peers.py and scale.py run it):
its C API loop and llama-cpp-python's generate decode the same greedy tokens from the same prompt,
EOS masked, so the two rates it reports time the same work. Runs in the peer's own venv; skipped
with the reason when llama-cpp-python is not installed there (../shared/PEERS.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fivefold.models.loader import load_tokenizer
from fivefold.models.registry import BUILTIN_MODELS, DEFAULT_LLM

LLAMACPP_PYTHON = Path.home() / "peers/llamacpp/bin/python"
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks/llamacpp_decode.py"


@pytest.mark.skipif(not LLAMACPP_PYTHON.exists(), reason=f"llama-cpp-python is not installed ({LLAMACPP_PYTHON})")
def test_c_loop_and_generate_decode_the_same_tokens(tmp_path):
    tokenizer = load_tokenizer(DEFAULT_LLM)[0]
    prompt = tokenizer.encode("The tokenizer turns the text of a module into a stream of tokens, and")
    (tmp_path / "prompt.json").write_text(json.dumps(prompt))
    proc = subprocess.run([str(LLAMACPP_PYTHON), str(SCRIPT), str(BUILTIN_MODELS[DEFAULT_LLM].path()),
                           "--prompt", str(tmp_path / "prompt.json"), "--new", "24", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found["decode_tokens"]) == 24
    assert found["decode_tokens"] == found["generate_tokens"]
    assert 2 not in found["decode_tokens"]  # SmolLM2's EOS, masked
    assert len(found["decode_tok_s_samples"]) == 2 and found["decode_tok_s"] == max(found["decode_tok_s_samples"])
    assert found["generate_tok_s"] > 0 and found["peak_rss"] >= found["peak_rss_load"] > 0
