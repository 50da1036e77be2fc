"""The memory invariant of loading, from the OS's peak RSS (VmHWM): an engine loading a bf16
checkpoint holds one copy of every weight, and the load's peak is that copy plus a few tensors'
worth of transients (the old loader held the dense weights, oneDNN's packed copy and the
streaming copy: three). Each load runs in a fresh process so that one's peak cannot hide another's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import _write_tokenizer, tiny_hf_config

HIDDEN, LAYERS, MLP = 1024, 8, 4096  # ~122M parameters: 0.49 GB in float32, 0.12 GB int8
SLACK = 200 << 20  # allocator and library pages that are not weights

CHILD = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch
from fivefold import kernels
from fivefold.llm import LLM
for ops in (kernels.stream_ops, kernels.fused_ops, kernels.paged_attention_ops, kernels.decode_loop_ops):
    ops()  # loaded before the baseline: library pages are not weights
x = torch.randn(256, 1024) @ torch.randn(1024, 1024)  # oneDNN's and OpenMP's own start-up
before = status("VmRSS:")
llm = LLM(sys.argv[1], quantization=sys.argv[2] or None, kv_cache_memory_bytes=16 << 20, stream_copy="off")
stats = llm.engine.stats()
print(json.dumps({"peak_delta": status("VmHWM:") - before, "weight_bytes": stats["weight_bytes"]}))
"""


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("bf16")
    config = tiny_hf_config("llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=MLP,
                            num_attention_heads=16, num_key_value_heads=4, rope_scaling=None, head_dim=64)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(str(directory))
    _write_tokenizer(directory)
    gen = torch.Generator().manual_seed(0)
    kv = HIDDEN // 4
    for i in range(LAYERS):  # one shard per layer, as large checkpoints are written
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (kv, HIDDEN),
                  "self_attn.v_proj.weight": (kv, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                  "mlp.gate_proj.weight": (MLP, HIDDEN), "mlp.up_proj.weight": (MLP, HIDDEN),
                  "mlp.down_proj.weight": (HIDDEN, MLP), "input_layernorm.weight": (HIDDEN,),
                  "post_attention_layernorm.weight": (HIDDEN,)}
        save_file({p + k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()},
                  str(directory / f"model-{i:05d}-of-{LAYERS + 1:05d}.safetensors"))
    vocab = config.vocab_size
    save_file({"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=gen).to(torch.bfloat16),
               "lm_head.weight": torch.randn(vocab, HIDDEN, generator=gen).to(torch.bfloat16),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)},
              str(directory / f"model-{LAYERS:05d}-of-{LAYERS + 1:05d}.safetensors"))
    return directory


@pytest.mark.parametrize("quantization", ["", "w8a16"])
def test_loading_peaks_at_one_copy_of_the_weights(bf16_checkpoint, quantization):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(bf16_checkpoint), quantization],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    params = LAYERS * (2 * HIDDEN * HIDDEN + 2 * (HIDDEN // 4) * HIDDEN + 3 * MLP * HIDDEN)
    expected = params * (1 if quantization else 4)
    assert expected <= found["weight_bytes"] <= expected * 1.1, found  # one copy (+ embeddings, norms, scales)
    largest = 2 * MLP * HIDDEN * 4  # the fused gate_up projection in float32
    bound = 1.15 * found["weight_bytes"] + 3 * largest + SLACK
    assert found["peak_delta"] <= bound, (found, bound)
