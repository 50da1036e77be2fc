"""Our C++ extensions: named by the instructions they were built for, and optional."""

import os
import subprocess
import sys
from pathlib import Path

from fivefold.kernels import build_dir_name
from fivefold.platform import current_platform

ROOT = Path(__file__).resolve().parents[2]


def test_build_directory_names_the_torch_install_and_the_instruction_set():
    name = build_dir_name("int8_linear")
    assert name.startswith("int8_linear-") and name.endswith(current_platform().build_key)


def test_without_a_compiler_every_path_falls_back_with_one_warning(tmp_path):
    """A fresh cache and no C++ compiler: one warning per kernel, kernel_status says why, the int8
    layers still compute the exact integer sums (W8A8 through the float64 fallback) and the 4-bit
    layers their dequantized product."""
    code = """
import warnings
import torch
from torch import nn
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from fivefold.kernels import int8_ops, kernel_status
    from fivefold.quant.config import Int8Config
    from fivefold.models.int8_backends import per_token_quantize
    from fivefold.models.int8_linear import Int8Linear
    assert int8_ops() is None and int8_ops() is None
    status = kernel_status()
    lin = nn.Linear(40, 24, bias=False)
    q = Int8Linear.from_float(lin, Int8Config("w8a8"))
    x = torch.randn(5, 40) * 4
    xq, xs = per_token_quantize(x)
    expected = (xq.long() @ q.weight.long().t()).double() * xs.double() * q.weight_scale.double()
    torch.testing.assert_close(q(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert q.kernel in ("float64-exact", "int_mm"), q.kernel
    w16 = Int8Linear.from_float(lin, Int8Config("w8a16"))
    assert w16.kernel == "dequant-tiles" and torch.isfinite(w16(x)).all()
    from fivefold.models.int4_linear import Int4Format, Int4Linear
    w4 = Int4Linear.from_float(nn.Linear(64, 24), Int4Format(group_size=32))
    x4 = torch.randn(3, 64)
    assert w4.kernel == "dequant" and w4.qweight is not None  # the checkpoint form, dequantized per call
    torch.testing.assert_close(w4(x4), x4 @ w4.dequantized_weight().t() + w4.bias, rtol=1e-5, atol=1e-5)
mine = [str(w.message) for w in caught if "fivefold: kernel" in str(w.message)]
assert len(mine) == 5, mine  # one per kernel with no dependency, however often it is asked for
assert "int8_linear unavailable" in status, status
print("ok")
"""
    env = {**os.environ, "FIVEFOLD_CACHE": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
