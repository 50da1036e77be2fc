"""Tiled (online-softmax) attention vs naive attention and PyTorch's SDPA: time and peak extra memory.

SDPA on CPU is PyTorch's C++ flash-attention kernel (itself tiled); it is what the engine's
prefill uses by default (``prefill_attention="sdpa"``), called as the engine calls it (K/V
repeated to the query heads). Causal prefill with SmolLM2's attention shape (9 query heads, 3 KV heads, head_dim 64),
float32, N = 1k, 4k, 8k. Each measurement runs in a fresh process: peak extra memory is
the growth of the process's peak resident set (ru_maxrss) over what it held once the
inputs existed. Time is the best of 2 calls after a warm-up call.

    .venv/bin/python benchmarks/tiled_attention.py [--sizes 1024,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, resource, sys, time
import torch
sys.path.insert(0, {root!r})
from fivefold.models.tiled_attention import naive_attention, tiled_attention
from fivefold.models.attention import _sdpa
n, kind = {n}, {kind!r}
g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(9, n, 64, generator=g), torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)
fn = {{"naive": lambda: naive_attention(q, k, v, True), "tiled": lambda: tiled_attention(q, k, v, True),
      "sdpa": lambda: _sdpa(q, k, v, None, True, 64 ** -0.5)}}[kind]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = fn()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
best = min((lambda t: (fn(), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(2))
print(json.dumps({{"extra_mb": (peak - before) / 1024, "seconds": best, "checksum": float(out.double().sum())}}))
"""


def measure(n: int, kind: str) -> dict:
    code = _CHILD.format(root=str(ROOT), n=n, kind=kind)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(ROOT))
    from fivefold.bench.report import json_line

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,4096,8192")
    args = ap.parse_args()
    rows = []
    for n in map(int, args.sizes.split(",")):
        naive, tiled, sdpa = measure(n, "naive"), measure(n, "tiled"), measure(n, "sdpa")
        rows.append({"n": n, "naive_s": naive["seconds"], "tiled_s": tiled["seconds"], "sdpa_s": sdpa["seconds"],
                     "naive_extra_mb": naive["extra_mb"], "tiled_extra_mb": tiled["extra_mb"],
                     "sdpa_extra_mb": sdpa["extra_mb"], "tiled_vs_sdpa": sdpa["seconds"] / tiled["seconds"],
                     "speedup": naive["seconds"] / tiled["seconds"],
                     "memory_share": tiled["extra_mb"] / naive["extra_mb"] if naive["extra_mb"] else None,
                     "same_output": abs(naive["checksum"] - tiled["checksum"]) < 1e-3 * max(1.0, abs(naive["checksum"]))})
    table = Table(title="causal attention, 9 heads / 3 KV heads, head_dim 64, float32")
    for col in ("N", "naive s", "tiled s", "SDPA flash s", "naive/tiled", "SDPA/tiled", "naive extra MB",
                "tiled extra MB", "SDPA extra MB", "tiled / naive memory"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["n"]), f"{r['naive_s']:.3f}", f"{r['tiled_s']:.3f}", f"{r['sdpa_s']:.3f}",
                      f"{r['speedup']:.2f}x", f"{r['tiled_vs_sdpa']:.2f}x", f"{r['naive_extra_mb']:.0f}",
                      f"{r['tiled_extra_mb']:.0f}", f"{r['sdpa_extra_mb']:.0f}",
                      f"{r['memory_share']:.1%}" if r["memory_share"] is not None else "-")
    Console(width=160).print(table)
    print(json_line({"benchmark": "tiled_attention", "rows": rows}))


if __name__ == "__main__":
    main()
