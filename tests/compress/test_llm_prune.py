"""Structured pruning of random Llama/Qwen2: shapes consistent, ratio 0 identical, the pruned
directory loads in transformers (same logits) and generates in the engine."""

import copy

import pytest
import torch

from fivefold.compress.llm_prune import prune_attention_groups_, prune_mlp_neurons_, save_hf_directory
from fivefold.errors import FivefoldError
from fivefold.models import load_model
from fivefold.models.forward import sequence_logits
from tests.conftest import TINY_VOCAB, save_random_hf_model

IDS = list(range(5, 5 + 19))


def _logits(loaded):
    with torch.inference_mode():
        return sequence_logits(loaded.model, IDS)


def test_ratio_zero_is_identical(tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    before = _logits(loaded)
    pruned = prune_mlp_neurons_(copy.deepcopy(loaded), 0.0, "activation", [IDS])
    assert pruned.config.intermediate_size == loaded.config.intermediate_size
    assert torch.equal(_logits(pruned), before)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pruned_directory_loads_in_transformers_and_generates_in_the_engine(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from fivefold import LLM, SamplingParams

    save_random_hf_model(arch, tmp_path / "orig")
    loaded = load_model(str(tmp_path / "orig"))
    pruned = prune_mlp_neurons_(loaded, 0.5, "activation", [IDS])
    pruned = prune_attention_groups_(pruned, 1)
    c = pruned.config
    assert (c.intermediate_size, c.num_heads, c.num_kv_heads) == (80, 2, 1)
    for layer in pruned.model.layers:
        assert layer.mlp.gate_up_proj.weight.shape == (160, 64) and layer.mlp.down_proj.weight.shape == (64, 80)
        assert layer.self_attn.qkv_proj.weight.shape == (c.q_size + 2 * c.kv_size, 64)
        assert layer.self_attn.o_proj.weight.shape == (64, c.q_size)
    ours = _logits(pruned)
    out = save_hf_directory(pruned, tmp_path / "pruned")
    reloaded = load_model(str(out))
    assert torch.allclose(_logits(reloaded), ours, atol=1e-5)
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert (ref - ours).abs().max().item() < 1e-4
    outs = LLM(str(out), kv_cache_memory_bytes=8 << 20).generate([IDS[:6]], SamplingParams(temperature=0, max_tokens=5))
    assert len(outs[0].outputs[0].token_ids) == 5
    assert all(0 <= t < TINY_VOCAB for t in outs[0].outputs[0].token_ids)


def test_least_important_neuron_goes_first_and_bad_ratios_are_refused(tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    inter = loaded.config.intermediate_size
    with torch.inference_mode():
        loaded.model.layers[0].mlp.gate_up_proj.weight[7].zero_()  # neuron 7's gate row
    down_before = loaded.model.layers[0].mlp.down_proj.weight.clone()
    pruned = prune_mlp_neurons_(loaded, 1 / inter, "l2")
    kept = [j for j in range(inter) if j != 7]
    assert torch.equal(pruned.model.layers[0].mlp.down_proj.weight, down_before[:, kept])
    with pytest.raises(FivefoldError, match="ratio must be in \\[0, 1\\)"):
        prune_mlp_neurons_(pruned, 1.0)
    with pytest.raises(FivefoldError, match="can remove 0 to 1 of 2 KV groups"):
        prune_attention_groups_(pruned, 2)
    with pytest.raises(FivefoldError, match="importance 'taylor' needs calibration text"):
        prune_mlp_neurons_(pruned, 0.2, "taylor")


@pytest.mark.parametrize("importance", ["activation", "taylor"])
def test_data_driven_importances_drop_a_dead_neuron_first(importance, tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    inter = loaded.config.intermediate_size
    with torch.inference_mode():
        for layer in loaded.model.layers:  # neuron 11 never fires: its up row is zero
            layer.mlp.gate_up_proj.weight[inter + 11].zero_()
    downs = [layer.mlp.down_proj.weight.clone() for layer in loaded.model.layers]
    pruned = prune_mlp_neurons_(loaded, 1 / inter, importance, [IDS, IDS[::-1]])
    kept = [j for j in range(inter) if j != 11]
    for layer, down in zip(pruned.model.layers, downs):
        assert torch.equal(layer.mlp.down_proj.weight, down[:, kept])


def test_every_other_layer_llm_student(tmp_path):
    from fivefold.compress.llm_prune import every_other_layer_student

    save_random_hf_model("qwen3", tmp_path)
    teacher = load_model(str(tmp_path))
    student = every_other_layer_student(teacher)
    assert student.config.num_layers == 2 and len(student.model.layers) == 2
    assert torch.equal(student.model.layers[1].mlp.down_proj.weight, teacher.model.layers[2].mlp.down_proj.weight)
    assert _logits(student).shape == (len(IDS), teacher.config.vocab_size)
