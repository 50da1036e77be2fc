import copy

import pytest
import torch
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.quant.config import Int8Config
from fivefold.models.int8_backends import per_token_quantize
from fivefold.models.int8_linear import Int8Linear
from fivefold.models.int8_primitives import sqnr_db
from fivefold.quant.quantize import quantize_


def _linear(k=256, n=384, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64])  # our kernel up to 4 rows, dequantized tiles above
@pytest.mark.parametrize("granularity", ["per-channel", "per-tensor"])
def test_w8a16_linear_sqnr_over_30_db(rows, granularity):
    lin = _linear()
    q = Int8Linear.from_float(lin, Int8Config("w8a16", weight_granularity=granularity))
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() <= 127
    x = torch.randn(rows, 256)
    with torch.no_grad():
        assert sqnr_db(lin(x), q(x)) >= 30.0


def test_w8a8_per_token_is_exact_int32_arithmetic():
    """The int8 path computes what integer arithmetic says: int8 x int8 summed in int32, rescaled."""
    lin = _linear(bias=False)
    q = Int8Linear.from_float(lin, Int8Config("w8a8"))
    x = torch.randn(7, 256) * 3
    xq, xs = per_token_quantize(x)
    acc = xq.to(torch.int64) @ q.weight.to(torch.int64).t()  # exact
    assert acc.abs().max() < 2**31
    expected = acc.double() * xs.double() * q.weight_scale.double()
    torch.testing.assert_close(q(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert sqnr_db(lin(x).detach(), q(x)) >= 25.0


@pytest.mark.parametrize("config", [
    Int8Config("w8a8", activation_granularity="per-tensor"),
    Int8Config("w8a8", activation="static", calibration="minmax"),
    Int8Config("w8a8", activation="static", activation_symmetric=False, calibration="percentile"),
    Int8Config("w8a8", "per-tensor", activation="static", calibration="entropy"),
    Int8Config("w8a8", activation="static", calibration="mse"),
])
def test_every_w8a8_mode_tracks_float(config):
    model = nn.Sequential(_linear(256, 512), nn.ReLU(), _linear(512, 128, seed=1))
    calib = [torch.randn(32, 256) for _ in range(4)]
    test = torch.randn(64, 256)
    ref = model(test).detach()
    result = quantize_(model, config, calib if config.is_static else None, show_progress=False)
    assert result.quantized == ["0", "2"] and all(isinstance(model[i], Int8Linear) for i in (0, 2))
    with torch.no_grad():
        assert sqnr_db(ref, model(test)) >= 25.0, config.label


def test_static_activations_saturate_at_the_calibrated_range():
    lin = _linear(bias=False)
    q = Int8Linear.from_float(lin, Int8Config("w8a8", activation="static"), clip_range=(-1.0, 1.0))
    x = torch.randn(4, 256).clamp(-1, 1)
    spiked = x.clone()
    spiked[0, 0] = 1e6  # an outlier far outside the calibrated range cannot overflow or explode
    with torch.no_grad():
        clipped = x.clone()
        clipped[0, 0] = 1.0
        torch.testing.assert_close(q(spiked), q(clipped))
        assert torch.isfinite(q(spiked)).all()


def test_dynamic_clipping_uses_the_calibrated_range():
    lin = _linear(bias=False)
    model = nn.Sequential(lin)
    quantize_(model, Int8Config("w8a8"), [torch.randn(64, 256) for _ in range(2)], show_progress=False)
    q = model[0]
    assert q.is_clipped
    x = torch.randn(2, 256)
    spiked = x.clone()
    spiked[0, 3] = 500.0
    with torch.no_grad():
        # The outlier is clipped to the range, so the rest of its token keeps a fine scale.
        assert sqnr_db(lin(x[1:]), q(spiked)[1:]) >= 25.0
        assert q(spiked)[0].abs().max() < 100


def test_bias_correction_lowers_the_mean_output_error():
    torch.manual_seed(3)
    lin = nn.Linear(128, 64)
    # Few, large weights per row and inputs with a non-zero mean: per-tensor rounding leaves a
    # systematic (non-zero mean) error per channel, which bias correction is for.
    with torch.no_grad():
        lin.weight.mul_(torch.rand(64, 1) * 4)
    calib = [torch.randn(256, 128) + 0.5 for _ in range(4)]
    held_out = torch.randn(2048, 128) + 0.5
    errors = {}
    for correct in (False, True):
        model = nn.Sequential(copy.deepcopy(lin))
        cfg = Int8Config("w8a8", "per-tensor", activation="static", bias_correction=correct)
        result = quantize_(model, cfg, calib, show_progress=False)
        with torch.no_grad():
            errors[correct] = float((lin(held_out) - model(held_out)).mean(0).abs().mean())
        assert bool(result.bias_shift_norms) == correct
    assert errors[True] < errors[False] / 2


def test_configs_are_validated():
    with pytest.raises(FivefoldError, match="scheme must be one of w8a16, w8a8"):
        Int8Config("w4a16")
    with pytest.raises(FivefoldError, match="calibration must be one of"):
        Int8Config(calibration="kl")
    with pytest.raises(ValueError, match="needs calibration data"):
        quantize_(nn.Sequential(_linear()), Int8Config("w8a8", activation="static"), show_progress=False)
