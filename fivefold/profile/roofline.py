"""The roofline: this machine's limits, measured, and where an op sits under them.

An op doing ``flops`` arithmetic over ``bytes`` of memory traffic has arithmetic
intensity I = flops / bytes. The machine can sustain at most
``min(peak_flops, I * peak_bandwidth)``; the intensity where the two meet is the
ridge point. Below the ridge an op is memory-bound (more arithmetic per byte, i.e.
fusion, a better layout or fewer bytes per weight, is what helps); above it,
compute-bound (fewer operations: quantization to faster arithmetic, slimming the
model). The share of that bound an op achieves says how good its kernel is.

Peaks are measured by micro-benchmarks (a large copy and a reduction for bandwidth, a
square GEMM for FLOP/s) and cached per machine, torch version and thread count in
``$FIVEFOLD_CACHE/peaks.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.paths import peaks_file

BANDWIDTH_BYTES = 256 << 20  # well past any last-level cache
GEMM_SIZE = 2048


@dataclass(frozen=True)
class MachinePeaks:
    """Sustained limits of this machine: bytes/s streamed from memory, FLOP/s per dtype."""

    bandwidth: float  # bytes/s
    flops: dict[str, float]  # dtype name -> FLOP/s

    def peak_flops(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["float32"])

    def ridge(self, dtype: str = "float32") -> float:
        """The intensity (FLOP/byte) where the memory and compute roofs meet."""
        return self.peak_flops(dtype) / self.bandwidth


@dataclass(frozen=True)
class OpCost:
    """Work of one op call: floating-point (or integer) operations and bytes moved."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


@dataclass(frozen=True)
class RooflinePoint:
    intensity: float  # FLOP/byte
    achieved_flops: float  # FLOP/s
    achieved_bandwidth: float  # bytes/s
    attainable_flops: float  # FLOP/s the roofline allows at this intensity
    is_memory_bound: bool

    @property
    def utilisation(self) -> float:
        """Achieved share of the roofline at this intensity (0..1, can exceed 1 when caches help)."""
        return self.achieved_flops / self.attainable_flops if self.attainable_flops else 0.0

    @property
    def bound(self) -> str:
        return "memory" if self.is_memory_bound else "compute"


def classify(cost: OpCost, seconds: float, peaks: MachinePeaks, dtype: str = "float32") -> RooflinePoint:
    """Place ``cost`` done in ``seconds`` on this machine's roofline."""
    intensity = cost.intensity
    peak = peaks.peak_flops(dtype)
    attainable = min(peak, intensity * peaks.bandwidth)
    return RooflinePoint(
        intensity=intensity,
        achieved_flops=cost.flops / seconds if seconds > 0 else 0.0,
        achieved_bandwidth=cost.bytes / seconds if seconds > 0 else 0.0,
        attainable_flops=attainable,
        is_memory_bound=intensity < peaks.ridge(dtype),
    )


def _best_time(fn, repeats: int) -> float:
    fn()  # warm: page faults, thread pool start
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes/s: the better of a copy (read + write) and a sum (read only) over a large buffer."""
    a = torch.ones(num_bytes // 4, dtype=torch.float32)
    b = torch.empty_like(a)
    copy = 2 * a.nbytes / _best_time(lambda: b.copy_(a), repeats)
    read = a.nbytes / _best_time(lambda: a.sum(), repeats)
    return max(copy, read)


def measure_flops(dtype: torch.dtype = torch.float32, size: int = GEMM_SIZE, repeats: int = 5) -> float:
    """FLOP/s of a square GEMM in ``dtype`` (int8: the kernel W8A8 per-token runs on this CPU, int32
    accumulation: ``torch._int_mm`` where it is exact, our exact kernel elsewhere)."""
    if dtype == torch.int8:
        from fivefold.models.int8_backends import int8_matmul_exact, w8a8_kernel

        a = torch.randint(-127, 128, (size, size), dtype=torch.int8)
        b = torch.randint(-127, 128, (size, size), dtype=torch.int8)
        if w8a8_kernel("per-token") == "int_mm":
            fn = lambda: torch._int_mm(a, b)  # noqa: E731
        else:
            fn = lambda: int8_matmul_exact(a, b)  # noqa: E731
    else:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        fn = lambda: torch.mm(a, b)  # noqa: E731
    return 2 * size**3 / _best_time(fn, repeats)


def machine_key() -> str:
    """Peaks are cached per host, instruction set in force (forcing AVX2 changes them), torch and threads."""
    from fivefold.platform import current_platform

    return (f"{platform.node()}|{current_platform().build_key}|{os.cpu_count()}|torch {torch.__version__}|"
            f"{torch.get_num_threads()} threads")


def measure_peaks(cache_path: str | Path | None = None, refresh: bool = False,
                  dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> MachinePeaks:
    """This machine's peaks, from the cache when measured before (a few seconds otherwise)."""
    path = Path(cache_path) if cache_path else peaks_file()
    key = machine_key()
    cached = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
    entry = cached.get(key)
    if entry and not refresh and all(d in entry["flops"] for d in dtypes):
        return MachinePeaks(entry["bandwidth"], dict(entry["flops"]))
    entry = entry if entry and not refresh else {"bandwidth": measure_bandwidth(), "flops": {}}
    for name in dtypes:
        if name not in entry["flops"]:
            entry["flops"][name] = measure_flops(getattr(torch, name))
    cached[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cached, indent=2, sort_keys=True))
    return MachinePeaks(entry["bandwidth"], dict(entry["flops"]))
