"""The KD loss against its definition, computed by hand; the temperature schedule's endpoints."""

import math

import pytest
import torch

from fivefold.compress.distill import DistillConfig, distill, kd_loss, temperature_at
from fivefold.errors import FivefoldError


def test_kd_loss_equals_hand_computed_definition():
    s = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]])
    t = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 0.0]])
    y = torch.tensor([0, 2])
    T, alpha = 2.0, 0.25

    def softmax(v):
        e = [math.exp(x) for x in v]
        return [x / sum(e) for x in e]

    kl = 0.0
    ce = 0.0
    for row in range(2):
        ps = softmax([x / T for x in s[row].tolist()])
        pt = softmax([x / T for x in t[row].tolist()])
        kl += sum(b * math.log(b / a) for a, b in zip(ps, pt))
        ce += -math.log(softmax(s[row].tolist())[y[row]])
    expected = alpha * (kl / 2) * T * T + (1 - alpha) * (ce / 2)
    assert kd_loss(s, t, y, T, alpha).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(s, t, None, T, alpha).item() == pytest.approx(kl / 2 * T * T, rel=1e-6)
    assert kd_loss(t, t, None, T, alpha).item() == pytest.approx(0.0, abs=1e-7)  # student == teacher


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_temperature_schedule_hits_its_endpoints(schedule):
    values = [temperature_at(i, 11, 4.0, 1.0, schedule) for i in range(11)]
    assert values[0] == pytest.approx(4.0) and values[-1] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone from high to low
    if schedule == "linear":
        assert values[5] == pytest.approx(2.5)
    else:
        assert values[5] == pytest.approx(2.5) and values[2] > 4.0 - (4.0 - 1.0) * 0.2  # slower than linear at first
    assert temperature_at(3, 10, 4.0, 1.0, "constant") == 4.0


def test_distill_moves_student_towards_teacher_and_config_is_validated():
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 3)
    student = torch.nn.Linear(4, 3)
    x = torch.randn(64, 4)
    y = teacher(x).argmax(-1).detach()

    def gap():
        with torch.no_grad():
            return kd_loss(student(x), teacher(x), None, 1.0, 1.0).item()

    before = gap()
    distill(student, teacher, lambda step: (x, y), DistillConfig(steps=100, lr=0.05, alpha=1.0))
    assert gap() < before / 4
    for bad in (dict(alpha=1.5), dict(t_start=0), dict(schedule="step"), dict(steps=0)):
        with pytest.raises(FivefoldError):
            DistillConfig(**bad)
