"""C++ kernels of our own, compiled on first use with torch.utils.cpp_extension.

Built once per machine (about 30 s on 2 cores) into ``$FIVEFOLD_CACHE/torch_extensions``
(``make`` does it during set-up) and loaded from there afterwards. When no compiler
is available, or ``FIVEFOLD_DISABLE_KERNELS=1`` is set, callers fall back to their
pure-PyTorch path; the choice is reported by :func:`kernel_status`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

_SOURCES = Path(__file__).parent
_module = None
_error: str | None = None


def paged_attention_ops():
    """The op namespace ``torch.ops.fivefold`` (with ``paged_decode_attention``), or None if it cannot be built."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    if os.environ.get("FIVEFOLD_DISABLE_KERNELS") == "1":
        _error = "disabled by FIVEFOLD_DISABLE_KERNELS=1"
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        from fivefold.models.tokenizer import cache_dir

        import hashlib

        import torch

        # One build per torch installation: two environments sharing a build directory
        # would recompile each other's build (ninja sees the include paths change).
        key = hashlib.sha256(f"{torch.__file__}|{torch.__version__}".encode()).hexdigest()[:12]
        build_dir = cache_dir() / "torch_extensions" / f"paged_attention-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        _module = load_inline(
            name="fivefold_paged_attention",
            cpp_sources=[(_SOURCES / "paged_attention.cpp").read_text()],
            functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
        )
        _module = torch.ops.fivefold  # loading the library registered the op with the dispatcher
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, say so once
        _error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        warnings.warn(f"fivefold: paged attention kernel unavailable, using the PyTorch path ({_error})")
    return _module


def kernel_status() -> str:
    return "compiled" if paged_attention_ops() is not None else f"unavailable ({_error})"
