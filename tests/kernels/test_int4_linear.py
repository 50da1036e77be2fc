"""fivefold::int4_linear, the 4-bit streaming linear: against a float64 reference of the dequantized
weights for every row count (the row groups and their remainder), group size (including a short
last group), symmetric and asymmetric codes, and N not a multiple of the channel tile; the
layouts round-trip exactly; bad operands are refused in one line. With int8 activations (W4A8):
the kernel quantizes rows to the same bytes as quantize_activations, computes what the float64
reference computes on those activations, and sums codes times activations exactly (against int64
on saturating operands: all-15 codes times -127/127). Runs on the forced-AVX2 leg too (Makefile
ISA_TESTS), where a step is 16 columns instead of 32 and the integer path is vpmaddubsw's, not
VNNI's. From 8 rows AVX-512 builds take the panel paths (pairs of tiles, chunks of columns, blocks
of 64 rows): the row counts 8-70, N = 37 and 44 (an odd tile left over) and K = 2336 (several
chunks, a partial last span) reach every part of them; from 16 rows with float activations
AVX-512 builds take panels.h's float panels of 32 channels (N = 64, 130: whole panels; 37, 44: one
panel and a rest of tiles; 3, 6: none), K = 2336 in blocks of 128 columns with groups of 32."""

import pytest
import torch

from fivefold.errors import FivefoldError
from fivefold.kernels import int4_ops
from fivefold.models.int4_linear import (
    Int4Format,
    Int4Levels,
    Int4Linear,
    Int4Quantized,
    dequantize_activations,
    dequantize_int4,
    pack_levels,
    pack_nibbles,
    quantize_activations,
    quantize_int4,
    unpack_levels,
    unpack_nibbles,
)
from fivefold.models import int4_linear
from fivefold.models.layers import ROW_TILES_MAX_ROWS


def _codes(n, k, group, symmetric, gen):
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, groups, generator=gen) / 20 + 1e-3).half()
    offset = None if symmetric else (torch.randn(n, groups, generator=gen) / 10).half()
    return q, scale, offset


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 11, 13, 17, 64, 70])
@pytest.mark.parametrize("n,k,group", [(64, 576, 32), (37, 576, 128), (6, 256, 64), (130, 512, 256), (3, 96, 64),
                                       (44, 2336, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_linear_matches_float64(rows, n, k, group, symmetric):
    ops = int4_ops()
    assert ops is not None, "the int4 kernel must build here"
    gen = torch.Generator().manual_seed(rows * 1000 + n + k + group + symmetric)
    q, scale, offset = _codes(n, k, group, symmetric, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    w = ops.int4_pack(q)
    assert torch.equal(ops.int4_unpack(w), q)  # every code where the layout says
    s = ops.int4_pack_groups(scale, True)
    o = None if offset is None else ops.int4_pack_groups(offset, True)
    assert torch.equal(ops.int4_pack_groups(s, False), scale)
    y = ops.int4_linear(x, w, s, o, bias)
    ref = x.double() @ dequantize_int4(q, scale, offset, group).double().t() + bias.double()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("n,k,group", [(64, 576, 32), (36, 576, 128), (8, 2048, 256), (37, 96, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_few_rows_are_as_exact_as_float32(rows, n, k, group, symmetric):
    """1-7 rows (AVX-512 VNNI: each group of a row as 24-bit integers, split in two 16-bit halves,
    summed exactly by vpdpwssd; elsewhere float FMAs): within float32's own rounding of the float64
    result, on rows whose groups mix magnitudes 1e-4 to 1e3 (a dropped or misplaced half, or a
    column matched to the wrong activation, is off by orders of magnitude more)."""
    ops = int4_ops()
    gen = torch.Generator().manual_seed(rows * 7919 + n + k + group + symmetric)
    q, scale, offset = _codes(n, k, group, symmetric, gen)
    x = torch.randn(rows, k, generator=gen) * 10.0 ** torch.randint(-4, 4, (rows, k), generator=gen)
    w = dequantize_int4(q, scale, offset, group).double()
    y = ops.int4_linear(x, ops.int4_pack(q), ops.int4_pack_groups(scale, True),
                        None if offset is None else ops.int4_pack_groups(offset, True), None)
    ref = x.double() @ w.t()
    # float32's rounding: of each product's terms, and of each group's largest activation
    groups = -(-k // group)
    xg = torch.nn.functional.pad(x.abs().double(), (0, groups * group - k)).view(rows, groups, group)
    wg = torch.nn.functional.pad(w.abs(), (0, groups * group - k)).view(n, groups, group)
    bound = 2.0 ** -24 * (x.abs().double() @ w.abs().t() + xg.amax(-1) @ wg.sum(-1).t())
    err = (y.double() - ref).abs()
    assert bool((err <= 16 * bound + 1e-30).all()), float((err / bound).max())


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("group", [32, 128])
def test_one_row_of_integers_is_summed_exactly(rows, group):
    """The row left to tile_row_digits (1 row; the 5th of 5) writes each group as three signed bytes
    of a 24-bit integer. Integer activations whose group maximum is the largest such integer
    (8355711) are taken as they are, so with scales 1 and offsets 0 the product is the int64 sum,
    up to float32's rounding of the per-group partial sums. The other activations stay under 2^17,
    so the two low byte planes carry them: one dropped or misplaced is off by far more."""
    ops = int4_ops()
    n, k = 37, 576
    gen = torch.Generator().manual_seed(rows * 31 + group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    x = torch.randint(-(2 ** 17), 2 ** 17, (rows, k), generator=gen)
    x[:, ::group] = 8355711 * (1 - 2 * torch.randint(0, 2, (rows, len(range(0, k, group))), generator=gen))
    groups = -(-k // group)
    y = ops.int4_linear(x.float(), ops.int4_pack(q), ops.int4_pack_groups(torch.ones(n, groups, dtype=torch.float16), True),
                        ops.int4_pack_groups(torch.zeros(n, groups, dtype=torch.float16), True), None)
    want = x @ q.long().t()
    bound = 2.0 ** -20 * (x.abs() @ q.long().t()).double()
    assert bool(((y.double() - want.double()).abs() <= bound).all()), float(((y.double() - want.double()).abs() / bound).max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64, 70])
@pytest.mark.parametrize("n,k,group", [(64, 576, 32), (37, 576, 128), (6, 256, 64), (130, 512, 256), (3, 96, 32),
                                       (44, 2336, 32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_activations_match_float64_on_the_quantized_rows(rows, n, k, group, symmetric):
    ops = int4_ops()
    gen = torch.Generator().manual_seed(rows * 1000 + n + k + group + symmetric + 1)
    q, scale, offset = _codes(n, k, group, symmetric, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(k, generator=gen) * 4  # uneven blocks
    x[0, :32] = 0.0  # an all-zero block: scale 0
    w, s = ops.int4_pack(q), ops.int4_pack_groups(scale, True)
    o = None if offset is None else ops.int4_pack_groups(offset, True)
    xq, xs = quantize_activations(x)
    ref = dequantize_activations(xq, xs).double() @ dequantize_int4(q, scale, offset, group).double().t() + bias.double()
    y = ops.int4_linear(x, w, s, o, bias, True)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(ops.int4_linear_int8(xq, xs, w, s, o, bias).double(), ref, rtol=1e-5,
                               atol=1e-5 * k ** 0.5)


def _levels(n, k, gen, lo=0, hi=64):
    """Random Q4_K levels of a weight [n, k]: sc and m in [lo, hi), d and dmin float16 around 1e-3."""
    return Int4Levels(torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=gen),
                      torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=gen),
                      (torch.rand(n, k // 256, generator=gen) * 2e-3 + 1e-5).half(),
                      (torch.rand(n, k // 256, generator=gen) * 2e-3).half())


def _level_weights(q, levels):
    """d sc_j q - dmin m_j in float64: the weights a Q4_K super-block means, no rounding."""
    scale = levels.d.double().repeat_interleave(8, 1) * levels.sc.double()
    offset = -levels.dmin.double().repeat_interleave(8, 1) * levels.m.double()
    return q.double() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)


def test_pack_levels_round_trips():
    gen = torch.Generator().manual_seed(3)
    for n, k in [(4, 256), (36, 512), (8, 4096)]:
        levels = _levels(n, k, gen)
        packed = pack_levels(levels)
        assert packed.dtype == torch.uint8 and packed.shape == (n, k // 256 * 20)
        back = unpack_levels(packed)
        for field in ("sc", "m", "d", "dmin"):
            assert torch.equal(getattr(back, field), getattr(levels, field)), field
        # a tile's first super-block: d [4] and dmin [4] float16, then sc_j [4] and m_j [4] for j = 0..7
        tile = packed[:4].reshape(-1)[:80]
        assert torch.equal(tile[:8].view(torch.float16), levels.d[:4, 0])
        assert torch.equal(tile[8:16].view(torch.float16), levels.dmin[:4, 0])
        assert torch.equal(tile[16:].reshape(8, 2, 4)[:, 0], levels.sc[:4, :8].t())
        assert torch.equal(tile[16:].reshape(8, 2, 4)[:, 1], levels.m[:4, :8].t())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 64, 70])
@pytest.mark.parametrize("n,k", [(64, 256), (36, 1024), (8, 4096)])
def test_q4_k_levels_times_int8_activations_match_float64(rows, n, k):
    """Q4_K's two levels as stored (sc, m per 32, d, dmin per 256): the float64 product of the
    quantized rows and the exact weights d sc_j q - dmin m_j, at the row tiles (1-8 rows, AVX-512
    VNNI; AVX2 to 9) and the panels (from 9 and 10 rows); the one-level float16 form of the same
    weights within its rounding."""
    ops = int4_ops()
    gen = torch.Generator().manual_seed(rows * 100 + n + k)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    levels = _levels(n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(k, generator=gen) * 4
    w, packed = ops.int4_pack(q), pack_levels(levels)
    xq, xs = quantize_activations(x)
    ref = dequantize_activations(xq, xs).double() @ _level_weights(q, levels).t() + bias.double()
    y = ops.int4_linear(x, w, packed, None, bias, True)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    torch.testing.assert_close(ops.int4_linear_int8(xq, xs, w, packed, None, bias).double(), ref, rtol=1e-5,
                               atol=1e-5 * k ** 0.5)
    one_level = ops.int4_linear(x, w, ops.int4_pack_groups(levels.scale(), True),
                                ops.int4_pack_groups(levels.offset(), True), bias, True)
    torch.testing.assert_close(one_level, y, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("rows", [1, 4, 6, 12])
def test_q4_k_level_sums_are_exact_on_saturating_operands(rows):
    """Codes 15 and 0, sc = m = 1 and d = dmin = 1 against activations -127 and 127 (d = 1): every
    output is the int64 sum of q x - x exactly (K = 2048: at most 2048 x 16 x 127 < 2^24)."""
    ops = int4_ops()
    n, k = 36, 2048
    q = torch.full((n, k), 15, dtype=torch.uint8)
    q[1::3, ::2] = 0
    q[2::5] = torch.randint(0, 16, (len(range(2, n, 5)), k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    _, x = saturating_operands(n, k, 0, 15, rows, seed=2)
    ones = torch.ones(n, k // 256, dtype=torch.float16)
    levels = Int4Levels(torch.ones(n, k // 32, dtype=torch.uint8), torch.ones(n, k // 32, dtype=torch.uint8), ones, ones)
    y = ops.int4_linear(x, ops.int4_pack(q), pack_levels(levels), None, None, True)
    want = x.long() @ (q.long() - 1).t()
    assert torch.equal(y.double(), want.double())


def test_q4_k_levels_refuse_what_they_cannot_take():
    ops = int4_ops()
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (8, 512), dtype=torch.uint8, generator=gen)
    packed = pack_levels(_levels(8, 512, gen))
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="need int8 activations"):
        ops.int4_linear(x, ops.int4_pack(q), packed, None, None, False)
    with pytest.raises(RuntimeError, match="two-level scales must be uint8"):
        ops.int4_linear(x, ops.int4_pack(q), packed[:, :20], None, None, True)
    with pytest.raises(RuntimeError, match="hold their minimums"):
        ops.int4_linear(x, ops.int4_pack(q), packed, ops.int4_pack_groups(torch.ones(8, 16, dtype=torch.float16), True),
                        None, True)


def test_kernel_quantizes_rows_to_the_reference_bytes():
    """With identity codes (scale 1, offset 0) the W4A8 product is the dequantized activations
    themselves: every code and scale the kernel chose, compared exactly (ties to even included)."""
    ops = int4_ops()
    k = 256
    eye = torch.eye(k, dtype=torch.uint8)
    w = ops.int4_pack(eye)
    ones = ops.int4_pack_groups(torch.ones(k, k // 32, dtype=torch.float16), True)
    zeros = ops.int4_pack_groups(torch.zeros(k, k // 32, dtype=torch.float16), True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, k, generator=gen) * 3
    x[1, :32] = torch.arange(32) - 15.5  # halves: x / scale lands on .5 for some, ties to even
    x[2, :32] = 127 * torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5] * 6 + [127.0, -127.0]) / 127
    y = ops.int4_linear(x, w, ones, zeros, None, True)
    assert torch.equal(y, dequantize_activations(*quantize_activations(x)))


@pytest.mark.parametrize("rows", [4, 6, 12])
@pytest.mark.parametrize("symmetric", [True, False])
def test_integer_sums_are_exact_on_saturating_operands(symmetric, rows):
    """Codes 15 (and 0) against activations -127 and 127, scales 1: every output is the int64 dot
    product exactly (K = 4096: sums up to 7.8e6, integers float32 holds). On AVX2, vpmaddubsw adds
    pairs of u8 x s8 products into int16 with saturation: 15 x 127 x 2 per pair, four pairs per
    block summed before widening, stay under 32767, which these operands reach the closest to.
    4 rows take one tile_a8, 6 two (4 + 2 with AVX-512, 2 + 2 + 2 with AVX2), 12 (the 6 rows
    twice) the panels with AVX-512 VNNI and AVX2 (groups of 32 from 9 and 10 rows)."""
    ops = int4_ops()
    n, k = 37, 4096
    q = torch.full((n, k), 15, dtype=torch.uint8)
    q[1::3, ::2] = 0
    q[2::5] = torch.randint(0, 16, (len(range(2, n, 5)), k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    xq = torch.full((6, k), -127, dtype=torch.int8)
    xq[1] = 127
    xq[2, ::2] = 127
    xq[3] = torch.randint(-127, 128, (k,), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    xq[4, ::4] = 0
    xq[5, 5::7] = 127
    xq = xq.repeat(2, 1)[:rows]
    scale = ops.int4_pack_groups(torch.ones(n, k // 32, dtype=torch.float16), True)
    offset = None if symmetric else ops.int4_pack_groups(torch.zeros(n, k // 32, dtype=torch.float16), True)
    y = ops.int4_linear_int8(xq, torch.ones(rows, k // 32), ops.int4_pack(q), scale, offset, None)
    want = xq.long() @ (q.long() - (8 if symmetric else 0)).t()
    assert bool((want.abs() < 2 ** 24).all())
    assert torch.equal(y.double(), want.double())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 17, 64, 70])
@pytest.mark.parametrize("n,k,group", [(64, 576, 32), (67, 576, 32), (6, 256, None), (3, 96, 32), (67, 576, 16),
                                       (3, 96, 16), (16, 256, None), (24, 576, 64), (19, 2080, 32), (16, 2080, 16)])
def test_int8_weights_times_int8_activations_match_float64(rows, n, k, group):
    """fivefold::int8_weight_linear_a8 (a GGUF's Q8_0 or Q6_K served as stored): stream_pack's int8
    weights, a scale per group of 32, of 16 or per channel, times the rows quantized per block of 32.
    With AVX-512 VNNI, pairs of full tiles take the panels from 10 rows, 8 for groups of 16 (17, 64,
    70; tile_q8 the rest): K = 2080 is three chunks of spans, the last span part-filled, as K = 576's is; 70 rows
    two blocks of rows. With AVX-512, tile_q8 takes 5-8 rows in one tile (7, 8)."""
    from fivefold.kernels import stream_ops

    gen = torch.Generator().manual_seed(rows + n + k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) / 50 if group else torch.rand(n, generator=gen) / 50
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(k, generator=gen) * 4
    wf = w.double() * (scale.double().repeat_interleave(group, dim=1) if group else scale.double()[:, None])
    ref = dequantize_activations(*quantize_activations(x)).double() @ wf.t() + bias.double()
    y = int4_ops().int8_weight_linear_a8(x, stream_ops().stream_pack(w), scale, bias)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("rows", [1, 5, 12])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("n,k", [(67, 576), (3, 96), (8, 1024)])
def test_q8_scales_in_float16_tile_order_give_the_float32_results(rows, n, k, group):
    """Group scales float16 holds exactly, passed in int4_pack_groups' tile-major order (how a
    GGUF's Q8_0 layer holds them), give bit for bit what the float32 row-major table gives, in both
    the int8-activation kernel and the float one (stream_linear), narrow last tiles included; 12 rows
    take the panels with AVX-512 VNNI, which read the two tables differently (permutes, gathers).
    Groups of 16 (Q6_K's, when float16 holds its scales) through tile_q8: equal within rounding."""
    from fivefold.kernels import stream_ops

    gen = torch.Generator().manual_seed(rows * n + k)
    w = stream_ops().stream_pack(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen))
    scale = (torch.rand(n, k // group, generator=gen) / 50).half().float()
    packed = int4_ops().int4_pack_groups(scale, True)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    y16, y32 = int4_ops().int8_weight_linear_a8(x, w, packed, bias), int4_ops().int8_weight_linear_a8(x, w, scale, bias)
    if group == 32:
        assert torch.equal(y16, y32)
    else:  # tile_q8's two half-block sums: the build may contract them in either order
        torch.testing.assert_close(y16, y32, rtol=1e-6, atol=1e-6)
    assert torch.equal(stream_ops().stream_linear(x, w, packed, bias), stream_ops().stream_linear(x, w, scale, bias))


def saturating_operands(n: int, k: int, lo: int, hi: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights at their range's ends (lo, hi, -hi) against activation rows at -127 and 127 (every
    block's amax 127, so d = 1), plus one random row with 127 in each block: 4 patterns, repeated
    to ``rows``."""
    w = torch.full((n, k), lo, dtype=torch.int8)
    w[1::2] = hi
    w[2::5, ::3] = -hi
    x = torch.full((4, k), 127.0)
    x[1] = -127
    x[2, ::2] = -127
    x[3] = torch.randint(-127, 128, (k,), generator=torch.Generator().manual_seed(seed)).float()
    x[3, ::32] = 127
    return w, x.repeat(3, 1)[:rows]


@pytest.mark.parametrize("rows", [4, 7, 12])
@pytest.mark.parametrize("group", [32, 16])
def test_int8_weight_sums_are_exact_on_saturating_operands(group, rows):
    """Weights -128 and 127 against activations -127 and 127 (every block's amax 127, so d = 1),
    scales 1: the int64 dot product exactly. VNNI adds 128 to each weight and folds 128 x sum(x)
    back out; AVX2 multiplies |w| by x * sign(w), whose pairs stay under 32767 even at w = -128."""
    from fivefold.kernels import stream_ops

    # sums up to 1024 x 128 x 127 < 2^24: exact in float32. 4 and 7 rows: tile_q8 (7: one tile with
    # AVX-512); 12 (VNNI) the panels for the first 32 channels, tile_q8 the rest
    n, k = 36, 1024
    w, x = saturating_operands(n, k, -128, 127, rows, seed=2)
    # groups of 16 (Q6_K): each half block its own dot product, VNNI's +128 folded per half
    y = int4_ops().int8_weight_linear_a8(x, stream_ops().stream_pack(w), torch.ones(n, k // group), None)
    assert torch.equal(y.double(), (x.long() @ w.long().t()).double())


def test_q6_pack_round_trips_and_refuses_what_it_cannot_hold():
    """fivefold::q6_pack holds stream_pack's int8 weights in [-32, 31] (GGUF Q6_K's codes) in 3/4 of
    their bytes, and q6_unpack gives the same layout back byte for byte; codes outside 6 bits, or a
    narrower last tile, are refused with the limit named."""
    from fivefold.kernels import stream_ops

    ops = int4_ops()
    gen = torch.Generator().manual_seed(6)
    for n, k in ((4, 32), (8, 256), (36, 1024), (64, 2080)):
        stream = stream_ops().stream_pack(torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen))
        six = ops.q6_pack(stream)
        assert six.dtype == torch.uint8 and tuple(six.shape) == (n, 3 * k // 4)
        assert torch.equal(ops.q6_unpack(six), stream)
    for bad in (32, -33):
        w = torch.zeros(8, 64, dtype=torch.int8)
        w[3, 17] = bad
        with pytest.raises(RuntimeError, match=r"\[-32, 31\]"):
            ops.q6_pack(stream_ops().stream_pack(w))
    with pytest.raises(RuntimeError, match="multiple of 4"):
        ops.q6_pack(stream_ops().stream_pack(torch.zeros(6, 64, dtype=torch.int8)))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 12, 17, 64, 70])
@pytest.mark.parametrize("n,k,group", [(64, 576, 16), (16, 2080, 16), (8, 1024, 32), (36, 256, None)])
def test_six_bit_weights_times_int8_activations_match_float64(rows, n, k, group):
    """Q6_K's codes held at 6 bits (q6_pack) through int8_weight_linear_a8: tile_q8 (every ISA, u = w
    + 32 unsigned: no sign trick) and, with AVX-512 VNNI, the panels from 5 rows unpack the same
    weights the int8 form holds: the float64 product, and the int8 form's result within float
    rounding (the lanes start from other folds)."""
    from fivefold.kernels import stream_ops

    gen = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) / 50).half() if group else torch.rand(n, generator=gen) / 50
    packed_scale = int4_ops().int4_pack_groups(scale, True) if group else scale
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen) * torch.rand(k, generator=gen) * 4
    wf = w.double() * (scale.double().repeat_interleave(group, dim=1) if group else scale.double()[:, None])
    ref = dequantize_activations(*quantize_activations(x)).double() @ wf.t() + bias.double()
    stream = stream_ops().stream_pack(w)
    y = int4_ops().int8_weight_linear_a8(x, int4_ops().q6_pack(stream), packed_scale, bias)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    int8_form = int4_ops().int8_weight_linear_a8(x, stream, packed_scale, bias)
    torch.testing.assert_close(y, int8_form, rtol=1e-5, atol=2e-6 * float(int8_form.abs().max()))


@pytest.mark.parametrize("rows", [4, 12])
@pytest.mark.parametrize("group", [32, 16])
def test_six_bit_weight_sums_are_exact_on_saturating_operands(group, rows):
    """Weights -32 and 31 against activations -127 and 127 (d = 1), scales 1, held at 6 bits: the
    int64 dot product exactly. u = w + 32 <= 63 enters vpdpbusd or vpmaddubsw unsigned (a pair at
    most 2 x 63 x 127 = 16002 < 32767) and 32 x sum(x) is folded back out (per half with groups of 16)."""
    from fivefold.kernels import stream_ops

    n, k = 40, 1024  # 4 rows: tile_q8; 12 (VNNI) the panels for the first 32 channels, tile_q8 the rest
    w, x = saturating_operands(n, k, -32, 31, rows, seed=3)
    six = int4_ops().q6_pack(stream_ops().stream_pack(w))
    y = int4_ops().int8_weight_linear_a8(x, six, torch.ones(n, k // group), None)
    assert torch.equal(y.double(), (x.long() @ w.long().t()).double())


def test_int8_activations_refuse_what_they_cannot_take():
    ops = int4_ops()
    gen = torch.Generator().manual_seed(4)
    q, scale, _ = _codes(8, 64, 32, True, gen)
    w, s = ops.int4_pack(q), ops.int4_pack_groups(scale, True)
    with pytest.raises(RuntimeError, match="xq must be int8"):
        ops.int4_linear_int8(torch.zeros(2, 64), torch.ones(2, 2), w, s, None, None)
    with pytest.raises(RuntimeError, match="d must be float32"):
        ops.int4_linear_int8(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 3), w, s, None, None)
    with pytest.raises(FivefoldError, match="multiple of 32, got 48"):
        quantize_activations(torch.randn(2, 48))
    with pytest.raises(FivefoldError, match="activations must be one of float, int8"):
        Int4Format(activations="int4")


@pytest.mark.parametrize("n,k,group,symmetric", [(64, 576, 32, True), (37, 576, 128, False), (3, 96, 64, False)])
def test_kernel_dequantizes_to_the_correctly_rounded_weights(n, k, group, symmetric):
    """fivefold::int4_dequantize (float activations at prefill sizes) writes scale * q + offset
    rounded once, as an FMA does: equal to the float64 value rounded to float32, every element."""
    ops = int4_ops()
    q, scale, offset = _codes(n, k, group, symmetric, torch.Generator().manual_seed(n + k))
    w = ops.int4_dequantize(ops.int4_pack(q), ops.int4_pack_groups(scale, True),
                            None if offset is None else ops.int4_pack_groups(offset, True))
    s = scale.double().repeat_interleave(group, dim=1)[:, :k]
    o = -8 * s if offset is None else offset.double().repeat_interleave(group, dim=1)[:, :k]
    assert torch.equal(w, (q.double() * s + o).float())


def test_dequantize_matches_the_formula_elementwise():
    """w = scale * q + offset, and scale * (q - 8) when symmetric, group by group (the last short)."""
    gen = torch.Generator().manual_seed(0)
    q, scale, offset = _codes(3, 96, 64, False, gen)
    w = dequantize_int4(q, scale, offset, 64)
    for col in (0, 63, 64, 95):
        g = col // 64
        assert torch.equal(w[:, col], scale[:, g].float() * q[:, col].float() + offset[:, g].float())
    ws = dequantize_int4(q, scale, None, 64)
    assert torch.equal(ws[:, 70], scale[:, 1].float() * (q[:, 70].float() - 8))


def test_int4_linear_keeps_bf16_activations_and_refuses_bad_input():
    ops = int4_ops()
    gen = torch.Generator().manual_seed(1)
    q, scale, _ = _codes(8, 64, 32, True, gen)
    w, s = ops.int4_pack(q), ops.int4_pack_groups(scale, True)
    x = torch.randn(2, 64).to(torch.bfloat16)
    y = ops.int4_linear(x, w, s, None, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float() @ dequantize_int4(q, scale, None, 32).t(), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.int4_linear(torch.randn(2, 128), w, s, None, None)
    with pytest.raises(RuntimeError, match="must come from this build's int4_pack"):
        ops.int4_linear(torch.randn(2, 64), q, s, None, None)  # unpacked codes
    with pytest.raises(RuntimeError, match="groups do not split K"):
        ops.int4_linear(torch.randn(2, 64), w, ops.int4_pack_groups(scale.repeat(1, 3)[:, :3], True), None, None)
    with pytest.raises(RuntimeError, match="values must be in 0..15"):
        ops.int4_pack(q + 16)
    with pytest.raises(RuntimeError, match="must be a multiple of"):
        ops.int4_pack(torch.zeros(4, 40, dtype=torch.uint8))


def test_nibble_packing_round_trips():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=gen)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 32) and packed[0, 0] == q[0, 0] | (q[0, 1] << 4)
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_error_is_within_half_a_step(symmetric, group):
    """Every weight is within half a quantization step of its code (plus the float16 rounding of
    the scale and offset, and the symmetric grid's one clipped level on the far side)."""
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(48, 576, generator=gen) / 10
    w[0, :7] = 0.0  # a group partly constant
    w[1, :group] = 0.25  # a constant group: scale 0 must not divide by zero
    fmt = Int4Format(group_size=group, symmetric=symmetric)
    qz = quantize_int4(w, fmt)
    assert qz.q.dtype == torch.uint8 and int(qz.q.max()) <= 15
    err = (qz.dequantize() - w).abs()
    step = qz.scale.float().abs().repeat_interleave(group, dim=1)[:, :576]
    bound = (step if symmetric else step / 2) * 1.01 + 1e-3 * w.abs()
    assert bool((err <= bound + 1e-6).all()), float((err - bound).max())
    assert float(err[1, :group].max()) < 1e-3
    # 4 bits in groups of 32 of Gaussian weights: ~20 dB SQNR (asymmetric), at least 17 dB symmetric
    from fivefold.models.int8_primitives import sqnr_db

    assert sqnr_db(w, qz.dequantize()) > (17 if symmetric else 18) - 2 * (group // 64)


@pytest.mark.parametrize("rows", [1, 5, 64, 65, 200, 1100])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_int4_module_matches_its_dequantized_weight(rows, symmetric, activations, monkeypatch):
    """The kernel (row tiles, panels) and, above 64 rows, the dequantized-tile GEMM (float
    activations where the build has no panels for them; forced here) both compute
    x @ dequantized(W).T + b (x as int8 activations see it, with int8 activations); the state dict
    is the checkpoint form and loads back exactly."""
    gen = torch.Generator().manual_seed(rows + 7 * symmetric)
    linear = torch.nn.Linear(576, 4101 + 3, bias=True)  # N not a multiple of the tile or of DEQUANT_TILE
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / 20)
    module = Int4Linear.from_float(linear, Int4Format(group_size=128, symmetric=symmetric, activations=activations))
    scheme = "w4a8" if activations == "int8" else "w4a16"
    assert module.kernel == f"fivefold-{scheme}" and module.qweight is None  # one copy: the kernel's layout
    x = torch.randn(rows, 576, generator=gen)
    xin = dequantize_activations(*quantize_activations(x)) if activations == "int8" else x
    ref = xin.double() @ module.dequantized_weight().double().t() + linear.bias.double()
    torch.testing.assert_close(module(x).double(), ref, rtol=1e-4, atol=1e-3)
    if rows > ROW_TILES_MAX_ROWS:
        with monkeypatch.context() as m:
            m.setattr(int4_linear, "quantized_kernel_max_rows", lambda bits: ROW_TILES_MAX_ROWS)
            torch.testing.assert_close(module(x).double(), ref, rtol=1e-4, atol=1e-3)
    state = module.state_dict()
    assert state["qweight"].shape == (4104, 288) and state["scale"].dtype == torch.float16
    assert ("offset" in state) != symmetric
    again = Int4Linear(576, 4104, True, Int4Format(group_size=128, symmetric=symmetric, activations=activations))
    again.load_state_dict(state)
    assert torch.equal(again.dequantized_weight(), module.dequantized_weight())
    assert torch.equal(again(x), module(x))


def test_bad_formats_are_refused_in_one_line():
    with pytest.raises(FivefoldError, match="group_size must be one of 32, 64, 128, 256"):
        Int4Format(group_size=48)
    with pytest.raises(FivefoldError, match="multiple of 32, got 100"):
        quantize_int4(torch.randn(4, 100), Int4Format(group_size=32))
    gen = torch.Generator().manual_seed(3)
    q, scale, offset = _codes(4, 64, 32, False, gen)
    with pytest.raises(FivefoldError, match="do not fit"):
        Int4Linear.from_quantized(Int4Quantized(q, scale[:, :1], offset[:, :1], 32))
