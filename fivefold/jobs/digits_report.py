"""The structure lever on the digits ResNet: pruning and distillation, measured against the original.

The teacher (``DigitsResNet``, width 96) is trained here on the train split. Decisions
(sensitivity, the iterative schedule's stopping point) use the calibration split; every
reported accuracy is on the test split, which nothing is fitted or chosen on. Latency is
batch 1, eager float32, measured for all variants in interleaved rounds (``add_latencies``). The original stays in memory as the
regression baseline that every row is compared with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fivefold.compress.distill import DistillConfig, distill
from fivefold.compress.pruning_sensitivity import pruning_sensitivity_scan, ratios_for_flops_target
from fivefold.compress.structured import count_flops, count_parameters, prune_channels
from fivefold.compress.unstructured import magnitude_prune_, remove_masks_, sparsity_of
from fivefold.fuse.layout import median_us
from fivefold.models.cnn import DigitsResNet
from fivefold.eval.digits import DigitsData, accuracy, load_digits_split, train


@dataclass(frozen=True)
class DigitsPlan:
    width: int = 96
    epochs: int = 12
    ratio: float = 0.5
    finetune_epochs: int = 5
    finetune_lr: float = 1e-3
    budget_points: float = 1.0  # accuracy the iterative schedule may lose (calibration split)
    schedule_step: float = 0.1
    sensitivity_ratios: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def measure(name: str, model: nn.Module, data: DigitsData) -> dict:
    """Size, FLOPs and test accuracy of one variant (latency is added by ``add_latencies``)."""
    x = data.test[0][:1]
    model.eval()
    return {"variant": name, "parameters": count_parameters(model), "mflops": count_flops(model, (x,)) / 1e6,
            "test_accuracy": accuracy(model, data.test), "model": model}


def add_latencies(rows: list[dict], x: torch.Tensor, rounds: int = 15, calls: int = 20) -> None:
    """Batch-1 latency of every row's model, measured in interleaved rounds (each round times
    every model once; the best round's median is kept), so that a slow moment of this shared
    machine hits all variants alike. Adds speed-up and accuracy delta against rows[0]."""
    best = [float("inf")] * len(rows)
    with torch.no_grad():
        for _ in range(rounds):
            for i, row in enumerate(rows):
                best[i] = min(best[i], median_us(lambda: row["model"](x), calls))
    for row, us in zip(rows, best):
        row["latency_us"] = us
        row["speedup"] = best[0] / us
        row["accuracy_delta"] = row["test_accuracy"] - rows[0]["test_accuracy"]


BATCH_SIZE = 64


def train_batches(data: DigitsData, seed: int = 1) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``batches(step)`` for ``distill``: random training batches of 64 from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)

    def batches(step: int):
        idx = torch.randint(0, len(data.train[1]), (BATCH_SIZE,), generator=gen)
        return data.train[0][idx], data.train[1][idx]

    return batches


def epoch_steps(data: DigitsData, epochs: int) -> int:
    """Optimizer steps of ``epochs`` passes over the training split in batches of 64."""
    return epochs * -(-len(data.train[1]) // BATCH_SIZE)


def iterative_prune(model: nn.Module, data: DigitsData, plan: DigitsPlan, log: Callable[[str], None] = print):
    """Uniform channel pruning from ``plan.ratio`` upwards by ``schedule_step``, fine-tuning after
    each step; stops before the step whose calibration accuracy falls more than the budget
    below the original's. Returns (model, final ratio, [(ratio, calibration accuracy)])."""
    x = data.calibration[0][:1]
    original_acc = accuracy(model, data.calibration)
    current, current_ratio, history = None, 0.0, []
    ratio = plan.ratio
    while ratio < 0.95:
        # Ratios are of the original widths: convert to a fraction of what is left.
        step = 1 - (1 - ratio) / (1 - current_ratio)
        candidate = train(prune_channels(current or model, (x,), step), data.train, plan.finetune_epochs,
                          lr=plan.finetune_lr)
        acc = accuracy(candidate, data.calibration)
        history.append((round(ratio, 2), acc))
        log(f"  iterative: {ratio:.0%} of channels pruned -> calibration accuracy {acc:.2f} "
            f"(original {original_acc:.2f})")
        if original_acc - acc > plan.budget_points:
            break
        current, current_ratio = candidate, ratio
        ratio += plan.schedule_step
    return current, current_ratio, history


def run_digits_report(plan: DigitsPlan = DigitsPlan(), log: Callable[[str], None] = print) -> dict:
    torch.manual_seed(0)
    data = load_digits_split()
    x = data.calibration[0][:1]
    log(f"training the teacher: DigitsResNet width {plan.width}, {plan.epochs} epochs")
    teacher = train(DigitsResNet(plan.width), data.train, plan.epochs)
    rows = [measure("original", teacher, data)]

    log("sensitivity scan (calibration split)")
    scan = pruning_sensitivity_scan(teacher, (x,), lambda m: accuracy(m, data.calibration), plan.sensitivity_ratios)
    target = ratios_for_flops_target(teacher, (x,), scan, 0.5)
    from_scan = train(prune_channels(teacher, (x,), target), data.train, plan.finetune_epochs, lr=plan.finetune_lr)
    rows.append(measure("per-group ratios from the scan (50% FLOPs) + fine-tune", from_scan, data))

    uniform = prune_channels(teacher, (x,), plan.ratio)
    rows.append(measure(f"{plan.ratio:.0%} channels, no fine-tune", copy.deepcopy(uniform), data))
    uniform = train(uniform, data.train, plan.finetune_epochs, lr=plan.finetune_lr)
    rows.append(measure(f"{plan.ratio:.0%} channels + fine-tune ({plan.finetune_epochs} epochs)", uniform, data))

    log("iterative schedule")
    iterative, final_ratio, history = iterative_prune(teacher, data, plan, log)
    if iterative is not None:
        rows.append(measure(f"iterative, stopped at {final_ratio:.0%} channels", iterative, data))

    for sparsity in (0.5, 0.9):
        masked = copy.deepcopy(teacher)
        magnitude_prune_(masked, sparsity, "global")
        masked = train(masked, data.train, plan.finetune_epochs, lr=plan.finetune_lr)
        remove_masks_(masked)
        row = measure(f"unstructured {sparsity:.0%} (global magnitude) + fine-tune", masked, data)
        row["sparsity"] = sparsity_of(masked)
        rows.append(row)

    log("distilling a half-width student (T 4 -> 1, cosine, alpha 0.7)")
    steps = epoch_steps(data, plan.epochs)
    batches = train_batches(data)

    torch.manual_seed(0)
    student = distill(DigitsResNet(plan.width // 2), teacher, batches, DistillConfig(steps=steps))
    rows.append(measure(f"half-width student, distilled ({steps} steps)", student, data))
    torch.manual_seed(0)
    control = distill(DigitsResNet(plan.width // 2), teacher, batches, DistillConfig(steps=steps, alpha=0.0))
    rows.append(measure("half-width student, hard labels only (control)", control, data))
    log("timing every variant at batch 1 (interleaved rounds)")
    add_latencies(rows, data.test[0][:1])
    models = {row["variant"]: row.pop("model") for row in rows}
    return {"plan": plan.__dict__, "rows": rows, "sensitivity": scan, "flops_target_ratios": target,
            "iterative_history": history, "models": models}

