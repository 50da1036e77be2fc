"""C++ kernels of our own, compiled on first use with torch.utils.cpp_extension.

Each is built once per machine and torch installation (about 30 s on 2 cores) into
``$FIVEFOLD_CACHE/torch_extensions`` (``make`` does it during set-up) and loaded from
there afterwards. The build directory is named by the torch installation and by
:attr:`fivefold.platform.Platform.build_key` (architecture, ISA level, the CPU flags
and ``-march`` it was compiled for), so a cache shared between an AVX-512 and an AVX2
host never hands one a binary compiled for the other's instructions (SIGILL). With
AVX2 forced (see :mod:`fivefold.platform`) the kernels are compiled for x86-64-v3.
OpenMP: the extensions link ``libgomp.so.1``, which resolves to the copy torch has
already loaded, so one OpenMP runtime (one thread pool) serves both. Each registers its
ops with the dispatcher under ``torch.ops.fivefold`` (so torch.profiler sees them by name, with shapes). When no
compiler is available, or ``FIVEFOLD_DISABLE_KERNELS=1`` is set, callers fall back to
their pure-PyTorch path; the choice is reported by :func:`kernel_status`.

- ``paged_attention.cpp``: decode attention reading keys and values in place from KV blocks;
- ``linear_stream.cpp``: the weight-streaming linear of decode-sized batches (1-16 rows) for
  float32, bfloat16 and int8 (W8A16) weights;
- ``int8_linear.cpp``: the exact int8 x int8 -> int32 matmul that W8A8 runs where the libraries'
  kernels saturate;
- ``int4_linear.cpp``: the weight-streaming linear of 4-bit weights with group scales (symmetric,
  zero point or minimum; GGUF Q4_0/Q4_1 blocks as they are), times float activations (W4A16) or
  int8 activations per block of 32 with integer dot products (W4A8: VNNI, or vpmaddubsw on AVX2);
- ``fused_ops.cpp``: the decoder's fused elementwise chains (add + RMSNorm, SiLU * up, RoPE on q and k);
- ``gguf_blocks.cpp``: GGUF's Q4_0, Q4_1, Q4_K and Q6_K blocks unpacked to codes and scales at load time;
- ``decode_loop.cpp``: the decoder's layer loop of a decode step, calling the kernels above (and
  oneDNN's GEMM) without a Python call between them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path

_SOURCES = Path(__file__).parent
_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}


# Kernels that call others (through the dispatcher) and are not loaded without them.
_DEPENDS_ON = {"int8_linear": ("linear_stream",),
               "decode_loop": ("paged_attention", "linear_stream", "int4_linear", "fused_ops")}


def _load(name: str) -> object | None:
    """Build (or load) ``<name>.cpp`` after the kernels it depends on; return ``torch.ops.fivefold``
    or None if it, or one of them, cannot be built."""
    if name in _loaded or name in _errors:
        return _loaded.get(name)
    if any(_load(dep) is None for dep in _DEPENDS_ON.get(name, ())):
        return None
    if os.environ.get("FIVEFOLD_DISABLE_KERNELS") == "1":
        _errors[name] = "disabled by FIVEFOLD_DISABLE_KERNELS=1"
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load_inline

        from fivefold.paths import kernel_build_root
        from fivefold.platform import current_platform

        build_dir = kernel_build_root() / build_dir_name(name)
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir, name):
            _copy_headers(build_dir)
            load_inline(
                name=f"fivefold_{name}",
                cpp_sources=[(_SOURCES / f"{name}.cpp").read_text()],
                extra_cflags=["-O3", *current_platform().compile_flags, "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                # The shared headers (simd.h), copied beside the build: an include path into this
                # checkout would make every checkout's build.ninja differ, and ninja would rebuild
                # whenever two checkouts of the same sources took turns with one cache.
                extra_include_paths=[str(build_dir)],
                build_directory=str(build_dir),
                is_python_module=False,  # the library registers its ops with the dispatcher when loaded
            )
        _loaded[name] = torch.ops.fivefold
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, say so once
        _errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(f"fivefold: kernel {name} unavailable, using the PyTorch path ({_errors[name]})")
    return _loaded.get(name)


def _copy_headers(build_dir: Path) -> None:
    """The shared headers into ``build_dir``, each written only when its content changed (a new
    mtime alone would make ninja rebuild)."""
    for header in _SOURCES.glob("*.h"):
        target = build_dir / header.name
        content = header.read_bytes()
        if not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)


TORCH_LOCK = "lock"  # the file torch.utils.cpp_extension creates while it builds, and waits on forever
OUR_LOCK = "fivefold-build.lock"


@contextlib.contextmanager
def build_lock(build_dir: Path, name: str):
    """Hold the build directory for this process, around torch's own build.

    torch marks a build with a ``lock`` file that it removes when done; a build killed midway
    (Ctrl-C, a CI timeout, the OOM killer) leaves it behind and every later process waits on it
    forever, silently. So every fivefold build first takes an ``flock`` on ``fivefold-build.lock``:
    the kernel drops that lock when its holder dies, however it dies. Whoever holds it is the only
    builder, so a torch ``lock`` found then is stale: it is removed, with one line saying so, and the
    kernel is rebuilt."""
    import fcntl
    import sys

    with open(build_dir / OUR_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            print(f"fivefold: waiting for {holder} to finish building kernel {name} ({build_dir})", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        stale = build_dir / TORCH_LOCK
        if stale.exists():
            print(f"fivefold: kernel {name}: removing the stale lock of an interrupted build ({stale}); rebuilding",
                  file=sys.stderr)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_dir_name(name: str) -> str:
    """``<name>-<torch installation>-<source hash>-<platform build key>``: one build per torch
    installation (two environments sharing a directory would recompile each other's build: ninja
    sees the include paths change), per source text (two checkouts with different sources sharing
    the cache would otherwise rebuild over each other's library; the shared headers count as part of
    every kernel's source) and per instruction set compiled for."""
    import torch

    from fivefold.platform import current_platform

    torch_key = hashlib.sha256(f"{torch.__file__}|{torch.__version__}".encode()).hexdigest()[:12]
    source = _SOURCES / f"{name}.cpp"
    # A name with no source (fivefold env shows the pattern with name "<name>") gets a placeholder.
    headers = b"".join(h.read_bytes() for h in sorted(_SOURCES.glob("*.h")))
    source_key = hashlib.sha256(source.read_bytes() + headers).hexdigest()[:8] if source.exists() else "<source>"
    return f"{name}-{torch_key}-{source_key}-{current_platform().build_key}"


def paged_attention_ops():
    """``torch.ops.fivefold`` with ``paged_decode_attention``, or None if it cannot be built."""
    return _load("paged_attention")


def int8_ops():
    """``torch.ops.fivefold`` with ``int8_weight_linear``, ``int8_int8_matmul`` and ``int8_int8_linear``, or None if it cannot be built."""
    return _load("int8_linear")


def stream_ops():
    """``torch.ops.fivefold`` with ``stream_linear`` (and ``int8_weight_linear``), or None."""
    return _load("linear_stream")


def int4_ops():
    """``torch.ops.fivefold`` with ``int4_pack``, ``int4_unpack``, ``int4_pack_groups``, ``int4_linear`` and
    ``int4_linear_int8``, or None."""
    return _load("int4_linear")


def fused_ops():
    """``torch.ops.fivefold`` with ``fused_add_rms_norm_``, ``silu_and_mul``, ``rotary_qk_`` and ``rotate_qk_``, or None."""
    return _load("fused_ops")


def gguf_block_ops():
    """``torch.ops.fivefold`` with ``gguf_q4_unpack``, ``gguf_q4_k_unpack`` and ``gguf_q6_k_unpack``, or
    None (the loader then unpacks the blocks with numpy)."""
    return _load("gguf_blocks")


def decode_loop_ops():
    """``torch.ops.fivefold`` with ``decode_layers``, or None; it calls the decode attention, streaming
    linear and fused kernels through the dispatcher, so it is available only when they all are."""
    return _load("decode_loop")


def _why_unavailable(name: str) -> str:
    if name in _errors:
        return _errors[name]
    missing = [d for d in _DEPENDS_ON.get(name, ()) if d in _errors]
    return f"needs {', '.join(missing)}: {_errors[missing[0]]}" if missing else "not loaded"


def kernel_status() -> str:
    parts = []
    for name, loader in (("paged_attention", paged_attention_ops), ("linear_stream", stream_ops),
                         ("int8_linear", int8_ops), ("int4_linear", int4_ops), ("fused_ops", fused_ops),
                         ("gguf_blocks", gguf_block_ops), ("decode_loop", decode_loop_ops)):
        parts.append(f"{name} " + ("compiled" if loader() is not None else f"unavailable ({_why_unavailable(name)})"))
    return ", ".join(parts)
