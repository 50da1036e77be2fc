"""Quantization-aware training: train through fake quantization, then convert to real int8.

``prepare_qat(model, config)`` wraps every linear/conv layer so that its forward sees
what the int8 model will see: weights quantized per output channel (symmetric, the
scale following the weights as they train) and inputs quantized with a per-tensor
range tracked as an exponential moving average of the observed min/max (static W8A8,
as the converted model will run). Gradients pass through the rounding with the
clipped straight-through estimator (``primitives.fake_quantize``). ``convert(model)``
then swaps each wrapper for the real int8 module with the learnt ranges.

QAT simulates exactly the kernel that will run, so it accepts only configs whose int8
arithmetic it reproduces: W8A8 with static activations (the int8 grid of the calibrated
range; every W8A8 kernel Fivefold runs is exact integer arithmetic on this CPU,
``fivefold.models.int8_backends``) and W8A16 (weights only: activations stay float). Dynamic
activations get a new scale per call at serve time, which a learnt range would not
reproduce: ``prepare_qat`` refuses them with a one-line error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.quant.config import Int8Config
from fivefold.models.int8_backends import EXACT_FALLBACK, EXACT_KERNEL, is_library_kernel_exact, w8a8_kernel
from fivefold.models.int8_primitives import (
    ACT_QMAX,
    ACT_QMIN,
    WEIGHT_QMAX,
    activation_qparams,
    fake_quantize,
    weight_scales,
)
from fivefold.quant.quantize import replace_module, target_linears, to_int8

EMA = 0.9


class FakeQuant(nn.Module):
    """Wraps a Linear or Conv2d: fake-quantized weights and inputs, float arithmetic, trainable."""

    def __init__(self, module: nn.Module, config: Int8Config) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.register_buffer("range", torch.tensor([0.0, 0.0]))
        self.register_buffer("is_initialised", torch.tensor(False))

    def _fake_weight(self) -> torch.Tensor:
        w = self.module.weight
        flat = w.reshape(w.shape[0], -1)
        scales = weight_scales(flat.detach(), self.config.weight_granularity == "per-channel")
        shape = (-1,) + (1,) * (w.dim() - 1)
        return fake_quantize(w, scales.reshape(shape), 0, -WEIGHT_QMAX, WEIGHT_QMAX)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                lo, hi = float(x.min()), float(x.max())
                if not bool(self.is_initialised):
                    self.range.copy_(torch.tensor([lo, hi]))
                    self.is_initialised.fill_(True)
                else:
                    self.range.mul_(EMA).add_(torch.tensor([lo, hi]) * (1 - EMA))
        if self.config.scheme == "w8a8":
            scale, zero_point = activation_qparams(float(self.range[0]), float(self.range[1]),
                                                   self.config.activation_symmetric)
            x = fake_quantize(x, scale, zero_point, ACT_QMIN, ACT_QMAX)
        w = self._fake_weight()
        if isinstance(self.module, nn.Conv2d):
            m = self.module
            return F.conv2d(x, w, m.bias, m.stride, m.padding, m.dilation, m.groups)
        return F.linear(x, w, self.module.bias)


def check_simulable(config: Int8Config) -> None:
    """Raise a one-line FivefoldError unless fake quantization reproduces the kernel that ``config``
    runs on this CPU (see the module docstring)."""
    if config.scheme == "w8a8" and not config.is_static:
        raise FivefoldError(f"QAT simulates W8A8 with static activations or W8A16, not '{config.label}': "
                            f"dynamic activation scales are chosen per call at serve time")
    if config.scheme == "w8a8":
        kernel = w8a8_kernel("static")
        if kernel not in (EXACT_KERNEL, EXACT_FALLBACK) and not is_library_kernel_exact(kernel):
            raise FivefoldError(f"QAT cannot simulate the int8 kernel '{kernel}' on this CPU: it saturates")


def prepare_qat(model: nn.Module, config: Int8Config) -> nn.Module:
    """Wrap every quantizable layer in :class:`FakeQuant` (in place); returns the model.

    Raises FivefoldError for a config whose kernel fake quantization cannot simulate."""
    check_simulable(config)
    for name, module in target_linears(model, config.skip):
        replace_module(model, name, FakeQuant(module, config))
    return model


def convert(model: nn.Module) -> nn.Module:
    """Swap every :class:`FakeQuant` for the real int8 module with its learnt input range."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FakeQuant):
            lo, hi = (float(v) for v in module.range)
            clip = (lo, hi) if module.config.scheme == "w8a8" else None  # W8A16 trained on unclipped inputs
            replace_module(model, name, to_int8(module.module, module.config, clip))
    return model.eval()
