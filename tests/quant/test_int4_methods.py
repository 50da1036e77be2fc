"""4-bit weight quantization methods against their references: GPTQ lowers a layer's output error
below round-to-nearest's on correlated inputs, AWQ's scale search never does worse than no
scaling and folds exactly, the clipping search never raises a group's error; quantize_int4_ swaps
every projection for an Int4Linear (the head for W8A16) and refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch

from fivefold.errors import FivefoldError
from fivefold.models import load_model
from fivefold.models.forward import llm_forward, prefill_logits
from fivefold.models.int4_linear import Int4Format, Int4Linear, quantize_int4
from fivefold.models.int8_linear import Int8Linear
from fivefold.quant.int4 import (
    Int4Config,
    awq_,
    awq_clip_search,
    awq_scale_search,
    bits_per_weight,
    gptq_quantize,
    gptq_sequential_,
    hessians,
    quantize_int4_,
    searched_group_params,
)
from tests.conftest import save_random_hf_model


def _correlated_inputs(tokens: int, k: int, gen) -> torch.Tensor:
    """Activations as LLMs have them: correlated channels, a few of them large."""
    mix = torch.randn(k, k, generator=gen) / k ** 0.5
    x = torch.randn(tokens, k, generator=gen) @ mix
    x[:, :4] *= 20
    return x


def _output_error(x, w, w_hat) -> float:
    return float((x @ (w - w_hat).t()).pow(2).mean())


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_beats_round_to_nearest_on_the_layer_output(symmetric, act_order):
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 64
    x = _correlated_inputs(2048, k, gen)
    w = torch.randn(n, k, generator=gen) / 10
    fmt = Int4Format(group_size=64, symmetric=symmetric)
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    gptq = gptq_quantize(w, h, fmt, act_order=act_order)
    rtn = quantize_int4(w, fmt)
    assert gptq.q.dtype == torch.uint8 and int(gptq.q.max()) <= 15
    assert torch.equal(gptq.scale, rtn.scale)  # static groups: the same scales, other codes
    err_gptq, err_rtn = _output_error(x, w, gptq.dequantize()), _output_error(x, w, rtn.dequantize())
    assert err_gptq < 0.7 * err_rtn, (err_gptq, err_rtn)


@pytest.mark.parametrize("symmetric", [False, True])
def test_searched_group_ranges_never_raise_a_groups_weighted_error(symmetric):
    """Each group's searched range rounds the weights with no more importance-weighted error than
    its minimum and maximum, and many groups get a shrunk range."""
    from fivefold.quant.int4 import _codes_error, _group_params

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 256, generator=gen) / 10
    importance = torch.rand(256, generator=gen) + 0.1
    fmt = Int4Format(group_size=64, symmetric=symmetric)
    scale, offset = searched_group_params(w, importance, fmt)
    base_scale, base_offset = _group_params(w, fmt)
    err = _codes_error(w, importance, scale, offset, fmt)
    base = _codes_error(w, importance, base_scale, base_offset, fmt)
    assert bool((err <= base).all())
    assert float(err.sum()) < 0.97 * float(base.sum())
    assert int((scale.float().abs() < base_scale.float().abs()).sum()) > 0.2 * scale.numel()  # many groups shrank


def test_sequential_gptq_calibrates_each_projection_on_the_quantized_layers_before_it(tmp_path):
    """The layer-by-layer replay hands each projection the Hessian a full forward of the model as
    it stands (earlier projections already 4-bit) gives it, in the order qkv, o, gate_up, down."""
    from fivefold.quant.int4 import _targets
    from fivefold.quant.quantize import replace_module

    save_random_hf_model("llama", tmp_path)
    model = load_model(str(tmp_path)).model
    data = [[(7 * i + j) % 90 + 3 for j in range(24)] for i in range(3)]
    config = Int4Config(method="gptq", group_size=32)
    targets, _ = _targets(model, config)
    order = []

    def check_and_round(name, module, h):
        want = hessians(model, [(name, module)], data, llm_forward, show_progress=False)[name]
        torch.testing.assert_close(h, want, rtol=1e-6, atol=1e-9 * float(want.abs().max()))
        replace_module(model, name, Int4Linear.from_quantized(quantize_int4(module.weight.detach(), config)))
        order.append(name)

    gptq_sequential_(model, targets, config, data, llm_forward, check_and_round, show_progress=False)
    assert order == [n for n, _ in targets]
    assert order[:4] == ["layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
                         "layers.0.mlp.down_proj"]


def test_gptq_with_a_dead_input_channel():
    """A channel that is always zero (H_jj = 0): its weights are zeroed, nothing is NaN."""
    gen = torch.Generator().manual_seed(1)
    x = _correlated_inputs(512, 128, gen)
    x[:, 5] = 0
    w = torch.randn(16, 128, generator=gen)
    qz = gptq_quantize(w, 2 * x.double().t() @ x.double(), Int4Format(group_size=32))
    assert torch.isfinite(qz.dequantize()).all()


def test_awq_scale_search_never_worse_than_unscaled_and_helps_with_outliers():
    gen = torch.Generator().manual_seed(2)
    k, n = 256, 96
    x = _correlated_inputs(1024, k, gen)
    w = torch.randn(n, k, generator=gen) / 10
    fmt = Int4Format(group_size=128)
    s, a = awq_scale_search(w, x, fmt, grid=20)
    assert s.shape == (k,) and bool((s > 0).all()) and 0 <= a < 1
    scaled = quantize_int4(w * s, fmt).dequantize() / s
    err_awq, err_rtn = _output_error(x, w, scaled), _output_error(x, w, quantize_int4(w, fmt).dequantize())
    assert err_awq <= err_rtn * (1 + 1e-6)
    assert err_awq < 0.8 * err_rtn, (err_awq, err_rtn)


def test_awq_clip_search_never_raises_a_groups_error():
    gen = torch.Generator().manual_seed(3)
    x = _correlated_inputs(256, 128, gen)
    w = torch.randn(32, 128, generator=gen)
    w[:, 7] *= 8  # outlier weights: clipping them can pay
    fmt = Int4Format(group_size=32)
    clipped = awq_clip_search(w, x, fmt)
    err_clip = _output_error(x, w, quantize_int4(clipped, fmt).dequantize())
    err_rtn = _output_error(x, w, quantize_int4(w, fmt).dequantize())
    assert err_clip <= err_rtn * (1 + 1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_awq_folds_keep_the_float_model(arch, tmp_path):
    save_random_hf_model(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    ids = [3, 17, 5, 40, 22, 9, 31, 1]
    before = prefill_logits(loaded.model, ids)
    data = [[(7 * i + j) % 90 + 3 for j in range(24)] for i in range(4)]
    awq_(loaded.model, Int4Config(method="awq"), data, llm_forward, show_progress=False)
    after = prefill_logits(loaded.model, ids)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantize_int4_swaps_projections_and_keeps_the_head_8bit(method, tmp_path):
    save_random_hf_model("llama", tmp_path)
    loaded = load_model(str(tmp_path))
    ids = [3, 17, 5, 40, 22, 9, 31, 1]
    reference = prefill_logits(loaded.model, ids)
    data = [[(7 * i + j) % 90 + 3 for j in range(24)] for i in range(4)] if method != "rtn" else None
    config = Int4Config(method=method, group_size=32)
    result = quantize_int4_(loaded.model, config, data, llm_forward, show_progress=False)
    layers = loaded.config.num_layers
    assert len(result.quantized) == 4 * layers and result.head == "lm_head"
    assert sum(isinstance(m, Int4Linear) for m in loaded.model.modules()) == 4 * layers
    assert isinstance(loaded.model.lm_head, Int8Linear)
    assert bits_per_weight(loaded.model) == pytest.approx(4 + 32 / 32)  # float16 scale and minimum per 32
    logits = prefill_logits(loaded.model, ids)
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), reference.flatten(), dim=0)
    assert float(cos) > 0.95


def test_bad_int4_configs_are_refused():
    with pytest.raises(FivefoldError, match="method must be one of rtn, gptq, awq"):
        Int4Config(method="hqq")
    with pytest.raises(FivefoldError, match="group_size must be one of"):
        Int4Config(group_size=100)
    with pytest.raises(FivefoldError, match="GPTQ needs calibration data"):
        quantize_int4_(torch.nn.Sequential(torch.nn.Linear(64, 64)), Int4Config(method="gptq"))
    assert Int4Config.from_dict(Int4Config(method="awq", group_size=64).to_dict()) == Int4Config(method="awq",
                                                                                                  group_size=64)


@pytest.mark.parametrize("symmetric", [False, True])
def test_4bit_directory_writes_and_reloads_exactly(symmetric, tmp_path):
    """save_quantized writes the 4-bit layers in their checkpoint form (and the 8-bit head);
    load_model rebuilds them on the meta device and computes the same logits bit for bit."""
    from fivefold.models.loader import save_quantized

    save_random_hf_model("qwen2", tmp_path / "hf")  # tied head, q/k/v biases
    loaded = load_model(str(tmp_path / "hf"))
    config = Int4Config(method="gptq", group_size=64, symmetric=symmetric)
    data = [[(7 * i + j) % 90 + 3 for j in range(24)] for i in range(4)]
    quantize_int4_(loaded.model, config, data, llm_forward, show_progress=False)
    names = [n for n, m in loaded.model.named_modules() if isinstance(m, (Int4Linear, Int8Linear))]
    save_quantized(loaded, config.to_dict(), names, tmp_path / "out")
    again = load_model(str(tmp_path / "out"))
    assert again.quantization["scheme"] == "w4a16"
    assert [n for n, m in again.model.named_modules() if isinstance(m, Int4Linear)] == \
        [n for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)]
    assert all(m.kernel_tensors() is not None for m in again.model.modules() if isinstance(m, Int4Linear))
    ids = [3, 17, 5, 40, 22, 9, 31, 1]
    torch.testing.assert_close(prefill_logits(again.model, ids), prefill_logits(loaded.model, ids), rtol=0, atol=0)


def test_mixed_bits_promotes_the_most_sensitive_layers_to_8_bits(tmp_path):
    """The 4-bit sensitivity scan ranks layers; mixed_bits keeps the fewest most-sensitive layers at
    8 bits that meet the budget: none for a loose one, some for a tight one, and every layer's
    width is 4 or 8 as chosen (bits per weight in between)."""
    from fivefold.quant.quantization_sensitivity import int4_sensitivity_scan, mixed_bits

    save_random_hf_model("llama", tmp_path)
    factory = lambda: load_model(str(tmp_path)).model  # noqa: E731
    ids = [(5 * j) % 90 + 3 for j in range(48)]
    reference = prefill_logits(factory(), ids)
    # the distance to the float model's logits (a random model's perplexity can improve by chance)
    metric = lambda m: 1.0 + float((prefill_logits(m, ids) - reference).pow(2).mean())  # noqa: E731
    config = Int4Config(method="rtn", group_size=32)
    float_model = factory()
    base, scan = int4_sensitivity_scan(float_model, config, metric, show_progress=False)
    assert len(scan) == 4 * 3 and [s.increase for s in scan] == sorted((s.increase for s in scan), reverse=True)
    assert all(isinstance(m, torch.nn.Linear) for n, m in float_model.named_modules() if n.endswith("_proj"))
    loose, eight, _ = mixed_bits(factory, config, scan, lambda v: True, metric, show_progress=False)
    assert eight == [] and bits_per_weight(loose) == pytest.approx(5.0)
    all_4bit = metric(loose)
    # a budget between the all-4-bit model and the float one: some layers go to 8 bits, the most sensitive first
    target = base + 0.5 * (all_4bit - base)
    mixed, eight, value = mixed_bits(factory, config, scan, lambda v: v <= target, metric, show_progress=False)
    assert value <= target and 0 < len(eight) and eight == [s.name for s in scan[:len(eight)]]
    widths = {n: type(m).__name__ for n, m in mixed.named_modules() if isinstance(m, (Int4Linear, Int8Linear))}
    assert all(widths[n] == "Int8Linear" for n in eight) and sum(w == "Int4Linear" for w in widths.values()) == 12 - len(eight)
    assert 5.0 < bits_per_weight(mixed) <= 8.0 + 1e-6
