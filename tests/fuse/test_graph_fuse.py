"""fuse(): fused equals unfused to 1e-5, and the rewrites it reports actually happened."""

import pytest
import torch
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.fuse.graph_fuse import FuseConfig, FusedConv2d, FusedLinear, count_kernels, fuse
from fivefold.models.bert import BertConfig, BertEncoder, load_bert
from fivefold.models.cnn import ResNet18, _randomise_batchnorm_, build_cnn

TOL = 1e-5


def _num(module, kind) -> int:
    return sum(isinstance(m, kind) for m in module.modules())


def _check_equal(model, inputs, config=FuseConfig()):
    fused, report = fuse(model, inputs, config)
    with torch.inference_mode():
        ref, out = model(*inputs), fused(*inputs)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    assert report.max_abs_diff == pytest.approx(float((out - ref).abs().max()), abs=1e-7)
    return fused, report


@pytest.mark.parametrize("config", [FuseConfig(), FuseConfig(channels_last=False, prepack=False),
                                    FuseConfig(fuse_residual_add=False, fuse_activations=False)])
def test_resnet_block_structure_fused_equals_eager(config):
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, width=8).eval()
    with torch.no_grad():
        _randomise_batchnorm_(model, 0)
    x = torch.randn(2, 3, 32, 32)
    fused, report = _check_equal(model, (x,), config)
    assert report.num_folded_batchnorms == _num(model, nn.BatchNorm2d) == 20
    assert _num(fused, nn.BatchNorm2d) == 0
    if config.fuse_residual_add:
        # 8 basic blocks: each conv2 + add + ReLU is one oneDNN call.
        assert report.num_fused_residual_adds == 8
        assert sum(isinstance(m, FusedConv2d) and m.has_residual and m.attr == "relu" for m in fused.modules()) == 8
        # stem + the 8 blocks' conv1: conv + ReLU.
        assert report.num_fused_activations == 9
        assert report.kernels_after < report.kernels_before / 2
    else:
        assert report.num_fused_activations == report.num_fused_residual_adds == 0
    # A second shape (not the one prepacked for) runs and still matches.
    y = torch.randn(1, 3, 48, 40)
    with torch.inference_mode():
        torch.testing.assert_close(fused(y), model(y), atol=TOL, rtol=TOL)


def test_mobilenet_v2_fused_equals_eager():
    model = build_cnn("mobilenet_v2")
    x = torch.randn(1, 3, 64, 64)
    fused, report = _check_equal(model, (x,))
    assert report.num_folded_batchnorms == _num(model, nn.BatchNorm2d) == 52
    assert report.num_fused_residual_adds == 10  # the stride-1, same-width inverted residuals
    assert report.num_fused_activations == 35  # every conv + ReLU6 (as hardtanh[0, 6])
    # Graph entry converts to channels_last once; nothing else converts layouts.
    assert report.layout_conversions_after == 1
    # Eager NCHW convs make oneDNN reorder activations and weights inside every call; fused, the
    # weights are prepacked and activations stay channels_last.
    assert report.onednn_reorders_before >= 52 and report.onednn_reorders_after <= 2


def test_functional_activations_and_torch_add_are_fused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 4, 3, padding=1)
            self.b = nn.Conv2d(4, 4, 1)
            self.bn = nn.BatchNorm2d(4)
            self.head = nn.Linear(4, 6)

        def forward(self, x):
            y = torch.nn.functional.silu(self.bn(self.a(x)))
            z = torch.relu(torch.add(self.b(y), x))
            return torch.sigmoid(self.head(z.mean((2, 3))))

    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        _randomise_batchnorm_(model, 1)
    fused, report = _check_equal(model, (torch.randn(3, 4, 9, 9),))
    assert (report.num_folded_batchnorms, report.num_fused_residual_adds, report.num_fused_activations) == (1, 1, 2)
    assert _num(fused, FusedLinear) == 1 and _num(fused, nn.Linear) == 0


def test_linear_batchnorm1d_folds_and_parallel_linears_merge():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)
            self.bn = nn.BatchNorm1d(16)
            self.gate, self.up = nn.Linear(16, 12, bias=False), nn.Linear(16, 12, bias=False)

        def forward(self, x):
            h = self.bn(self.fc(x))
            return self.gate(h) * self.up(h)

    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        _randomise_batchnorm_(model, 2)
    # Alignment off: it keeps or swaps a linear by timing it (packed, padded), so which module types
    # remain would depend on the machine's load; this test is about the fold and the merge.
    fused, report = _check_equal(model, (torch.randn(5, 8),), FuseConfig(align_linears=False))
    assert report.num_folded_batchnorms == 1 and report.num_merged_linear_groups == 1
    linears = [m for m in fused.modules() if isinstance(m, nn.Linear)]
    assert sorted(m.out_features for m in linears) == [16, 24]


def test_encoder_matches_transformers_and_fused_equals_unfused():
    from transformers import BertConfig as HFBertConfig, BertModel

    torch.manual_seed(0)
    hf = BertModel(HFBertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                                intermediate_size=96), add_pooling_layer=False).eval()
    ours = BertEncoder(BertConfig(120, 48, 3, 4, 96))
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if "position_ids" not in k})
    ids = torch.randint(0, 120, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    with torch.inference_mode():
        ref = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        out = ours(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=TOL, rtol=TOL)
    fused, report = _check_equal(ours.eval(), (ids, mask))
    assert report.num_merged_linear_groups == 3  # Q, K and V of each layer read the same input
    assert report.num_fused_activations == 3  # intermediate dense + GELU
    assert report.kernels_after < report.kernels_before


def test_minilm_checkpoint_loads_and_matches_transformers():
    from transformers import AutoModel

    from fivefold.models.registry import resolve_model_path

    path = resolve_model_path("all-minilm-l6-v2")
    ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        ref = AutoModel.from_pretrained(str(path)).eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        out = load_bert(path)(ids, mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=TOL, rtol=TOL)


def test_kernel_counter_counts_dispatched_ops():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    counts = count_kernels(model, (torch.randn(2, 4),))
    assert counts == {"aten.linear": 1, "aten.relu": 1}


def test_bad_input_errors():
    with pytest.raises(FivefoldError, match="eval mode"):
        fuse(build_cnn("resnet18").train(), (torch.randn(1, 3, 32, 32),))

    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(FivefoldError, match="cannot trace Branchy"):
        fuse(Branchy().eval(), (torch.randn(2),))
    with pytest.raises(FivefoldError, match="must be a bool"):
        FuseConfig(prepack="yes")


def test_padded_linear_equals_original_and_alignment_is_timed():
    from fivefold.fuse.layout import PaddedLinear, padded_copy

    torch.manual_seed(0)
    linear = nn.Linear(24, 1000)
    padded = PaddedLinear(padded_copy(linear, 64), 1000)
    assert padded.inner.out_features == 1024
    x = torch.randn(3, 24)
    with torch.inference_mode():
        torch.testing.assert_close(padded(x), linear(x), atol=TOL, rtol=TOL)
    fused, report = _check_equal(nn.Sequential(nn.Linear(24, 1000)).eval(), (x,))
    (decision,) = report.linear_layouts
    assert set(decision["us"]) == {"as is", "packed", "padded to 16"}
    assert decision["choice"] in decision["us"]
