import copy

import torch
from torch import nn

from fivefold.quant.config import Int8Config
from fivefold.models.cnn import DigitsCNN
from fivefold.eval.digits import accuracy, load_digits_split, train
from fivefold.models.int8_linear import Int8Conv2d, Int8Linear
from fivefold.models.int8_primitives import sqnr_db
from fivefold.quant.qat import FakeQuant, convert, prepare_qat
from fivefold.quant.quantize import quantize_
from fivefold.quant.quantization_sensitivity import mixed_precision, quantization_sensitivity_scan


def test_int8_conv_matches_float_conv():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1, stride=2)
    x = torch.randn(2, 3, 9, 9)
    q = Int8Conv2d.from_float(conv, Int8Config("w8a8", activation="static"), clip_range=(float(x.min()), float(x.max())))
    with torch.no_grad():
        ref = conv(x)
        assert q(x).shape == ref.shape and sqnr_db(ref, q(x)) >= 25.0


def test_qat_trains_through_fake_quant_and_converts_to_real_int8():
    data = load_digits_split()
    model = train(DigitsCNN(), data.train, epochs=8)
    float_acc = accuracy(model, data.test)
    assert float_acc > 90.0
    config = Int8Config("w8a8", activation="static", calibration="minmax")
    ptq = copy.deepcopy(model)
    quantize_(ptq, config, data.calibration[0].split(64), show_progress=False)
    assert isinstance(ptq.conv1, Int8Conv2d) and isinstance(ptq.fc2, Int8Linear)
    assert accuracy(ptq, data.test) > float_acc - 3.0
    qat = prepare_qat(copy.deepcopy(model), config)
    assert isinstance(qat.conv1, FakeQuant)
    before = qat.conv1.module.weight.detach().clone()
    train(qat, data.train, epochs=2, lr=1e-3)
    assert not torch.equal(before, qat.conv1.module.weight)  # gradients flowed through the STE
    fake_acc = accuracy(qat, data.test)
    convert(qat)
    assert isinstance(qat.conv1, Int8Conv2d) and isinstance(qat.fc1, Int8Linear)
    assert qat.conv1.linear.weight.dtype == torch.int8
    # Fake quantization simulated the int8 model: the converted one scores the same (one image at most).
    assert abs(accuracy(qat, data.test) - fake_acc) <= 100.0 / len(data.test[1]) + 1e-6
    assert accuracy(qat, data.test) > 90.0


def test_sensitivity_scan_ranks_the_layer_with_outliers_first_and_mixed_precision_keeps_it():
    torch.manual_seed(0)

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
        with torch.no_grad():
            m[1].weight[:, 0] *= 200.0  # one huge input column: per-tensor scales ruin this layer
        return m

    x = torch.randn(256, 64)
    target = make()(x).detach()

    def metric(model):
        with torch.no_grad():
            return float((model(x) - target).pow(2).mean()) + 1e-3

    config = Int8Config("w8a16", weight_granularity="per-tensor")
    model = make()
    base, scan = quantization_sensitivity_scan(model, config, metric, show_progress=False)
    assert [s.name for s in scan][0] == "1" and scan[0].increase > scan[1].increase
    assert all(type(m) is nn.Linear for m in model)  # the scan leaves the model float
    all_int8, layer_1_float = make(), make()
    quantize_(all_int8, config, show_progress=False)
    quantize_(layer_1_float, config, filter_fn=lambda _m, name: name != "1", show_progress=False)
    budget = metric(layer_1_float) * 1.001
    assert metric(all_int8) > 10 * budget  # the outlier layer is what breaks the int8 model
    mixed, kept, value = mixed_precision(make, config, scan, lambda v: v <= budget, metric)
    assert kept == ["1"] and value <= budget
    assert type(mixed[1]) is nn.Linear and isinstance(mixed[0], Int8Linear) and isinstance(mixed[2], Int8Linear)


def test_smoothquant_keeps_float_outputs_and_evens_out_activation_outliers(tmp_path):
    from fivefold.models import load_model
    from fivefold.models.forward import llm_forward, sequence_logits
    from fivefold.quant.smoothquant import smooth_
    from tests.conftest import save_random_hf_model

    for arch in ("llama", "qwen2"):  # GQA; qwen2 adds qkv biases
        save_random_hf_model(arch, tmp_path / arch)
        model = load_model(str(tmp_path / arch)).model
        with torch.inference_mode():
            model.layers[0].input_layernorm.weight[3] = 40.0  # an outlier channel into qkv_proj
        ids = list(range(5, 45))
        before = sequence_logits(model, ids)
        x_max = {}
        hook = model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(
            lambda _m, a: x_max.__setitem__(len(x_max), a[0].abs().amax(0)))
        sequence_logits(model, ids)
        assert smooth_(model, [ids[:20], ids[20:]], llm_forward) == 4 * len(model.layers)
        sequence_logits(model, ids)
        hook.remove()
        torch.testing.assert_close(sequence_logits(model, ids), before, rtol=1e-4, atol=1e-4)
        spread = [float(m.max() / m.median()) for m in x_max.values()]
        assert spread[-1] < spread[0] / 4  # the outlier channel no longer dominates the input's range


def test_prepare_qat_refuses_what_it_cannot_simulate_and_w8a16_qat_matches_its_int8_model():
    import pytest

    from fivefold.errors import FivefoldError

    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))  # noqa: E731
    for config in (Int8Config("w8a8"), Int8Config("w8a8", activation_granularity="per-tensor")):
        with pytest.raises(FivefoldError, match="QAT simulates W8A8 with static activations or W8A16"):
            prepare_qat(make(), config)
    qat = prepare_qat(make(), Int8Config("w8a16"))
    x = torch.randn(16, 32) * 3
    qat.train()
    qat(x)
    qat.eval()
    with torch.no_grad():
        fake = qat(x)
        convert(qat)
        assert isinstance(qat[0], Int8Linear) and not qat[0].is_clipped  # weights only: inputs stay float
        torch.testing.assert_close(qat(x), fake, rtol=1e-4, atol=1e-4)
