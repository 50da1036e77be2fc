"""Operator fusion and layout on CNNs: ResNet-18 and MobileNet-V2 (random weights), float32.

For each model and batch size, the median latency of:
  eager                 the nn.Module as written (NCHW)
  eager channels_last   the same module and input converted to channels_last
  fold BN only          fuse() with only BatchNorm folding and parallel-linear merging
  fused NCHW            + residual add and activations as oneDNN post-ops, prepacked weights
  fused channels_last   + channels_last (what ``fuse`` does by default)
  torch.compile         inductor on the eager module (only with --compile; slow to compile)
Every variant's output is checked against eager (max abs difference printed).

    .venv/bin/python benchmarks/fuse_cnn.py [--batches 1,32] [--image-size 224] [--compile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.fuse.graph_fuse import FuseConfig, fuse  # noqa: E402
from fivefold.fuse.layout import median_us  # noqa: E402
from fivefold.models.cnn import build_cnn  # noqa: E402

OFF = dict(fuse_residual_add=False, fuse_activations=False, channels_last=False, prepack=False, align_linears=False)


def variants(name: str, x: torch.Tensor, use_compile: bool) -> dict:
    model = build_cnn(name)
    out = {"eager": (model, x)}
    cl = build_cnn(name).to(memory_format=torch.channels_last)
    out["eager channels_last"] = (cl, x.contiguous(memory_format=torch.channels_last))
    out["fold BN only"] = (fuse(model, (x,), FuseConfig(**OFF))[0], x)
    out["fused NCHW"] = (fuse(model, (x,), FuseConfig(channels_last=False))[0], x)
    fused, report = fuse(model, (x,))
    out["fused channels_last"] = (fused, x)
    if use_compile:
        compiled = torch.compile(model)
        with torch.inference_mode():
            compiled(x)
        out["torch.compile"] = (compiled, x)
    return out, report


def main() -> None:
    from rich.console import Console

    from fivefold.bench.report import results_table

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,mobilenet_v2")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    console = Console(width=140)
    rows = []
    for name in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            x = torch.randn(batch, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0))
            models, report = variants(name, x, args.compile)
            calls = 20 if batch == 1 else 5
            with torch.inference_mode():
                ref = models["eager"][0](x)
                eager_ms = median_us(lambda: models["eager"][0](x), calls) / 1e3
                for variant, (module, inp) in models.items():
                    ms = eager_ms if variant == "eager" else median_us(lambda: module(inp), calls) / 1e3
                    rows.append({"model": name, "batch": batch, "variant": variant, "ms": ms,
                                 "speedup": eager_ms / ms, "max_abs_diff": float((module(inp) - ref).abs().max()),
                                 **({"kernels": [report.kernels_before, report.kernels_after],
                                     "onednn_reorders": [report.onednn_reorders_before, report.onednn_reorders_after]}
                                    if variant == "fused channels_last" else {})})
    console.print(results_table(
        f"CNN latency, {args.image_size}x{args.image_size}, float32, {torch.get_num_threads()} threads "
        "(median; speedup vs eager)", ("model", "batch", "variant", "ms", "speedup", "max |diff| vs eager"),
        [(r["model"], str(r["batch"]), r["variant"], f"{r['ms']:.2f}", f"{r['speedup']:.2f}x",
          f"{r['max_abs_diff']:.1e}") for r in rows]))
    print(json_line({"benchmark": "fuse_cnn", "image_size": args.image_size, "rows": rows}))


if __name__ == "__main__":
    main()
