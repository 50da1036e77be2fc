"""Which int8 kernel to run, measured on this machine: every candidate on SmolLM2's
projection shapes at decode batch 1 and 32 (and a prefill chunk of 128), against the
float32 oneDNN-packed linear we serve with. Times include quantizing the activations
where a scheme needs it (that is part of the cost).

Candidates:
  fp32-packed        mkldnn._linear_pointwise on reordered float32 weights (the baseline)
  w8a16-int8pack     aten._weight_int8pack_mm: int8 weights, per-channel scales, float activations
  w8a16-fivefold     our C++ kernel (fivefold/kernels/linear_stream.cpp): int8 weights, float activations
                     (weights streamed below 16 rows, packed panels from 16)
  w8a8-int_mm        per-token dynamic int8 activations, torch._int_mm (int32 accumulation), rescale
  w8a8-onednn        onednn.qlinear_pointwise (u8 activations, per-tensor scale/zero point, VNNI)
  w8a8-fbgemm        quantized.linear_dynamic (fbgemm, per-tensor dynamic activations)
  w8a8-fivefold-exact our C++ int8 x int8 -> int32 kernel (fivefold/kernels/int8_linear.cpp: exact on
                     every CPU; packed panels from 16 rows), per-token activations

Without VNNI the library W8A8 kernels saturate (their rel. error column shows it);
the last line says which kernel each W8A8 mode runs on this CPU (``fivefold env`` too).

    .venv/bin/python benchmarks/int8_kernels.py [--repeats 50] [--batches 1,32,128]
        [--kernels w8a8-fivefold-exact,...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.models import int8_backends  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def bench(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def bench_alternating(fns: dict, repeats: int, rounds: int) -> dict:
    """Each candidate's median time per call over ``rounds`` rounds, the candidates taking turns in
    every round: this VM's speed drifts by 20-40% from minute to minute, which back-to-back runs of
    one candidate then the next would turn into a ratio."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(bench(fn, max(1, repeats // rounds)))
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--kernels", default="", help="comma-separated candidates to run (fp32-packed always runs)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds per shape; medians reported")
    args = ap.parse_args()
    wanted = set(filter(None, args.kernels.split(","))) | {"fp32-packed"} if args.kernels else None
    torch.manual_seed(0)
    results = []
    for m in map(int, args.batches.split(",")):
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k) * 0.05
            x = torch.randn(m, k)
            ref = x @ w.T
            fns = {cand: fn for cand, fn in int8_backends.candidates(w, x).items()
                   if fn is not None and (wanted is None or cand in wanted)}
            errors = {cand: float((fn() - ref).norm() / ref.norm()) for cand, fn in fns.items()}
            for cand, t in bench_alternating(fns, args.repeats, args.rounds).items():
                results.append({"m": m, "shape": name, "k": k, "n": n, "kernel": cand,
                                "us": t * 1e6, "rel_err": errors[cand]})
    table = Table(title="int8 kernels vs float32 packed (time per call; ratio = fp32 time / kernel time)")
    for col in ("M", "shape", "kernel", "us", "ratio", "rel. error"):
        table.add_column(col, justify="right")
    base = {(r["m"], r["shape"]): r["us"] for r in results if r["kernel"] == "fp32-packed"}
    for r in results:
        r["speedup"] = base[(r["m"], r["shape"])] / r["us"]
        table.add_row(str(r["m"]), r["shape"], r["kernel"], f"{r['us']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['rel_err']:.4f}")
    Console(width=120).print(table)
    totals = {}
    for r in results:
        totals.setdefault((r["m"], r["kernel"]), 0.0)
        totals[(r["m"], r["kernel"])] += r["us"]
    summary = {f"M={m} {kern}": round(base_total / t, 3) for (m, kern), t in totals.items()
               for base_total in [totals[(m, "fp32-packed")]]}
    Console(width=120).print("sum over the five shapes, speed-up vs fp32-packed:", summary)
    chosen = {mode: int8_backends.w8a8_kernel(mode) for mode in int8_backends.LIBRARY_KERNELS}
    Console(width=120).print("W8A8 kernel per activation mode on this CPU:", chosen)
    print(json_line({"benchmark": "int8_kernels", "threads": torch.get_num_threads(), "results": results,
                     "summary": summary, "chosen": chosen}))


if __name__ == "__main__":
    main()
