"""Reference CNNs for the fusion and layout passes: ResNet-18 and MobileNet-V2.

Written here after the torchvision definitions (same layers, widths and strides;
torchvision itself is not a dependency), with random weights and BatchNorm
statistics set to non-trivial values, so folding BN is actually exercised. They
exist to measure and test `fivefold.fuse`, not to classify anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _randomise_batchnorm_(model: nn.Module, seed: int) -> None:
    """Give every BN layer non-identity statistics and affine terms, as a trained net has."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
            module.running_var.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
            module.weight.data.copy_(torch.rand(n, generator=gen) * 0.5 + 0.75)
            module.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the (optionally downsampled) input, then ReLU."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, in_channels = [], width
        for i, channels in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(in_channels, channels, stride), BasicBlock(channels, channels)))
            in_channels = channels
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _conv_bn_relu6(in_channels: int, out_channels: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise, 1x1 linear projection; a residual when shapes allow."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = in_channels * expand_ratio
        self.use_residual = stride == 1 and in_channels == out_channels
        layers = [] if expand_ratio == 1 else [_conv_bn_relu6(in_channels, hidden, 1, 1)]
        layers += [_conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    # (expand ratio, output channels, repeats, first stride), as in the paper and torchvision
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers, in_channels = [_conv_bn_relu6(3, 32, 3, 2)], 32
        for expand, channels, repeats, stride in self.SETTINGS:
            for i in range(repeats):
                layers.append(InvertedResidual(in_channels, channels, stride if i == 0 else 1, expand))
                in_channels = channels
        layers.append(_conv_bn_relu6(in_channels, 1280, 1, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


CNN_BUILDERS = {"resnet18": ResNet18, "mobilenet_v2": MobileNetV2}


def build_cnn(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """A reference CNN with seeded random weights, in eval mode."""
    if name not in CNN_BUILDERS:
        raise ValueError(f"unknown CNN '{name}'; built-in: {', '.join(CNN_BUILDERS)}")
    torch.manual_seed(seed)
    model = CNN_BUILDERS[name](**kwargs)
    with torch.no_grad():
        _randomise_batchnorm_(model, seed)
    return model.eval()


class DigitsResNet(nn.Module):
    """A ResNet-style classifier for the 8x8 digits: stem, two blocks at ``width`` (8x8),
    a strided block to 2 x ``width`` (4x4) and one more, global average pool, linear.
    Trained here in well under a minute; the model the structure lever is shown on."""

    def __init__(self, width: int = 96, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class DigitsCNN(nn.Module):
    """A small CNN for the 8x8 digits (fivefold/eval/digits.py): the model on which post-training
    quantization and QAT are compared."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # [B, 16, 4, 4]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # [B, 32, 2, 2]
        return self.fc2(F.relu(self.fc1(x.flatten(1))))
