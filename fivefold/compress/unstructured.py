"""Unstructured magnitude pruning with masks that stay applied, and a sparse execution path.

``magnitude_prune_(model, sparsity, scope)`` zeroes the smallest-magnitude weights of every
Linear and Conv2d: ``scope="global"`` ranks all of them together (layers that matter less
lose more), ``"layer"`` prunes each layer to the same sparsity. The mask is a
``torch.nn.utils.parametrize`` parametrization: ``module.weight`` is recomputed as
``original * mask`` at every use, so fine-tuning updates the original but can never
revive a pruned weight (its gradient is masked too). ``remove_masks_`` bakes them in.

Zeros alone save nothing: ``sparsify_linears_`` swaps a linear for a CSR ``SparseLinear``
only where that measures faster than the dense kernel on the layer's real input shape.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from fivefold.errors import FivefoldError
from fivefold.fuse.layout import median_us

SCOPES = ("global", "layer")


class _Mask(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _prunable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def magnitude_prune_(model: nn.Module, sparsity: float, scope: str = "global") -> dict[str, float]:
    """Mask the smallest weights in place; returns each layer's resulting sparsity."""
    if not 0 <= sparsity < 1:
        raise FivefoldError(f"sparsity must be in [0, 1), got {sparsity}")
    if scope not in SCOPES:
        raise FivefoldError(f"scope must be one of {', '.join(SCOPES)}, got '{scope}'")
    layers = _prunable(model)
    weights = {n: m.weight.detach().abs() for n, m in layers}
    if scope == "global":
        everything = torch.cat([w.flatten() for w in weights.values()])
        k = int(sparsity * everything.numel())
        threshold = everything.kthvalue(k).values if k > 0 else torch.tensor(-1.0)
        thresholds = {n: threshold for n in weights}
    else:
        thresholds = {}
        for n, w in weights.items():
            k = int(sparsity * w.numel())
            thresholds[n] = w.flatten().kthvalue(k).values if k > 0 else torch.tensor(-1.0)
    result = {}
    for name, module in layers:
        mask = (weights[name] > thresholds[name]).to(module.weight.dtype)
        if parametrize.is_parametrized(module, "weight"):
            mask = mask * module.parametrizations.weight[0].mask
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        parametrize.register_parametrization(module, "weight", _Mask(mask))
        result[name] = 1.0 - float(mask.mean())
    return result


def remove_masks_(model: nn.Module) -> None:
    """Make the masked weights plain parameters again (zeros included)."""
    for _, module in _prunable(model):
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def sparsity_of(model: nn.Module) -> float:
    total = zeros = 0
    for _, m in _prunable(model):
        total += m.weight.numel()
        zeros += int((m.weight == 0).sum())
    return zeros / max(1, total)


class SparseLinear(nn.Module):
    """y = x W^T + b with W in CSR (``torch.sparse.mm``): worth it only at high sparsity."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with warnings.catch_warnings():  # "sparse CSR support is in beta": known, and tested here
            warnings.simplefilter("ignore", UserWarning)
            self.weight_csr = linear.weight.detach().to_sparse_csr()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.sparse.mm(self.weight_csr, flat.t()).t()  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def sparsify_linears_(model: nn.Module, num_rows: int = 1, min_speedup: float = 1.05) -> list[dict]:
    """Swap each (unmasked) linear for a SparseLinear where it is ``min_speedup`` x faster on
    ``num_rows`` input rows; returns one decision per linear with both timings."""
    decisions = []
    for module in [*model.modules()]:
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            x = torch.randn(num_rows, child.in_features)
            sparse = SparseLinear(child)
            dense_us, sparse_us = median_us(lambda: child(x)), median_us(lambda: sparse(x))
            is_faster = dense_us / sparse_us >= min_speedup
            decisions.append({"name": name, "sparsity": float((child.weight == 0).float().mean()),
                              "dense_us": dense_us, "sparse_us": sparse_us, "is_sparse": is_faster})
            if is_faster:
                setattr(module, name, sparse)
    return decisions
