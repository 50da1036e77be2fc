"""Decode attention against the memory bandwidth: fivefold::paged_decode_attention vs gather + SDPA.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16 scattered
over the pool), one query token per sequence over its paged context. Each layer has its own
cache, and a pass runs every layer in turn, as a decode step does, so the context comes from
DRAM (30 layers x 64 sequences x 192 tokens is 566 MB), not from a hot cache. GB/s = the K and V
bytes of the contexts / time per layer; the share is of the copy bandwidth measured in the same run
(fivefold.profile.roofline.measure_bandwidth). The baseline, in the same process: the engine's
PyTorch fallback (gather the blocks into a padded copy, SDPA).

    .venv/bin/python benchmarks/paged_attention.py [--shapes 64x192,1x2048] [--kv-dtypes float32,int8]

Prints a table and one JSON line.
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
from fivefold.kernels import paged_attention_ops  # noqa: E402
from fivefold.models import kv_quant  # noqa: E402
from fivefold.models.attention import AttentionMetadata, _batched_decode  # noqa: E402
from fivefold.profile.roofline import measure_bandwidth  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def make_caches(batch: int, context: int, kv_dtype: str, gen: torch.Generator):
    """Per-layer caches with each sequence's blocks scattered over the pool; the block table."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    row = kv_quant.row_bytes(HEAD_DIM) if kv_dtype == "int8" else HEAD_DIM
    dtype = torch.int8 if kv_dtype == "int8" else torch.float32
    caches = []
    for _ in range(NUM_LAYERS):
        kv = torch.randn(2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen)
        caches.append(kv_quant.quantize_rows(kv) if dtype == torch.int8 else kv)
    assert caches[0].shape[-1] == row
    table = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    return caches, table


def time_per_layer(run, num_passes: int = 7) -> float:
    run()  # warm-up
    samples = []
    for _ in range(num_passes):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) / NUM_LAYERS)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x192,1x2048,8x512,64x192", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--kv-dtypes", default="float32,int8")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    if paged_attention_ops() is None:
        raise SystemExit("the paged attention kernel is not built (fivefold.kernels.kernel_status())")
    gen = torch.Generator().manual_seed(0)
    bandwidth = measure_bandwidth()
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        for shape in args.shapes.split(","):
            batch, context = (int(x) for x in shape.split("x"))
            caches, table = make_caches(batch, context, kv_dtype, gen)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
            lens = torch.full((batch,), context, dtype=torch.long)
            meta = AttentionMetadata(query_start_loc=list(range(batch + 1)), seq_lens=[context] * batch,
                                     slot_mapping=torch.zeros(batch, dtype=torch.long), block_tables=table,
                                     block_size=BLOCK_SIZE)
            plan = meta.decode_plan()
            out = torch.empty_like(q)
            scale = HEAD_DIM ** -0.5
            ops = paged_attention_ops()

            def kernel():
                for cache in caches:
                    ops.paged_decode_attention(q, cache, table, lens, scale)

            def gather_sdpa():
                for cache in caches:
                    _batched_decode(q, cache, plan, scale, out, use_kernel=False)

            nbytes = 2 * batch * context * NUM_KV_HEADS * caches[0].shape[-1] * caches[0].element_size()
            t_kernel, t_base = time_per_layer(kernel), time_per_layer(gather_sdpa)
            rows.append({"kv_dtype": kv_dtype, "batch": batch, "context": context, "MB_per_layer": round(nbytes / 1e6, 2),
                         "kernel_ms": round(t_kernel * 1e3, 4), "gather_sdpa_ms": round(t_base * 1e3, 4),
                         "kernel_GB_s": round(nbytes / t_kernel / 1e9, 1),
                         "kernel_share_of_bandwidth": round(nbytes / t_kernel / bandwidth, 3),
                         "speedup_vs_gather_sdpa": round(t_base / t_kernel, 2)})
            del caches
    table = Table(title=f"paged decode attention, {NUM_LAYERS} layers' caches (from DRAM); copy bandwidth "
                        f"{bandwidth / 1e9:.1f} GB/s")
    for col in ("KV", "batch x context", "MB / layer", "kernel ms / layer", "GB/s", "of bandwidth",
                "gather + SDPA ms", "kernel vs gather + SDPA"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["kv_dtype"], f"{r['batch']} x {r['context']}", f"{r['MB_per_layer']:.2f}", f"{r['kernel_ms']:.3f}",
                      f"{r['kernel_GB_s']:.1f}", f"{r['kernel_share_of_bandwidth']:.0%}", f"{r['gather_sdpa_ms']:.3f}",
                      f"{r['speedup_vs_gather_sdpa']:.2f}x")
    Console(width=140).print(table)
    print(json_line({"benchmark": "paged_attention", "bandwidth_GB_s": round(bandwidth / 1e9, 2), "results": rows}))


if __name__ == "__main__":
    main()
