"""PackedLinear: the same numbers as nn.Linear for any row count, through a bounded set of
GEMM shapes (oneDNN caches a primitive and its buffer per shape; see row_pieces)."""
import pytest
import torch
from torch import nn

from fivefold.models import layers
from fivefold.models.layers import MAX_GEMM_ROWS, PackedLinear, row_pieces

pytestmark = pytest.mark.skipif(not PackedLinear.is_available(), reason="oneDNN packing unavailable")


def test_row_pieces_cover_the_rows_with_buckets_only():
    for rows in list(range(1, 300)) + [511, 512, 513, 1000, 2047, 2048, 2049, 4097, 5000]:
        pieces = row_pieces(rows)
        assert sum(n for n, _ in pieces) == rows
        for n, padded in pieces:
            assert padded in layers._ROW_BUCKETS and n <= padded <= MAX_GEMM_ROWS
            assert padded - n < 128
    assert len(layers._ROW_BUCKETS) <= 48


@pytest.mark.parametrize("rows", [1, 7, 9, 13, 65, 130, 700, 2048, 2100])
def test_output_matches_linear_and_gemm_sees_only_buckets(rows, monkeypatch):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96)
    packed = PackedLinear(linear)
    seen = []
    gemm = PackedLinear._gemm
    monkeypatch.setattr(PackedLinear, "_gemm", lambda self, x: (seen.append(x.numel() // 64), gemm(self, x))[1])
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-4)
    if rows <= packed.stream_max_rows:  # decode-sized: the streaming kernel on the row-major weight
        assert not seen and packed.stream_max_rows == layers.stream_max_rows(torch.float32)
    else:
        assert seen and all(r in layers._ROW_BUCKETS for r in seen)
