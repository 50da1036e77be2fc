"""The int8 KV cache's row layout (``EngineConfig.kv_cache_dtype="int8"``).

With an int8 cache a layer's cache is still one tensor, int8,
``[2 (K, V), num_blocks, num_kv_heads, block_size, head_dim + 4]``: each row (one token of one
KV head) is its ``head_dim`` int8 values followed by its float32 scale in the row's last 4 bytes.
Quantization is symmetric, per row (per token, per head)::

    scale = max(amax(|x|) / 127, SCALE_FLOOR)      q = clamp(round(x / scale), -127, 127)

so ``x ~ q * scale`` with an error of at most ``scale / 2`` per element. Keeping the scale in the
row means one row read brings its scale (what the paged kernels stream), and the rest of the code
keeps "one cache tensor per layer". The scale sits at byte ``head_dim`` of a row of
``head_dim + 4`` bytes, so it is 4-byte aligned only when ``head_dim % 4 == 0``, which
:func:`check_head_dim` requires. A row costs ``head_dim + 4`` bytes instead of ``4 * head_dim``
(float32): 3.8x the tokens per byte at head_dim 64.

The C++ kernels (fivefold/kernels/paged_attention.cpp, decode_loop.cpp) read and write the same
layout; :func:`quantize_rows` is the reference they are tested against.
"""

from __future__ import annotations

import functools

import torch

from fivefold.errors import FivefoldError

SCALE_BYTES = 4  # one float32 per row
# Scale of an all-zero row: division by it is safe, and its values quantize (and dequantize) to 0.
SCALE_FLOOR = 1e-12
QMAX = 127


def row_bytes(head_dim: int) -> int:
    """Bytes of one int8 cache row: the values and their scale."""
    return head_dim + SCALE_BYTES


def check_head_dim(head_dim: int) -> None:
    """Raise FivefoldError unless rows of ``head_dim`` values can carry an aligned float32 scale."""
    if head_dim % SCALE_BYTES != 0:
        raise FivefoldError(f"kv_cache_dtype='int8' needs head_dim % 4 == 0 (the row's float32 scale is stored "
                            f"after its values, and must be 4-byte aligned), got head_dim {head_dim}")


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def values(rows: torch.Tensor) -> torch.Tensor:
    """The int8 values of int8 rows ``[..., D + 4]``: a view ``[..., D]``."""
    return rows[..., :-SCALE_BYTES]


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales of int8 rows ``[..., D + 4]``: a view ``[...]`` into the rows' last 4 bytes."""
    return rows[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Float rows ``[..., D]`` -> int8 rows ``[..., D + 4]`` (values, then the float32 scale)."""
    check_head_dim(x.shape[-1])
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # Multiplications by reciprocals, as the C++ writer (decode_loop.cpp) computes them, so that both
    # write the same bytes.
    scale = (amax * (1.0 / QMAX)).clamp_(min=SCALE_FLOOR)  # [..., 1]
    q = torch.round(x * scale.reciprocal()).clamp_(-QMAX, QMAX).to(torch.int8)  # [..., D]
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)  # [..., D + 4]


@functools.lru_cache(maxsize=8)
def key_rotation(head_dim: int) -> torch.Tensor:
    """The orthonormal [D, D] matrix R by which an int8 cache's keys, and the queries that meet
    them, are rotated after RoPE (q R . k R = q . k, so attention is unchanged in exact arithmetic).

    Keys have a few channels far larger than the rest; with one scale per row those channels set
    the step and the others keep few levels. R spreads every channel over all of them (QuaRot's
    and SpinQuant's rotation, applied to the cache only), so the row's step fits its values
    evenly: on SmolLM2's held-out text, teacher-forced top-1 agreement with the float cache goes
    from 98.3% to 99.1% (tests/engine/test_kv_cache_int8.py). A normalised Walsh-Hadamard matrix
    when D is a power of two, else a fixed orthonormal matrix (QR of a seeded Gaussian). Values
    are not rotated: their error was already small (99.5% with only values in int8).
    """
    if head_dim & (head_dim - 1) == 0:
        r = torch.ones(1, 1)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        return r / head_dim ** 0.5
    gaussian = torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return torch.linalg.qr(gaussian)[0].float()


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., D + 4]`` -> ``[..., D]`` of ``dtype``: each value times its row's scale."""
    return (values(rows).float() * scales(rows).unsqueeze(-1)).to(dtype)
