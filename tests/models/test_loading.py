"""Model loading: directory layouts, built-in names, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fivefold.errors import ModelLoadError
from fivefold.models import BUILTIN_MODELS, export_hf_directory, load_model, resolve_model_path
from tests.conftest import save_random_hf_model
from tests.models.test_gguf import write_tiny_gguf


def _same_weights(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_builtin_names_resolve_to_package_files():
    llm = resolve_model_path("smollm2-135m-instruct")
    assert llm.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and llm.stat().st_size > 50e6
    enc = resolve_model_path("all-minilm-l6-v2")
    assert (enc / "config.json").exists() and (enc / "model.safetensors").exists()
    assert set(BUILTIN_MODELS) == {"smollm2-135m-instruct", "all-minilm-l6-v2"}


def test_sharded_checkpoint_with_and_without_index(tmp_path):
    save_random_hf_model("llama", tmp_path / "single")
    single = load_model(str(tmp_path / "single"))
    model = save_random_hf_model("llama", tmp_path / "sharded")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _same_weights(single, load_model(str(tmp_path / "sharded")))
    (tmp_path / "sharded" / "model.safetensors.index.json").unlink()
    _same_weights(single, load_model(str(tmp_path / "sharded")))


def test_export_hf_directory_round_trips(tmp_path):
    save_random_hf_model("qwen3", tmp_path / "src")
    loaded = load_model(str(tmp_path / "src"))
    export_hf_directory(loaded, tmp_path / "out")
    _same_weights(loaded, load_model(str(tmp_path / "out")))


def test_export_of_the_builtin_gguf_holds_only_a_float_checkpoints_names(tmp_path, smollm2):
    """The built-in file keeps its tied Q8_0 head as int8, with scale buffers: the export writes
    none of them (vLLM refused the directory: "no parameter named lm_head.input_clip"), and
    transformers finds exactly its own parameters."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    export_hf_directory(smollm2, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("lm_head.") for n in names)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    expected = {k for k in model.state_dict() if k != "lm_head.weight"}
    assert names == expected


def test_chat_template_from_hf_directory(tmp_path):
    save_random_hf_model("qwen2", tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}w5 {{ m['content'] }} w6 {% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in tmp_path.glob("chat_template.*"):
        f.unlink()
    tok = load_model(str(tmp_path)).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "w7 w8"}]) == [5, 7, 8, 6]


# --- bad input: each gets a one-line message that names the problem ---------------------------

def test_missing_path():
    with pytest.raises(ModelLoadError, match=r"model '/no/such/model' not found: no such file or directory.*built-ins: smollm2"):
        load_model("/no/such/model")


def test_unsupported_hf_architecture(tmp_path):
    save_random_hf_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM, "
                                             r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", {}, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2' in m.gguf; supported GGUF architectures: llama, qwen2, qwen3"):
        load_model(str(tmp_path / "m.gguf"))


def test_no_tokenizer_in_hf_directory(tmp_path):
    save_random_hf_model("llama", tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / f).exists():
            (tmp_path / f).unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer found in .* \(looked for tokenizer.json, tokenizer.model"):
        load_model(str(tmp_path))


def test_no_tokenizer_in_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", {}, with_tokenizer=False)
    with pytest.raises(ModelLoadError, match=r"no tokenizer found in .*m.gguf \(GGUF metadata has no tokenizer.ggml.tokens\)"):
        load_model(str(tmp_path / "m.gguf"))


def test_truncated_gguf(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": "Q8_0"})
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated GGUF file .*m.gguf"):
        load_model(str(tmp_path / "m.gguf"))


def test_garbage_gguf(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + os.urandom(300))
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated GGUF file"):
        load_model(str(tmp_path / "m.gguf"))


def test_truncated_safetensors(tmp_path):
    save_random_hf_model("llama", tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated safetensors file .*model.safetensors"):
        load_model(str(tmp_path))


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    save_random_hf_model("llama", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"checkpoint is missing tensor 'layers.1.mlp.down_proj.weight'"):
        load_model(str(tmp_path))


def test_bad_dtype(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported dtype 'float64'; supported: float32, bfloat16"):
        load_model("smollm2-135m-instruct", dtype="float64")


def test_cli_error_is_one_line_and_nonzero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fivefold", "generate", "--model", str(tmp_path / "nope"),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: model ") and "not found" in proc.stderr
