"""Magnitude pruning: exact sparsity, masks that survive fine-tuning, and the CSR path equal to dense."""

import pytest
import torch
from torch import nn

from fivefold.compress.unstructured import (
    SparseLinear,
    magnitude_prune_,
    remove_masks_,
    sparsify_linears_,
    sparsity_of,
)
from fivefold.errors import FivefoldError


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def test_layer_scope_prunes_each_layer_to_the_sparsity_and_global_ranks_all_together():
    net = _net()
    per_layer = magnitude_prune_(net, 0.75, "layer")
    assert all(abs(s - 0.75) < 0.02 for s in per_layer.values())
    net = _net()
    overall = magnitude_prune_(net, 0.6, "global")
    assert abs(sparsity_of(net) - 0.6) < 0.01
    assert len({round(s, 2) for s in overall.values()}) > 1  # layers end at different sparsities
    # The surviving weights are exactly the largest ones, across all layers.
    layers = (net[0], net[3], net[5])
    original = torch.cat([m.parametrizations.weight.original.detach().abs().flatten() for m in layers])
    kept = torch.cat([(m.weight != 0).flatten() for m in layers])
    assert original[kept].min() >= original[~kept].max()


def test_masks_survive_fine_tuning_and_can_be_baked_in():
    net = _net()
    magnitude_prune_(net, 0.8, "global")
    zero_before = [m.weight == 0 for m in (net[0], net[3], net[5])]
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    for m, zeros in zip((net[0], net[3], net[5]), zero_before):
        assert torch.all(m.weight[zeros] == 0)
        assert not torch.equal(m.parametrizations.weight.original, m.parametrizations.weight.original * 0)
    # A second, higher pruning keeps the first mask.
    magnitude_prune_(net, 0.9, "global")
    assert all(torch.all(m.weight[z] == 0) for m, z in zip((net[0], net[3], net[5]), zero_before))
    remove_masks_(net)
    assert isinstance(net[3].weight, nn.Parameter) and abs(sparsity_of(net) - 0.9) < 0.01


def test_sparse_linear_equals_dense_and_is_used_only_where_faster():
    torch.manual_seed(0)
    linear = nn.Linear(256, 512)
    with torch.no_grad():
        linear.weight[torch.rand_like(linear.weight) < 0.95] = 0
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(SparseLinear(linear)(x), linear(x), atol=1e-5, rtol=1e-5)
    model = nn.Sequential(linear)
    (decision,) = sparsify_linears_(model, num_rows=1)
    assert decision["is_sparse"] == isinstance(model[0], SparseLinear)
    assert decision["is_sparse"] == (decision["dense_us"] / decision["sparse_us"] >= 1.05)
    with torch.no_grad():
        torch.testing.assert_close(model(x), linear(x), atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(FivefoldError, match="sparsity must be in \\[0, 1\\)"):
        magnitude_prune_(_net(), 1.0)
    with pytest.raises(FivefoldError, match="scope must be one of"):
        magnitude_prune_(_net(), 0.5, "block")
