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
                    calibration_data=None, forward_fn=None, show_progress: bool = True, ranges=None
                    ) -> tuple[nn.Module, list[str], float]:
    """Quantize all but the k most sensitive layers, the smallest k whose metric is acceptable
    (e.g. ``lambda ppl: ppl <= float_ppl * 1.005``).

    ``model_factory()`` gives a fresh float model for each try. Returns (model, layers kept
    float, metric); keeping every layer float is the last resort.
    """
    order = [s.name for s in scan]
    values: dict[int, float] = {}
    best: tuple[int, nn.Module] | None = None  # only the best acceptable model is kept in memory

    def acceptable(k: int) -> bool:
        nonlocal best
        if k not in values:
            model = model_factory()
            quantized = set(order[k:])
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
