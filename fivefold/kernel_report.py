"""What ``fivefold env`` prints about kernels: for every path whose kernel depends on the
machine, the one chosen here. It sits above the kernels, the layers and the int8 backends
(which all ask fivefold.platform what the CPU can do), so that platform.py depends on none
of them."""

from __future__ import annotations


def kernel_choices() -> list[tuple[str, str]]:
    """(path, kernel chosen on this CPU) for every path whose kernel depends on the machine: what
    ``fivefold env`` prints. Builds (or loads) our C++ extensions to know whether they run."""
    import torch

    from fivefold.kernels import build_dir_name, decode_loop_ops, fused_ops, int8_ops, paged_attention_ops
    from fivefold.models.layers import PackedLinear, stream_max_rows
    from fivefold.platform import current_platform, openmp_runtimes
    from fivefold.models.int8_backends import LIBRARY_KERNELS, w8a8_kernel

    p = current_platform()
    def streamed(dtype) -> str:
        n = stream_max_rows(dtype)
        return f"; fivefold::stream_linear up to {n} rows" if n else ""

    rows = [("float32 linear", ("oneDNN packed (mkldnn._linear_pointwise)" if PackedLinear.can_pack(torch.float32)
                                else "F.linear") + streamed(torch.float32)),
            ("bfloat16 linear", "oneDNN packed bf16" if PackedLinear.can_pack(torch.bfloat16)
             else "dense F.linear (no oneDNN bf16 here)" + ("" if p.has_bf16_compute else "; slower than float32")),
            ("decode step", "layer loop in C++ (fivefold::decode_layers)" if decode_loop_ops() is not None
             else "Python layer loop (decode_loop kernel unavailable)")]
    if PackedLinear.can_pack(torch.bfloat16) and stream_max_rows(torch.bfloat16):
        rows[1] = ("bfloat16 linear", "oneDNN packed bf16" + streamed(torch.bfloat16))
    rows.append(("W8A16 linear", "fivefold::int8_weight_linear up to 64 rows, dequantized tiles above"
                 if int8_ops() is not None else "dequantized tiles (C++ kernel unavailable)"))
    rows += int4_rows(p)
    for mode in LIBRARY_KERNELS:
        kernel = w8a8_kernel(mode)
        label = "static" if mode == "static" else f"dynamic {mode}"
        note = "int32 sums, exact on any CPU" if kernel.endswith("exact") else "library kernel, VNNI, probed exact"
        rows.append((f"W8A8 {label}", f"{kernel}: {note}"))
    rows.append(("decode attention", "fivefold::paged_decode_attention" if paged_attention_ops() is not None
                 else "gather + SDPA"))
    rows.append(("fused elementwise ops", "fivefold fused_ops" if fused_ops() is not None else "eager PyTorch"))
    rows.append(("C++ extensions", f"{' '.join(p.compile_flags)}, cache {build_dir_name('<name>')}"))
    rows.append(("OpenMP runtimes", ", ".join(openmp_runtimes()) or "none loaded"))
    return rows


def int4_rows(p) -> list[tuple[str, str]]:
    """The 4-bit linear's kernels on this build: W4A16 (float activations) and W4A8 (int8
    activations: which integer dot product the -march of the build gives)."""
    from fivefold.kernels import int4_ops

    if int4_ops() is None:
        return [("W4A16 / W4A8 linear", "dequantized tiles (C++ kernel unavailable)")]
    level = p.isa_level
    if level in ("amx", "avx512-vnni"):
        dot = "vpdpbusd (AVX-512 VNNI)"
    elif level == "avx512":
        dot = "vpmaddubsw + vpmaddwd (AVX-512BW, exact: 4-bit codes cannot saturate)"
    elif level.startswith("avx2"):
        dot = "vpmaddubsw + vpmaddwd (AVX2, exact: 4-bit codes cannot saturate)"
    else:
        dot = "none in this build: activations quantized, then the float path"
    return [("W4A16 linear", "fivefold::int4_linear, float activations, up to 64 rows; dequantized tiles above"),
            ("W4A8 linear", f"fivefold::int4_linear, int8 activations per block of 32, every batch size: {dot}")]
