"""Tuning 4-bit group scales end to end (fivefold.quant.int4_tune): codes kept, the float16 served
form, the KL to the float model lowered on the windows it trained on, bad input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fivefold.errors import FivefoldError
from fivefold.models import load_model
from fivefold.models.forward import llm_forward, prefill_logits
from fivefold.models.int4_linear import Int4Linear
from fivefold.quant.int4 import Int4Config, quantize_int4_
from fivefold.quant.int4_tune import teacher_log_probs, tune_int4_scales_
from tests.conftest import save_random_hf_model


def _windows(n: int, length: int = 24, offset: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(offset)
    return [torch.randint(3, 95, (length,), generator=gen).tolist() for _ in range(n)]


def _kl(model, windows, teacher) -> float:
    with torch.inference_mode():
        return sum(float(F.kl_div(F.log_softmax(prefill_logits(model, ids), -1), t, log_target=True,
                                  reduction="batchmean")) for ids, t in zip(windows, teacher)) / len(windows)


def _codes(model) -> dict[str, torch.Tensor]:
    return {n: m.codes()[0].clone() for n, m in model.named_modules() if isinstance(m, Int4Linear)}


@pytest.mark.parametrize("arch,symmetric", [("llama", False), ("qwen2", True)])  # qwen2: tied head, biases
def test_tuning_lowers_the_kl_to_float_and_keeps_codes_and_served_form(arch, symmetric, tmp_path):
    save_random_hf_model(arch, tmp_path, initializer_range=0.1)  # peaked logits: a KL worth lowering
    model = load_model(str(tmp_path)).model
    windows = _windows(4)
    teacher = teacher_log_probs(model, windows)
    quantize_int4_(model, Int4Config(method="rtn", group_size=32, symmetric=symmetric), None, llm_forward,
                   show_progress=False)
    codes, before = _codes(model), _kl(model, windows, teacher)
    losses = tune_int4_scales_(model, windows, teacher, steps=24, lr=1e-4, show_progress=False)
    after = _kl(model, windows, teacher)
    assert len(losses) == 24 and all(l >= 0 for l in losses)
    assert after < 0.7 * before, (before, after)
    again = _codes(model)
    assert again.keys() == codes.keys() and all(torch.equal(again[n], codes[n]) for n in codes)
    for m in model.modules():
        if isinstance(m, Int4Linear):  # the served kernels' layout, float16 scales, no trainable leftovers
            _, scale, offset = m.codes()
            assert scale.dtype == torch.float16 and (offset is None) == symmetric
            assert m.kernel_tensors() is not None
    assert not any(p.requires_grad for p in model.parameters())


def test_quantize_int4_tunes_when_asked_and_records_the_losses(tmp_path):
    save_random_hf_model("llama", tmp_path, initializer_range=0.1)
    windows = _windows(3)
    plain, tuned = load_model(str(tmp_path)).model, load_model(str(tmp_path)).model
    teacher = teacher_log_probs(plain, windows)
    quantize_int4_(plain, Int4Config(method="gptq", group_size=32), windows, llm_forward, show_progress=False)
    config = Int4Config(method="gptq", group_size=32, tune_steps=12)
    assert config.uses_calibration and "scales tuned (12 steps)" in config.label
    result = quantize_int4_(tuned, config, windows, llm_forward, show_progress=False)
    assert len(result.tune_losses) == 12
    assert _kl(tuned, windows, teacher) < 0.8 * _kl(plain, windows, teacher)
    assert all(torch.equal(a, b) for a, b in zip(_codes(plain).values(), _codes(tuned).values()))
    assert Int4Config.from_dict(config.to_dict()) == config


def test_bad_tuning_input_is_refused(tmp_path):
    with pytest.raises(FivefoldError, match="tune_steps must be 0 or more and tune_lr positive"):
        Int4Config(tune_steps=-1)
    with pytest.raises(FivefoldError, match="tune_steps must be 0 or more and tune_lr positive"):
        Int4Config(tune_steps=4, tune_lr=0)
    with pytest.raises(FivefoldError, match="needs a Fivefold Llama-family decoder"):
        quantize_int4_(torch.nn.Sequential(torch.nn.Linear(64, 64)), Int4Config(tune_steps=2), [[1, 2, 3]])
    save_random_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path)).model
    with pytest.raises(FivefoldError, match="calibration windows of token ids"):
        quantize_int4_(model, Int4Config(tune_steps=2), [torch.zeros(2, 8)], llm_forward, show_progress=False)
    with pytest.raises(FivefoldError, match="steps >= 1 and lr > 0"):
        tune_int4_scales_(model, [[1, 2, 3]], [torch.zeros(3, 8)], steps=0, lr=1e-3)
    from fivefold.quant.int4_tune import check_memory

    with pytest.raises(FivefoldError, match=r"tuning 4-bit scales needs about .* GiB available"):
        check_memory(model, _windows(2), available=1 << 20)
    check_memory(model, _windows(2), available=1 << 40)
