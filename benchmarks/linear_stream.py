"""Decode linears against the memory bandwidth: weights streamed from DRAM, not a hot loop.

Builds every projection of the default model's decoder (30 layers of qkv, o, gate_up, down,
then the LM head: SmolLM2-135M's shapes, random weights) in each weight dtype, and enough
copies of them that the working set is at least twice the last-level cache; one "pass"
multiplies M activation rows by every matrix in turn, as a decode step does, cycling through
the copies so no matrix is in cache when its turn comes. GB/s = weight bytes / time per pass;
the share is of the machine's copy bandwidth measured in the same run (a 256 MB copy,
fivefold.profile.roofline.measure_bandwidth).

"Of roofline" divides by the roofline's time instead: the larger of the bytes over the bandwidth
and the FLOPs (2 * rows * weights) over the GEMM rate measured in the same run for the dtype the
backend computes in (the stream kernel widens every weight to float32, so its rate is float32's;
oneDNN's bf16 GEMM computes in bf16). Past a few rows, a 2-core CPU cannot do one multiply-add per
weight per row as fast as DRAM delivers the weights, and this column says how close a backend is
to what the machine allows there.

Backends:
  stream   fivefold::stream_linear (fivefold/kernels/linear_stream.cpp) on stream_pack's tile-major
           layout: float32, bfloat16, int8 (W8A16); for int4, fivefold::int4_linear
           (fivefold/kernels/int4_linear.cpp): 4-bit codes with a float16 scale and minimum per 32
           weights (GGUF Q4_1's form, 5 bits per weight; the bytes counted include the scales);
           int4-g128 per 128 (what `--quantization w4a16` makes on load, 4.25 bits); q4_0 a scale
           per 32, no minimum
  stream-a8  int4, q4_0, q4_k, q8_0, q6_k, q6_k6: int8 activations (W4A8, W8A8 as llama.cpp runs Q8_0 and Q6_K:
           each row quantized per block of 32 inside the call, integer dot products: VNNI
           vpdpbusd, or vpmaddubsw on AVX2)
  onednn   mkldnn._linear_pointwise on oneDNN-packed weights (PackedLinear's GEMM): float32, bfloat16
  aten     F.linear on the plain row-major weight (MKL / oneDNN without packing)

    .venv/bin/python benchmarks/linear_stream.py [--rows 1,4,8,16] [--dtypes float32,bfloat16,int8,int4,int4-g128,q4_0,q4_k,q8_0,q6_k,q6_k6] [--shapes smollm2|llama3b|llama8b]

Prints a table and one JSON line; the engine's row threshold (STREAM_MAX_ROWS in
fivefold/models/layers.py) comes from this table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivefold.bench.report import json_line  # noqa: E402
from fivefold.kernels import int4_ops, stream_ops  # noqa: E402
from fivefold.models.int4_linear import Int4Levels, pack_levels  # noqa: E402
from fivefold.models.layers import PackedLinear  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402
from fivefold.profile.roofline import measure_bandwidth, measure_flops  # noqa: E402

HIDDEN, INTERMEDIATE, NUM_LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 960
INT4_GROUP = 32
# q8_0: GGUF Q8_0's form, int8 weights with a float16 scale per 32 in the kernels' tile-major order,
# as a Q8_0 file's layers hold them (8.5 bits per weight, the file's bytes); q6_k: GGUF Q6_K's as
# fivefold serves it, codes -32..31 as int8 with a float16 scale per 16 in the same order (d x the
# sub-block's scale rounded to float16: 9 bits per weight streamed, against the file's 6.56); q6_k6:
# the same codes as a Q6_K layer holds them against int8 activations (fivefold::q6_pack: 6 bits and
# the float16 scale per 16, 7 bits per weight; int8 activations only); q4_0:
# GGUF Q4_0's, symmetric codes with a float16 scale per 32 (4.5 bits); q4_k: GGUF Q4_K's as a layer
# holds it against int8 activations, its two scale levels as stored (sc and m a byte per 32, d and
# dmin float16 per 256: 4.625 bits; int8 activations only; int4 is the one-level form it had before,
# a float16 scale and minimum per 32)
# int4-g128: the form `--quantization w4a16` makes on load (a float16 scale and minimum per 128);
# int4-g64: GPTQ's and AWQ's common group (a scale and minimum per 64)
INT4_GROUPS = {"int4": INT4_GROUP, "int4-g64": 64, "int4-g128": 128, "q4_0": 32}
BYTES_PER_WEIGHT = {"int8": 1, "int4": 0.5 + 4 / INT4_GROUP, "int4-g64": 0.5 + 4 / 64, "int4-g128": 0.5 + 4 / 128,
                    "q8_0": 1 + 2 / 32, "q6_k": 1 + 2 / 16, "q6_k6": 0.75 + 2 / 16,
                    "q4_0": 0.5 + 2 / 32, "q4_k": 0.5 + 2 / 32 + 4 / 256}
# --shapes: SmolLM2-135M's 121 decode matrices (the built-in), or two layers of a Llama-3-8B
# (qkv, o, gate_up, down: 4096 wide, 14336 intermediate), where a call streams 12-120 MB of weights
# and the per-call cost (the Python call, the thread team, quantizing one activation row) is small.
SHAPE_SETS = {
    "smollm2": [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * NUM_LAYERS + [
        (VOCAB, HIDDEN)],
    "llama8b": [(6144, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336)] * 2,
    "llama3b": [(5120, 3072), (3072, 3072), (2 * 8192, 3072), (3072, 8192)] * 2,
}
SHAPES = SHAPE_SETS["smollm2"]


def last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (what the working set must exceed)."""
    best = 32 << 20
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, size)
    return best


def make_weights(dtype: str, num_copies: int, generator: torch.Generator):
    out = []
    for _ in range(num_copies):
        copy = []
        for n, k in SHAPES:
            if dtype in INT4_GROUPS:  # codes, float16 scales (and minimums for int4) per group
                groups = -(-k // INT4_GROUPS[dtype])
                copy.append((torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
                             ((torch.rand(n, groups, generator=generator) / 100).half(),
                              None if dtype == "q4_0" else
                              (torch.randn(n, groups, generator=generator) / 10).half())))
            elif dtype == "q4_k":  # codes and two levels
                copy.append((torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator),
                             Int4Levels(*(torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=generator)
                                          for _ in range(2)),
                                        *((torch.rand(n, k // 256, generator=generator) / 1000).half() for _ in range(2)))))
            elif dtype == "q8_0":  # scales float16 holds exactly
                copy.append((torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
                             (torch.rand(n, k // 32, generator=generator) / 100).half().float()))
            elif dtype in ("q6_k", "q6_k6"):
                copy.append((torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=generator),
                             (torch.rand(n, k // 16, generator=generator) / 100).half().float()))
            elif dtype == "int8":
                copy.append((torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator),
                             torch.rand(n, generator=generator) / 100))
            else:
                copy.append((torch.randn(n, k, generator=generator).to(getattr(torch, dtype)), None))
        out.append(copy)
    return out


def backends(dtype: str):
    if dtype in INT4_GROUPS:
        ops4 = int4_ops()
        if ops4 is None:
            return {}
        def pack(q, so):  # q4_0: no offsets (w = s (q - 8))
            return (ops4.int4_pack(q), ops4.int4_pack_groups(so[0], True),
                    None if so[1] is None else ops4.int4_pack_groups(so[1], True))

        # stream: float activations (W4A16); stream-a8: int8 activations per block of 32, integer
        # dot products (W4A8, the quantization of x included in the time)
        return {"stream": (pack, lambda x, p: ops4.int4_linear(x, p[0], p[1], p[2], None, False)),
                "stream-a8": (pack, lambda x, p: ops4.int4_linear(x, p[0], p[1], p[2], None, True))}
    ops = stream_ops()
    if dtype == "q4_k":  # two levels: int8 activations only
        if int4_ops() is None:
            return {}
        return {"stream-a8": (lambda q, levels: (int4_ops().int4_pack(q), pack_levels(levels)),
                              lambda x, p: int4_ops().int4_linear(x, p[0], p[1], None, None, True))}
    if dtype == "q6_k6":  # 6-bit codes: int8 activations only
        if int4_ops() is None:
            return {}
        return {"stream-a8": (lambda w, s: (int4_ops().q6_pack(ops.stream_pack(w)), int4_ops().int4_pack_groups(s, True)),
                              lambda x, p: int4_ops().int8_weight_linear_a8(x, p[0], p[1], None))}
    if dtype in ("q8_0", "q6_k"):  # float activations (W8A16 with block scales) and int8 ones (as llama.cpp)
        found = {}
        if ops is not None:
            def pack8(w, s):  # the float16 tile-major scales Int8Linear keeps (_pack_scales)
                return ops.stream_pack(w), int4_ops().int4_pack_groups(s, True) if int4_ops() else s

            found["stream"] = (pack8, lambda x, p: ops.stream_linear(x, p[0], p[1], None))
            if int4_ops() is not None:
                found["stream-a8"] = (pack8, lambda x, p: int4_ops().int8_weight_linear_a8(x, p[0], p[1], None))
        return found
    torch_dtype = torch.float32 if dtype == "int8" else getattr(torch, dtype)
    found = {}
    if ops is not None:
        found["stream"] = (lambda w, s: (ops.stream_pack(w), s), lambda x, p: ops.stream_linear(x, p[0], p[1], None))
    if dtype != "int8" and PackedLinear.can_pack(torch_dtype):
        found["onednn"] = (lambda w, s: PackedLinear(_linear(w)), lambda x, p: p._gemm(x))
    if dtype != "int8":
        found["aten"] = (lambda w, s: w, lambda x, p: F.linear(x, p))
    return found


def _linear(w: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def time_passes(prepared_by_backend: dict, x_by_k: dict, repeats: int) -> dict:
    """Seconds per pass over one copy of the model's matrices, per backend (best of ``repeats``).

    The backends take turns within each repeat, so that the VM's drifting bandwidth (23-32 GB/s
    from one minute to the next here) shifts every backend alike instead of favouring one."""
    best = {name: float("inf") for name in prepared_by_backend}
    with torch.inference_mode():
        for name, (run, prepared) in prepared_by_backend.items():  # warm-up: one pass over every copy
            for copy in prepared:
                for p, k in copy:
                    run(x_by_k[k], p)
        for _ in range(repeats):
            for name, (run, prepared) in prepared_by_backend.items():
                start = time.perf_counter()
                for copy in prepared:
                    for p, k in copy:
                        run(x_by_k[k], p)
                best[name] = min(best[name], (time.perf_counter() - start) / len(prepared))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--dtypes", default=None, help="default: float32, bfloat16 where oneDNN packs it, int8, int4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default="smollm2", choices=sorted(SHAPE_SETS))
    args = ap.parse_args()
    global SHAPES
    SHAPES = SHAPE_SETS[args.shapes]

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    plat = current_platform()
    dtypes = args.dtypes.split(",") if args.dtypes else (
        ["float32", "bfloat16", "int8", "int4"] if plat.can_pack_bf16 else ["float32", "int8", "int4"])
    rows = [int(r) for r in args.rows.split(",")]
    llc = last_level_cache_bytes()
    bandwidth = measure_bandwidth()
    # FLOP/s of the arithmetic each backend does: float32 for the stream kernel (it widens).
    flops = {"float32": measure_flops(torch.float32)}
    if "bfloat16" in dtypes:
        flops["bfloat16"] = measure_flops(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    results = []
    for dtype in dtypes:
        itemsize = BYTES_PER_WEIGHT.get(dtype) or getattr(torch, dtype).itemsize
        model_bytes = int(sum(n * k for n, k in SHAPES) * itemsize)
        num_copies = max(1, -(-2 * llc // model_bytes))
        weights = make_weights(dtype, num_copies, generator)
        x_dtype = torch.float32 if dtype in ("float32", "int8", "q8_0", "q6_k", "q6_k6", "q4_k", *INT4_GROUPS) else torch.bfloat16
        prepared_by_backend = {name: (run, [[(prepare(w, s), w.shape[1]) for w, s in copy] for copy in weights])
                               for name, (prepare, run) in backends(dtype).items()}
        num_weights = sum(n * k for n, k in SHAPES)
        for m in track(rows, description=f"{dtype}"):
            x_by_k = {k: torch.randn(m, k).to(x_dtype) for k in {k for _, k in SHAPES}}
            for name, seconds in time_passes(prepared_by_backend, x_by_k, args.repeats).items():
                rate = flops["bfloat16" if dtype == "bfloat16" and name != "stream" else "float32"]
                results.append({"dtype": dtype, "backend": name, "rows": m, "ms_per_pass": round(seconds * 1e3, 3),
                                "GB_s": round(model_bytes / seconds / 1e9, 2), "seconds": seconds,
                                "model_bytes": model_bytes, "compute_s": 2 * m * num_weights / rate,
                                "working_set_MB": round(num_copies * model_bytes / 1e6)})
        del prepared_by_backend
        del weights
    # This VM's bandwidth drifts (33-54 GB/s from one minute to the next): the shares are taken
    # against the larger of the copy bandwidths measured before and after the timings (the lower share).
    bandwidth = max(bandwidth, measure_bandwidth())
    for r in results:
        seconds, model_bytes, compute_s = r.pop("seconds"), r.pop("model_bytes"), r.pop("compute_s")
        roof_seconds = max(model_bytes / bandwidth, compute_s)
        r.update({"share_of_bandwidth": round(model_bytes / seconds / bandwidth, 3),
                  "share_of_roofline": round(roof_seconds / seconds, 3),
                  "bound": "memory" if roof_seconds == model_bytes / bandwidth else "compute"})

    table = Table(title=f"decode linears streamed from DRAM: {len(SHAPES)} matrices per pass ({args.shapes} shapes), "
                        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, last-level cache {llc >> 20} MiB, "
                        f"{torch.get_num_threads()} threads, {plat.isa_level}; GEMM "
                        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in flops.items()))
    for col in ("dtype", "backend", "rows", "ms / pass", "GB/s", "of bandwidth", "of roofline", "roof bound",
                "working set MB"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["dtype"], r["backend"], str(r["rows"]), f"{r['ms_per_pass']:.2f}", f"{r['GB_s']:.1f}",
                      f"{r['share_of_bandwidth']:.0%}", f"{r['share_of_roofline']:.0%}", r["bound"],
                      str(r["working_set_MB"]))
    Console(width=150).print(table)
    print(json_line({"benchmark": "linear_stream", "shapes": args.shapes, "bandwidth_GB_s": round(bandwidth / 1e9, 2),
                     "last_level_cache_MiB": llc >> 20,
                     "gemm_GFLOP_s": {k: round(v / 1e9, 1) for k, v in flops.items()}, "results": results}))


if __name__ == "__main__":
    main()
