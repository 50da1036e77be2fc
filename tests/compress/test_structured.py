"""Structured channel pruning keeps every shape consistent and, at ratio 0, the outputs identical."""

import pytest
import torch
from torch import nn

from fivefold.compress.structured import channel_groups, count_flops, count_parameters, prune_channels
from fivefold.errors import FivefoldError
from fivefold.models.cnn import DigitsResNet, ResNet18, _randomise_batchnorm_, build_cnn
from fivefold.models.cnn import DigitsCNN


def _resnet(width=8):
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, width=width).eval()
    with torch.no_grad():
        _randomise_batchnorm_(model, 0)
    return model


def test_residual_groups_tie_every_conv_writing_into_the_stream():
    model = _resnet()
    groups = {g.name: g for g in channel_groups(model, (torch.randn(1, 3, 32, 32),))}
    stage1 = groups["conv1"]  # the stem and both blocks' conv2 add into one stream
    assert set(stage1.producers) == {"conv1", "layer1.0.conv2", "layer1.1.conv2"}
    assert {"bn1", "layer1.0.bn2", "layer1.1.bn2"} <= set(stage1.members)
    assert ("layer2.0.downsample.0", 1) in stage1.consumers and stage1.is_prunable
    stage2 = groups["layer2.0.downsample.0"]  # named after its first producer in execution order
    assert set(stage2.producers) == {"layer2.0.conv2", "layer2.0.downsample.0", "layer2.1.conv2"}
    inner = groups["layer1.0.conv1"]
    assert inner.producers == ["layer1.0.conv1"] and inner.consumers == [("layer1.0.conv2", 1)]
    assert not groups["fc"].is_prunable  # the logits are the model's output


@pytest.mark.parametrize("importance", ["l1", "l2", "bn", "taylor"])
def test_pruned_resnet_runs_with_consistent_shapes(importance):
    model = _resnet()
    x = torch.randn(2, 3, 32, 32)
    loss_fn = lambda m: m(x).logsumexp(-1).sum()  # noqa: E731
    pruned = prune_channels(model, (x,), 0.5, importance, loss_fn=loss_fn)
    assert pruned(x).shape == (2, 10)
    for m in pruned.modules():
        if isinstance(m, nn.Conv2d):
            assert m.weight.shape == (m.out_channels, m.in_channels // m.groups, *m.kernel_size)
        if isinstance(m, nn.BatchNorm2d):
            assert m.weight.shape == m.running_mean.shape == (m.num_features,)
    assert pruned.conv1.out_channels == 4 and pruned.layer4[1].conv2.out_channels == 32
    assert pruned.fc.in_features == 32
    # Halving every width quarters the convs between pruned layers (the 3-channel input stays).
    assert count_flops(pruned, (x,)) < 0.36 * count_flops(model, (x,))
    assert count_parameters(pruned) < 0.3 * count_parameters(model)


def test_ratio_zero_is_identical_and_pruning_keeps_the_most_important_channels():
    model = _resnet()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(prune_channels(model, (x,), 0.0)(x), model(x))
    # Zero one inner channel's filter: L1 importance must drop exactly that channel.
    with torch.no_grad():
        model.layer1[0].conv1.weight[3].zero_()
    pruned = prune_channels(model, (x,), {"layer1.0.conv1": 1 / 8})
    kept = pruned.layer1[0].conv1.weight
    assert kept.shape[0] == 7
    expected = torch.cat([model.layer1[0].conv1.weight[:3], model.layer1[0].conv1.weight[4:]])
    assert torch.equal(kept, expected)
    assert torch.equal(pruned.layer1[0].conv2.weight, model.layer1[0].conv2.weight[:, [0, 1, 2, 4, 5, 6, 7]])
    # Only that group changed: the rest of the network is untouched.
    assert torch.equal(pruned.layer2[0].conv1.weight, model.layer2[0].conv1.weight)


def test_mobilenet_depthwise_and_flatten_consumers():
    model = build_cnn("mobilenet_v2")
    x = torch.randn(1, 3, 64, 64)
    pruned = prune_channels(model, (x,), 0.25)
    assert pruned(x).shape == (1, 1000)
    dw = pruned.features[2].conv[1][0]  # a depthwise conv follows its expanded channels
    assert dw.groups == dw.in_channels == dw.out_channels == pruned.features[2].conv[0][0].out_channels < 96
    digits = DigitsCNN().eval()  # conv -> pool -> flatten (4 features per channel) -> fc1
    y = torch.randn(3, 1, 8, 8)
    small = prune_channels(digits, (y,), 0.5)
    assert small.conv2.out_channels == 16 and small.fc1.in_features == 64 and small.fc1.out_features == 32
    assert small(y).shape == (3, 10)


def test_digits_resnet_prunes_and_bad_input_is_refused():
    model = DigitsResNet(width=16).eval()
    x = torch.randn(2, 1, 8, 8)
    assert prune_channels(model, (x,), 0.5)(x).shape == (2, 10)
    with pytest.raises(FivefoldError, match="ratios must be in \\[0, 1\\)"):
        prune_channels(model, (x,), 1.0)
    with pytest.raises(FivefoldError, match="needs a loss_fn"):
        prune_channels(model, (x,), 0.5, "taylor")
    with pytest.raises(FivefoldError, match="importance must be one of"):
        prune_channels(model, (x,), 0.5, "random")
