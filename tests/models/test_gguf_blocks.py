"""GGUF blocks unpacked at load time (fivefold/kernels/gguf_blocks.cpp: ``gguf_q4_unpack`` for
Q4_0 and Q4_1, ``gguf_q4_k_unpack``, ``gguf_q6_k_unpack``): on random blocks (every bit pattern of
the codes and 6-bit scales, finite float16 d and dmin of every magnitude, subnormals and signs
included) they give exactly what the loader's numpy path gives, which the GGUF tests check against
the gguf package's dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fivefold.kernels import gguf_block_ops
from fivefold.models.gguf_file import Q4_K_BYTES, Q6_K_BYTES, _q4_k_numpy, _q4_numpy, _q6_k_numpy, _tensor

pytestmark = pytest.mark.skipif(gguf_block_ops() is None, reason="the C++ kernels are not built on this machine")


def random_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite float16 values as raw bytes [n, 2]: random bit patterns (all exponents, subnormals
    and both signs) with inf and NaN redrawn as zero."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] = 0
    return bits.view(np.uint8).reshape(n, 2)


def random_blocks(rng: np.random.Generator, count: int, size: int, halves_at: tuple[int, ...]) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for at in halves_at:
        blocks[:, at:at + 2] = random_halves(rng, count)
    return blocks


@pytest.mark.parametrize("has_min", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_q4_0_and_q4_1_unpack_match_numpy(seed, has_min):
    rng = np.random.default_rng(200 + seed)
    for count in (1, 3, 1023, 1025, 5000):
        blocks = random_blocks(rng, count, 20 if has_min else 18, (0, 2) if has_min else (0,))
        got = gguf_block_ops().gguf_q4_unpack(_tensor(blocks), has_min)
        want = _q4_numpy(blocks, has_min)
        assert torch.equal(got[0], want[0]) and got[0].shape == (count, 32), count
        for g, w in zip(got[1:], want[1:]):  # the float16 scale (and minimum) bit for bit
            assert g.dtype == w.dtype == torch.float16 and torch.equal(g.view(torch.int16), w.view(torch.int16))
        assert got[2].numel() == (count if has_min else 0)


@pytest.mark.parametrize("seed", range(6))
def test_q4_k_unpack_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    for count in (1, 3, 255, 257, 1000):
        blocks = random_blocks(rng, count, Q4_K_BYTES, (0, 2))
        got = gguf_block_ops().gguf_q4_k_unpack(_tensor(blocks))
        with np.errstate(over="ignore"):  # d sc overflows float16 for the largest d, on both paths
            want = _q4_k_numpy(blocks)
        for name, g, w in zip(("codes", "sc", "m", "scale", "offset"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            # bitwise: float16 NaN-free, and -0.0 against 0.0 would be a different rounding path
            assert torch.equal(g.view(torch.int16) if g.dtype == torch.float16 else g,
                               w.view(torch.int16) if w.dtype == torch.float16 else w), (name, count)
        assert int(got[0].max()) <= 15 and int(got[1].max()) <= 63 and int(got[2].max()) <= 63


@pytest.mark.parametrize("seed", range(6))
def test_q6_k_unpack_matches_numpy(seed):
    rng = np.random.default_rng(100 + seed)
    for count in (1, 3, 255, 257, 1000):
        blocks = random_blocks(rng, count, Q6_K_BYTES, (208,))
        got_q, got_scale = gguf_block_ops().gguf_q6_k_unpack(_tensor(blocks))
        with np.errstate(over="ignore"):
            want_q, want_scale = _q6_k_numpy(blocks)
        assert got_q.dtype == torch.int8 and torch.equal(got_q, want_q), count
        assert got_scale.dtype == torch.float32 and torch.equal(got_scale.view(torch.int32),
                                                                 want_scale.view(torch.int32)), count
        assert int(got_q.min()) >= -32 and int(got_q.max()) <= 31


def test_unpack_refuses_a_partial_block():
    ops = gguf_block_ops()
    with pytest.raises(RuntimeError, match="gguf_q4_unpack: expects uint8 blocks of 20 bytes"):
        ops.gguf_q4_unpack(torch.zeros(18, dtype=torch.uint8), True)
    with pytest.raises(RuntimeError, match="gguf_q4_k_unpack: expects uint8 blocks of 144 bytes"):
        ops.gguf_q4_k_unpack(torch.zeros(145, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="gguf_q6_k_unpack: expects uint8 blocks of 210 bytes"):
        ops.gguf_q6_k_unpack(torch.zeros(210, dtype=torch.int8))
