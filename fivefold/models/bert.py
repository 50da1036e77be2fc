"""A BERT encoder (all-MiniLM-L6-v2 and other BertModel checkpoints) written to be traced.

Module and parameter names follow transformers' ``BertModel``, so its safetensors load
as they are; outputs equal transformers' ``last_hidden_state`` (tested to 1e-5). It has
no data-dependent Python control flow, so ``torch.fx`` traces it and ``fivefold.fuse``
can merge Q/K/V into one linear and apply GELU as a post-op of the intermediate linear.
Token type ids are taken as all zero (single-segment input, what sentence encoders see).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.errors import ModelLoadError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelLoadError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ModelLoadError(f"unsupported BERT activation '{self.hidden_act}' (supported: gelu, gelu_new, relu)")

    @classmethod
    def from_hf(cls, config: dict) -> "BertConfig":
        return cls(config["vocab_size"], config["hidden_size"], config["num_hidden_layers"],
                   config["num_attention_heads"], config["intermediate_size"],
                   config.get("max_position_embeddings", 512), config.get("type_vocab_size", 2),
                   config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu"))


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.hidden_size // c.num_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        def heads(t):  # [B, L, hidden] -> [B, H, L, D]
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)  # heads may be pruned


class _Output(nn.Module):
    """dense, then LayerNorm of (dense output + residual), as BertSelfOutput / BertOutput."""

    def __init__(self, c: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(c)
        self.output = _Output(c, c.hidden_size)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.intermediate_act_fn = nn.ReLU() if c.hidden_act == "relu" else nn.GELU(
            approximate="tanh" if c.hidden_act == "gelu_new" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Output(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention.output(self.attention.self(x, mask), x)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))


class BertEncoder(nn.Module):
    """``forward(input_ids [B, L], attention_mask [B, L]) -> last hidden state [B, L, hidden]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        mask = attention_mask[:, None, None, :].bool()  # [B, 1, 1, L], True for real keys
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers' mean pooling, L2-normalised, [B, hidden]."""
    return pool(hidden, attention_mask, "mean", normalize=True)


POOLING_MODES = ("mean", "cls", "lasttoken", "max", "mean_sqrt_len")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """Sentence embeddings [B, hidden] from token states [B, T, hidden], as sentence-transformers'
    Pooling module computes them (padding on the right): the mean over real tokens, the first
    ([CLS]) token's state, the last real token's, the max over real tokens, or the sum over
    sqrt(length); then L2-normalised when the model has a Normalize module."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    lengths = mask.sum(1).clamp(min=1e-9)
    if mode == "mean":
        out = (hidden * mask).sum(1) / lengths
    elif mode == "cls":
        out = hidden[:, 0]
    elif mode == "lasttoken":
        last = attention_mask.sum(1).long().clamp(min=1) - 1
        out = hidden[torch.arange(hidden.shape[0]), last]
    elif mode == "max":
        out = hidden.masked_fill(mask == 0, float("-inf")).max(1).values
    elif mode == "mean_sqrt_len":
        out = (hidden * mask).sum(1) / lengths.sqrt()
    else:
        raise ValueError(f"pooling mode {mode!r}: one of {', '.join(POOLING_MODES)}")
    return F.normalize(out, dim=-1) if normalize else out


def load_bert(path: str | Path) -> BertEncoder:
    """A BertModel checkpoint directory (config.json + model.safetensors) as a float32 BertEncoder, in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from None
    if config.get("model_type") != "bert":
        raise ModelLoadError(f"{path} is a '{config.get('model_type')}' model, not a BERT encoder")
    model = BertEncoder(BertConfig.from_hf(config))
    state = {k.removeprefix("bert."): v.float() for k, v in load_file(path / "model.safetensors").items()
             if not k.startswith(("pooler.", "bert.pooler.")) and not k.endswith("position_ids")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ModelLoadError(f"checkpoint {'is missing' if missing else 'has unexpected'} tensor '{name}'")
    return model.eval()
