"""Per-layer sensitivity, and mixed precision from it.

``quantization_sensitivity_scan`` quantizes one linear layer at a time (all others float), measures
the metric on held-out data and restores the layer: the increase over float is that
layer's sensitivity. ``mixed_precision`` quantizes everything, then keeps the most
sensitive layers in float, the fewest that bring the metric within the budget (a
doubling then bisection search over how many, so about 2 log2(layers) evaluations).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from fivefold.quant.config import Int8Config
from fivefold.quant.quantize import (
    calibrate,
    quantize_,
    replace_module,
    target_linears,
    to_int8,
)


@dataclass(frozen=True)
class LayerSensitivity:
    name: str
    metric: float  # with only this layer quantized
    increase: float  # relative to float: metric / float_metric - 1 (lower metric is better)


def quantization_sensitivity_scan(model: nn.Module, config: Int8Config, metric_fn: Callable[[nn.Module], float],
                     calibration_data=None, forward_fn=None, show_progress: bool = True, ranges=None
                     ) -> tuple[float, list[LayerSensitivity]]:
    """(float metric, layers sorted from most to least sensitive). The model is left float.

    With ``calibration_data`` (and no precomputed ``ranges``) activations are calibrated once."""
    from rich.progress import Progress

    targets = target_linears(model, config.skip)
    ranges = dict(ranges or {})
    if calibration_data is not None and not ranges:
        from fivefold.quant.quantize import _default_forward

        ranges = calibrate(model, targets, config, calibration_data, forward_fn or _default_forward, show_progress)
    base = metric_fn(model)
    out = []
    with Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task("sensitivity scan", total=len(targets))
        for name, module in targets:
            original = replace_module(model, name, to_int8(module, config, ranges.get(name)))
            value = metric_fn(model)
            replace_module(model, name, original)
            out.append(LayerSensitivity(name, value, value / base - 1))
            bar.advance(task)
    return base, sorted(out, key=lambda s: -s.increase)


def save_quantization_scan(path: str | Path, config: Int8Config, base: float, scan: list[LayerSensitivity]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config.to_dict(), "float_metric": base,
                                "layers": [asdict(s) for s in scan]}, indent=2))
    return path


def mixed_precision(model_factory: Callable[[], nn.Module], config: Int8Config, scan: list[LayerSensitivity],
                    is_acceptable: Callable[[float], bool], metric_fn: Callable[[nn.Module], float],
                    calibration_data=None, forward_fn=None, show_progress: bool = True, ranges=None,
                    quantize_fn: Callable[[nn.Module, set[str]], None] | None = None
                    ) -> tuple[nn.Module, list[str], float]:
    """Quantize all but the k most sensitive layers, the smallest k whose metric is acceptable
    (e.g. ``lambda ppl: ppl <= float_ppl * 1.005``).

    ``model_factory()`` gives a fresh float model for each try. Returns (model, layers kept
    float, metric); keeping every layer float is the last resort. ``quantize_fn(model, names)``
    replaces the default (``config`` on the layers ``names``, the others float): mixed bit widths
    pass one that quantizes ``names`` to 4 bits and the kept layers to 8 (:func:`mixed_bits`).
    """
    order = [s.name for s in scan]
    values: dict[int, float] = {}
    best: tuple[int, nn.Module] | None = None  # only the best acceptable model is kept in memory

    def acceptable(k: int) -> bool:
        nonlocal best
        if k not in values:
            model = model_factory()
            quantized = set(order[k:])
            if quantize_fn is not None:
                quantize_fn(model, quantized)
            else:
                quantize_(model, config, calibration_data, forward_fn, filter_fn=lambda _m, name: name in quantized,
                          show_progress=show_progress, ranges=ranges)
            values[k] = metric_fn(model)
            if is_acceptable(values[k]) and (best is None or k < best[0]):
                best = (k, model)
        return is_acceptable(values[k])

    k, hi = 0, None
    while k <= len(order):
        if acceptable(k):
            hi = k
            break
        k = 1 if k == 0 else 2 * k
    if hi is None:
        hi = len(order)
        model = model_factory()  # every layer float: the budget cannot be met with int8 layers
        values[hi], best = metric_fn(model), (hi, model)
    lo = k // 2 if k > 1 else 0  # acceptable(lo) failed, or lo == 0 == hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if acceptable(mid):
            hi = mid
        else:
            lo = mid
    return best[1], order[:hi], values[hi]


def int4_sensitivity_scan(model: nn.Module, config, metric_fn: Callable[[nn.Module], float],
                          show_progress: bool = True) -> tuple[float, list[LayerSensitivity]]:
    """Like :func:`quantization_sensitivity_scan` at 4 bits: each target layer alone rounded to
    nearest in ``config``'s groups (the ranking; the chosen method runs on the final model)."""
    from rich.progress import Progress

    from fivefold.models.int4_linear import Int4Format, Int4Linear
    from fivefold.quant.int4 import _targets

    fmt = Int4Format(config.group_size, config.symmetric, config.activations)
    targets, _ = _targets(model, config)
    base = metric_fn(model)
    out = []
    with Progress(transient=True, disable=not show_progress) as bar:
        task = bar.add_task("4-bit sensitivity scan", total=len(targets))
        for name, module in targets:
            original = replace_module(model, name, Int4Linear.from_float(module, fmt))
            value = metric_fn(model)
            replace_module(model, name, original)
            out.append(LayerSensitivity(name, value, value / base - 1))
            bar.advance(task)
    return base, sorted(out, key=lambda s: -s.increase)


def mixed_bits(model_factory: Callable[[], nn.Module], config, scan: list[LayerSensitivity],
               is_acceptable: Callable[[float], bool], metric_fn: Callable[[nn.Module], float],
               calibration_data=None, forward_fn=None, show_progress: bool = True
               ) -> tuple[nn.Module, list[str], float]:
    """Mixed bit widths: every layer 4-bit (``config``: RTN, GPTQ or AWQ) but the k most sensitive,
    which are W8A16 (per channel), the smallest k whose metric is acceptable (the search of
    :func:`mixed_precision`). Returns (model, layers at 8 bits, metric); if even every layer at 8
    bits misses the budget, the float model (as :func:`mixed_precision` does)."""
    from dataclasses import replace

    from fivefold.quant.int4 import quantize_int4_

    w8a16 = Int8Config(scheme="w8a16")

    def quantize_fn(model: nn.Module, four_bit: set[str]) -> None:
        names = [s.name for s in scan]
        eight = tuple(n for n in names if n not in four_bit)
        quantize_int4_(model, replace(config, skip=tuple(config.skip) + eight), calibration_data, forward_fn,
                       show_progress=show_progress)
        quantize_(model, w8a16, None, forward_fn, filter_fn=lambda _m, name: name in eight,
                  show_progress=show_progress)

    return mixed_precision(model_factory, w8a16, scan, is_acceptable, metric_fn, calibration_data, forward_fn,
                           show_progress, quantize_fn=quantize_fn)
