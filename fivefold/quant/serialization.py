"""A quantized LLM as a directory: ``config.json`` with a ``quantization_config``,
``model.safetensors`` holding int8 weights with their scales, zero points and clip
ranges (module names as Fivefold serves them: fused ``qkv_proj`` and ``gate_up_proj``),
and the tokenizer. ``load_model`` recognises it and rebuilds the int8 modules, so
``fivefold generate`` and ``fivefold serve`` run it in int8.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fivefold.errors import ModelLoadError
from fivefold.quant.config import Int8Config
from fivefold.quant.linear import Int8Linear
from fivefold.quant.quantize import replace_module

QUANT_METHOD = "fivefold-int8"
FORMAT_VERSION = 1


def save_quantized(loaded, config: Int8Config, modules: list[str], out_dir: str | Path,
                   extra: dict | None = None) -> Path:
    """Write ``loaded`` (already quantized by ``quantize_``) as a directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    state = {}
    for name, tensor in model.state_dict().items():
        state[name] = tensor.detach().contiguous()
    lm_head_quantized = "lm_head" in modules
    if loaded.config.is_tied_embeddings and not lm_head_quantized:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; re-tied on load
    save_file(state, str(out / "model.safetensors"))
    hf = loaded.config.to_hf_dict()
    hf["quantization_config"] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                                 "config": config.to_dict(), "modules": list(modules), **(extra or {})}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    loaded.tokenizer.hf.save_pretrained(str(out))
    return out


def quantization_config(directory: Path) -> dict | None:
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = raw.get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD else None


def load_quantized_model(directory: Path, model_config, dtype: torch.dtype, qconfig: dict):
    """Rebuild a Fivefold LLM with int8 modules from a directory written by :func:`save_quantized`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from fivefold.models.layers import RotaryEmbedding
    from fivefold.models.llama import LlamaForCausalLM

    if qconfig.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{directory}: quantized format version {qconfig.get('format_version')} is not "
                             f"supported (this version reads {FORMAT_VERSION})")
    config = Int8Config.from_dict(qconfig["config"])
    try:
        state = load_file(str(directory / "model.safetensors"))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ModelLoadError(f"corrupt or truncated safetensors file in {directory}: {exc}") from None
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config)
        for name in qconfig["modules"]:
            linear = model.get_submodule(name)
            replace_module(model, name, Int8Linear(linear.in_features, linear.out_features, f"{name}.bias" in state,
                                                   config))
    model.rotary = RotaryEmbedding(model_config)
    tied = model_config.is_tied_embeddings and "lm_head.weight" not in state
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    state = {k: v.to(dtype) if v.is_floating_point() and not _is_int8_buffer(k, qconfig["modules"]) else v
             for k, v in state.items()}
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{directory}: tensors do not match the quantization config: "
                             f"{str(exc).splitlines()[0]}") from None
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def _is_int8_buffer(key: str, modules: list[str]) -> bool:
    """Scales, zero points, clip ranges and biases of int8 modules stay float32."""
    return key.rpartition(".")[0] in modules
