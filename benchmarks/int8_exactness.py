"""Are the int8 results right on this CPU? W8A8 SQNR against float for the five activation
modes, with the kernel Fivefold chooses here and with the library kernel forced in its place,
and QAT's fake-quant accuracy against its converted int8 model (digits CNN, test split).

On a CPU without VNNI (or with AVX2 forced: ``ONEDNN_MAX_CPU_ISA=AVX2
FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2``) the library kernels saturate;
the "library" column shows what that costs, the "chosen" column what runs.

    .venv/bin/python benchmarks/int8_exactness.py
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fivefold.models.int8_linear as int8_linear  # noqa: E402
from fivefold.bench.report import json_line, results_table  # noqa: E402
from fivefold.platform import current_platform  # noqa: E402
from fivefold.quant.config import Int8Config  # noqa: E402
from fivefold.models.int8_backends import LIBRARY_KERNELS, w8a8_kernel  # noqa: E402
from fivefold.models.int8_primitives import sqnr_db  # noqa: E402
from fivefold.quant.quantize import quantize_  # noqa: E402

CONFIGS = [Int8Config("w8a8", activation_granularity="per-tensor"),
           Int8Config("w8a8", activation="static", calibration="minmax"),
           Int8Config("w8a8", activation="static", activation_symmetric=False, calibration="percentile"),
           Int8Config("w8a8", "per-tensor", activation="static", calibration="entropy"),
           Int8Config("w8a8", activation="static", calibration="mse"),
           Int8Config("w8a8")]


@contextlib.contextmanager
def library_kernels():
    """Int8Linear runs the library kernel of each mode, exact here or not (for comparison only)."""
    chosen = int8_linear.w8a8_kernel
    int8_linear.w8a8_kernel = LIBRARY_KERNELS.__getitem__
    try:
        yield
    finally:
        int8_linear.w8a8_kernel = chosen


def _fresh(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, int8_linear.Int8Linear):
            m._prepared = None  # re-derive the kernel operands for the kernel now in force
    return model


def mlp_rows() -> list[dict]:
    rows = []
    for config in CONFIGS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))
        calib = [torch.randn(32, 256) for _ in range(4)]
        test = torch.randn(64, 256)
        ref = model(test).detach()
        quantize_(model, config, calib if config.is_static else None, show_progress=False)
        with torch.no_grad():
            chosen = sqnr_db(ref, _fresh(model)(test))
            with library_kernels():
                library = sqnr_db(ref, _fresh(model)(test))
        mode = "static" if config.is_static else config.activation_granularity
        rows.append({"config": config.label, "kernel": w8a8_kernel(mode), "sqnr_db": chosen,
                     "library_kernel": LIBRARY_KERNELS[mode], "library_sqnr_db": library})
        _fresh(model)
    return rows


def qat_row() -> dict:
    from fivefold.models.cnn import DigitsCNN
    from fivefold.eval.digits import accuracy, load_digits_split, train
    from fivefold.quant.qat import convert, prepare_qat

    data = load_digits_split()
    model = train(DigitsCNN(), data.train, epochs=8)
    config = Int8Config("w8a8", activation="static", calibration="minmax")
    qat = prepare_qat(copy.deepcopy(model), config)
    train(qat, data.train, epochs=2, lr=1e-3)
    fake = accuracy(qat, data.test)
    convert(qat)
    converted = accuracy(qat, data.test)
    with library_kernels():
        library = accuracy(_fresh(qat), data.test)
    _fresh(qat)
    return {"float_acc": accuracy(model, data.test), "fake_quant_acc": fake, "converted_acc": converted,
            "converted_library_acc": library, "kernel": w8a8_kernel("static")}


def main() -> None:
    from rich.console import Console

    console = Console(width=130)
    platform = current_platform()
    rows = mlp_rows()
    console.print(results_table(
        f"W8A8 SQNR vs float, MLP 256-512-128 ({platform.isa_level}{', forced: ' + platform.forced if platform.forced else ''})",
        ("config", "kernel chosen", "SQNR dB", "library kernel", "its SQNR dB"),
        [(r["config"], r["kernel"], f"{r['sqnr_db']:.1f}", r["library_kernel"], f"{r['library_sqnr_db']:.1f}")
         for r in rows]))
    qat = qat_row()
    console.print(results_table(
        "QAT on the digits CNN (test accuracy %, W8A8 static)",
        ("float", "fake-quant", f"converted ({qat['kernel']})", "converted (library kernel)"),
        [(f"{qat['float_acc']:.2f}", f"{qat['fake_quant_acc']:.2f}", f"{qat['converted_acc']:.2f}",
          f"{qat['converted_library_acc']:.2f}")]))
    print(json_line({"benchmark": "int8_exactness", "mlp": rows, "qat": qat}))


if __name__ == "__main__":
    main()
