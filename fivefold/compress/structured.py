"""Structured pruning of conv nets: remove output channels and everything that depends on them.

``channel_groups(model, example_inputs)`` traces the model with torch.fx and finds, for
every conv or linear output, which other tensors carry the same channels:

- BatchNorm, activations, pooling, dropout and depthwise convs pass channels through
  (the BN's statistics and the depthwise filters are sliced with them);
- ``a + b`` (a residual connection) ties the channels of ``a`` and ``b`` into one group:
  every conv writing into the same residual stream loses the same channels;
- a conv or a linear reading the tensor consumes the channels (its input side is sliced;
  after ``flatten`` of a C x H x W map each channel owns H x W consecutive features).

A group that reaches the model's output or its inputs, or meets an op not listed above,
is left alone (its shape is part of the interface, or the pass cannot prove the slice
safe). ``prune_channels`` then keeps, in each group, the channels with the highest
importance: L1 or L2 norm of the producing filters, |gamma| of the group's BatchNorms
(network slimming), or first-order Taylor |w x dL/dw| summed per channel.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from fivefold.errors import FivefoldError

IMPORTANCES = ("l1", "l2", "bn", "taylor")

_PASSTHROUGH_MODULES = (nn.BatchNorm2d, nn.BatchNorm1d, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Hardswish, nn.Sigmoid,
                        nn.Tanh, nn.Dropout, nn.Identity, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
                        nn.LeakyReLU)
_PASSTHROUGH_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.silu, F.gelu, F.hardswish, torch.sigmoid, torch.tanh,
                          F.dropout, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.leaky_relu}
_PASSTHROUGH_METHODS = {"relu", "contiguous", "sigmoid", "tanh"}
_ADDS = {operator.add, operator.iadd, torch.add}


@dataclass
class ChannelGroup:
    """Channels that must be removed together. ``producers``: modules whose outputs are these
    channels; ``members``: modules sliced along them (BN, depthwise conv); ``consumers``:
    (module, features per channel) reading them."""

    name: str
    num_channels: int
    producers: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    consumers: list[tuple[str, int]] = field(default_factory=list)
    is_prunable: bool = True


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, a: int) -> int:
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        self.parent[max(ra, rb)] = min(ra, rb)
        return min(ra, rb)


def _is_depthwise(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels == m.out_channels


def channel_groups(model: nn.Module, example_inputs: tuple) -> list[ChannelGroup]:
    """Every channel group of ``model`` (prunable or not), named after its first producer."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises several types on control flow
        raise FivefoldError(f"cannot trace {type(model).__name__} with torch.fx: {str(exc).splitlines()[0]}") from None
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
    modules = dict(gm.named_modules())
    uf = _UnionFind()
    of: dict[fx.Node, tuple[int, int]] = {}  # node -> (group id, features per channel)
    info: dict[int, ChannelGroup] = {}
    blocked: set[int] = set()

    def new_group(name: str, channels: int) -> int:
        gid = len(info)
        info[gid] = ChannelGroup(name, channels)
        return gid

    def tensor_inputs(node: fx.Node) -> list[fx.Node]:
        return [a for a in node.all_input_nodes if a in of]

    for node in gm.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        srcs = tensor_inputs(node)
        if node.op == "placeholder":
            continue
        if node.op == "output":
            blocked.update(uf.find(of[s][0]) for s in srcs)
            continue
        if isinstance(module, nn.Conv2d) and _is_depthwise(module) and srcs:
            gid = uf.find(of[srcs[0]][0])
            info[gid].members.append(node.target)
            of[node] = (gid, 1)
            continue
        if isinstance(module, (nn.Conv2d, nn.Linear)) and module.__class__ in (nn.Conv2d, nn.Linear):
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                blocked.update(uf.find(of[s][0]) for s in srcs)
                continue
            for s in srcs:
                gid, per_channel = of[s]
                info[uf.find(gid)].consumers.append((node.target, per_channel))
            out = module.out_channels if isinstance(module, nn.Conv2d) else module.out_features
            gid = new_group(node.target, out)
            info[gid].producers.append(node.target)
            of[node] = (gid, 1)
            continue
        is_pass = (isinstance(module, _PASSTHROUGH_MODULES)
                   or (node.op == "call_function" and node.target in _PASSTHROUGH_FUNCTIONS)
                   or (node.op == "call_method" and node.target in _PASSTHROUGH_METHODS))
        if is_pass and len(srcs) == 1:
            gid, per_channel = of[srcs[0]]
            if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm1d)):
                info[uf.find(gid)].members.append(node.target)
            of[node] = (gid, per_channel)
            continue
        if node.op == "call_function" and node.target in _ADDS and len(node.args) == 2:
            a, b = node.args
            if all(isinstance(x, fx.Node) and x in of for x in (a, b)):
                gid = uf.union(of[a][0], of[b][0])
                of[node] = (gid, of[a][1])
                continue
        is_flatten = (node.op == "call_function" and node.target is torch.flatten) or \
                     (node.op == "call_method" and node.target == "flatten")
        if is_flatten and len(srcs) == 1 and tuple(node.args[1:2]) in ((1,),) and of[srcs[0]][1] == 1:
            shape = srcs[0].meta["tensor_meta"].shape
            of[node] = (of[srcs[0]][0], int(torch.tensor(shape[2:]).prod()) if len(shape) > 2 else 1)
            continue
        is_spatial_mean = node.op == "call_method" and node.target == "mean" and len(srcs) == 1 and \
            tuple(node.args[1:2]) in (((2, 3),), ((-2, -1),), ((-1, -2),), ((3, 2),))
        if is_spatial_mean:
            of[node] = of[srcs[0]]
            continue
        # Anything else that reads grouped channels: leave those groups alone.
        blocked.update(uf.find(of[s][0]) for s in srcs)

    merged: dict[int, ChannelGroup] = {}
    for gid, group in info.items():
        root = uf.find(gid)
        target = merged.setdefault(root, ChannelGroup(info[root].name, info[root].num_channels))
        target.producers += group.producers
        target.members += group.members
        target.consumers += group.consumers
    for root, group in merged.items():
        group.is_prunable = root not in {uf.find(b) for b in blocked} and bool(group.producers)
        if any(_module_out(modules[p]) != group.num_channels for p in group.producers):
            group.is_prunable = False  # a residual add of mismatched widths would not have traced
    return list(merged.values())


def _module_out(m: nn.Module) -> int:
    return m.out_channels if isinstance(m, nn.Conv2d) else m.out_features


def _channel_importance(model: nn.Module, group: ChannelGroup, importance: str,
                        grads: dict[str, torch.Tensor] | None) -> torch.Tensor:
    score = torch.zeros(group.num_channels)
    if importance == "bn":
        bns = [model.get_submodule(m) for m in group.members
               if isinstance(model.get_submodule(m), (nn.BatchNorm2d, nn.BatchNorm1d))]
        if bns:
            return sum(bn.weight.detach().abs() for bn in bns)
        importance = "l1"  # a group without BN: fall back to filter norms
    for name in group.producers:
        w = model.get_submodule(name).weight.detach()
        flat = w.reshape(w.shape[0], -1)
        if importance == "l1":
            part = flat.abs().sum(1)
        elif importance == "l2":
            part = flat.pow(2).sum(1).sqrt()
        else:
            part = (flat * grads[name].reshape(flat.shape)).abs().sum(1)
        score += part / part.sum().clamp(min=1e-12)  # each producer weighs the same
    return score


def taylor_grads(model: nn.Module, backward: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    """{module name: dL/dW} of every Conv2d and Linear weight, after ``backward(model)`` (in eval
    mode) has run the loss's backward pass, or several (the gradients add up): the Taylor
    importance's first factor, for the CNN channel groups here and the LLM's MLP neurons."""
    model.zero_grad()
    was_training = model.training
    model.eval()
    backward(model)
    model.train(was_training)
    grads = {n: m.weight.grad.detach().clone() for n, m in model.named_modules()
             if isinstance(m, (nn.Conv2d, nn.Linear)) and m.weight.grad is not None}
    model.zero_grad()
    return grads


def _slice_(module: nn.Module, name: str, index: torch.Tensor, dim: int) -> None:
    tensor = getattr(module, name)
    if tensor is None:
        return
    sliced = tensor.detach().index_select(dim, index).clone()
    if isinstance(tensor, nn.Parameter):
        setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
    else:
        setattr(module, name, sliced)


def prune_group_(model: nn.Module, group: ChannelGroup, keep: torch.Tensor) -> None:
    """Keep only channels ``keep`` (sorted indices) of ``group``, in place."""
    n = len(keep)
    for name in group.producers:
        m = model.get_submodule(name)
        _slice_(m, "weight", keep, 0)
        _slice_(m, "bias", keep, 0)
        if isinstance(m, nn.Conv2d):
            m.out_channels = n
        else:
            m.out_features = n
    for name in group.members:
        m = model.get_submodule(name)
        if isinstance(m, nn.Conv2d):  # depthwise: one filter per channel
            _slice_(m, "weight", keep, 0)
            _slice_(m, "bias", keep, 0)
            m.in_channels = m.out_channels = m.groups = n
        else:
            for attr in ("weight", "bias", "running_mean", "running_var"):
                _slice_(m, attr, keep, 0)
            m.num_features = n
    for name, per_channel in group.consumers:
        m = model.get_submodule(name)
        cols = (keep.unsqueeze(1) * per_channel + torch.arange(per_channel)).reshape(-1)
        _slice_(m, "weight", cols, 1)
        if isinstance(m, nn.Conv2d):
            m.in_channels = n
        else:
            m.in_features = n * per_channel
    group.num_channels = n


def prune_channels(model: nn.Module, example_inputs: tuple, ratio: float | dict[str, float],
                   importance: str = "l1", loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
                   round_to: int = 1) -> nn.Module:
    """A copy of ``model`` with ``ratio`` of each prunable group's channels removed.

    ``ratio`` is one fraction for every group or ``{group name: fraction}`` (others kept
    whole). ``loss_fn(model) -> loss`` is needed for ``importance="taylor"``. The number
    kept is rounded up to a multiple of ``round_to`` and is at least 1.
    """
    if importance not in IMPORTANCES:
        raise FivefoldError(f"importance must be one of {', '.join(IMPORTANCES)}, got '{importance}'")
    if importance == "taylor" and loss_fn is None:
        raise FivefoldError("importance 'taylor' needs a loss_fn(model) to take gradients of")
    ratios = ratio if isinstance(ratio, dict) else None
    for value in (ratios or {"": ratio}).values():
        if not 0 <= value < 1:
            raise FivefoldError(f"pruning ratios must be in [0, 1), got {value}")
    pruned = copy.deepcopy(model)
    groups = channel_groups(pruned, example_inputs)
    grads = taylor_grads(pruned, lambda m: loss_fn(m).backward()) if importance == "taylor" else None
    # Every (module, dim) belongs to one group, so all choices are made on the unpruned weights
    # first and then applied in any order.
    plan = []
    for group in groups:
        r = ratios.get(group.name, 0.0) if ratios is not None else ratio
        if not group.is_prunable or r == 0:
            continue
        num_keep = max(1, group.num_channels - int(group.num_channels * r))
        num_keep = min(group.num_channels, -(-num_keep // round_to) * round_to)
        scores = _channel_importance(pruned, group, importance, grads)
        plan.append((group, scores.topk(num_keep).indices.sort().values))
    for group, keep in plan:
        prune_group_(pruned, group, keep)
    return pruned


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_flops(model: nn.Module, example_inputs: tuple) -> int:
    """Multiply-accumulates x 2 of the convs and linears in one forward of ``example_inputs``."""
    flops = 0

    def hook(module, inputs, output):
        nonlocal flops
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops += 2 * output.numel() * per_output
        else:
            flops += 2 * output.numel() * module.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return flops
