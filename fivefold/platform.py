"""The one place that knows the machine: architecture, ISA level, what oneDNN and our
C++ kernels can use here, and the thread count.

Every kernel choice that depends on the CPU asks :func:`current_platform` (never the
developer's assumption): whether u8 x s8 int8 GEMMs of oneDNN and fbgemm can be exact
(VNNI: without it they sum pairs of products in int16 and saturate), whether oneDNN
packs bf16 weights, which ``-march`` our extensions are compiled for.

Forcing. The environment variables that make PyTorch's libraries run their AVX2 paths on
a bigger CPU are honoured here too, so that one AVX-512 machine can check what an
AVX2-only machine will do: ``ATEN_CPU_CAPABILITY`` (``avx2``/``default``),
``ONEDNN_MAX_CPU_ISA`` (``AVX2``, ``SSE41``, ...) and ``FBGEMM_ENABLE_INSTRUCTIONS``
(``AVX2``). Any of them set to an AVX2-or-lower level removes every flag above AVX2
(AVX-512, VNNI, AMX, bf16, fp16 conversions) from :attr:`Platform.isa_flags`.
``FIVEFOLD_FORCE_ISA=avx2`` does the same for Fivefold alone.

``fivefold env`` prints :func:`describe` with the kernel chosen for each path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform as _platform
from dataclasses import dataclass

# Flags that an AVX2-only x86 CPU (Zen 2/3, Haswell..Comet Lake) does not have.
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_vnni_int8", "avx_ifma", "avx10")
# The flags that change what our kernels and PyTorch's can run (the rest do not matter here).
_RELEVANT = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "avx_ne_convert", "asimd", "asimddp",
             "bf16", "i8mm", "sve")
# (variable, values meaning "AVX2 or below") of the libraries' own forcing switches.
_FORCING = (("ATEN_CPU_CAPABILITY", ("avx2", "default")),
            ("ONEDNN_MAX_CPU_ISA", ("avx2", "avx", "sse41", "default")),
            ("DNNL_MAX_CPU_ISA", ("avx2", "avx", "sse41", "default")),
            ("FBGEMM_ENABLE_INSTRUCTIONS", ("avx2",)),
            ("FIVEFOLD_FORCE_ISA", ("avx2",)))


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or _platform.processor() or _platform.machine(), flags


def forced_by() -> str | None:
    """The environment variable forcing AVX2-level paths, as ``NAME=value``, or None."""
    for var, values in _FORCING:
        if os.environ.get(var, "").strip().lower() in values:  # AVX2_VNNI is not listed: int8 stays exact
            return f"{var}={os.environ[var]}"
    return None


@dataclass(frozen=True)
class Platform:
    """What this CPU can run, after forcing. Build with :func:`current_platform`."""

    arch: str  # "x86_64", "aarch64", ...
    cpu_name: str
    isa_flags: frozenset[str]  # the CPU's flags that kernels may use (forcing applied)
    forced: str | None  # the variable that forced AVX2 paths, or None
    num_cores: int

    @property
    def num_threads(self) -> int:
        """torch's intra-op threads (read live: callers may change them)."""
        import torch

        return torch.get_num_threads()

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "AMD64", "i686")

    def has(self, *flags: str) -> bool:
        return all(f in self.isa_flags for f in flags)

    @property
    def has_avx512(self) -> bool:
        return self.has("avx512f", "avx512bw", "avx512vl", "avx512dq")

    @property
    def has_vnni(self) -> bool:
        """int8 dot products accumulated straight into int32 (no int16 saturation)."""
        return self.has("avx512_vnni") or self.has("avx_vnni")

    @property
    def has_bf16_compute(self) -> bool:
        """Native bf16 arithmetic (AVX512-BF16 or AMX): without it bf16 is emulated and slower than float32."""
        return self.has("avx512_bf16") or self.has("amx_bf16") or (not self.is_x86 and self.has("bf16"))

    @property
    def can_pack_bf16(self) -> bool:
        """Whether oneDNN's bf16 linear (``mkldnn._reorder_linear_weight``) runs here: PyTorch
        requires avx512bw+vl+dq or avx_ne_convert on x86 and refuses with a RuntimeError otherwise."""
        if not self.is_x86:
            return False
        return self.has_avx512 or self.has("avx_ne_convert")

    @property
    def can_run_fp16(self) -> bool:
        """Whether oneDNN runs float16 GEMMs here (PyTorch requires AVX512-FP16 or AVX-NE-CONVERT on x86).
        Informational: Fivefold serves float32 and bfloat16."""
        return self.is_x86 and (self.has("avx512_fp16") or self.has("avx_ne_convert"))

    @property
    def isa_level(self) -> str:
        """One word for the vector ISA the kernels run: amx, avx512-vnni, avx512, avx2-vnni, avx2, neon, ..."""
        if not self.is_x86:
            return "neon" if self.has("asimd") or self.arch in ("aarch64", "arm64") else "generic"
        if self.has("amx_int8"):
            return "amx"
        if self.has_avx512:
            return "avx512-vnni" if self.has("avx512_vnni") else "avx512"
        if self.has("avx2", "fma"):
            return "avx2-vnni" if self.has("avx_vnni") else "avx2"
        return "sse"

    @property
    def compile_flags(self) -> list[str]:
        """``-march`` for our C++ extensions: the host's own ISA, or plain x86-64-v3 (AVX2 + FMA)
        when forced, so the forced run tests the binary an AVX2 machine builds."""
        if self.is_x86 and self.forced:
            return ["-march=x86-64-v3"]
        return ["-march=native"]

    @property
    def build_key(self) -> str:
        """Names a compiled extension: architecture, ISA level, hash of the relevant flags and the
        compile flags. Two hosts sharing a cache never load each other's binaries unless they
        were compiled for the same instructions."""
        text = f"{self.arch}|{' '.join(self.compile_flags)}|{' '.join(sorted(self.isa_flags & set(_RELEVANT)))}"
        return f"{self.arch}-{self.isa_level}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"

    def describe(self) -> dict:
        """The machine as recorded with every benchmark and registry run."""
        return {"arch": self.arch, "cpu": self.cpu_name, "isa_level": self.isa_level,
                "vnni": self.has_vnni, "avx512": self.has_avx512, "bf16_compute": self.has_bf16_compute,
                "onednn_bf16_pack": self.can_pack_bf16, "onednn_fp16": self.can_run_fp16, "forced": self.forced, "cores": self.num_cores,
                "threads": self.num_threads,
                "flags": sorted(self.isa_flags & set(_RELEVANT))}


def _usable_flags(flags: frozenset[str], forced: str | None) -> frozenset[str]:
    if not forced:
        return flags
    return frozenset(f for f in flags if not f.startswith(_ABOVE_AVX2))


@functools.lru_cache(maxsize=1)
def current_platform() -> Platform:
    """This process's platform (read once: the libraries read their forcing variables once too)."""
    import torch

    name, flags = _cpuinfo()
    forced = forced_by()
    arch = _platform.machine()
    if not flags and arch in ("x86_64", "AMD64"):  # no /proc/cpuinfo: what ATen detected
        capability = torch.backends.cpu.get_cpu_capability().lower()
        flags = frozenset({"avx2", "fma"} | ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}
                                             if "avx512" in capability else set()))
    return Platform(arch=arch, cpu_name=name, isa_flags=_usable_flags(flags, forced), forced=forced,
                    num_cores=os.cpu_count() or 1)


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; empty elsewhere). One is
    right: two (say torch's libgomp and a system libgomp of our extensions) mean two thread
    pools competing for the same cores."""
    names = ("libgomp", "libiomp", "libomp")
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if any(n in line for n in names)}
    except OSError:
        return []
    return sorted(os.path.realpath(p) for p in paths if p.startswith("/"))


@functools.lru_cache(maxsize=1)
def _libc_function(name: str):
    """glibc's ``name`` (``malloc_trim``, ``mallopt``), or None where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Loading converts one tensor after another through float32 temporaries of a few to a few hundred
    MB. glibc serves those from its heap once a freed block raised its mmap threshold, and freed
    heap pages stay in the process: a 122M-parameter W8A16 load peaked 573 MB above its start for
    124 MB of int8 weights, 362 MB when trimmed after each tensor. Called by the loader only: at run
    time the heap's reuse is what keeps a step's allocations cheap (see :func:`keep_step_heap`)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


# glibc's mallopt parameters (malloc.h) and the values a serving process runs with.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEP_MMAP_THRESHOLD = 32 << 20   # glibc's largest: blocks below it come from the heap
STEP_TRIM_THRESHOLD = 256 << 20  # free memory at the heap's top kept for the next step, at most


def keep_step_heap() -> bool:
    """Make glibc keep a step's freed blocks for the next step instead of unmapping them.

    By default glibc serves a block above its mmap threshold (128 KB, raised to the size of the
    last such block freed, 32 MB at most) with a fresh ``mmap`` and unmaps it on free, and gives the
    heap's top back to the OS beyond twice that. A fresh mapping costs one page fault per 4 KB on
    first touch. Which blocks land there, and when the top is trimmed, depends on the order of
    allocations and on where address randomization put the heap, so it varies by path and by
    process: in SmolLM2's 2048-token prompt steps under W8A16, some processes faulted in all 6,112
    pages of every 25 MB gate_up output again, 39.7 ms a call in the engine against 34 ms alone
    (Zen 4), and a test's three 24 MB outputs per step were faulted in again on every step in 7
    processes of 8. Fixed thresholds (which also turn off glibc's adjusting them) keep blocks below
    32 MB on the heap and up to 256 MB of freed heap mapped between steps: 35 ms, and no faults once
    the heap has grown over the first few steps.
    The cost is that much resident free memory between steps at most, as with tcmalloc or jemalloc
    (vLLM's CPU backend recommends preloading TCMalloc). Called by the model runner;
    the loader still trims after each layer (:func:`release_free_heap`). Returns False where the C
    library has no ``mallopt`` (not glibc)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); 8 GiB when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
