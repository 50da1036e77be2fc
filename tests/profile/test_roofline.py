import json

import pytest

from fivefold.profile import roofline
from fivefold.profile.ops import categorize, op_cost
from fivefold.profile.roofline import MachinePeaks, OpCost, classify

PEAKS = MachinePeaks(bandwidth=10e9, flops={"float32": 100e9, "int8": 400e9})  # ridge at 10 FLOP/byte


def test_synthetic_ops_of_known_intensity_land_on_the_right_side_of_the_ridge():
    assert PEAKS.ridge() == 10.0 and PEAKS.ridge("int8") == 40.0
    streaming = classify(OpCost(flops=1e9, bytes=1e9), seconds=0.2, peaks=PEAKS)  # 1 FLOP/B
    assert streaming.is_memory_bound and streaming.bound == "memory"
    assert streaming.attainable_flops == pytest.approx(10e9)  # 1 FLOP/B x 10 GB/s
    assert streaming.utilisation == pytest.approx(0.5)  # 5 GFLOP/s achieved of 10
    assert streaming.achieved_bandwidth == pytest.approx(5e9)
    n = 2048
    gemm = classify(OpCost(2 * n**3, 4 * 3 * n * n), seconds=0.25, peaks=PEAKS)  # ~341 FLOP/B
    assert not gemm.is_memory_bound and gemm.attainable_flops == 100e9
    assert gemm.utilisation == pytest.approx(2 * n**3 / 0.25 / 100e9)
    at_ridge = classify(OpCost(10e9, 1e9), 1.0, PEAKS)
    assert not at_ridge.is_memory_bound  # the ridge itself counts as compute-bound
    # The same intensity is memory-bound for int8, whose compute roof is higher.
    assert classify(OpCost(20e9, 1e9), 1.0, PEAKS, "int8").is_memory_bound


def test_op_costs_from_shapes():
    assert op_cost("aten::mm", [[8, 16], [16, 32]], 4) == OpCost(2 * 8 * 16 * 32, 4 * (8 * 16 + 16 * 32 + 8 * 32))
    assert op_cost("aten::addmm", [[32], [8, 16], [16, 32], [], []], 4).flops == 2 * 8 * 16 * 32
    # A packed linear: x [2, 3, 16], weight [32, 16] -> M = 6.
    assert op_cost("mkldnn::_linear_pointwise", [[2, 3, 16], [32, 16], [], [], [], []], 2) == OpCost(
        2 * 6 * 32 * 16, 2 * (6 * 16 + 6 * 32) + 2 * 32 * 16)
    # The streaming kernels' packed weight [N, K / W, W] (W = 8 on AVX2): N is its first dimension.
    assert op_cost("fivefold::stream_linear", [[1, 576], [3072, 72, 8], [], []], 4) == OpCost(
        2 * 3072 * 576, 4 * (576 + 3072) + 4 * 3072 * 576)
    assert op_cost("fivefold::int8_weight_linear", [[1, 576], [960, 36, 16], [960], []], 4).bytes == 4 * (576 + 960) + 960 * 576
    assert op_cost("aten::_int_mm", [[8, 16], [16, 32]], 4) == OpCost(2 * 8 * 16 * 32, 8 * 16 + 16 * 32 + 4 * 8 * 32)
    # Paged decode: 2 sequences, 4 heads over 2 KV heads, head_dim 8, a 3-block table of 16-token blocks.
    cost = op_cost("fivefold::paged_decode_attention", [[2, 4, 8], [2, 100, 2, 16, 8], [2, 3], [2], []], 4)
    assert cost == OpCost(4 * 2 * 4 * 48 * 8, 4 * (2 * 2 * 4 * 8 + 2 * 2 * 2 * 48 * 8))
    assert op_cost("aten::add", [[4, 5], [4, 5], []], 4) == OpCost(20, 4 * 60)
    assert op_cost("aten::view", [[4, 5], []], 4) is None  # metadata: no work


def test_categories_follow_the_outermost_meaningful_op():
    assert categorize(["aten::rms_norm", "aten::_fused_rms_norm", "aten::pow"]) == "norm"
    assert categorize(["aten::reshape", "aten::clone", "aten::copy_"]) == "copy/layout"  # a reshape that copies
    assert categorize(["aten::view"]) == "overhead"
    assert categorize(["fivefold::iteration", "fivefold::sampling", "aten::softmax"]) == "sampling"
    assert categorize(["mkldnn::_linear_pointwise", "aten::empty"]) == "matmul"
    assert categorize(["fivefold::paged_decode_attention"]) == "attention"
    assert categorize(["aten::silu"]) == "activation" and categorize(["aten::mul"]) == "elementwise"


def test_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda: calls.append("bw") or 20e9)
    monkeypatch.setattr(roofline, "measure_flops", lambda dtype: calls.append(str(dtype)) or 50e9)
    cache = tmp_path / "peaks.json"
    first = roofline.measure_peaks(cache, dtypes=("float32",))
    assert first == MachinePeaks(20e9, {"float32": 50e9}) and calls == ["bw", "torch.float32"]
    assert roofline.measure_peaks(cache, dtypes=("float32",)) == first and len(calls) == 2  # from the cache
    roofline.measure_peaks(cache, dtypes=("float32", "bfloat16"))  # only the missing dtype is measured
    assert calls == ["bw", "torch.float32", "torch.bfloat16"]
    assert roofline.machine_key() in json.loads(cache.read_text())


def test_real_micro_benchmarks_give_plausible_peaks():
    bandwidth = roofline.measure_bandwidth(num_bytes=32 << 20, repeats=2)
    flops = roofline.measure_flops(size=256, repeats=2)
    assert 1e8 < bandwidth < 1e13 and 1e8 < flops < 1e14
