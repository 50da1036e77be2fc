import math

import pytest
import torch

from fivefold.quant.observers import NUM_BINS, make_observer
from fivefold.models.int8_primitives import (
    activation_qparams,
    dequantize_activation,
    dequantize_weight,
    fake_quantize,
    quantize_activation,
    quantize_weight,
    sqnr_db,
)


def _long_tail(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400_000, generator=g)
    x[:40] = 80.0  # 0.01% of the values, 80 sigma out
    return x[torch.randperm(x.numel(), generator=g)]


def _observe(method, x, chunks=8):
    obs = make_observer(method)
    for part in x.chunk(chunks):
        obs(part)
    return obs


def _bulk_mse(obs, x):
    scale, zp = obs.calculate_qparams(symmetric=True)
    bulk = x[x.abs() < 3]
    return float((dequantize_activation(quantize_activation(bulk, scale, zp), scale, zp) - bulk).pow(2).mean())


def test_minmax_keeps_the_tail_that_percentile_and_entropy_clip():
    x = _long_tail()
    minmax, pct, ent = (_observe(m, x) for m in ("minmax", "percentile", "entropy"))
    assert minmax.threshold() == pytest.approx(80.0)
    # 99.99th percentile of |N(0,1)| is 3.89; the tail is the last 0.01%, so the cut lands near it.
    assert 3.0 < pct.threshold() < 6.0
    assert 3.0 < ent.threshold() < 12.0
    for clipped in (pct, ent):
        assert _bulk_mse(clipped, x) < _bulk_mse(minmax, x) / 20  # a much finer step on the bulk


def test_thresholds_on_known_distributions():
    g = torch.Generator().manual_seed(1)
    uniform = torch.rand(200_000, generator=g) * 2 - 1
    for method in ("minmax", "percentile", "entropy"):
        assert _observe(method, uniform).threshold() == pytest.approx(1.0, abs=0.01), method
    gauss = torch.randn(1_000_000, generator=g)
    p999 = make_observer("percentile", percentile=99.9)
    p999(gauss)
    assert p999.threshold() == pytest.approx(3.29, abs=0.05)  # two-sided 99.9% of N(0, 1)
    # MSE on a Laplace distribution clips well inside the maximum (the optimum for int8 is ~10 b).
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((400_000,))
    mse = _observe("mse", laplace)
    assert 6.0 < mse.threshold() < 0.8 * laplace.abs().max()


def test_histogram_rebins_exactly_when_the_range_grows():
    obs = make_observer("percentile", percentile=100.0)
    obs(torch.tensor([0.5, 1.0]))
    obs(torch.tensor([7.9]))  # range doubles three times: 1 -> 8
    assert obs.hist_max == 8.0 and obs.hist.sum() == 3 and obs.hist.size == NUM_BINS
    assert obs.threshold() == pytest.approx(7.9)
    with pytest.raises(ValueError, match="calibration must be one of"):
        make_observer("kl")


def test_symmetric_and_asymmetric_round_trips():
    x = torch.linspace(-2.0, 6.0, 1001)
    for symmetric in (True, False):
        scale, zp = activation_qparams(-2.0, 6.0, symmetric)
        q = quantize_activation(x, scale, zp)
        assert q.dtype == torch.int8
        err = (dequantize_activation(q, scale, zp) - x).abs().max()
        assert err <= scale / 2 + 1e-6  # round to nearest, nothing clipped
        assert dequantize_activation(quantize_activation(torch.zeros(1), scale, zp), scale, zp).item() == 0.0
    sym_scale, _ = activation_qparams(-2.0, 6.0, True)
    asym_scale, asym_zp = activation_qparams(-2.0, 6.0, False)
    assert asym_scale == pytest.approx(8.0 / 255) and sym_scale == pytest.approx(6.0 / 127)
    assert asym_zp == round(-128 + 2.0 / asym_scale)
    w = torch.randn(64, 128)
    q, s = quantize_weight(w)
    assert q.abs().max() <= 127 and torch.equal(quantize_weight(dequantize_weight(q, s))[0], q)


def test_fake_quantize_passes_gradients_inside_the_range_only():
    x = torch.tensor([-3.0, -0.4, 0.1, 0.7, 5.0], requires_grad=True)
    y = fake_quantize(x, 1.0 / 127, 0, -127, 127)  # range [-1, 1]
    y.sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert y[0].item() == pytest.approx(-1.0) and y[-1].item() == pytest.approx(1.0)
    assert sqnr_db(torch.ones(4), torch.ones(4)) == math.inf
