"""What an op is (its category) and what it costs (FLOPs and bytes, from its input shapes).

Categories follow the levers: matmul and attention are where the arithmetic is;
norm, activation, elementwise and copy/layout are the small memory-bound ops that
fusion removes; sampling is the engine's; "overhead" is Python and the framework
(metadata ops such as view or empty, and the time between ops).
"""

from __future__ import annotations

import math

from fivefold.profile.roofline import OpCost

CATEGORIES = ("matmul", "attention", "norm", "activation", "elementwise", "copy/layout", "sampling", "overhead")

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_linear_pointwise", "_int_mm",
           "_weight_int8pack_mm", "addmv", "mv", "dot", "einsum", "conv1d", "conv2d", "convolution", "_convolution",
           "mkldnn_convolution", "int8_weight_linear", "stream_linear", "linear_dynamic", "qlinear_pointwise"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_attention_math", "paged_decode_attention", "tiled_attention", "softmax", "_softmax"}
_NORM = {"rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
         "_batch_norm_impl_index", "group_norm", "native_group_norm", "fused_add_rms_norm", "fused_add_rms_norm_"}
_ACTIVATION = {"silu", "silu_", "gelu", "gelu_", "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_",
               "hardswish", "leaky_relu", "elu", "softplus", "mish", "silu_and_mul"}
_COPY = {"copy_", "clone", "contiguous", "cat", "stack", "index", "index_select", "index_put_", "_index_put_impl_",
         "gather", "scatter", "scatter_", "to", "_to_copy", "repeat_interleave", "repeat", "embedding", "pad",
         "constant_pad_nd", "flip", "roll", "masked_select", "type_as", "tile"}
_FRAMEWORK = {"view", "reshape", "_unsafe_view", "_reshape_alias", "as_strided", "unsqueeze", "squeeze", "expand",
              "slice", "select", "t", "transpose", "permute", "narrow", "split", "split_with_sizes", "chunk", "unbind",
              "detach", "detach_", "alias", "resolve_conj", "resolve_neg", "result_type", "empty", "empty_like",
              "empty_strided", "lift_fresh", "item", "_local_scalar_dense", "is_nonzero", "size", "stride", "flatten",
              "unflatten", "view_as", "expand_as", "numpy_T", "set_", "lift_fresh_copy", "scalar_tensor", "tensor"}
_FUSED_ELEMENTWISE = {"rotary_qk_", "rotate_qk_"}  # our fused per-row kernels (RoPE; the int8 cache's key rotation)
_SAMPLING = {"argmax", "topk", "sort", "multinomial", "exponential_"}
SAMPLING_REGION = "fivefold::sampling"


def short_name(name: str) -> str:
    """``aten::add_`` -> ``add_``; ``mkldnn::_linear_pointwise`` -> ``_linear_pointwise``."""
    return name.rsplit("::", 1)[-1]


def category_of_name(name: str) -> str | None:
    """The category an op's own name implies; None for names we do not know."""
    op = short_name(name)
    for category, names in (("matmul", _MATMUL), ("attention", _ATTENTION), ("norm", _NORM),
                            ("activation", _ACTIVATION), ("copy/layout", _COPY), ("overhead", _FRAMEWORK),
                            ("sampling", _SAMPLING)):
        if op in names:
            return category
    if name.startswith("aten::") or op in _FUSED_ELEMENTWISE:
        return "elementwise"  # the remaining aten ops are pointwise maths and reductions
    return None


def categorize(chain: list[str]) -> str:
    """Category of an op given its names from the outermost ancestor down to itself.

    The outermost op that says something decides (``aten::rms_norm``'s inner ``pow`` is
    norm time), except that metadata ops do not: a ``reshape`` that copies is a copy. An
    op called inside the sampler's region is sampling.
    """
    if SAMPLING_REGION in chain:
        return "sampling"
    categories = [c for c in map(category_of_name, chain) if c is not None]
    for category in categories:
        if category != "overhead":
            return category
    return "overhead"


def _numel(shape) -> int:
    return math.prod(shape) if shape else 0


def op_cost(name: str, shapes: list[list[int]], elem_bytes: int) -> OpCost | None:
    """FLOPs and bytes of one call, from its input shapes; None when we have no model of it.

    Matmuls: 2*M*N*K FLOPs over inputs + output (weights at their own width: int8
    weights are 1 byte). Attention: QK^T and PV, 4*Lq*Lk*D per head; the paged decode
    kernel's context length is taken from its block table's width (an upper bound for
    the shorter sequences of a batch). Pointwise ops (leaves only): one FLOP per
    element over every input and the output.
    """
    op = short_name(name)
    s = [list(x) for x in shapes]
    try:
        if op in ("mm", "_int_mm") and len(s) >= 2:
            (m, k), (_, n) = s[0], s[1]
            in_bytes, out_bytes = (1, 4) if op == "_int_mm" else (elem_bytes, elem_bytes)
            return OpCost(2 * m * n * k, in_bytes * (m * k + k * n) + out_bytes * m * n)
        if op == "addmm" and len(s) >= 3:
            (m, k), (_, n) = s[1], s[2]
            return OpCost(2 * m * n * k, elem_bytes * (m * k + k * n + 2 * m * n))
        if op in ("bmm", "baddbmm"):
            a, b = (s[0], s[1]) if op == "bmm" else (s[1], s[2])
            (bt, m, k), n = a, b[2]
            return OpCost(2 * bt * m * n * k, elem_bytes * bt * (m * k + k * n + m * n))
        if op in ("_linear_pointwise", "linear", "_weight_int8pack_mm", "int8_weight_linear", "stream_linear"):
            x, w = s[0], s[1]
            k, m = x[-1], _numel(x[:-1])
            # [N, K] (or oneDNN's [K, N] view); the streaming kernels' packed [N, Kp / W, W].
            n = w[0] if len(w) == 3 or w[1] == k else w[1]
            w_bytes = 1 if op in ("_weight_int8pack_mm", "int8_weight_linear") else elem_bytes
            return OpCost(2 * m * n * k, elem_bytes * (m * k + m * n) + w_bytes * n * k)
        if op == "_scaled_dot_product_flash_attention_for_cpu" or op == "scaled_dot_product_attention":
            (b, h, lq, d), (_, hk, lk, _) = s[0], s[1]
            return OpCost(4 * b * h * lq * lk * d, elem_bytes * (2 * b * h * lq * d + 2 * b * hk * lk * d))
        if op == "paged_decode_attention":
            (num_seqs, h, d), cache, table = s[0], s[1], s[2]
            num_kv_heads, lk = cache[2], table[1] * cache[3]
            return OpCost(4 * num_seqs * h * lk * d, elem_bytes * (2 * num_seqs * h * d + 2 * num_seqs * num_kv_heads * lk * d))
    except (IndexError, ValueError, TypeError):
        return None
    if category_of_name(name) in ("norm", "activation", "elementwise", "copy/layout"):
        sizes = [_numel(x) for x in s if x]
        if not sizes:
            return None
        return OpCost(max(sizes), elem_bytes * (sum(sizes) + max(sizes)))
    return None
