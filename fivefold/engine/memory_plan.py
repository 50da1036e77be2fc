"""Memory planning before the weights are read: will the model, its KV pool and the runtime fit in
the RAM available now? A model that cannot fit is refused in one line naming the sizes and the
options that would make it fit, instead of being killed by the OS half-way through loading.

The weights are counted as the loader holds them (models.assemble: every tensor converted to its
served form as it is read, one copy): float weights at the served dtype; quantized projections at
their bits per weight, scales included (int8 per channel 8, a GGUF Q8_0 file's 9 with its float32
scale per 32, Q4_0 4.5, Q4_1 5, W4A16 on load 4.25 in groups of 128), the embedding staying at the
served dtype beside an LM head of at least 8 bits. The packed layout keeps a second copy of the
projections in the streaming kernel's layout only where the engine decides it is cheap
(:func:`wants_stream_copy`: small models). Loading's transients are a few copies of the largest
tensor in float32 (the pieces of a fused projection, their concatenation, the quantizer's
working copy). Set ``FIVEFOLD_NO_MEMORY_CHECK=1`` to load anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from fivefold.engine.config import EngineConfig, available_memory_bytes
from fivefold.errors import FivefoldError
from fivefold.models.assemble import ServedForm
from fivefold.models.config import ModelConfig

RUNTIME_BYTES = 1 << 30  # torch, oneDNN's scratch, the tokenizer, activations of a step
LOAD_COPIES = 3  # float32 copies of the largest tensor alive while it is converted
STREAM_COPY_MAX_BYTES = 1 << 30  # the streaming kernel's second copy: only for models this small
INT8_BITS = 8.0  # bits per weight of int8 projections with one scale per channel


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the engine will hold for one model, against what is available."""

    num_parameters: int
    weight_bytes: int
    load_bytes: int  # transients while loading (a tensor converted at a time)
    kv_cache_bytes: int
    available_bytes: int
    stream_copy: bool  # whether packed projections also keep the streaming kernel's copy
    describe: str  # how the weight bytes are counted, for the refusal message
    runtime_bytes: int = RUNTIME_BYTES

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.load_bytes + self.kv_cache_bytes + self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes


def _weight_bytes(model: ModelConfig, dtype: torch.dtype, is_int8: bool, bits: float) -> tuple[int, int, str]:
    """(weight bytes without the streaming copy, the projections' float bytes, description)."""
    size = torch.empty(0, dtype=dtype).element_size()
    embed = model.vocab_size * model.hidden_size
    projections = model.num_parameters() - embed * (1 if model.is_tied_embeddings else 2)
    if is_int8:  # quantized projections; the LM head at >= 8 bits, the embedding looked up at the served dtype
        quantized = projections * bits / 8 + embed * max(bits, INT8_BITS) / 8
        return (int(quantized + embed * size), 0,
                f"{(projections + embed) / 1e9:.2f}B at {bits:g} bits + embedding {_gb(embed * size)}")
    head = 0 if model.is_tied_embeddings else embed
    return model.num_parameters() * size, (projections + head) * size, f"{size} bytes x {model.num_parameters() / 1e9:.2f}B"


def wants_stream_copy(model: ModelConfig, dtype: torch.dtype, config: EngineConfig, is_int8: bool = False,
                      available_bytes: int | None = None) -> bool:
    """Whether packed float projections also keep the streaming kernel's copy: ``stream_copy="on"``,
    or ``"auto"`` where that copy costs under 1 GiB and under an eighth of the available memory
    (SmolLM2 in float32: 0.5 GB, kept; a 1B model: 4.3 GB, one copy). The copy makes decode at 1-4
    rows 20-30% faster (models.layers.PackedLinear), at twice the projections' memory."""
    if is_int8 or config.weight_layout != "packed" or config.stream_copy == "off":
        return False
    if config.stream_copy == "on":
        return True
    available = available_memory_bytes() if available_bytes is None else available_bytes
    extra = _weight_bytes(model, dtype, False, INT8_BITS)[1]
    return extra <= min(STREAM_COPY_MAX_BYTES, available // 8)


def plan_memory(model: ModelConfig, dtype: torch.dtype, config: EngineConfig, is_int8: bool = False,
                available_bytes: int | None = None, bits: float = INT8_BITS) -> MemoryPlan:
    """The plan of ``model`` served in ``dtype`` with ``config`` (``is_int8``: its projections
    quantized, from a quantized checkpoint, a GGUF's blocks or quantization on load, at ``bits`` per
    weight)."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    weights, extra, describe = _weight_bytes(model, dtype, is_int8, bits)
    stream_copy = wants_stream_copy(model, dtype, config, is_int8, available)
    if stream_copy:
        weights += extra
        describe += " + the streaming copy"
    largest = max(2 * model.intermediate_size, model.vocab_size, model.q_size + 2 * model.kv_size) * model.hidden_size
    load = LOAD_COPIES * largest * 4
    kv = config.kv_cache_bytes()
    if config.kv_cache_memory_fraction is not None:  # a share of what is left once the weights are in
        kv = int(config.kv_cache_memory_fraction * max(0, available - weights - load - RUNTIME_BYTES))
    return MemoryPlan(model.num_parameters(), int(weights), load, kv, available, stream_copy, describe)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(name: str, model: ModelConfig, dtype: torch.dtype, config: EngineConfig, is_int8: bool = False,
               available_bytes: int | None = None, bits: float = INT8_BITS, four_bit_file: bool = False) -> MemoryPlan:
    """The plan, or a FivefoldError naming the sizes and what would fit (a smaller dtype, int8 or
    4-bit weights quantized on load, a GGUF's 4-bit blocks as they are (``four_bit_file``), a
    smaller KV pool)."""
    plan = plan_memory(model, dtype, config, is_int8, available_bytes, bits)
    if plan.fits or os.environ.get("FIVEFOLD_NO_MEMORY_CHECK") == "1":
        return plan
    options = []
    candidates = []
    if not is_int8 and dtype == torch.float32:
        candidates.append(("--dtype bfloat16", torch.bfloat16, False, INT8_BITS))
    if not is_int8:
        if four_bit_file:
            candidates.append(("--quantization gguf", dtype, True, 5.0))
        candidates += [("--quantization w8a16", dtype, True, INT8_BITS), ("--quantization w4a16", dtype, True, 4.25)]
    for label, d, int8, b in candidates:
        alt = plan_memory(model, d, config, int8, plan.available_bytes, b)
        if alt.fits:
            options.append(f"{label} ({_gb(alt.total_bytes)})")
    room = plan.available_bytes - plan.weight_bytes - plan.load_bytes - plan.runtime_bytes
    if plan.kv_cache_bytes > (256 << 20) and room >= (256 << 20):
        options.append(f"a KV pool under {_gb(room)} (--kv-cache-memory-bytes)")
    raise FivefoldError(
        f"{name} does not fit: {plan.num_parameters / 1e9:.2f}B parameters need about {_gb(plan.total_bytes)} "
        f"(weights {_gb(plan.weight_bytes)} = {plan.describe}, loading {_gb(plan.load_bytes)}, KV pool "
        f"{_gb(plan.kv_cache_bytes)}, runtime {_gb(plan.runtime_bytes)}) but {_gb(plan.available_bytes)} are "
        f"available; would fit: {'; '.join(options) or 'none of the options here'} "
        f"(FIVEFOLD_NO_MEMORY_CHECK=1 loads anyway)")


def planned_form(name: str, dtype: torch.dtype, config: EngineConfig, quantization: str | None = None):
    """The ``before_weights`` hook of :func:`fivefold.models.load_model` for an engine that loads its
    own model: refuse one that cannot fit (:func:`check_fits`), else load it in the served form the
    plan chose (``config.weight_layout``, the streaming copy or not, ``quantization``)."""
    def hook(model: ModelConfig, is_int8: bool, bits: float, four_bit_file: bool = False) -> ServedForm:
        plan = check_fits(name, model, dtype, config, is_int8 or quantization is not None, bits=bits,
                          four_bit_file=four_bit_file)
        return ServedForm(dtype, config.weight_layout, plan.stream_copy, quantization)
    return hook
