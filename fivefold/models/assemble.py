"""Build a Llama-family model tensor by tensor, each converted to its served form as it is read.

The model is created on the meta device (no memory); every checkpoint tensor, as it arrives,
is cast to the served dtype, fused with its siblings (q/k/v, gate/up) once they are all there,
and turned into the module that serves it: an ``nn.Linear`` (``weight_layout="dense"``), a
:class:`~fivefold.models.layers.PackedLinear` (``"packed"``: oneDNN's layout replaces the dense
weight), a W8A16 :class:`~fivefold.models.int8_linear.Int8Linear` (``quantization="w8a16"``,
quantized per output channel as ``fivefold quantize --scheme w8a16`` does; and GGUF Q8_0
tensors, kept int8 with their scale per block of 32), or an
:class:`~fivefold.models.int4_linear.Int4Linear` (``quantization="w4a16"``: round to nearest in
groups of 128 with a minimum; and, with ``quantization="gguf"``, GGUF Q4_0/Q4_1 tensors as they are). The float source of a tensor is dropped as
soon as its served form exists, so a load's peak is the served model plus a fused tensor or two.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable

import torch
from torch import nn

from fivefold.errors import ModelLoadError
from fivefold.models.config import ModelConfig
from fivefold.models.int4_linear import Int4Format, Int4Levels, Int4Linear, Int4Quantized
from fivefold.models.int8_linear import GroupQuantized, Int8Format, Int8Linear
from fivefold.models.layers import HeadRowsEmbedding, PackedLinear, SplitLinear
from fivefold.models.llama import LlamaForCausalLM
from fivefold.platform import release_free_heap

QUANTIZE_ON_LOAD = ("w8a16", "w4a16", "w4a8")  # the schemes that need no calibration data
AS_STORED = "gguf"  # a GGUF file's quantized blocks served as they are (Q4_0, Q4_1; Q8_0 always)
LAYOUTS = ("dense", "packed")


@dataclass(frozen=True)
class ServedForm:
    """What every tensor becomes while it is loaded.

    dtype: float32 or bfloat16, for everything not int8 (and the activations).
    weight_layout: "dense" (``nn.Linear``) or "packed" (oneDNN's blocked layout, one copy; where
        oneDNN cannot pack the dtype on this CPU the layer stays dense).
    stream_copy: packed layers also keep the streaming kernel's copy (faster decode at 1-4 rows,
        twice the memory: the engine turns it on for small models only).
    quantization: None, "w8a16" (int8 weights, one scale per output channel, quantized here),
        "w4a16" (4-bit weights, groups of 128 with a minimum, quantized here; a tied LM head W8A16),
        "w4a8" (the same, multiplied by int8 activations) or "gguf" (a GGUF file's 4-bit blocks
        kept as they are; they and its Q8_0 tensors multiplied by int8 activations as llama.cpp does).
    """

    dtype: torch.dtype = torch.float32
    weight_layout: str = "dense"
    stream_copy: bool = False
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.weight_layout not in LAYOUTS:
            raise ModelLoadError(f"weight_layout must be one of {', '.join(LAYOUTS)}, got '{self.weight_layout}'")
        if self.quantization is not None and self.quantization not in (*QUANTIZE_ON_LOAD, AS_STORED):
            raise ModelLoadError(f"quantization on load supports {', '.join(QUANTIZE_ON_LOAD)} (and {AS_STORED}: a "
                                 f"GGUF's blocks as they are), got "
                                 f"'{self.quantization}' (calibrated schemes: fivefold quantize)")


W8A16 = Int8Format(scheme="w8a16")
W4A16 = Int4Format(group_size=128, symmetric=False)
GGUF_ACTIVATIONS = "int8"  # a GGUF's Q4_0/Q4_1 blocks against int8 activations per block of 32, as llama.cpp


def on_load_int4_format(quantization: str) -> Int4Format:
    """The 4-bit format of ``--quantization w4a16`` or ``w4a8``: RTN groups of 128 with a minimum."""
    return dataclasses.replace(W4A16, activations="int8" if quantization == "w4a8" else "float")
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _fused_name(name: str) -> tuple[str, int, int]:
    """(served name, part index, number of parts) of a checkpoint tensor name."""
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in _FUSED:
        fused, index = _FUSED[leaf]
        return f"{parent}.{fused}.{kind}", index, 3 if fused == "qkv_proj" else 2
    return name, 0, 1


def _cat_as_int8(parts: list) -> GroupQuantized:
    """Siblings in 8-bit and 4-bit block types that _split_runs does not hold apart (gate in Q4_K
    beside up in Q6_K; q, k, v in three runs) fused into one int8 weight with a scale per G
    columns, G the smallest 8-bit group: the 8-bit parts as stored (a larger group's scales
    repeated: exact), the 4-bit parts dequantized and rounded
    to int8 per group of G against float16 scales (a step of 1/127 of the group's largest weight,
    against the 4-bit step's 1/15 of its range). Held at 8 bits plus a float16 scale per G
    instead of 32 bits in float."""
    from fivefold.models.int8_primitives import quantize_weight

    group = min(p.group_size for p in parts if isinstance(p, GroupQuantized))
    qs, scales = [], []
    for p in parts:
        if isinstance(p, GroupQuantized):
            qs.append(p.q)
            scales.append(p.scale.float().repeat_interleave(p.group_size // group, dim=1))
        else:
            q, scale = quantize_weight(p.dequantize(), per_channel=False, group_size=group, float16_scales=True)
            qs.append(q)
            scales.append(scale)
    return GroupQuantized(torch.cat(qs), torch.cat(scales), group)


@dataclass(frozen=True)
class SplitWeight:
    """A fused weight kept as row blocks of different quantized forms (served as a SplitLinear)."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])


def _split_runs(parts: list) -> SplitWeight | None:
    """q, k, v stored in two quantized forms, each in one run (a Q4_K_M file: q and k Q4_K, v
    Q6_K): the runs fused apart, each held at its own bits (the C++ decode loop takes two blocks
    of a qkv projection). Other mixes: None (fused into one int8 weight)."""
    runs: list[list] = []
    for p in parts:
        if runs and type(runs[-1][0]) is type(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) != 2:
        return None
    fused = [_cat(run, torch.float32) for run in runs]
    return SplitWeight(tuple(fused)) if all(isinstance(f, (GroupQuantized, Int4Quantized)) for f in fused) else None


def _cat(parts: list, dtype: torch.dtype) -> torch.Tensor | GroupQuantized | Int4Quantized | SplitWeight:
    if all(isinstance(p, GroupQuantized) for p in parts):
        return GroupQuantized(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                              parts[0].group_size)
    if all(isinstance(p, Int4Quantized) for p in parts) and len({p.group_size for p in parts}) == 1:
        if any(p.offset is None for p in parts) and any(p.offset is not None for p in parts):
            # Q4_0 beside Q4_1: the symmetric parts' offset is -8 x scale (exact in float16)
            parts = [p if p.offset is not None else Int4Quantized(p.q, p.scale, -8 * p.scale, p.group_size)
                     for p in parts]
        offset = None if parts[0].offset is None else torch.cat([p.offset for p in parts])
        levels = None  # Q4_K's two levels, where every part has them
        if all(p.levels is not None for p in parts):
            levels = Int4Levels(*(torch.cat([getattr(p.levels, f) for p in parts]) for f in ("sc", "m", "d", "dmin")))
        return Int4Quantized(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), offset,
                             parts[0].group_size, levels)
    if all(isinstance(p, (GroupQuantized, Int4Quantized)) for p in parts) and any(
            isinstance(p, GroupQuantized) for p in parts):
        split = _split_runs(parts) if len(parts) == 3 else None  # q/k/v (gate/up mixes stay one int8 weight)
        return split if split is not None else _cat_as_int8(parts)
    # siblings stored quantized and in float: served in float
    return torch.cat([p.dequantize(dtype) if isinstance(p, (GroupQuantized, Int4Quantized)) else p.to(dtype)
                      for p in parts])


class _Assembler:
    def __init__(self, config: ModelConfig, form: ServedForm, source: str) -> None:
        self.config, self.form, self.source = config, form, source
        with torch.device("meta"):
            self.model = LlamaForCausalLM(config)
        self.expected = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self.linears = {name for name, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        self.parts: dict[str, list] = {}  # fused tensors waiting for their siblings
        self.linear_parts: dict[str, dict] = {}  # a linear's weight waiting for its bias, or the reverse
        self.done: set[str] = set()
        self.tied_source = None  # the embedding as read, for a tied LM head

    def add(self, name: str, tensor) -> None:
        name = name.removeprefix("model.")
        if name.startswith("lm_head") and self.config.is_tied_embeddings:
            return
        served, index, count = _fused_name(name)
        if served not in self.expected:
            raise ModelLoadError(f"{self.source}: unexpected tensor '{name}'")
        tensor = self._cast(tensor)
        if count > 1:
            want = self._part_shape(served, index)
            if tuple(tensor.shape) != want:
                raise ModelLoadError(f"{self.source}: tensor '{name}' has shape {tuple(tensor.shape)}, the config "
                                     f"expects {want}")
            parts = self.parts.setdefault(served, [None] * count)
            if parts[index] is not None:
                raise ModelLoadError(f"{self.source}: tensor '{name}' appears twice")
            parts[index] = tensor
            if any(p is None for p in parts):
                return
            del self.parts[served]
            tensor = _cat(parts, self.form.dtype)
        self._place(served, tensor)

    def _part_shape(self, fused: str, index: int) -> tuple[int, ...]:
        """The shape of part ``index`` of a fused tensor (q, k, v of qkv_proj; gate, up of gate_up_proj)."""
        c, shape = self.config, self.expected[fused]
        rows = (c.q_size, c.kv_size, c.kv_size)[index] if ".qkv_proj." in fused else c.intermediate_size
        return (rows, *shape[1:])

    def _cast(self, tensor):
        if isinstance(tensor, (GroupQuantized, Int4Quantized)) or not tensor.is_floating_point():
            return tensor
        cast = tensor.to(self.form.dtype)
        return cast.clone() if cast.data_ptr() == tensor.data_ptr() else cast  # never a view of the file

    def _place(self, name: str, tensor) -> None:
        expected = self.expected[name]
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{self.source}: tensor '{name}' has shape {tuple(tensor.shape)}, the config "
                                 f"expects {expected}")
        if name in self.done:
            raise ModelLoadError(f"{self.source}: tensor '{name}' appears twice")
        self.done.add(name)
        module_name, _, kind = name.rpartition(".")
        if module_name in self.linears:
            parts = self.linear_parts.setdefault(module_name, {})
            parts[kind] = tensor
            has_bias = self.model.get_submodule(module_name).bias is not None
            if "weight" in parts and ("bias" in parts or not has_bias):
                del self.linear_parts[module_name]
                self.model.set_submodule(module_name, self._linear(parts["weight"], parts.get("bias"),
                                                                   head=module_name == "lm_head"))
                del parts
                release_free_heap()  # the float temporaries of this layer: back to the OS before the next
            return
        if isinstance(tensor, (GroupQuantized, Int4Quantized)):  # an embedding or a norm stored quantized: looked up as float
            if name == "embed_tokens.weight" and self.config.is_tied_embeddings:
                self.tied_source = tensor
                if self.form.quantization == AS_STORED:  # served from the head's blocks (see _tie): no float table
                    return
            tensor = tensor.dequantize(self.form.dtype)
        elif name == "embed_tokens.weight":
            self.tied_source = tensor
        module = self.model.get_submodule(module_name)
        if kind in module._parameters:
            module._parameters[kind] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[kind] = tensor

    def _linear(self, weight, bias, head: bool = False) -> nn.Module:
        """The served module of one projection (``head``: the LM head, which W4A16 keeps 8-bit: its
        errors land directly on the logits, and GPTQ and AWQ leave it unquantized too)."""
        form = self.form
        if isinstance(weight, SplitWeight):  # each block with its rows of the bias
            rows = [p.shape[0] for p in weight.parts]
            biases = [None] * len(rows) if bias is None else [b.clone() for b in bias.split(rows)]
            return SplitLinear([self._linear(p, b, head) for p, b in zip(weight.parts, biases)])
        if bias is not None and isinstance(bias, torch.Tensor):
            quantized = isinstance(weight, (GroupQuantized, Int4Quantized)) or form.quantization in QUANTIZE_ON_LOAD
            bias = bias.float() if quantized else bias
        if isinstance(weight, Int4Quantized):
            return Int4Linear.from_quantized(weight, bias, GGUF_ACTIVATIONS)
        if isinstance(weight, GroupQuantized):
            fmt = Int8Format(scheme="w8a16", weight_granularity="per-group", group_size=weight.group_size)
            module = Int8Linear(weight.q.shape[1], weight.q.shape[0], bias is not None, fmt, device="meta")
            module.weight, module.weight_scale = weight.q, weight.scale.float()
            if bias is not None:
                module.bias = bias
            if form.quantization == AS_STORED and weight.group_size in (16, 32):  # Q8_0, Q6_K x Q8 activations, as llama.cpp
                module.set_activations_(GGUF_ACTIVATIONS)
            return module.pack_()
        four_bit = form.quantization in ("w4a16", "w4a8")
        if form.quantization == "w8a16" or (four_bit and head):
            return Int8Linear.from_float(SimpleNamespace(weight=weight, bias=bias), W8A16).pack_()
        if four_bit:
            return Int4Linear.from_float(SimpleNamespace(weight=weight, bias=bias), on_load_int4_format(form.quantization))
        if form.weight_layout == "packed" and PackedLinear.can_pack(weight.dtype):
            return PackedLinear.from_weight(weight, bias, stream_copy=form.stream_copy)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias, requires_grad=False)
        return linear

    def finish(self) -> LlamaForCausalLM:
        if self.parts:
            name, parts = next(iter(self.parts.items()))
            raise ModelLoadError(f"{self.source}: checkpoint has {sum(p is not None for p in parts)} of the "
                                 f"{len(parts)} tensors fused into '{name}'")
        if self.config.is_tied_embeddings and self.tied_source is not None:
            self._tie()
        tied = {"lm_head.weight"} if self.config.is_tied_embeddings else set()
        missing = sorted(set(self.expected) - self.done - tied)
        if missing:
            raise ModelLoadError(f"{self.source}: checkpoint is missing tensor '{missing[0]}' ({len(missing)} "
                                 f"missing in all)")
        return self.model.eval()

    def _tie(self) -> None:
        """The LM head of a tied model: the embedding's weight, in the head's served form. Dense (or
        packed with one copy, where the packed layout cannot be looked up by row), the head shares
        the embedding's tensor; int8 (quantized, or Q8_0) and packed with the streaming copy, it has
        its own copy in the kernel's layout. A GGUF served as stored (``quantization="gguf"``) with
        a quantized table: the head holds its blocks and the embedding looks rows up in them
        (HeadRowsEmbedding), one copy."""
        source, form = self.tied_source, self.form
        embedding = self.model.embed_tokens.weight
        if isinstance(source, (GroupQuantized, Int4Quantized)) and form.quantization == AS_STORED:
            # served as stored: the head holds the table in its blocks and the embedding reads its rows
            self.model.lm_head = self._linear(source, None, head=True)
            self.model.embed_tokens = HeadRowsEmbedding(self.model.lm_head, form.dtype)
        elif isinstance(source, (GroupQuantized, Int4Quantized)) or form.quantization in QUANTIZE_ON_LOAD:
            self.model.lm_head = self._linear(source, None, head=True)
        elif form.weight_layout == "packed" and form.stream_copy and PackedLinear.can_pack(embedding.dtype):
            self.model.lm_head = PackedLinear.from_weight(embedding.detach(), None, stream_copy=True)
        else:
            self.model.lm_head = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False, device="meta")
            self.model.lm_head.weight = self.model.embed_tokens.weight
        self.tied_source = None


def assemble(config: ModelConfig, tensors: Iterable[tuple[str, object]], form: ServedForm,
             source: str = "checkpoint") -> LlamaForCausalLM:
    """The model of ``config`` with every tensor of ``tensors`` (Hugging Face names, un-fused or
    fused) in ``form``. A tensor whose shape does not match the config, a missing or unexpected
    tensor: one-line :class:`ModelLoadError` naming ``source`` and the tensor."""
    assembler = _Assembler(config, form, source)
    with torch.inference_mode():
        for name, tensor in tensors:
            assembler.add(name, tensor)
    return assembler.finish()
