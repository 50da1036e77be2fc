"""Load a model by built-in name, Hugging Face directory or GGUF file; write one back.

``load_model`` returns the serving model (weights in the requested dtype), its
tokenizer and its config. Every failure a user can cause is a one-line
:class:`~fivefold.errors.ModelLoadError`.

Loading follows gpt-fast: the model is built on the meta device, the module types the
checkpoint's format names are swapped in (``Int8Linear`` for a directory written by
:func:`save_quantized`), and each tensor is assigned once.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from fivefold.errors import FivefoldError, ModelLoadError
from fivefold.models.config import ModelConfig
from fivefold.models.llama import LlamaForCausalLM
from fivefold.models.registry import resolve_model_path
from fivefold.models.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ON_LOAD_BITS = {"w8a16": 8.0, "w4a16": 4.25, "w4a8": 4.25}  # bits per projection weight, scales included (W4A16: groups of 128)
QUANT_METHOD = "fivefold-int8"  # config.json's quantization_config.quant_method of save_quantized
FORMAT_VERSION = 1


@dataclass
class LoadedModel:
    """A model ready to serve: module, tokenizer, config and where it came from."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    format: str  # "gguf" or "hf"
    name: str
    # The Int8Config (as a dict) the weights carry, from the checkpoint or from quantizing after
    # loading: int8 cannot be undone, so a caller wanting another quantization reloads.
    quantization: dict | None = None


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
    shards = [f for f in files if re.fullmatch(r".*-\d+-of-\d+\.safetensors", f.name)]
    files = shards or files  # a complete sharded set beside an older single file: the shards
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory}")
    return files


def hf_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every safetensors shard of a directory, one tensor at a time through
    the shard's memory map (models.safetensors_file: each tensor is valid until the next is read)."""
    from fivefold.models.safetensors_file import read_tensors

    for file in _safetensors_files(directory):
        try:
            yield from read_tensors(file)
        except OSError as exc:
            raise ModelLoadError(f"cannot read safetensors file {file}: {exc}") from None


def build_model(config: ModelConfig, weights, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model of ``config`` with ``weights`` (Hugging Face names) as dense ``dtype`` tensors."""
    from fivefold.models.assemble import ServedForm, assemble

    return assemble(config, weights, ServedForm(dtype=dtype))


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


def load_model(name_or_path: str, dtype: str | torch.dtype = "float32",
               before_weights: Callable[..., object] | None = None,
               quantization: str | None = None, weight_layout: str = "dense",
               stream_copy: bool = False) -> LoadedModel:
    """Load a built-in name, Hugging Face directory or GGUF file for serving, tensor by tensor.

    Each tensor is converted to its served form as it is read (models.assemble): ``dtype``;
    ``weight_layout="packed"`` (oneDNN's layout in place of the dense weight, plus the streaming
    kernel's copy when ``stream_copy``); ``quantization="w8a16"`` (int8 weights quantized per
    output channel while loading, as ``fivefold quantize --scheme w8a16`` writes them). GGUF Q8_0
    tensors stay int8 with their scale per block of 32; a directory written by ``fivefold quantize``
    loads in its own int8 format.

    ``quantization="w4a16"``: 4-bit weights in groups of 128 with a minimum (round to nearest), the
    tied LM head W8A16; ``"w4a8"``: the same weights multiplied by int8 activations (per row and
    block of 32, integer dot products). ``quantization="gguf"``: a GGUF file's Q4_0/Q4_1 blocks
    served as they are by the 4-bit kernel against int8 activations, as llama.cpp runs them (by
    default they are dequantized to ``dtype``: the built-in model's float weights are these blocks
    dequantized, and the float model is what fivefold's passes work on).

    ``before_weights(config, is_int8, bits, four_bit_file)`` runs once the checkpoint's metadata is
    read and before any weight is (``bits``: per quantized projection weight, scales included;
    ``four_bit_file``: a GGUF whose 4-bit blocks are about to be dequantized): the engine's memory
    plan refuses a model that cannot fit there, and may return the :class:`ServedForm` to load in
    (it decides whether packed layers keep the streaming copy)."""
    from fivefold.models.assemble import ServedForm, assemble

    torch_dtype = parse_dtype(dtype)
    form = ServedForm(torch_dtype, weight_layout, stream_copy, quantization)
    warn_if_slow_dtype(torch_dtype)
    path = resolve_model_path(name_or_path)
    fmt, location = find_checkpoint(path)
    config, tokenizer, reader = _config_and_tokenizer(fmt, location)
    qconfig = quantization_config(location) if fmt == "hf" else None  # read config.json once
    if qconfig is not None and quantization is not None:
        raise ModelLoadError(f"{location} is already quantized ({qconfig['config'].get('scheme')}): "
                             f"load it without --quantization")
    four_bit_file = False
    if fmt == "gguf":
        from fivefold.models.gguf_file import gguf_served_bits, gguf_tensors

        keep_4bit = quantization == "gguf"
        stored_bits = gguf_served_bits(reader, keep_4bit)
        four_bit_file = not keep_4bit and (gguf_served_bits(reader, True) or 8.0) < 8.0
        bits = stored_bits if stored_bits is not None else ON_LOAD_BITS.get(quantization, 8.0)
        is_int8 = quantization is not None or stored_bits is not None
        weights = gguf_tensors(reader, config, location, keep_4bit=keep_4bit)
    else:
        if quantization == "gguf":
            raise ModelLoadError(f"--quantization gguf serves a GGUF file's blocks as they are; {location} is not a "
                                 f"GGUF file (quantize on load: w8a16, w4a16, w4a8)")
        is_int8 = quantization is not None or qconfig is not None
        bits = ON_LOAD_BITS.get(quantization, 8.0)
        weights = hf_tensors(location)
    if before_weights is not None:
        decided = before_weights(config, is_int8, bits, four_bit_file)
        if isinstance(decided, ServedForm):
            form = decided
    if qconfig is not None:  # written by `fivefold quantize`: int8 modules, run in int8
        model = load_quantized_model(location, config, torch_dtype, qconfig)
        return LoadedModel(model, tokenizer, config, location, fmt, name_or_path, qconfig["config"])
    model = assemble(config, weights, form, source=str(location))
    quant = None
    if form.quantization == "w8a16":
        from fivefold.models.assemble import W8A16

        quant = {**dataclasses.asdict(W8A16), "skip": []}
    elif form.quantization in ("w4a16", "w4a8"):
        from fivefold.models.assemble import on_load_int4_format

        fmt = on_load_int4_format(form.quantization)
        quant = {"scheme": fmt.scheme, "method": "rtn", **dataclasses.asdict(fmt)}
    return LoadedModel(model, tokenizer, config, location, fmt, name_or_path, quant)


def quantization_config(directory: Path) -> dict | None:
    """config.json's ``quantization_config`` when :func:`save_quantized` wrote the directory."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = raw.get("quantization_config")
    return q if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD else None


def load_quantized_model(directory: Path, model_config: ModelConfig, dtype: torch.dtype,
                         qconfig: dict) -> LlamaForCausalLM:
    """Rebuild a Fivefold LLM with int8 and 4-bit modules from a directory written by
    :func:`save_quantized`: built on the meta device, the modules ``qconfig["modules"]`` names
    swapped for :class:`Int8Linear` of the saved format, or :class:`Int4Linear` for those
    ``qconfig["int4"]`` lists with their group size, every tensor assigned once."""
    from fivefold.models.int4_linear import Int4Format, Int4Linear
    from fivefold.models.int8_linear import Int8Format, Int8Linear

    if qconfig.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{directory}: quantized format version {qconfig.get('format_version')} is not "
                             f"supported (this version reads {FORMAT_VERSION})")
    # a 4-bit model's other quantized layers (its LM head) are W8A16 per channel
    int8_format = (Int8Format("w8a16") if qconfig["config"].get("scheme") in ("w4a16", "w4a8")
                   else Int8Format.of(qconfig["config"]))
    int4 = qconfig.get("int4", {})  # name -> {"group_size", "symmetric"[, "activations"]}
    from fivefold.models.safetensors_file import read_header, read_tensors

    file = directory / "model.safetensors"
    if not file.exists():
        raise ModelLoadError(f"{directory}: model.safetensors is missing")
    names = set(read_header(file)[0])
    int8_modules = set(qconfig["modules"])
    grouped = qconfig.get("grouped", {})  # modules kept with a scale per block (a GGUF's Q8_0 tensors)
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config)
        for name in qconfig["modules"]:
            linear = model.get_submodule(name)
            has_bias = f"{name}.bias" in names
            if name in int4:
                model.set_submodule(name, Int4Linear(linear.in_features, linear.out_features, has_bias,
                                                     Int4Format(**int4[name])))
                continue
            fmt = (Int8Format("w8a16", "per-group", group_size=grouped[name]) if name in grouped else int8_format)
            model.set_submodule(name, Int8Linear(linear.in_features, linear.out_features, has_bias, fmt))
    tied = model_config.is_tied_embeddings and "lm_head.weight" not in names
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    seen = set()
    with torch.inference_mode():
        for key, tensor in read_tensors(file):
            if key not in expected:
                raise ModelLoadError(f"{directory}: tensor '{key}' is not in the quantization config's model")
            if tuple(tensor.shape) != tuple(expected[key].shape):
                raise ModelLoadError(f"{directory}: tensor '{key}' has shape {tuple(tensor.shape)}, the config "
                                     f"expects {tuple(expected[key].shape)}")
            module_name, _, kind = key.rpartition(".")
            # Scales, zero points, clip ranges and biases of quantized modules stay as written.
            cast = tensor.to(dtype) if tensor.is_floating_point() and module_name not in int8_modules else tensor
            cast = cast.clone() if cast.data_ptr() == tensor.data_ptr() else cast  # not a view of the file
            module = model.get_submodule(module_name)
            if kind in module._parameters:
                module._parameters[kind] = torch.nn.Parameter(cast, requires_grad=False)
            else:
                module._buffers[kind] = cast
            seen.add(key)
            if module_name in int8_modules and all(f"{module_name}.{b}" in seen for b, v in
                                                   module._buffers.items() if v is not None):
                module.pack_()  # the kernel's layout replaces the row-major int8 weight
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelLoadError(f"{directory}: tensors do not match the quantization config: missing "
                             f"'{missing[0]}' ({len(missing)} in all)")
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def save_quantized(loaded: LoadedModel, config: dict, modules: list[str], out_dir: str | Path,
                   extra: dict | None = None) -> Path:
    """Write ``loaded`` (already quantized: ``modules`` are int8 or 4-bit layers made with ``config``,
    an ``Int8Config.to_dict()`` or ``Int4Config.to_dict()``) as a directory :func:`load_model`
    reads back as it was: config.json with a ``quantization_config`` (``int4``: each 4-bit layer's
    group size and symmetry), model.safetensors (int8 weights with their scales, zero points and
    clip ranges; 4-bit layers as :class:`~fivefold.models.int4_linear.Int4Linear`'s checkpoint
    form: ``qweight`` two codes per byte, float16 ``scale`` and ``offset``; under the names Fivefold
    serves: fused ``qkv_proj`` and ``gate_up_proj``), and the tokenizer."""

    from fivefold.models.safetensors_file import write_tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = state_entries(loaded.model)
    if loaded.config.is_tied_embeddings and "lm_head" not in modules:
        entries.pop("lm_head.weight", None)  # the same tensor as the embedding; re-tied on load
    write_tensors(out / "model.safetensors", [(name, shape, dtype) for name, (shape, dtype, _) in entries.items()],
                  lambda name: entries[name][2]())
    from fivefold.models.int4_linear import Int4Linear
    from fivefold.models.int8_linear import Int8Linear

    grouped = {name: m.group_size for name, m in loaded.model.named_modules()
               if isinstance(m, Int8Linear) and m.group_size is not None}
    int4 = {name: {"group_size": m.format.group_size, "symmetric": m.format.symmetric,
                   **({"activations": m.format.activations} if m.int8_activations else {})}
            for name, m in loaded.model.named_modules() if isinstance(m, Int4Linear)}
    hf = loaded.config.to_hf_dict()
    hf["quantization_config"] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                                 "config": config, "modules": list(modules), **({"grouped": grouped} if grouped else {}),
                                 **({"int4": int4} if int4 else {}),
                                 **(extra or {})}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    loaded.tokenizer.hf.save_pretrained(str(out))
    return out


def state_entries(model: torch.nn.Module) -> dict[str, tuple[tuple, torch.dtype, Callable[[], torch.Tensor]]]:
    """{name: (shape, dtype, make)} of every tensor ``model.state_dict()`` holds, without making them:
    a weight held only in a kernel's layout (W8A16 ``Int8Linear``, ``PackedLinear``) is unpacked
    by ``make`` when its turn comes, so a writer holds one at a time."""
    from fivefold.models.int4_linear import Int4Linear, pack_nibbles
    from fivefold.models.int8_linear import Int8Linear
    from fivefold.models.layers import PackedLinear

    entries = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, Int4Linear) and module.kernel_tensors() is not None:
            groups = -(-module.in_features // module.format.group_size)
            entries[prefix + "qweight"] = ((module.out_features, module.in_features // 2), torch.uint8,
                                           lambda m=module: pack_nibbles(m.codes()[0]))
            entries[prefix + "scale"] = ((module.out_features, groups), torch.float16, lambda m=module: m.codes()[1])
            if not module.format.symmetric:
                entries[prefix + "offset"] = ((module.out_features, groups), torch.float16,
                                              lambda m=module: m.codes()[2])
        elif isinstance(module, Int8Linear):
            if module._buffers["weight"] is None:
                entries[prefix + "weight"] = ((module.out_features, module.in_features), torch.int8, module.int8_weight)
            if module._buffers["weight_scale"] is None:  # held as the kernel's float16 tile-major copy
                entries[prefix + "weight_scale"] = ((module.out_features, module.in_features // module.group_size),
                                                    torch.float32, module.weight_scales)
        elif isinstance(module, PackedLinear):
            entries[prefix + "weight"] = ((module.out_features, module.in_features), module.packed_weight.dtype,
                                          module.unpacked_weight)
        for kind, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or kind in module._non_persistent_buffers_set:
                continue
            entries[prefix + kind] = (tuple(tensor.shape), tensor.dtype, lambda t=tensor: t.detach())
    return entries


# a quantized layer's buffers beside its weight (int8_linear.py): not part of a float checkpoint
QUANTIZATION_BUFFERS = frozenset({"weight_scale", "input_scale", "input_zero_point", "input_clip"})


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
        if name.startswith("lm_head.") and config.is_tied_embeddings:
            continue  # the embedding is the head; a head kept int8 (a GGUF's Q8_0) also has scales here
        if name.rsplit(".", 1)[-1] in QUANTIZATION_BUFFERS:
            raise FivefoldError(f"export_hf_directory writes float weights; {name} belongs to a quantized layer "
                                "(load the model without --quantization, or export with `fivefold quantize`)")
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
