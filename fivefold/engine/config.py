"""Engine configuration: KV cache size, batch limits, context length."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fivefold.errors import FivefoldError
from fivefold.platform import available_memory_bytes  # noqa: F401  (re-exported: memory_plan, tests)


PREALLOCATION_POLICIES = ("none", "full", "predicted")
WEIGHT_LAYOUTS = ("packed", "dense")
DECODE_ATTENTION_BACKENDS = ("kernel", "torch")
HOT_PATHS = ("fused", "eager")
PREFILL_ATTENTION_BACKENDS = ("sdpa", "tiled")
DECODE_LOOPS = ("cpp", "python")
SPECULATIVE_METHODS = ("ngram", "draft")
KV_CACHE_DTYPES = ("auto", "int8")


DEFAULT_KV_CACHE_BYTES = 1 << 30
RENAMED_OPTIONS = {
    "kv_cache_memory": "kv_cache_memory was split in two: kv_cache_memory_bytes (bytes) or kv_cache_memory_fraction "
                       "(a share of the available RAM, in (0, 1])",
}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the LLM engine, validated on construction.

    kv_cache_memory_bytes / kv_cache_memory_fraction: the KV block pool, in bytes, or as a
    share (0, 1] of the RAM available at start (as vLLM names ``kv_cache_memory_bytes`` and
    ``gpu_memory_utilization``); at most one of them; neither: 1 GiB. The pool is allocated
    once and never grows. The old ``kv_cache_memory`` (bytes above 1, a fraction below) is
    refused by :meth:`from_options` with a message naming the two.
    max_model_len: None means the model's own limit.
    enable_prefix_caching: reuse the KV blocks of shared prompt prefixes (radix tree).
    preallocation: blocks reserved when a request is admitted: "none" (only what each
    step computes), "full" (prompt + max_tokens) or "predicted" (prompt + the 90th
    percentile of recent output lengths, capped at max_tokens).
    weight_layout: "packed" swaps every projection for a oneDNN-packed linear (the
    weights reordered once into the blocked layout the GEMM reads, replacing the dense weight
    when the engine loads the model itself); "dense" keeps nn.Linear (the reference, and what
    the hardware lever is measured against).
    stream_copy: whether packed projections also keep a second copy in the streaming kernel's
    layout (decode at 1-4 rows 20-30% faster, twice the projections' memory): "on", "off", or
    "auto" (the default: only where that copy costs under 1 GiB and an eighth of the available
    memory, i.e. small models; engine.memory_plan.wants_stream_copy).
    decode_attention: "kernel" runs single-token attention in the C++ paged decode kernel, and
    the attention of a chunk over its cached context (chunked prefill, prefix-cache hits) in the
    C++ paged prefill kernel (keys read in place from their blocks, online softmax); "torch"
    gathers the context and calls SDPA (the reference).
    hot_path: "fused" runs the decoder's elementwise chains (residual add + RMSNorm,
    SiLU * up, RoPE on q and k) as one C++ kernel each (fivefold/kernels/fused_ops.cpp,
    float32; faster here than torch.compile of the same code, see
    benchmarks/fused_hot_path.py); "eager" runs them as separate PyTorch ops.
    prefill_attention: "sdpa" calls PyTorch's SDPA, which on CPU is a C++ flash-attention
    kernel (tiled, online softmax); "tiled" runs fivefold.models.tiled_attention, the same
    algorithm written in PyTorch ops. Neither holds the N x N scores. SDPA is the default
    because it measured faster at every length (benchmarks/tiled_attention.py).
    decode_loop: "cpp" runs the decoder's layer loop of a decode-only step in one C++ call
    (fivefold.models.native_decode: the same kernels, no Python between them), where the model
    allows it (float32, fused hot path, kernel decode attention; the others keep the Python
    loop); "python" always runs the modules' forward. Prefill steps run the Python loop either way.
    speculative: None (off, the default), "ngram" (prompt lookup) or "draft" (``draft_model``
    proposes): up to ``num_speculative_tokens`` tokens proposed per decoding row and verified in
    one target pass (fivefold.engine.speculative). prompt_lookup_min / prompt_lookup_max: the
    n-gram lengths the prompt-lookup proposer matches, longest first. draft_model: a model
    name or path with the target's tokenizer, e.g. the student ``fivefold distill`` writes.
    grammar_budget_s: the grammar work (compile and token masks, CPU seconds in the grammar threads,
    or wall seconds of one unfinished piece) one structured-output request may use; past it the
    request ends with finish_reason "error" naming the budget (fivefold.engine.structured_output).
    kv_cache_dtype: "auto" stores keys and values in the model's dtype; "int8" stores each
    (token, KV head) row as head_dim int8 values and its float32 scale (symmetric, per row;
    fivefold.models.kv_quant), head_dim + 4 bytes instead of 4 * head_dim for a float32 model:
    ~3.8x the tokens in the same kv_cache_memory_bytes at head_dim 64. Keys and values are
    quantized as they are written and read back by the same kernels (never a float copy of the
    context); a whole prompt in one step attends to the int8 round trip of its keys and values,
    as a chunked one does. Needs head_dim % 4 == 0.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preallocation: str = "none"
    weight_layout: str = "packed"
    stream_copy: str = "auto"
    decode_attention: str = "kernel"
    hot_path: str = "fused"
    prefill_attention: str = "sdpa"
    decode_loop: str = "cpp"
    speculative: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    kv_cache_dtype: str = "auto"
    grammar_budget_s: float = 5.0

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise FivefoldError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_fraction is not None:
            raise FivefoldError("give kv_cache_memory_bytes or kv_cache_memory_fraction, not both")
        if self.kv_cache_memory_bytes is not None:
            if isinstance(self.kv_cache_memory_bytes, bool) or self.kv_cache_memory_bytes < 1 or \
                    self.kv_cache_memory_bytes != int(self.kv_cache_memory_bytes):
                raise FivefoldError(f"kv_cache_memory_bytes must be a whole number of bytes >= 1, got "
                                    f"{self.kv_cache_memory_bytes}")
            object.__setattr__(self, "kv_cache_memory_bytes", int(self.kv_cache_memory_bytes))  # 64e6 -> 64000000
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise FivefoldError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_num_seqs < 1:
            raise FivefoldError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise FivefoldError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preallocation not in PREALLOCATION_POLICIES:
            raise FivefoldError(
                f"preallocation must be one of {', '.join(PREALLOCATION_POLICIES)}, got '{self.preallocation}'"
            )
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise FivefoldError(f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got '{self.weight_layout}'")
        if self.stream_copy not in ("auto", "on", "off"):
            raise FivefoldError(f"stream_copy must be one of auto, on, off, got '{self.stream_copy}'")
        if self.decode_attention not in DECODE_ATTENTION_BACKENDS:
            raise FivefoldError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION_BACKENDS)}, "
                                f"got '{self.decode_attention}'")
        if self.hot_path not in HOT_PATHS:
            raise FivefoldError(f"hot_path must be one of {', '.join(HOT_PATHS)}, got '{self.hot_path}'")
        if self.prefill_attention not in PREFILL_ATTENTION_BACKENDS:
            raise FivefoldError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION_BACKENDS)}, "
                                f"got '{self.prefill_attention}'")
        if self.decode_loop not in DECODE_LOOPS:
            raise FivefoldError(f"decode_loop must be one of {', '.join(DECODE_LOOPS)}, got '{self.decode_loop}'")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise FivefoldError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (or None), "
                                f"got '{self.speculative}'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise FivefoldError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise FivefoldError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                                f"and {self.prompt_lookup_max}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise FivefoldError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                f"got '{self.kv_cache_dtype}'")
        if not 0 < self.grammar_budget_s <= 3600:
            raise FivefoldError(f"grammar_budget_s must be in (0, 3600] seconds, got {self.grammar_budget_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise FivefoldError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """The config of keyword options (``LLM(..., **options)``, a stored recipe), refusing
        renamed and unknown options by name."""
        for old, message in RENAMED_OPTIONS.items():
            if old in options:
                raise FivefoldError(message)
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise FivefoldError(f"unknown engine option(s) {unknown}; the options are "
                                f"{', '.join(f.name for f in fields(cls))}")
        return cls(**options)

    def kv_cache_bytes(self) -> int:
        """The pool's size in bytes (a fraction is of the RAM available now)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if self.kv_cache_memory_fraction is not None:
            return int(self.kv_cache_memory_fraction * available_memory_bytes())
        return DEFAULT_KV_CACHE_BYTES
