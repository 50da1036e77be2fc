"""Structured pruning of BERT encoders (``fivefold.models.bert``): FFN neurons and attention heads.

FFN neurons are found by the generic channel groups (intermediate.dense -> GELU ->
output.dense); heads are removed here: a head's Q, K and V rows and its columns of the
attention output projection, importance by the L2 norm of those slices. Each layer may
keep a different number of heads (the modules carry their own head count).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fivefold.compress.distill import every_other_layer
from fivefold.compress.structured import channel_groups, prune_channels
from fivefold.errors import FivefoldError
from fivefold.models.layers import linear_from


def prune_encoder_ffn(model: nn.Module, example_inputs: tuple, ratio: float, importance: str = "l1") -> nn.Module:
    """A copy with ``ratio`` of every layer's FFN neurons removed."""
    ffn = {g.name: ratio for g in channel_groups(model, example_inputs)
           if g.is_prunable and g.name.endswith("intermediate.dense")}
    return prune_channels(model, example_inputs, ffn, importance)


def prune_encoder_heads(model: nn.Module, num_heads: int) -> nn.Module:
    """A copy with the ``num_heads`` least important heads of every layer removed."""
    pruned = copy.deepcopy(model)
    for layer in pruned.encoder.layer:
        attn, out = layer.attention.self, layer.attention.output.dense
        if not 0 <= num_heads < attn.num_heads:
            raise FivefoldError(f"can remove 0 to {attn.num_heads - 1} of {attn.num_heads} heads, got {num_heads}")
        d = attn.head_dim
        rows = [torch.arange(h * d, (h + 1) * d) for h in range(attn.num_heads)]
        score = torch.stack([sum(lin.weight.detach()[r].norm() for lin in (attn.query, attn.key, attn.value))
                             + out.weight.detach()[:, r].norm() for r in rows])
        keep = score.topk(attn.num_heads - num_heads).indices.sort().values
        index = torch.cat([rows[h] for h in keep.tolist()])
        for name in ("query", "key", "value"):
            lin = getattr(attn, name)
            setattr(attn, name, linear_from(lin.weight.detach()[index], lin.bias.detach()[index]))
        layer.attention.output.dense = linear_from(out.weight.detach()[:, index], out.bias.detach())
        attn.num_heads = len(keep)
    return pruned


def every_other_layer_encoder(model: nn.Module) -> nn.Module:
    """A student initialised from the teacher's layers 0, 2, 4, ... (DistilBERT's recipe)."""
    student = copy.deepcopy(model)
    student.encoder.layer = nn.ModuleList(every_other_layer(student.encoder.layer))
    return student
