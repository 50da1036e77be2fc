"""SmoothQuant for Fivefold's Llama-family models: move activation outliers into the weights.

LLM activations have a few input channels hundreds of times larger than the rest; a
per-tensor int8 scale sized for them leaves the others a handful of levels. For each
linear layer with input X and weight W, ``X W^T = (X / s)(W * s)^T`` for any per-channel
s > 0; choosing ``s_j = max|X_j|^a / max|W_:,j|^(1-a)`` (a = 0.5) evens out both. The
division is folded, exactly, into what produces X:

- qkv_proj and gate_up_proj: into the RMSNorm weight before them;
- o_proj: into the V rows of qkv_proj (attention output is linear in V per head; with
  grouped KV heads the scale is shared by the query heads of a group);
- down_proj: into the "up" rows of gate_up_proj (its input is silu(gate) * up).

The LM head is left alone (its weight is tied to the embedding). Xiao et al., 2023.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import nn

from fivefold.errors import FivefoldError


# Models smooth_ has rescaled, with their alpha: smoothing twice would divide the activations
# again, so quantize_ asks (is_smoothed) before it smooths. Held weakly: no model is kept alive.
_SMOOTHED: "weakref.WeakKeyDictionary[nn.Module, float]" = weakref.WeakKeyDictionary()


def is_smoothed(model: nn.Module) -> bool:
    """Whether :func:`smooth_` has already rescaled ``model``."""
    return model in _SMOOTHED


def _input_absmax(model, names: list[str], data, forward_fn) -> dict[str, torch.Tensor]:
    maxima: dict[str, torch.Tensor] = defaultdict(lambda: None)

    def hook(name, x):
        m = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        maxima[name] = m if maxima[name] is None else torch.maximum(maxima[name], m)

    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: hook(n, a[0])) for n in names]
    try:
        with torch.inference_mode():
            for sample in data:
                forward_fn(model, sample)
    finally:
        for h in hooks:
            h.remove()
    return dict(maxima)


def _scales(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.abs().amax(dim=0).float().clamp(min=1e-5)
    return (act_max.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


@torch.inference_mode()  # the loaded weights are inference tensors
def fold_input_scales_(model: nn.Module, layer: int, kind: str, s: torch.Tensor) -> None:
    """Multiply the input columns of linear ``kind`` of decoder layer ``layer`` by ``s`` and divide,
    exactly, what produces its input by ``s`` (the folds of the module docstring), so that the
    float output is unchanged up to rounding. ``kind``: "self_attn.qkv_proj", "self_attn.o_proj"
    (``s`` over the query heads' channels, equal within each KV group: it folds into V's rows),
    "mlp.gate_up_proj" or "mlp.down_proj". SmoothQuant and AWQ share these folds."""
    c = model.config
    block = model.layers[layer]
    attn, mlp = block.self_attn, block.mlp
    linear = model.get_submodule(f"layers.{layer}.{kind}")
    s = s.float()
    if kind == "self_attn.qkv_proj":
        block.input_layernorm.weight.div_(s.to(block.input_layernorm.weight.dtype))
    elif kind == "mlp.gate_up_proj":
        block.post_attention_layernorm.weight.div_(s.to(block.post_attention_layernorm.weight.dtype))
    elif kind == "self_attn.o_proj":
        group = c.num_heads // c.num_kv_heads
        s_kv = s.reshape(c.num_kv_heads, group, c.head_dim)[:, 0, :].reshape(-1)
        v_rows = slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)
        attn.qkv_proj.weight[v_rows].div_(s_kv.reshape(-1, 1).to(attn.qkv_proj.weight.dtype))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias[v_rows].div_(s_kv.to(attn.qkv_proj.bias.dtype))
    elif kind == "mlp.down_proj":  # its input is silu(gate) * up: scale the up half of gate_up
        inter = mlp.down_proj.weight.shape[1]
        mlp.gate_up_proj.weight[inter:].div_(s.reshape(-1, 1).to(mlp.gate_up_proj.weight.dtype))
        if mlp.gate_up_proj.bias is not None:
            mlp.gate_up_proj.bias[inter:].div_(s.to(mlp.gate_up_proj.bias.dtype))
    else:
        raise FivefoldError(f"no fold for the input of '{kind}'")
    linear.weight.mul_(s.to(linear.weight.dtype))


@torch.inference_mode()  # the loaded weights are inference tensors
def smooth_(model: nn.Module, calibration_data, forward_fn, alpha: float = 0.5) -> int:
    """Rescale ``model`` (a Fivefold LlamaForCausalLM with plain nn.Linear layers) in place;
    the float outputs are unchanged up to rounding. Returns the number of layers smoothed."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "config"):
        raise FivefoldError("SmoothQuant needs a Fivefold Llama-family model")
    for name, m in model.named_modules():
        if type(m).__name__ == "PackedLinear":
            raise FivefoldError(f"SmoothQuant must run before weights are packed ({name} is packed)")
    c = model.config
    names = [f"layers.{i}.{p}" for i in range(len(layers))
             for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    act = _input_absmax(model, names, list(calibration_data), forward_fn)
    group = c.num_heads // c.num_kv_heads
    for i, layer in enumerate(layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for linear, key in ((attn.qkv_proj, "self_attn.qkv_proj"), (mlp.gate_up_proj, "mlp.gate_up_proj"),
                            (mlp.down_proj, "mlp.down_proj")):
            fold_input_scales_(model, i, key, _scales(act[p + key], linear.weight, alpha))
        # o_proj's input channel (query head h, dim d) comes from V of KV head h // group.
        o_act = act[p + "self_attn.o_proj"].reshape(c.num_kv_heads, group, c.head_dim).amax(dim=1)  # [KVH, D]
        o_w = attn.o_proj.weight.reshape(-1, c.num_kv_heads, group, c.head_dim).abs().amax(dim=(0, 2))  # [KVH, D]
        s_kv = (o_act.clamp(min=1e-5).pow(alpha) / o_w.float().clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
        fold_input_scales_(model, i, "self_attn.o_proj", s_kv[:, None, :].expand(c.num_kv_heads, group, c.head_dim).reshape(-1))
    _SMOOTHED[model] = alpha
    return len(names)
