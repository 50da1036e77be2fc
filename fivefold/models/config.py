"""The architecture description shared by every Llama-family checkpoint we serve.

Hugging Face ``config.json`` files and GGUF metadata are both normalised into one
frozen :class:`ModelConfig`, so the model code never reads either format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from fivefold.errors import ModelLoadError

# Hugging Face architecture names -> our family name. Mistral and SmolLM are Llama
# graphs; Qwen2 adds a bias to q/k/v; Qwen3 adds RMSNorm on q and k per head.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # empty: plain RoPE
    max_position_embeddings: int = 2048
    is_tied_embeddings: bool = False
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_mlp_bias: bool = False
    has_qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling '{rope_type}'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence served correctly: with a sliding window we only serve
        what fits inside it, since the attention kernels attend to the full context."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def num_parameters(self) -> int:
        """Parameter count, embeddings counted once when tied."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.has_qk_norm else 0)
        embed = self.vocab_size * self.hidden_size * (1 if self.is_tied_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + self.hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        family = None
        for arch in archs:
            family = SUPPORTED_HF_ARCHITECTURES.get(arch)
            if family:
                break
        if family is None:
            family = {v: v for v in SUPPORTED_HF_ARCHITECTURES.values()}.get(cfg.get("model_type", ""))
        if family is None:
            named = ", ".join(archs) or cfg.get("model_type") or "unknown"
            raise ModelLoadError(
                f"unsupported architecture '{named}'; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act '{cfg['hidden_act']}'; supported: silu")
        # transformers 5 stores RoPE settings in rope_parameters; 4.x in rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = cfg.get("sliding_window") if (family == "mistral" or cfg.get("use_sliding_window")) else None
        return cls(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            is_tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            has_qkv_bias=family == "qwen2" or attention_bias,
            has_o_bias=family == "llama" and attention_bias,
            has_mlp_bias=bool(cfg.get("mlp_bias", False)),
            has_qk_norm=family == "qwen3",
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers loads into the same architecture."""
        arch = {v: k for k, v in SUPPORTED_HF_ARCHITECTURES.items()}[self.architecture]
        rope = {"rope_type": "default", **self.rope_scaling, "rope_theta": self.rope_theta}
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": (rope if self.rope_scaling else None),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.is_tied_embeddings,
            "attention_bias": self.has_o_bias,
            "mlp_bias": self.has_mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
        return out


def rope_inv_freq(config: ModelConfig) -> "torch.Tensor":
    """Inverse frequencies of RoPE, after the configured scaling.

    llama3 scaling keeps high frequencies, divides low ones by ``factor`` and
    interpolates linearly (in wavelength space) between the two bands.
    """
    import torch

    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = config.rope_scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(config.rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(config.rope_scaling["factor"])
        low = float(config.rope_scaling["low_freq_factor"])
        high = float(config.rope_scaling["high_freq_factor"])
        original_len = float(config.rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        long_wavelen, short_wavelen = original_len / low, original_len / high
        scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
        return torch.where(in_between, blended, scaled)
    return inv_freq
