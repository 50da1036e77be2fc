"""``quantize_(model, Int8Config(...), calibration_data)``: swap linear layers for int8 ones.

In torchao's spirit: in place, one config, the calibration data optional where the
config allows. Steps:

1. (calibration) observers on every target layer's input record ``calibration_data``
   run through ``forward_fn``; each decides a clipping range (``Int8Config.calibration``);
2. (bias correction) a second pass measures, per output channel, the mean of
   ``float output - int8 output`` on the same data and adds it to the bias;
3. every target ``nn.Linear`` (or oneDNN-packed linear) becomes an :class:`Int8Linear`, every
   ``nn.Conv2d`` an :class:`Int8Conv2d` (im2col over the same kernels).

Both passes feed each layer the float model's activations (the layer's own error,
not the accumulated error of the layers before it).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fivefold.quant.config import Int8Config
from fivefold.models.int8_linear import Int8Conv2d, Int8Linear
from fivefold.quant.observers import make_observer


@dataclass
class QuantizationResult:
    """Which modules became int8, their calibrated ranges and bias shifts."""

    config: Int8Config
    quantized: list[str] = field(default_factory=list)
    clip_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    bias_shift_norms: dict[str, float] = field(default_factory=dict)


def is_quantizable(module: nn.Module) -> bool:
    """nn.Linear, the oneDNN-packed linear, and plain (groups=1) Conv2d."""
    from fivefold.models.layers import PackedLinear

    return type(module) in (nn.Linear, PackedLinear) or (type(module) is nn.Conv2d and module.groups == 1)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` where the submodule ``name`` is; return the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def to_int8(module: nn.Module, config: Int8Config, clip_range=None, bias_shift=None) -> nn.Module:
    if isinstance(module, nn.Conv2d):
        return Int8Conv2d.from_float(module, config, clip_range, bias_shift)
    return Int8Linear.from_float(module, config, clip_range, bias_shift)


def target_linears(model: nn.Module, skip: Iterable[str] = ()) -> list[tuple[str, nn.Module]]:
    """Float linear (and conv) layers of ``model`` not matched by any ``skip`` pattern, in module order."""
    skip = tuple(skip)
    return [(name, m) for name, m in model.named_modules()
            if is_quantizable(m) and not any(fnmatch.fnmatch(name, pat) for pat in skip)]


def _run(model, data, forward_fn, description: str, show_progress: bool) -> None:
    from rich.progress import Progress

    data = list(data)
    with torch.inference_mode(), Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task(description, total=len(data))
        for sample in data:
            forward_fn(model, sample)
            bar.advance(task)


def calibrate(model: nn.Module, targets: list[tuple[str, nn.Module]], config: Int8Config, data,
              forward_fn: Callable, show_progress: bool = True) -> dict[str, tuple[float, float]]:
    """Run ``data`` through the model with an observer on each target's input; return clip ranges."""
    observers = {name: make_observer(config.calibration, config.percentile) for name, _ in targets}
    def record(name, args):
        observers[name](args[0])  # a pre-hook returning None leaves the input unchanged

    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: record(name, args)) for name, m in targets]
    try:
        _run(model, data, forward_fn, f"calibrating ({config.calibration})", show_progress)
    finally:
        for h in hooks:
            h.remove()
    return {name: obs.clip_range() for name, obs in observers.items()}


def measure_bias_shifts(model: nn.Module, targets: list[tuple[str, nn.Module]], config: Int8Config,
                        ranges: dict[str, tuple[float, float]], data, forward_fn: Callable,
                        show_progress: bool = True) -> dict[str, torch.Tensor]:
    """Mean (over calibration tokens) of float output minus int8 output, per output channel."""
    quantized = {name: to_int8(m, config, ranges.get(name)) for name, m in targets}
    sums = {name: torch.zeros(getattr(m, "out_features", None) or m.out_channels, dtype=torch.float64)
            for name, m in targets}
    counts = dict.fromkeys(sums, 0)

    def hook(module, args, output, name):
        x = args[0]
        err = output.float() - quantized[name](x).float()
        if isinstance(module, nn.Conv2d):
            err = err.movedim(1, -1)  # channels last: one column per output channel
        err = err.reshape(-1, err.shape[-1])
        sums[name] += err.double().sum(dim=0)
        counts[name] += err.shape[0]

    hooks = [m.register_forward_hook(lambda mod, a, o, name=name: hook(mod, a, o, name)) for name, m in targets]
    try:
        _run(model, data, forward_fn, "bias correction", show_progress)
    finally:
        for h in hooks:
            h.remove()
    return {name: (sums[name] / max(counts[name], 1)).float() for name in sums}


def _default_forward(model, sample):
    return model(*sample) if isinstance(sample, (tuple, list)) else model(sample)


def quantize_(model: nn.Module, config: Int8Config, calibration_data: Iterable[Any] | None = None,
              forward_fn: Callable | None = None, filter_fn: Callable[[nn.Module, str], bool] | None = None,
              show_progress: bool = True, ranges: dict[str, tuple[float, float]] | None = None
              ) -> QuantizationResult:
    """Quantize ``model``'s linear layers in place; return what was done.

    The targets are the quantizable layers (nn.Linear, the packed linear, groups=1 Conv2d) that
    ``config.skip`` does not name and, as in torchao, for which ``filter_fn(module, name)`` is true
    when given (mixed precision passes the layers it quantizes): the caller chooses, ``quant``
    knows no architecture. ``forward_fn(model, sample)`` runs one calibration sample (default:
    ``model(sample)``). ``ranges`` reuses clip ranges calibrated before (by name) instead of
    calibrating again.
    """
    forward_fn = forward_fn or _default_forward
    targets = target_linears(model, config.skip)
    if filter_fn is not None:
        targets = [(n, m) for n, m in targets if filter_fn(m, n)]
    result = QuantizationResult(config)
    data = list(calibration_data) if calibration_data is not None else None
    if (config.bias_correction or config.smoothquant_alpha or (config.is_static and ranges is None)) and not data:
        raise ValueError(f"{config.label}{' with bias correction' if config.bias_correction else ''} needs calibration data")
    if config.smoothquant_alpha:
        from fivefold.quant.smoothquant import is_smoothed, smooth_

        if not is_smoothed(model):  # before calibration: ranges are of X / s
            smooth_(model, data, forward_fn, config.smoothquant_alpha)
    if ranges is None:
        ranges = calibrate(model, targets, config, data, forward_fn, show_progress) if data else {}
    shifts = (measure_bias_shifts(model, targets, config, ranges, data, forward_fn, show_progress)
              if config.bias_correction else {})
    for name, module in targets:
        replace_module(model, name, to_int8(module, config, ranges.get(name), shifts.get(name)))
        result.quantized.append(name)
        if name in ranges:
            result.clip_ranges[name] = ranges[name]
        if name in shifts:
            result.bias_shift_norms[name] = float(shifts[name].norm())
    return result
