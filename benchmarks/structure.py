"""The structure lever, measured: pruning and distillation against the original model.

``--part digits`` (about 2 minutes): the digits ResNet (width 96) trained here; its
sensitivity table; structured pruning (uniform 50%, per-group ratios from the scan for
50% FLOPs, the iterative schedule), unstructured pruning, and a distilled half-width
student, each with parameters, MFLOPs, batch-1 latency and test accuracy.

``--part sparse`` (under a minute): CSR ``SparseLinear`` vs the faster dense linear on SmolLM2's
MLP shapes at 1 and 32 rows, over sparsities 50-99%: the crossover sparsity above which
the sparse path is faster (``sparsify_linears_`` uses it only there).

``--part llm`` (several minutes): SmolLM2-135M with 25% of its MLP neurons pruned, with
and without a short token-level KD heal from the original: held-out perplexity and
single-stream decode tokens/s against the original, in the same run.

    .venv/bin/python benchmarks/structure.py [--part digits,llm] [--heal-steps 40]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line, results_table  # noqa: E402
from fivefold.jobs.digits_report import DigitsPlan, run_digits_report  # noqa: E402
from fivefold.jobs.report import scan_table  # noqa: E402


def digits(console) -> dict:
    report = run_digits_report(DigitsPlan(), log=console.print)
    console.print(scan_table(report["sensitivity"], "digits ResNet: calibration accuracy drop (points) when one "
                                                    "channel group alone is pruned"))
    console.print(f"per-group ratios for 50% of the FLOPs, from the scan: {report['flops_target_ratios']}")
    console.print(results_table(
        "digits ResNet: structure lever vs the original (test split, batch-1 eager latency)",
        ("variant", "params", "MFLOPs", "latency us", "speed-up", "test acc %", "delta points"),
        [(r["variant"], f"{r['parameters']:,}", f"{r['mflops']:.1f}", f"{r['latency_us']:.0f}",
          f"{r.get('speedup', 1.0):.2f}x", f"{r['test_accuracy']:.2f}", f"{r.get('accuracy_delta', 0.0):+.2f}")
         for r in report["rows"]]))
    report.pop("models")
    return report


def sparse(console) -> dict:
    import torch

    from fivefold.compress.unstructured import SparseLinear
    from fivefold.fuse.layout import median_us
    from fivefold.models.layers import PackedLinear

    sparsities = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
    rows = []
    for in_f, out_f in ((576, 1536), (1536, 576)):
        for num_rows in (1, 32):
            torch.manual_seed(0)
            linear = torch.nn.Linear(in_f, out_f)
            x = torch.randn(num_rows, in_f)
            packed = PackedLinear(linear)
            with torch.no_grad():
                # The dense baseline is the faster of plain F.linear and the oneDNN-packed linear the engine uses.
                dense_us = min(median_us(lambda: linear(x), 200), median_us(lambda: packed(x), 200))
                ratios = {}
                for s in sparsities:
                    masked = torch.nn.Linear(in_f, out_f)
                    masked.weight.copy_(linear.weight * (torch.rand_like(linear.weight) >= s))
                    layer = SparseLinear(masked)
                    ratios[s] = dense_us / median_us(lambda: layer(x), 200)
            crossover = next((s for s in sparsities if ratios[s] >= 1.0), None)
            rows.append({"shape": f"{in_f}->{out_f}", "rows": num_rows, "dense_us": dense_us, "speedup": ratios,
                         "crossover": crossover})
    console.print(results_table(
        "CSR sparse linear vs the faster of F.linear and the packed dense linear (speed-up = dense / sparse time)",
        ("shape", "rows", "dense us", *(f"{s:.0%}" for s in sparsities), "crossover"),
        [(r["shape"], str(r["rows"]), f"{r['dense_us']:.1f}", *(f"{r['speedup'][s]:.2f}x" for s in sparsities),
          "none" if r["crossover"] is None else f"{r['crossover']:.0%}") for r in rows]))
    return {"rows": rows}


def main() -> None:
    from rich.console import Console

    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="digits,sparse,llm")
    ap.add_argument("--heal-steps", type=int, default=40)
    args = ap.parse_args()
    console = Console(width=150)
    out = {"benchmark": "structure"}
    parts = args.part.split(",")
    if "digits" in parts:
        out["digits"] = digits(console)
    if "sparse" in parts:
        out["sparse"] = sparse(console)
    if "llm" in parts:
        from fivefold.jobs.llm_report import run_llm_report

        out["llm"] = run_llm_report(heal_steps=args.heal_steps, console=console)
    print(json_line(out))


if __name__ == "__main__":
    main()
