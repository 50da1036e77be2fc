"""``fuse(model, example_inputs)``: a torch.fx pass that keeps the math and cuts trips to memory.

Rewrites, in this order, on the traced graph:

1. **BatchNorm folding.** ``bn(conv(x))`` and ``bn(linear(x))`` in eval mode become one
   conv/linear with ``w' = w * g / sqrt(var + eps)`` and ``b' = (b - mean) * g / sqrt(var + eps) + beta``.
2. **Parallel linears.** Linears that read the same tensor (Q, K and V; gate and up) become one
   linear over the concatenated weights, followed by a split into views.
3. **Residual add.** ``act(conv(x) + y)`` becomes one oneDNN convolution with a post-op sum
   (and the activation), when ``y`` has the conv output's shape.
4. **Activation.** conv or linear followed by ReLU, ReLU6, SiLU, GELU, Hardswish, sigmoid or
   tanh becomes one oneDNN call with the activation as a post-op.
5. **Layout.** With ``channels_last``, 4-d inputs are converted once at the graph's entry and
   every conv weight is reordered once into oneDNN's blocked layout (``prepack``), so no
   per-call weight reorder or NCHW<->NHWC conversion is left on the path.
6. **Alignment.** Each remaining linear is timed on its real input shape as it is, with its
   weight packed for oneDNN, and with its outputs padded to a multiple of ``align_multiple``
   (see ``fivefold.fuse.layout``); the fastest is kept if it wins by 5% or more.

Steps 3-5 need oneDNN (``torch.backends.mkldnn``) and CPU float tensors; elsewhere the pass
folds and merges only. The report counts graph ops, dispatched kernels (every ATen op a
forward calls, the CPU analogue of kernel launches) and layout conversions before and after,
and the largest difference of the outputs on the example inputs.
"""

from __future__ import annotations

import copy
import operator
import os
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.errors import FivefoldError
from fivefold.fuse.layout import PaddedLinear, median_us, padded_copy
from fivefold.models.layers import linear_from


@dataclass(frozen=True)
class FuseConfig:
    """Which rewrites ``fuse`` applies; all on by default."""

    fold_batchnorm: bool = True
    merge_parallel_linears: bool = True
    fuse_residual_add: bool = True
    fuse_activations: bool = True
    channels_last: bool = True
    prepack: bool = True
    align_linears: bool = True
    align_multiple: int = 16

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "align_multiple" and not isinstance(value, bool):
                raise FivefoldError(f"FuseConfig.{name} must be a bool, got {value!r}")
        if not isinstance(self.align_multiple, int) or self.align_multiple < 1 or self.align_multiple > 256:
            raise FivefoldError(f"FuseConfig.align_multiple must be an integer in [1, 256], got {self.align_multiple!r}")


@dataclass
class FuseReport:
    """Counts before and after one ``fuse`` call; ``max_abs_diff`` on the example inputs."""

    graph_ops_before: int
    graph_ops_after: int
    kernels_before: int
    kernels_after: int
    layout_conversions_before: int
    layout_conversions_after: int
    onednn_reorders_before: int
    onednn_reorders_after: int
    num_folded_batchnorms: int
    num_merged_linear_groups: int
    num_fused_residual_adds: int
    num_fused_activations: int
    max_abs_diff: float
    max_abs_output: float
    linear_layouts: list  # one dict per timed linear: name, shape, microseconds per candidate, choice

    def to_dict(self) -> dict:
        return asdict(self)


# Activations oneDNN applies as a post-op: module type or function -> (attr, scalars, algorithm).
_ACTIVATION_MODULES = {nn.ReLU: ("relu", [], ""), nn.ReLU6: ("hardtanh", [0.0, 6.0], ""), nn.SiLU: ("swish", [], ""),
                       nn.Hardswish: ("hardswish", [], ""), nn.Sigmoid: ("sigmoid", [], ""), nn.Tanh: ("tanh", [], "")}
_ACTIVATION_FUNCTIONS = {F.relu: ("relu", [], ""), torch.relu: ("relu", [], ""), F.relu6: ("hardtanh", [0.0, 6.0], ""),
                         F.silu: ("swish", [], ""), F.hardswish: ("hardswish", [], ""), torch.sigmoid: ("sigmoid", [], ""),
                         torch.tanh: ("tanh", [], "")}
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_LAYOUT_OPS = ("aten.clone", "aten._to_copy", "aten.copy_", "aten.contiguous")


def _is_onednn_ready(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
            and all(t.device.type == "cpu" for t in tensors)
            and all(t.dtype == torch.float32 for t in tensors if t.is_floating_point()))


class FusedConv2d(nn.Module):
    """A conv (BN already folded) with its activation and optional residual add as oneDNN post-ops.

    ``forward(x)`` or ``forward(x, residual)`` = ``act(conv(x) [+ residual])``. The plain
    weight stays in the state dict; the reordered copy is built once by ``prepack``.
    """

    def __init__(self, conv: nn.Conv2d, activation: tuple = ("none", [], ""), has_residual: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach().clone(), requires_grad=False)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone(), requires_grad=False)
        self.padding, self.stride = list(conv.padding), list(conv.stride)
        self.dilation, self.groups = list(conv.dilation), conv.groups
        self.attr, self.scalars, self.algorithm = activation
        self.has_residual = has_residual
        self._packed: torch.Tensor | None = None
        self._packed_for: list[int] | None = None

    def prepack(self, input_shape: list[int]) -> None:
        """Reorder the weight once for this input shape (other shapes still work, reordering per call)."""
        self._packed_for = list(input_shape)
        self._packed = torch.ops.mkldnn._reorder_convolution_weight(
            self.weight.detach(), self.padding, self.stride, self.dilation, self.groups, self._packed_for)

    # oneDNN's reordered tensors cannot be pickled: save without them, reorder again on load.
    def __getstate__(self):
        return {**self.__dict__, "_packed": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._packed_for is not None:
            self.prepack(self._packed_for)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        weight = self._packed if self._packed is not None else self.weight
        conv = torch.ops.mkldnn._convolution_pointwise
        if residual is None:
            return conv(x, weight, self.bias, self.padding, self.stride, self.dilation, self.groups,
                        self.attr, self.scalars, self.algorithm)
        unary = None if self.attr == "none" else self.attr
        return conv.binary(x, residual, weight, self.bias, self.padding, self.stride, self.dilation, self.groups,
                           "add", None, unary, self.scalars, self.algorithm or None)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[1] * self.groups}, {self.weight.shape[0]}, kernel={tuple(self.weight.shape[2:])}, "
                f"stride={self.stride}, groups={self.groups}, post_ops={'add+' if self.has_residual else ''}{self.attr}")


class FusedLinear(nn.Module):
    """A linear with its activation as a oneDNN post-op, on a weight packed once."""

    def __init__(self, linear: nn.Linear, activation: tuple) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.attr, self.scalars, self.algorithm = activation
        self._pack()

    def _pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)

    def __getstate__(self):
        return {**self.__dict__, "_packed": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, self.attr, self.scalars, self.algorithm)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, post_op={self.attr}"


class KernelCounter(TorchDispatchMode):
    """Counts every ATen/oneDNN op a forward dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_kernels(module: nn.Module, example_inputs: tuple) -> Counter:
    """How many times each op is dispatched in one forward (``aten.convolution``: 20, ...)."""
    with torch.inference_mode(), KernelCounter() as counter:
        module(*example_inputs)
    return counter.counts


def num_layout_conversions(counts: Counter) -> int:
    """Copies that only change a tensor's layout or dtype (clone, _to_copy, copy_, contiguous)."""
    return sum(n for op, n in counts.items() if op in _LAYOUT_OPS)


def count_onednn_primitives(module: nn.Module, example_inputs: tuple) -> Counter:
    """oneDNN primitives executed in one forward, by kind (``convolution``, ``reorder``, ...).

    Read from oneDNN's verbose log, which it writes to file descriptor 1: the only place
    that shows the reorders oneDNN does inside a call (e.g. an NCHW activation or a plain
    weight converted to its blocked layout on every conv). Empty without oneDNN.
    """
    counts: Counter = Counter()
    if not torch.backends.mkldnn.is_available():
        return counts
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.inference_mode(), torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                module(*example_inputs)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        for line in log.read().decode(errors="replace").splitlines():
            fields = line.split(",")
            if fields[0] == "onednn_verbose" and "exec" in fields:
                counts[fields[fields.index("exec") + 2]] += 1
    return counts


def _num_graph_ops(gm: fx.GraphModule) -> int:
    """Calls in the graph; tuple indexing (``getitem``, as after a split) is not an op."""
    return sum(node.op in ("call_module", "call_function", "call_method") and node.target is not operator.getitem
               for node in gm.graph.nodes)


def _module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _activation_of(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """(attr, scalars, algorithm) if ``node`` is an activation oneDNN can apply as a post-op."""
    if node.op == "call_module":
        module = _module(gm, node)
        if isinstance(module, nn.GELU):
            return ("gelu", [], module.approximate)
        if isinstance(module, nn.Hardtanh) and type(module) is nn.Hardtanh:
            return ("hardtanh", [module.min_val, module.max_val], "")
        return _ACTIVATION_MODULES.get(type(module))
    if node.op == "call_function":
        if node.target is F.gelu:
            return ("gelu", [], node.kwargs.get("approximate", "none"))
        return _ACTIVATION_FUNCTIONS.get(node.target) if len(node.args) == 1 else None
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return ("relu", [], "")
    return None


def _is_fusable_conv(module) -> bool:
    return type(module) is nn.Conv2d and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _replace_with_module(gm: fx.GraphModule, anchor: fx.Node, last: fx.Node, module: nn.Module, args: tuple,
                         name: str) -> fx.Node:
    """Insert ``module(*args)`` before ``anchor``, route ``last``'s users to it, and return the node."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(anchor):
        new = gm.graph.call_module(name, args)
    new.meta = dict(last.meta)
    last.replace_all_uses_with(new)
    return new


def _unique_name(gm: fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    names = dict(gm.named_modules())
    i, name = 0, base
    while name in names:
        i += 1
        name = f"{base}_{i}"
    return name


def _fold_batchnorms(gm: fx.GraphModule) -> int:
    folded = 0
    for node in list(gm.graph.nodes):
        bn = _module(gm, node)
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or bn.training or not bn.track_running_stats:
            continue
        producer = node.args[0]
        layer = _module(gm, producer) if isinstance(producer, fx.Node) else None
        if not isinstance(layer, (nn.Conv2d, nn.Conv1d, nn.Linear)) or len(producer.users) != 1:
            continue
        fused = copy.deepcopy(layer)
        scale = (bn.running_var + bn.eps).rsqrt()
        gamma = bn.weight if bn.affine else torch.ones_like(scale)
        beta = bn.bias if bn.affine else torch.zeros_like(scale)
        factor = (gamma * scale).detach()
        bias = layer.bias.detach() if layer.bias is not None else torch.zeros_like(bn.running_mean)
        with torch.no_grad():
            fused.weight = nn.Parameter(layer.weight.detach() * factor.reshape(-1, *[1] * (layer.weight.dim() - 1)),
                                        requires_grad=False)
            fused.bias = nn.Parameter((bias - bn.running_mean) * factor + beta.detach(), requires_grad=False)
        _replace_with_module(gm, producer, node, fused, producer.args, _unique_name(gm, f"{producer.target}_bn"))
        gm.graph.erase_node(node)
        gm.graph.erase_node(producer)
        folded += 1
    return folded


def _merge_parallel_linears(gm: fx.GraphModule) -> int:
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        module = _module(gm, node)
        if type(module) is nn.Linear and len(node.args) == 1 and not node.kwargs:
            groups.setdefault(node.args[0], []).append(node)
    merged = 0
    for source, nodes in groups.items():
        if len(nodes) < 2:
            continue
        linears = [_module(gm, n) for n in nodes]
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            continue
        sizes = [lin.out_features for lin in linears]
        combined = linear_from(torch.cat([lin.weight.detach() for lin in linears]),
                               torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None)
        combined.requires_grad_(False)
        first = nodes[0]
        name = _unique_name(gm, "_".join(n.target for n in nodes[:1]) + f"_merged{len(nodes)}")
        gm.add_submodule(name, combined)
        with gm.graph.inserting_before(first):
            out = gm.graph.call_module(name, (source,))
            parts = gm.graph.call_function(torch.split, (out, sizes), {"dim": -1})
            for i, node in enumerate(nodes):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
                piece.meta = dict(node.meta)
                node.replace_all_uses_with(piece)
        for node in nodes:
            gm.graph.erase_node(node)
        merged += 1
    return merged


def _shape(node) -> torch.Size | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return getattr(meta, "shape", None)


def _fuse_conv_add(gm: fx.GraphModule) -> int:
    fused = 0
    for node in list(gm.graph.nodes):
        conv = _module(gm, node)
        if not _is_fusable_conv(conv) or len(node.args) != 1:
            continue
        add = _only_user(node)
        if add is None or add.op != "call_function" or add.target not in _ADD_FUNCTIONS or add.kwargs:
            continue
        other = add.args[1] if add.args[0] is node else add.args[0]
        if not isinstance(other, fx.Node) or other is node or _shape(other) != _shape(node):
            continue
        last, activation = add, ("none", [], "")
        act_node = _only_user(add)
        if act_node is not None and (act := _activation_of(gm, act_node)) is not None:
            last, activation = act_node, act
        module = FusedConv2d(conv, activation, has_residual=True)
        # Placed where the last fused node was: the conv input and the residual both exist there.
        _replace_with_module(gm, last, last, module, (node.args[0], other), _unique_name(gm, f"{node.target}_add"))
        for dead in ([last, add] if last is not add else [add]):
            gm.graph.erase_node(dead)
        gm.graph.erase_node(node)
        fused += 1
    return fused


def _fuse_activations(gm: fx.GraphModule) -> int:
    fused = 0
    for node in list(gm.graph.nodes):
        layer = _module(gm, node)
        is_conv = _is_fusable_conv(layer)
        if not (is_conv or type(layer) is nn.Linear) or len(node.args) != 1:
            continue
        act_node = _only_user(node)
        activation = _activation_of(gm, act_node) if act_node is not None else None
        if activation is None and not is_conv:
            continue
        module = FusedConv2d(layer, activation or ("none", [], "")) if is_conv else FusedLinear(layer, activation)
        last = act_node if activation is not None else node
        _replace_with_module(gm, last, last, module, node.args, _unique_name(gm, f"{node.target}_fused"))
        if last is not node:
            gm.graph.erase_node(last)
        gm.graph.erase_node(node)
        fused += activation is not None
    return fused


def _align_linears(gm: fx.GraphModule, multiple: int) -> list[dict]:
    decisions = []
    for node in list(gm.graph.nodes):
        module = _module(gm, node)
        shape = _shape(node.args[0]) if node.args else None
        if not isinstance(module, (nn.Linear, FusedLinear)) or shape is None:
            continue
        activation = (module.attr, module.scalars, module.algorithm) if isinstance(module, FusedLinear) \
            else ("none", [], "")
        candidates = {"as is": module}
        if isinstance(module, nn.Linear):
            candidates["packed"] = FusedLinear(module, activation)
        if module.weight.shape[0] % multiple:
            candidates[f"padded to {multiple}"] = PaddedLinear(FusedLinear(padded_copy(module, multiple), activation),
                                                               module.weight.shape[0])
        if len(candidates) == 1:
            continue
        x = torch.randn(shape)
        times = {name: median_us(lambda m=m: m(x)) for name, m in candidates.items()}
        choice = min(times, key=times.get)
        if times[choice] > 0.95 * times["as is"]:
            choice = "as is"
        decisions.append({"name": node.target, "in_shape": list(shape), "out_features": module.weight.shape[0],
                          "us": {k: round(v, 1) for k, v in times.items()}, "choice": choice})
        if choice != "as is":
            _replace_with_module(gm, node, node, candidates[choice], node.args, _unique_name(gm, f"{node.target}_aligned"))
            gm.graph.erase_node(node)
    return decisions


def _to_channels_last(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        shape = _shape(node)
        if node.op == "placeholder" and shape is not None and len(shape) == 4:
            with gm.graph.inserting_after(node):
                converted = gm.graph.call_method("contiguous", (node,), {"memory_format": torch.channels_last})
            node.replace_all_uses_with(converted, delete_user_cb=lambda user: user is not converted)
    gm.to(memory_format=torch.channels_last)


def _prepack(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        module = _module(gm, node)
        if isinstance(module, FusedConv2d) and _shape(node.args[0]) is not None:
            module.prepack(list(_shape(node.args[0])))


def trace(model: nn.Module) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` with a one-line error for untraceable modules."""
    try:
        return fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...) for control flow
        raise FivefoldError(f"cannot trace {type(model).__name__} with torch.fx: {str(exc).splitlines()[0]}") from None


def fuse(model: nn.Module, example_inputs: tuple, config: FuseConfig = FuseConfig()) -> tuple[fx.GraphModule, FuseReport]:
    """Trace ``model`` (left unchanged) and return its fused copy with a :class:`FuseReport`.

    ``example_inputs`` fixes the shapes used to check residual adds and to prepack
    weights; other shapes still run. The model must be in eval mode (BN is folded with
    its running statistics).
    """
    if model.training:
        raise FivefoldError("fuse needs a model in eval mode (call model.eval()): BatchNorm folds running statistics")
    example_inputs = tuple(example_inputs)
    original = trace(model)
    gm = trace(copy.deepcopy(model))
    with torch.no_grad():
        ShapeProp(gm).propagate(*example_inputs)
        folded = _fold_batchnorms(gm) if config.fold_batchnorm else 0
        merged = _merge_parallel_linears(gm) if config.merge_parallel_linears else 0
        residuals = activations = 0
        layouts: list[dict] = []
        if _is_onednn_ready(gm):
            residuals = _fuse_conv_add(gm) if config.fuse_residual_add else 0
            activations = _fuse_activations(gm) if config.fuse_activations else 0
            if config.channels_last:
                _to_channels_last(gm)
            if config.prepack:
                _prepack(gm)
            if config.align_linears:
                layouts = _align_linears(gm, config.align_multiple)
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
        for node in gm.graph.nodes:
            # Annotations from the forward signature make torch.save of the GraphModule fail (torch 2.13).
            node.type = None
        gm.graph.lint()
        gm.recompile()
    before, after = count_kernels(model, example_inputs), count_kernels(gm, example_inputs)
    with torch.inference_mode():
        ref, out = model(*example_inputs), gm(*example_inputs)  # also warms oneDNN's primitive caches
    reorders = [count_onednn_primitives(m, example_inputs)["reorder"] for m in (model, gm)]
    diff, magnitude = _max_abs_diff(ref, out)
    report = FuseReport(_num_graph_ops(original), _num_graph_ops(gm), sum(before.values()), sum(after.values()),
                        num_layout_conversions(before), num_layout_conversions(after), *reorders, folded, merged,
                        residuals,
                        activations, diff, magnitude, layouts)
    return gm, report


def _max_abs_diff(a, b) -> tuple[float, float]:
    """Largest |a - b| over (nested) tensor outputs, and the largest |a|."""
    if isinstance(a, torch.Tensor):
        return float((a - b).abs().max()), float(a.abs().max())
    if isinstance(a, dict):
        a, b = list(a.values()), list(b.values())
    pairs = [_max_abs_diff(x, y) for x, y in zip(a, b)]
    return max(p[0] for p in pairs), max(p[1] for p in pairs)
