"""4-bit weight quantization (W4A16): round to nearest, GPTQ and AWQ, into :class:`Int4Linear`.

``quantize_int4_(model, Int4Config(method=...), calibration_data, forward_fn)`` replaces every
target linear layer in place (torchao's ``quantize_`` spirit, as :func:`fivefold.quant.quantize.quantize_`
does for int8). The LM head is quantized W8A16 per channel, not to 4 bits (its errors land on the
logits directly; GPTQ and AWQ leave it unquantized, llama.cpp keeps it at 6+ bits in its Q4 mixes).

Methods, each choosing the same served form (codes 0..15, float16 scale and minimum per group):

- ``rtn``: round to nearest per group (no data).
- ``gptq`` (Frantar et al., 2022): quantize the columns of W one at a time and spread each
  column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of
  the layer's squared output error, H = 2 X^T X over the calibration inputs X. Columns go in order
  of decreasing H_jj (activation importance, "act-order"); the group scales are fixed up front from
  the weights (GPTQ's "static groups"), so each group stays a contiguous run of columns that the
  kernel serves without a column permutation. Dampening ``damp`` x mean(diag H) keeps H invertible.
- ``awq`` (Lin et al., 2023): scale each input channel j of a layer by s_j = mean|X_j|^a (the
  channels that carry large activations keep more precision once multiplied up), with a searched
  per layer on the calibration inputs to minimise the layer's output error after RTN, and fold 1/s
  into what produces X, exactly (the RMSNorm weight before qkv and gate_up, the V rows of qkv
  before o_proj, the up rows of gate_up before down_proj: the SmoothQuant folds). Then a clipping
  search shrinks each group's range where that lowers the output error.

GPTQ on a Llama-family decoder runs layer by layer (``sequential``): each projection's Hessian is
taken on the outputs of the projections quantized before it, and each group's range is searched
(``clip_steps``) against the rounding error weighted by diag H. AWQ's statistics are those of the
float model (one calibration pass collects them all).

``tune_steps`` > 0 then trains the group scales and minimums (codes kept) end to end against the
float model's logits on the calibration windows (:mod:`fivefold.quant.int4_tune`, EfficientQAT's
E2E-QP): GPTQ g128 on SmolLM2 goes from +7.9% to about +2% held-out perplexity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.quant.quantize import _default_forward, _run
from fivefold.models.int4_linear import (
    COLUMN_MULTIPLE,
    Int4Format,
    Int4Linear,
    Int4Quantized,
    _grouped,
    dequantize_int4,
    quantize_int4,
)

METHODS = ("rtn", "gptq", "awq")
CLIP_TOKENS = 512  # calibration rows of AWQ's clipping search (as the paper's implementation)


@dataclass(frozen=True)
class Int4Config(Int4Format):
    """4-bit weights: the served form (:class:`Int4Format`: group_size, symmetric) and how the
    codes are chosen.

    method: "rtn", "gptq" or "awq" (GPTQ and AWQ need calibration data).
    damp: GPTQ's dampening, a fraction of the mean diagonal of H (0.01 as in the paper).
    act_order: GPTQ columns in decreasing order of H_jj.
    block_size: GPTQ's lazy-batch block (columns updated together).
    awq_grid: points of AWQ's search over the exponent a in [0, 1).
    awq_clip: AWQ's clipping search (shrink each group's range by up to 50% where it helps).
    clip_steps: GPTQ's search of each group's range (shrunk by up to 20%, in this many steps,
        where that lowers the rounding error weighted by diag H); 0 takes the minimum and maximum.
    sequential: GPTQ layer by layer on a Llama-family decoder, each projection calibrated on the
        outputs of the layers (and projections) quantized before it; False: every Hessian from
        the float model in one pass.
    max_tokens: calibration tokens kept per layer input for AWQ's searches (a random subset).
    head_bits: 8 (the LM head W8A16) or 16 (left in float).
    tune_steps: after the method, train the group scales and minimums (codes fixed) for this many
        calibration windows against the float model's logits (0: off; a decoder only; see
        :mod:`fivefold.quant.int4_tune`).
    tune_lr: Adam's learning rate for that tuning (cosine schedule to 0).
    skip: module names (fnmatch patterns) left as they are.
    """

    method: str = "rtn"
    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    awq_grid: int = 20
    awq_clip: bool = True
    clip_steps: int = 20
    sequential: bool = True
    max_tokens: int = 2048
    head_bits: int = 8
    tune_steps: int = 0
    tune_lr: float = 1e-4
    skip: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in METHODS:
            raise FivefoldError(f"method must be one of {', '.join(METHODS)}, got '{self.method}'")
        if not 0 < self.damp < 1:
            raise FivefoldError(f"damp must be in (0, 1), got {self.damp}")
        if self.head_bits not in (8, 16):
            raise FivefoldError(f"head_bits must be 8 or 16, got {self.head_bits}")
        if self.awq_grid < 1 or self.block_size < 1 or self.max_tokens < 1:
            raise FivefoldError("awq_grid, block_size and max_tokens must be positive")
        if self.tune_steps < 0 or self.tune_lr <= 0:
            raise FivefoldError(f"tune_steps must be 0 or more and tune_lr positive, got {self.tune_steps} and {self.tune_lr}")
        if self.clip_steps < 0:
            raise FivefoldError(f"clip_steps must be 0 or more, got {self.clip_steps}")
        object.__setattr__(self, "skip", tuple(self.skip))

    @property
    def uses_calibration(self) -> bool:
        return self.method != "rtn" or self.tune_steps > 0

    @property
    def label(self) -> str:
        tuned = f" + scales tuned ({self.tune_steps} steps)" if self.tune_steps else ""
        return (f"{self.scheme.upper()} {self.method.upper()}{tuned} g{self.group_size} "
                f"{'sym' if self.symmetric else 'asym'} ({self.bits_per_weight():.2f} bits/weight)")

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, **asdict(self), "skip": list(self.skip)}

    @classmethod
    def from_dict(cls, d: dict) -> "Int4Config":
        scheme = d.get("scheme", "w4a16")
        d = {k: v for k, v in d.items() if k != "scheme"}
        d.setdefault("activations", "int8" if scheme == "w4a8" else "float")  # older configs: from the scheme
        return cls(**{**d, "skip": tuple(d.get("skip", ()))})


@dataclass
class Int4Result:
    """Which modules became 4-bit (and the 8-bit head), with each method's per-layer choices."""

    config: Int4Config
    quantized: list[str] = field(default_factory=list)
    head: str | None = None
    awq_alpha: dict[str, float] = field(default_factory=dict)
    tune_losses: list[float] = field(default_factory=list)


def _float_weight(module: nn.Module) -> torch.Tensor:
    from fivefold.models.int8_linear import dense_weight

    return dense_weight(module)


def _targets(model: nn.Module, config: Int4Config) -> tuple[list[tuple[str, nn.Module]], str | None]:
    """(the float linears quantized to 4 bits, the LM head's name if it is quantized to 8)."""
    from fivefold.quant.quantize import target_linears

    targets, head = [], None
    for name, module in target_linears(model, config.skip):
        if isinstance(module, nn.Conv2d):
            continue
        if name == "lm_head" or name.endswith(".lm_head"):
            head = name if config.head_bits == 8 else None
            continue
        if _float_weight(module).shape[1] % COLUMN_MULTIPLE:
            continue  # kept float: the kernel needs K a multiple of 32 (reported by the caller's count)
        targets.append((name, module))
    return targets, head


# --- GPTQ -------------------------------------------------------------------------------------


def hessians(model: nn.Module, targets: list[tuple[str, nn.Module]], data, forward_fn: Callable,
             show_progress: bool = True) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n (float64) of every target's input over the calibration data."""
    return _input_hessians(targets, lambda: _run(model, data, forward_fn, "GPTQ: input statistics", show_progress))


def _input_hessians(targets: list[tuple[str, nn.Module]], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n (float64) of each target's inputs while ``run()`` runs."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def record(name, x):
        x = x.detach().reshape(-1, x.shape[-1]).double()
        h = sums.get(name)
        sums[name] = x.t() @ x if h is None else h.addmm_(x.t(), x)
        counts[name] = counts.get(name, 0) + x.shape[0]

    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: record(n, a[0])) for n, m in targets]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return {n: 2 * sums[n] / max(counts[n], 1) for n in sums}


def _group_params(w: torch.Tensor, fmt: Int4Format) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group float16 scale (and offset) of ``w``, exactly as :func:`quantize_int4` chooses them."""
    qz = quantize_int4(w, fmt)
    return qz.scale, qz.offset


def _codes_error(w: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 fmt: Int4Format) -> torch.Tensor:
    """sum_j weight_j (w_j - deq_j)^2 per output channel and group [N, groups] of rounding ``w``
    (not clipped) to the codes of the given group parameters."""
    g = fmt.group_size
    s = scale.float()[:, :, None]
    s = torch.where(s == 0, torch.ones_like(s), s)
    wg = _grouped(w, g)
    if offset is None:
        deq = (torch.clamp(torch.round(wg / s) + 8, 0, 15) - 8) * s
    else:
        o = offset.float()[:, :, None]
        deq = torch.clamp(torch.round((wg - o) / s), 0, 15) * s + o
    return ((wg - deq).pow(2) * _grouped(weight[None, :], g)).sum(dim=2)


def searched_group_params(w: torch.Tensor, importance: torch.Tensor, fmt: Int4Format, steps: int = 20,
                          max_shrink: float = 0.2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group float16 scale (and offset) with each group's range shrunk (a ratio of ``steps`` in
    [1 - max_shrink, 1], the same for its minimum and maximum) where that lowers the group's
    rounding error weighted by the input channels' ``importance`` [K] (GPTQ: the diagonal of H,
    each column's share of the layer's output error). The outlying weights then clip; GPTQ's error
    feedback carries what they lose. Ratio 1 is :func:`quantize_int4`'s choice, so no group's
    weighted error is larger than with min-max ranges."""
    w = w.detach().float()
    importance = importance.float()
    best_scale, best_offset = _group_params(w, fmt)
    best_err = _codes_error(w, importance, best_scale, best_offset, fmt)
    for step in range(1, steps + 1):
        ratio = 1 - max_shrink * step / steps
        scale, offset = _group_params(w * ratio, fmt)  # the range of every group scaled by ratio
        err = _codes_error(w, importance, scale, offset, fmt)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if offset is not None:
            best_offset = torch.where(better, offset, best_offset)
    return best_scale, best_offset


def _quantize_column(col: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """Codes of one column (float32 [N]) against its group's scale and offset ([N], float32)."""
    s = torch.where(scale == 0, torch.ones_like(scale), scale)
    if offset is None:
        return torch.clamp(torch.round(col / s) + 8, 0, 15)
    return torch.clamp(torch.round((col - offset) / s), 0, 15)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, fmt: Int4Format, damp: float = 0.01,
                  act_order: bool = True, block_size: int = 128, clip_steps: int = 0) -> Int4Quantized:
    """GPTQ of one weight [N, K] with input Hessian ``h`` [K, K] (see the module docstring);
    ``clip_steps`` > 0 searches each group's range (:func:`searched_group_params`) instead of
    taking its minimum and maximum."""
    w = w.detach().float().clone()
    n, k = w.shape
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    # static groups: from the weights before any update
    scale, offset = (searched_group_params(w, torch.diag(h), fmt, clip_steps) if clip_steps
                     else _group_params(w, fmt))
    col_group = torch.arange(k) // fmt.group_size
    scale_f = scale.float()
    offset_f = None if offset is None else offset.float()
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except RuntimeError:  # not positive definite even dampened: more dampening
        h += 10 * damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(n, k, dtype=torch.uint8)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = int(perm[b0 + i])
            g = int(col_group[j])
            col = wb[:, i]
            codes = _quantize_column(col, scale_f[:, g], None if offset_f is None else offset_f[:, g])
            q[:, b0 + i] = codes.to(torch.uint8)
            deq = scale_f[:, g] * (codes - 8 if offset_f is None else codes) + (0 if offset_f is None else offset_f[:, g])
            e = (col - deq) / hb[i, i]
            wb[:, i + 1:] -= e[:, None] * hb[i, i + 1:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    inverse = torch.argsort(perm)
    return Int4Quantized(q[:, inverse].contiguous(), scale, offset, fmt.group_size)


# --- AWQ --------------------------------------------------------------------------------------


def _llama_groups(model: nn.Module) -> list[dict]:
    """AWQ's scaling points of a Fivefold Llama-family model: which linear (its input) and what its
    input scale folds into."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "config"):
        raise FivefoldError("AWQ needs a Fivefold Llama-family model (it folds scales into the norms)")
    return [{"layer": i, "name": f"layers.{i}.{p}", "kind": p}
            for i in range(len(layers))
            for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]


def _collect_inputs(model: nn.Module, names: list[str], data, forward_fn, max_tokens: int,
                    show_progress: bool) -> dict[str, torch.Tensor]:
    """A random subset (at most ``max_tokens`` rows, seeded) of each named linear's inputs."""
    chunks: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    gen = torch.Generator().manual_seed(0)
    data = list(data)
    per_sample = max(1, math.ceil(max_tokens / max(len(data), 1)))

    def record(name, x):
        x = x.detach().reshape(-1, x.shape[-1]).float()
        keep = torch.randperm(x.shape[0], generator=gen)[:per_sample]
        chunks[name].append(x[keep].clone())

    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: record(n, a[0])) for n in names]
    try:
        _run(model, data, forward_fn, "AWQ: input samples", show_progress)
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(c)[:max_tokens] for n, c in chunks.items()}


def _rtn_dequantized(w: torch.Tensor, fmt: Int4Format) -> torch.Tensor:
    return quantize_int4(w, fmt).dequantize()


def awq_scale_search(w: torch.Tensor, x: torch.Tensor, fmt: Int4Format, grid: int,
                     share: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, float]:
    """(per-input-channel scale s [K], the exponent a chosen): s = mean|x|^a (normalised), the a of
    ``grid`` points in [0, 1) whose RTN of W * s, applied to x / s, is closest to x W^T.
    ``share`` maps a scale to the one the fold can apply (o_proj: shared by a KV group's heads)."""
    ref = x @ w.t()
    mean_abs = x.abs().mean(dim=0).clamp(min=1e-8)
    best, best_s, best_a = float("inf"), torch.ones_like(mean_abs), 0.0
    for step in range(grid):
        a = step / grid
        s = mean_abs.pow(a)
        if share is not None:
            s = share(s)
        s = (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)
        w_eff = _rtn_dequantized(w * s[None, :], fmt) / s[None, :]
        loss = float((x @ w_eff.t() - ref).pow(2).mean())
        if loss < best:
            best, best_s, best_a = loss, s, a
    return best_s, best_a


def awq_clip_search(w: torch.Tensor, x: torch.Tensor, fmt: Int4Format, steps: int = 10,
                    max_shrink: float = 0.5) -> torch.Tensor:
    """``w`` with each group's range shrunk (towards its centre, a shared ratio per output channel
    and group) to the ratio of ``steps`` in [1 - max_shrink, 1] that minimises that group's output
    error on ``x``; the weights outside the shrunk range are clipped to it."""
    n, k = w.shape
    g = fmt.group_size
    wg = _grouped(w, g)  # [N, G, g]
    xg = _grouped(x, g)  # [T, G, g]
    groups = wg.shape[1]
    ref = torch.einsum("tgc,ngc->tng", xg, wg)  # each group's contribution to each output
    best_err = torch.full((n, groups), float("inf"))
    best = wg.clone()
    lo, hi = wg.amin(dim=2, keepdim=True), wg.amax(dim=2, keepdim=True)
    if fmt.symmetric:
        lo, hi = -wg.abs().amax(dim=2, keepdim=True), wg.abs().amax(dim=2, keepdim=True)
    for step in range(steps + 1):
        ratio = 1 - max_shrink * step / steps
        clipped = torch.maximum(torch.minimum(wg, hi * ratio), lo * ratio)
        deq = _grouped(_rtn_dequantized(clipped.reshape(n, -1)[:, :k], fmt), g)
        err = (torch.einsum("tgc,ngc->tng", xg, deq) - ref).pow(2).mean(dim=0)  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[:, :, None], clipped, best)
    return best.reshape(n, -1)[:, :k].contiguous()


@torch.inference_mode()
def awq_(model: nn.Module, config: Int4Config, data, forward_fn: Callable, show_progress: bool = True,
         result: Int4Result | None = None) -> dict[str, torch.Tensor]:
    """Search and fold AWQ's input scales into ``model`` (float, in place; its float outputs are
    unchanged up to rounding); return the (scaled) calibration inputs of each linear for the clipping
    search."""
    from fivefold.quant.smoothquant import fold_input_scales_

    for name, m in model.named_modules():
        if type(m).__name__ == "PackedLinear":
            raise FivefoldError(f"AWQ must run before weights are packed ({name} is packed)")
    points = _llama_groups(model)
    names = [p["name"] for p in points]
    inputs = _collect_inputs(model, names, data, forward_fn, config.max_tokens, show_progress)
    c = model.config
    group = c.num_heads // c.num_kv_heads
    fmt = Int4Format(config.group_size, config.symmetric, config.activations)

    def share_o(s: torch.Tensor) -> torch.Tensor:  # o_proj's channel (head h, dim d) folds into V of head h // group
        per_kv = s.reshape(c.num_kv_heads, group, c.head_dim).mean(dim=1)
        return per_kv[:, None, :].expand(c.num_kv_heads, group, c.head_dim).reshape(-1)

    from rich.progress import Progress

    with Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task("AWQ: scale search", total=len(points))
        for p in points:
            module = model.get_submodule(p["name"])
            w = module.weight.detach().float()
            s, a = awq_scale_search(w, inputs[p["name"]], fmt, config.awq_grid,
                                    share_o if p["kind"] == "self_attn.o_proj" else None)
            fold_input_scales_(model, p["layer"], p["kind"], s)
            inputs[p["name"]] = inputs[p["name"]] / s[None, :]
            if result is not None:
                result.awq_alpha[p["name"]] = a
            bar.advance(task)
    return inputs


# --- sequential GPTQ ------------------------------------------------------------------------------


class _Stop(Exception):
    """Ends a calibration forward at the first decoder layer (its inputs are all it needed)."""


SEQUENTIAL_STAGES = (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))


def _first_layer_inputs(model: nn.Module, data, forward_fn: Callable) -> list[list]:
    """Each calibration sample's arguments to ``model.layers[0]`` (cos_sin, hidden, residual,
    meta, kv_cache); the forward stops there."""
    captured: list[list] = []

    def grab(_module, args):
        captured.append(list(args))
        raise _Stop

    hook = model.layers[0].register_forward_pre_hook(grab)
    try:
        with torch.inference_mode():
            for sample in data:
                try:
                    forward_fn(model, sample)
                except _Stop:
                    pass
    finally:
        hook.remove()
    return captured


def _run_layer(layer: nn.Module, args: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on saved arguments, which it leaves as they were (the fused add + RMSNorm
    writes its inputs in place)."""
    cos_sin, hidden, residual, meta, kv_cache = args
    return layer(cos_sin, hidden.clone(), None if residual is None else residual.clone(), meta, kv_cache)


def gptq_sequential_(model: nn.Module, targets: list[tuple[str, nn.Module]], config: Int4Config, data,
                     forward_fn: Callable, quantize: Callable[[str, nn.Module, torch.Tensor], None],
                     show_progress: bool = True) -> None:
    """GPTQ layer by layer, each projection's Hessian taken on the outputs of everything quantized
    before it (the reference implementation's "true sequential" order: in each decoder layer qkv,
    then o on the quantized attention, then gate_up, then down). The calibration windows run once
    to the first layer; their hidden states then go through one layer at a time (five passes of a
    layer each: four to collect, one to hand the quantized layer's outputs on), so the cost is
    about five forwards of the model, not one per layer. ``quantize(name, module, h)`` replaces a
    target."""
    inputs = _first_layer_inputs(model, data, forward_fn)
    by_name = dict(targets)
    from rich.progress import Progress

    with torch.inference_mode(), Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task("4-bit GPTQ, layer by layer", total=len(model.layers))
        for i, layer in enumerate(model.layers):
            for stage in SEQUENTIAL_STAGES:
                names = [f"layers.{i}.{p}" for p in stage if f"layers.{i}.{p}" in by_name]
                if not names:
                    continue
                found = _input_hessians([(n, by_name[n]) for n in names],
                                        lambda: [_run_layer(layer, args) for args in inputs])
                for n in names:
                    quantize(n, by_name.pop(n), found.pop(n))
            for args in inputs:  # the quantized layer's outputs are the next layer's inputs
                args[1], args[2] = _run_layer(layer, args)
            bar.advance(task)
    for name, module in list(by_name.items()):  # outside the decoder layers (none in a Llama): one pass
        h = hessians(model, [(name, module)], data, forward_fn, show_progress=False)[name]
        quantize(name, module, h)


# --- the entry point ---------------------------------------------------------------------------


def quantize_int4_(model: nn.Module, config: Int4Config, calibration_data: Iterable[Any] | None = None,
                   forward_fn: Callable | None = None, show_progress: bool = True) -> Int4Result:
    """Quantize ``model``'s linear layers to 4 bits in place (see the module docstring); the LM head
    to W8A16 unless ``config.head_bits == 16``. GPTQ and AWQ need ``calibration_data``."""
    from fivefold.models.int8_linear import Int8Format, Int8Linear
    from fivefold.quant.quantize import replace_module

    forward_fn = forward_fn or _default_forward
    data = list(calibration_data) if calibration_data is not None else None
    if config.uses_calibration and not data:
        raise FivefoldError(f"{config.method.upper()}{' with tune_steps' if config.tune_steps else ''} needs calibration data")
    result = Int4Result(config)
    fmt = Int4Format(config.group_size, config.symmetric, config.activations)
    teacher = None
    if config.tune_steps:
        from fivefold.quant.int4_tune import check_memory, check_windows, teacher_log_probs

        if not _is_decoder(model):
            raise FivefoldError("tune_steps needs a Fivefold Llama-family decoder (it trains against its logits)")
        data = check_windows(data)
        check_memory(model, data)
        teacher = teacher_log_probs(model, data)  # before any weight changes: no float copy kept
    samples: dict[str, torch.Tensor] = {}
    if config.method == "awq":
        samples = awq_(model, config, data, forward_fn, show_progress, result)
    targets, head = _targets(model, config)

    def replace(name: str, module: nn.Module, qz: Int4Quantized) -> None:
        replace_module(model, name, Int4Linear.from_quantized(qz, getattr(module, "bias", None), fmt.activations))
        result.quantized.append(name)

    def gptq(name: str, module: nn.Module, h: torch.Tensor) -> None:
        replace(name, module, gptq_quantize(_float_weight(module), h, fmt, config.damp, config.act_order,
                                            config.block_size, config.clip_steps))

    if config.method == "gptq" and config.sequential and _is_decoder(model):
        gptq_sequential_(model, targets, config, data, forward_fn, gptq, show_progress)
        targets = []
    stats = hessians(model, targets, data, forward_fn, show_progress) if config.method == "gptq" and targets else {}
    from rich.progress import Progress

    with torch.inference_mode(), Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task(f"4-bit {config.method.upper()}", total=len(targets))
        for name, module in targets:
            if config.method == "gptq":
                gptq(name, module, stats.pop(name))
            else:
                w = _float_weight(module)
                if config.method == "awq" and config.awq_clip and name in samples:
                    w = awq_clip_search(w, samples[name][:CLIP_TOKENS], fmt)
                replace(name, module, quantize_int4(w, fmt))
            bar.advance(task)
    if head is not None:
        from types import SimpleNamespace

        module = model.get_submodule(head)
        linear = SimpleNamespace(weight=_float_weight(module), bias=getattr(module, "bias", None))
        replace_module(model, head, Int8Linear.from_float(linear, Int8Format(scheme="w8a16")).pack_())
        result.head = head
    if teacher is not None:
        from fivefold.quant.int4_tune import tune_int4_scales_

        result.tune_losses = tune_int4_scales_(model, data, teacher, config.tune_steps, config.tune_lr, show_progress)
    return result


def _is_decoder(model: nn.Module) -> bool:
    """A Fivefold Llama-family decoder (its layers can be replayed one at a time)."""
    from fivefold.models.llama import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


def bits_per_weight(model: nn.Module) -> float:
    """Average bits per weight of the decoder's linear layers as held (4-bit codes with their
    scales, int8 with its scales, float), as GPTQ and AWQ count them: the embedding and the LM head
    not counted (the head is reported on its own)."""
    from fivefold.models.int8_linear import Int8Linear

    bits = weights = 0.0
    for name, m in model.named_modules():
        if name.endswith("lm_head"):
            continue
        if isinstance(m, Int4Linear):
            count = m.in_features * m.out_features
            bits += count * m.format.bits_per_weight(m.in_features)
        elif isinstance(m, Int8Linear):
            count = m.in_features * m.out_features
            bits += count * 8 + m.weight_scales().numel() * 32
        elif isinstance(m, nn.Linear) or type(m).__name__ == "PackedLinear":
            w = _float_weight(m)
            count = w.numel()
            bits += count * 8 * (m.weight.element_size() if isinstance(m, nn.Linear) else 4)
        else:
            continue
        weights += count
    return bits / max(weights, 1)
