"""Per-layer pruning sensitivity, and per-layer ratios for a FLOPs target derived from it.

Each prunable channel group is pruned alone at each ratio (10% to 90% by default) and a
metric is measured on a small proxy split (never the split the report uses); the drop
from the unpruned metric is the group's sensitivity at that ratio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from torch import nn

from fivefold.compress.structured import channel_groups, count_flops, prune_channels

DEFAULT_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def pruning_sensitivity_scan(model: nn.Module, example_inputs: tuple, metric: Callable[[nn.Module], float],
                     ratios: tuple[float, ...] = DEFAULT_RATIOS, importance: str = "l1",
                     progress=None) -> dict:
    """``{"baseline": m, "groups": {name: {"channels": C, "drops": {ratio: baseline - metric}}}}``.

    ``metric`` is higher-is-better (accuracy); ``progress(done, total)`` reports progress.
    """
    baseline = metric(model)
    groups = [g for g in channel_groups(model, example_inputs) if g.is_prunable]
    result = {"baseline": baseline, "ratios": list(ratios), "groups": {}}
    total, done = len(groups) * len(ratios), 0
    for group in groups:
        drops = {}
        for ratio in ratios:
            drops[ratio] = baseline - metric(prune_channels(model, example_inputs, {group.name: ratio}, importance))
            done += 1
            if progress is not None:
                progress(done, total)
        result["groups"][group.name] = {"channels": group.num_channels, "drops": drops}
    return result


def ratios_for_flops_target(model: nn.Module, example_inputs: tuple, scan: dict, flops_fraction: float,
                            importance: str = "l1") -> dict[str, float]:
    """Per-group ratios whose pruned model has at most ``flops_fraction`` of the FLOPs.

    Greedy on the scan: repeatedly raise by one step the group whose next step costs the
    least metric per FLOP saved, until the target is met (or every group is at the last ratio).
    """
    steps = scan["ratios"]
    level = {name: -1 for name in scan["groups"]}  # index into steps; -1 = unpruned
    original = count_flops(model, example_inputs)

    def ratios() -> dict[str, float]:
        return {name: steps[i] for name, i in level.items() if i >= 0}

    def flops(r: dict[str, float]) -> int:
        return count_flops(prune_channels(model, example_inputs, r, importance), example_inputs)

    current = original
    while current > flops_fraction * original:
        best, best_cost = None, None
        for name, i in level.items():
            if i + 1 >= len(steps):
                continue
            trial = {**ratios(), name: steps[i + 1]}
            saved = current - flops(trial)
            if saved <= 0:
                continue
            before = 0.0 if i < 0 else scan["groups"][name]["drops"][steps[i]]
            cost = max(0.0, scan["groups"][name]["drops"][steps[i + 1]] - before) / saved
            if best_cost is None or cost < best_cost:
                best, best_cost = name, cost
        if best is None:
            break
        level[best] += 1
        current = flops(ratios())
    return ratios()


def save_pruning_scan(scan: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(scan, indent=2))
