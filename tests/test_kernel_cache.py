"""The kernel cache survives a build killed midway, and two checkouts of the same sources share
one build (issue 34, finding 12).

Kept out of tests/kernels/ on purpose: that folder also runs on the forced-AVX2 leg, and these
two builds (about a minute each on 2 cores) check the cache's bookkeeping, which does not depend
on the instruction set."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "fused_ops"  # no dependencies, one of the quicker builds
USE = """
import sys, torch
from fivefold.kernels import fused_ops, kernel_status
import fivefold
ops = fused_ops()
assert ops is not None, kernel_status()
x = torch.randn(3, 16)
torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
print("ok", fivefold.__file__)
"""


def _env(cache: Path) -> dict:
    return {**os.environ, "FIVEFOLD_CACHE": str(cache)}


def _build_dir(cache: Path) -> Path:
    root = cache / "torch_extensions"
    found = [d for d in root.glob(f"{KERNEL}-*") if d.is_dir()] if root.exists() else []
    return found[0] if found else root / "<none>"


def test_a_killed_build_leaves_no_hang_and_two_checkouts_share_one_build(tmp_path):
    cache = tmp_path / "cache"
    # 1. A build killed midway (as Ctrl-C, a CI timeout or the OOM killer would) leaves torch's lock file.
    victim = subprocess.Popen([sys.executable, "-c", USE], cwd=ROOT, env=_env(cache), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (_build_dir(cache) / "lock").exists():
        assert victim.poll() is None and time.time() < deadline, "the build never started"
        time.sleep(0.1)
    time.sleep(3)  # into the compiler
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    build_dir = _build_dir(cache)
    assert (build_dir / "lock").exists()

    # 2. The next start says so in one line, rebuilds and runs (before the fix: asleep forever).
    out = subprocess.run([sys.executable, "-c", USE], cwd=ROOT, env=_env(cache), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
    assert "stale lock" in out.stderr, out.stderr[-2000:]
    assert not (build_dir / "lock").exists()
    library = build_dir / f"fivefold_{KERNEL}.so"
    built = library.stat().st_mtime_ns

    # 3. A second checkout of the same sources (another path) loads that build without rebuilding it.
    other = tmp_path / "other-checkout"
    shutil.copytree(ROOT / "fivefold", other / "fivefold", ignore=shutil.ignore_patterns("__pycache__"))
    env = _env(cache) | {"PYTHONPATH": str(other)}
    for _ in range(2):  # and back again: alternating checkouts never rebuild
        for cwd, run_env in ((other, env), (ROOT, _env(cache))):
            out = subprocess.run([sys.executable, "-c", USE], cwd=cwd, env=run_env, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == 0, out.stderr[-3000:]
            assert str(cwd) in out.stdout, out.stdout  # that checkout's package was the one imported
            assert library.stat().st_mtime_ns == built, f"rebuilt for {cwd}"
