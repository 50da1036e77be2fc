"""The platform layer: flags, forcing, the choices that depend on them, and `fivefold env`."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fivefold.platform import Platform, _usable_flags, current_platform, forced_by

ZEN3 = frozenset("avx avx2 fma f16c sse4_2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16".split())
SAPPHIRE_RAPIDS = ZEN4 | frozenset("amx_tile amx_int8 amx_bf16 avx_vnni avx512_fp16".split())
FORCING_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS",
                "FIVEFOLD_FORCE_ISA")


def _platform(flags, forced=None):
    return Platform("x86_64", "test cpu", _usable_flags(flags, forced), forced, 2)


def test_capabilities_follow_the_flags():
    zen3, zen4, spr = _platform(ZEN3), _platform(ZEN4), _platform(SAPPHIRE_RAPIDS)
    assert (zen3.isa_level, zen4.isa_level, spr.isa_level) == ("avx2", "avx512-vnni", "amx")
    assert not zen3.has_vnni and zen4.has_vnni and spr.has_vnni
    assert not zen3.can_pack_bf16 and zen4.can_pack_bf16
    assert not zen3.has_bf16_compute and zen4.has_bf16_compute
    assert spr.can_run_fp16 and not zen4.can_run_fp16 and not zen3.can_run_fp16
    assert _platform(ZEN3 | {"avx_ne_convert"}).can_pack_bf16  # PyTorch's other condition for oneDNN bf16
    assert _platform(ZEN3 | {"avx_vnni"}).has_vnni and _platform(ZEN3 | {"avx_vnni"}).isa_level == "avx2-vnni"
    arm = Platform("aarch64", "neoverse", frozenset({"asimd", "bf16"}), None, 2)
    assert arm.isa_level == "neon" and not arm.can_pack_bf16 and arm.compile_flags == ["-march=native"]


def test_forcing_removes_every_flag_above_avx2_and_compiles_for_x86_64_v3():
    forced = _platform(SAPPHIRE_RAPIDS, forced="ATEN_CPU_CAPABILITY=avx2")
    assert forced.isa_flags == ZEN3
    assert forced.isa_level == "avx2" and not forced.has_vnni and not forced.can_pack_bf16
    assert forced.compile_flags == ["-march=x86-64-v3"]
    # A real AVX2 host and a forced AVX-512 host build the same kind of binary, never one for the other.
    assert forced.build_key != _platform(SAPPHIRE_RAPIDS).build_key
    assert _platform(ZEN3).build_key != _platform(ZEN4).build_key != _platform(SAPPHIRE_RAPIDS).build_key
    assert _platform(ZEN3).build_key.startswith("x86_64-avx2-") and _platform(ZEN4).build_key.startswith(
        "x86_64-avx512-vnni-")


@pytest.mark.parametrize("var,value,expected", [
    ("ATEN_CPU_CAPABILITY", "avx2", True), ("ATEN_CPU_CAPABILITY", "avx512", False),
    ("ONEDNN_MAX_CPU_ISA", "AVX2", True), ("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI", False),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", False), ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2", True),
    ("FBGEMM_ENABLE_INSTRUCTIONS", "AVX512", False), ("FIVEFOLD_FORCE_ISA", "avx2", True),
])
def test_forcing_variables_are_read_like_the_libraries_read_them(monkeypatch, var, value, expected):
    for v in FORCING_VARS:
        monkeypatch.delenv(v, raising=False)
    assert forced_by() is None
    monkeypatch.setenv(var, value)
    assert (forced_by() == f"{var}={value}") is expected


def test_this_process_platform_honours_the_environment():
    p = current_platform()
    if forced_by():
        assert p.forced and not p.has_avx512 and not p.has_vnni and not p.can_pack_bf16
    if p.is_x86:
        assert p.has("avx2") or p.isa_level == "sse"
    assert p.describe()["threads"] == torch.get_num_threads()


def test_one_openmp_runtime_serves_torch_and_our_kernels():
    """In a fresh process (other libraries, scikit-learn's among them, bring their own runtime):
    after torch and our three extensions have run, one OpenMP runtime is mapped, torch's."""
    code = """
import torch
from fivefold.kernels import fused_ops, int8_ops, paged_attention_ops
from fivefold.platform import openmp_runtimes
assert int8_ops() is not None and fused_ops() is not None and paged_attention_ops() is not None
ops = torch.ops.fivefold
ops.int8_weight_linear(torch.randn(64, 2048), ops.stream_pack(torch.ones(64, 2048, dtype=torch.int8)), torch.ones(64), None)
torch.randn(256, 256) @ torch.randn(256, 256)
print(*openmp_runtimes(), sep="\\n")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    runtimes = out.stdout.split()
    assert len(runtimes) == 1, runtimes  # two would be two thread pools fighting for the same cores
    assert Path(runtimes[0]).parent == Path(torch.__file__).resolve().parent / "lib"


_STEP_HEAP = """
import resource, sys, torch
from fivefold.platform import keep_step_heap
if sys.argv[1] == "keep":
    assert keep_step_heap()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
once = torch.empty(30 << 18).fill_(1.0)  # a 30 MB block: glibc's own mmap threshold rises to it
del once
per_step = []
for step in range(12):  # a prompt step: three 24 MB outputs, all freed at its end
    f0 = faults()
    outputs = [torch.empty(24 << 18).fill_(1.0) for _ in range(3)]
    per_step.append(faults() - f0)
    del outputs
print(sum(per_step[8:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_step_outputs_reuse_the_heap_after_keep_step_heap():
    """A memory invariant, not a timing: once the engine set glibc's thresholds
    (platform.keep_step_heap), a step's freed outputs are reused by the next step, their pages
    faulted in while the heap grows over the first steps (3-6 here), never again. Under glibc's
    adjusting thresholds this sequence faulted in all 72 MB again on every step in 7 processes of
    8 (in the engine: W8A16's 25 MB gate_up outputs of SmolLM2's prompt steps, 39.7 ms a call
    against 34 ms). Two processes, since the heap's layout varies with address randomization."""
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _STEP_HEAP, "keep"], capture_output=True, text=True, timeout=600,
                             check=True)
        assert int(out.stdout.split()[-1]) == 0  # pages first touched by steps 9-12


def test_fivefold_env_prints_the_machine_and_each_paths_kernel(capsys):
    from fivefold.cli import main

    assert main(["env", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = current_platform()
    assert out["platform"]["isa_level"] == p.isa_level and out["platform"]["forced"] == p.forced
    kernels = out["kernels"]
    for mode in ("W8A8 dynamic per-token", "W8A8 dynamic per-tensor", "W8A8 static"):
        assert kernels[mode].startswith("fivefold-exact" if not p.has_vnni else ("int_mm", "fbgemm", "onednn",
                                                                                  "fivefold-exact"))
    assert kernels["bfloat16 linear"].startswith("oneDNN packed" if p.can_pack_bf16 else "dense")
    # the 4-bit kernel's integer dot product follows the build's ISA (the forced-AVX2 leg: vpmaddubsw)
    assert ("vpdpbusd" if p.isa_level in ("amx", "avx512-vnni") else "vpmaddubsw") in kernels["W4A8 linear"]
    assert p.build_key in kernels["C++ extensions"]
    assert main(["env"]) == 0 and "kernel chosen for each path" in capsys.readouterr().out


def test_registry_runs_record_the_platform(tmp_path):
    from fivefold.bench.registry import RunRegistry

    registry = RunRegistry(str(tmp_path / "runs.db"))
    run_id = registry.record("x", {"a": 1}, {"tok_s": 1.0}, None)
    machine = registry.get(run_id).machine
    assert machine["cpu"]["isa_level"] == current_platform().isa_level
    assert machine["cpu"]["forced"] == current_platform().forced
