"""The command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import subprocess
import sys


def fivefold(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_models_lists_builtins_with_paths():
    proc = fivefold("models")
    assert proc.returncode == 0
    assert "smollm2-135m-instruct" in proc.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf" in proc.stdout
    assert "all-minilm-l6-v2" in proc.stdout


def test_generate_streams_the_greedy_answer():
    proc = fivefold("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "The capital of France is Paris."


def test_chat_keeps_history():
    proc = fivefold("chat", "--max-tokens", "24", stdin="What is the capital of France?\nRepeat your last answer.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert "Paris" in lines[0]
    assert "Paris" in proc.stdout.split("\n", 1)[1]  # the second answer needs the first turn


def test_bad_sampling_parameter_is_one_line():
    proc = fivefold("generate", "--prompt", "hi", "--temperature", "5")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: temperature must be in [0, 2], got 5.0"


def test_prompt_beyond_context_is_one_line():
    proc = fivefold("generate", "--prompt", "hi", "--max-tokens", "100000")
    assert proc.returncode == 1
    assert "exceeds the maximum context length 8192" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_with_an_int8_kv_cache():
    proc = fivefold("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24",
                    "--kv-cache-dtype", "int8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    proc = fivefold("generate", "--prompt", "hi", "--kv-cache-dtype", "fp8")
    assert proc.returncode != 0 and "--kv-cache-dtype" in proc.stderr
