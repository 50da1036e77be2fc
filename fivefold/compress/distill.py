"""Knowledge distillation: the loss, the temperature schedule, and a training loop.

``kd_loss`` is Hinton et al.'s: alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T))
+ (1 - alpha) x cross-entropy(student, labels). The T^2 keeps the soft term's gradients
at the same scale as T changes. For causal LMs the logits are per token
([tokens, vocab]) and the labels are the next tokens: token-level KD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.errors import FivefoldError

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class DistillConfig:
    """alpha: weight of the soft (teacher) term; 1 - alpha goes to the hard labels.
    temperature from ``t_start`` to ``t_end`` over the steps, by ``schedule``."""

    steps: int = 200
    lr: float = 3e-3
    alpha: float = 0.7
    t_start: float = 4.0
    t_end: float = 1.0
    schedule: str = "cosine"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise FivefoldError(f"steps must be >= 1, got {self.steps}")
        if not 0 <= self.alpha <= 1:
            raise FivefoldError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.t_start <= 0 or self.t_end <= 0:
            raise FivefoldError(f"temperatures must be positive, got {self.t_start} -> {self.t_end}")
        if self.schedule not in SCHEDULES:
            raise FivefoldError(f"schedule must be one of {', '.join(SCHEDULES)}, got '{self.schedule}'")
        if self.lr <= 0:
            raise FivefoldError(f"lr must be positive, got {self.lr}")


def temperature_at(step: int, num_steps: int, t_start: float, t_end: float, schedule: str = "cosine") -> float:
    """The temperature at ``step`` of ``num_steps``: ``t_start`` at step 0, ``t_end`` at the last step."""
    if schedule == "constant" or num_steps <= 1:
        return t_start if schedule == "constant" else t_end
    progress = min(max(step / (num_steps - 1), 0.0), 1.0)
    if schedule == "linear":
        return t_start + (t_end - t_start) * progress
    return t_end + (t_start - t_end) * 0.5 * (1 + math.cos(math.pi * progress))


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None,
            temperature: float, alpha: float) -> torch.Tensor:
    """[N, C] logits (N samples or tokens), labels [N] (None: soft term only, alpha taken as 1)."""
    log_p_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    p_teacher = F.softmax(teacher_logits.float() / temperature, dim=-1)
    soft = F.kl_div(log_p_student, p_teacher, reduction="batchmean") * temperature ** 2
    if labels is None:
        return soft
    return alpha * soft + (1 - alpha) * F.cross_entropy(student_logits.float(), labels)


def distill(student: nn.Module, teacher: nn.Module, batches: Callable[[int], tuple], config: DistillConfig,
            logits_of: Callable[[nn.Module, tuple], torch.Tensor] | None = None,
            on_step: Callable[[int, float, float], None] | None = None) -> nn.Module:
    """Train ``student`` on ``batches(step) -> (inputs, labels)`` against the frozen ``teacher``.

    ``logits_of(model, inputs) -> [N, C]`` (default ``model(inputs)``). ``on_step(step, T, loss)``
    reports progress. Returns the student in eval mode.
    """
    logits_of = logits_of or (lambda model, inputs: model(inputs))
    teacher.eval()
    student.train()
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=config.lr)
    for step in range(config.steps):
        inputs, labels = batches(step)
        t = temperature_at(step, config.steps, config.t_start, config.t_end, config.schedule)
        with torch.no_grad():
            teacher_logits = logits_of(teacher, inputs)
        loss = kd_loss(logits_of(student, inputs), teacher_logits, labels, t, config.alpha)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step, t, float(loss))
    return student.eval()


def every_other_layer(layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The student initialisation of DistilBERT: layers 0, 2, 4, ... of the teacher."""
    return list(layers)[::2]
