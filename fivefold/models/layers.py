"""Building blocks of the Llama-family decoder, numerically matched to transformers."""

from __future__ import annotations

import torch
from torch import nn

from fivefold.models.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, with an optional fused residual add.

    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)`` so the
    decoder layer needs no separate add kernel for the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout of Hugging Face checkpoints).

    cos/sin are tabulated once for every position up to ``max_position_embeddings``
    and looked up by each token's absolute position, so prefill and decode tokens of
    different sequences are rotated in one call.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)  # [D/2]
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for the batch's positions, [T, 1, D/2]; computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        # q: [T, H, D], k: [T, KVH, D]; both rotated with the same table rows.
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SiluAndMul(nn.Module):
    """silu(gate) * up for a fused [gate | up] projection output."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up
