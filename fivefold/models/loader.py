"""Load a model by built-in name, Hugging Face directory or GGUF file.

``load_model`` returns the serving model (weights in the requested dtype), its
tokenizer and its config. Every failure a user can cause is a one-line
:class:`~fivefold.errors.ModelLoadError`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from fivefold.errors import ModelLoadError
from fivefold.models.config import ModelConfig
from fivefold.models.llama import LlamaForCausalLM
from fivefold.models.registry import resolve_model_path
from fivefold.models.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready to serve: module, tokenizer, config and where it came from."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    format: str  # "gguf" or "hf"
    name: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"unsupported dtype '{dtype}'; supported: {', '.join(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[dtype]


def find_checkpoint(path: Path) -> tuple[str, Path]:
    """('gguf', file) or ('hf', directory) for a path the user gave."""
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        if path.name == "config.json":
            return "hf", path.parent
        raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if (path / "config.json").exists():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    raise ModelLoadError(
        f"no model in {path}: expected config.json + *.safetensors, or exactly one .gguf file"
        + (f" (found {len(ggufs)} .gguf files)" if ggufs else "")
    )


def read_hf_config(directory: Path) -> ModelConfig:
    try:
        raw = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"corrupt config.json in {directory}: {exc}") from None
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as exc:
        raise ModelLoadError(f"config.json in {directory} lacks {exc}") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"corrupt {index}: {exc}") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"checkpoint shard {f.name} named in {index.name} does not exist")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory}")
    return files


def hf_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every safetensors shard of a directory."""
    from safetensors import SafetensorError, safe_open

    for file in _safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {exc}") from None


def build_model(config: ModelConfig, weights, dtype: torch.dtype) -> LlamaForCausalLM:
    """Instantiate without allocating (meta device), then assign the loaded tensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    from fivefold.models.layers import RotaryEmbedding

    model.rotary = RotaryEmbedding(config)  # its tables are computed, not loaded
    model.load_weights(weights, dtype)
    return model.eval()


def _config_and_tokenizer(fmt: str, location: Path):
    """(config, tokenizer, GGUF reader or None) of a checkpoint, without its weights."""
    if fmt == "gguf":
        from fivefold.models.gguf_file import gguf_config, open_gguf

        reader = open_gguf(location)
        config = gguf_config(reader, location)
        return config, load_gguf_tokenizer(location, reader, config.eos_token_ids), reader
    config = read_hf_config(location)
    return config, load_hf_tokenizer(location, config.eos_token_ids), None


def load_tokenizer(name_or_path: str) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and config of a model, without reading its weights (a router's needs)."""
    config, tokenizer, _ = _config_and_tokenizer(*find_checkpoint(resolve_model_path(name_or_path)))
    return tokenizer, config


def warn_if_slow_dtype(dtype: torch.dtype) -> None:
    """One line when bfloat16 is asked for on a CPU without bf16 arithmetic (AVX512-BF16, AMX): it
    runs (dense, upcast by PyTorch where oneDNN cannot pack it), but slower than float32."""
    from fivefold.platform import current_platform

    platform = current_platform()
    if dtype == torch.bfloat16 and platform.is_x86 and not platform.has_bf16_compute:
        warnings.warn(f"fivefold: bfloat16 is slower than float32 on this CPU ({platform.isa_level}, no "
                      f"AVX512-BF16/AMX); --dtype float32 is faster here", stacklevel=3)


def load_model(name_or_path: str, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load a built-in name, Hugging Face directory or GGUF file for serving."""
    torch_dtype = parse_dtype(dtype)
    warn_if_slow_dtype(torch_dtype)
    path = resolve_model_path(name_or_path)
    fmt, location = find_checkpoint(path)
    config, tokenizer, reader = _config_and_tokenizer(fmt, location)
    if fmt == "gguf":
        from fivefold.models.gguf_file import gguf_tensors

        weights = gguf_tensors(reader, config)
    else:
        from fivefold.quant.serialization import load_quantized_model, quantization_config

        qconfig = quantization_config(location)
        if qconfig is not None:  # written by `fivefold quantize`: int8 modules, run in int8
            model = load_quantized_model(location, config, torch_dtype, qconfig)
            return LoadedModel(model, tokenizer, config, location, fmt, name_or_path)
        weights = hf_tensors(location)
    with torch.inference_mode():
        model = build_model(config, weights, torch_dtype)
    return LoadedModel(model, tokenizer, config, location, fmt, name_or_path)


def export_hf_directory(loaded: LoadedModel, out_dir: str | Path) -> Path:
    """Write the loaded weights as a Hugging Face directory (float32 safetensors,
    un-fused names, config.json, tokenizer), e.g. to run transformers or vLLM on
    exactly the weights we serve."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    state: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.model.state_dict().items():
        if name == "lm_head.weight" and config.is_tied_embeddings:
            continue
        tensor = tensor.float().contiguous()
        if ".qkv_proj." in name:
            q, k, v = tensor.split([config.q_size, config.kv_size, config.kv_size], dim=0)
            for part, t in zip("qkv", (q, k, v)):
                state["model." + name.replace("qkv_proj", f"{part}_proj")] = t.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2, dim=0)
            state["model." + name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            state["model." + name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif name.startswith("lm_head"):
            state[name] = tensor
        else:
            state["model." + name] = tensor
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
    loaded.tokenizer.hf.save_pretrained(str(out))
    return out
