"""Where fivefold keeps what it computes once and reuses: one root, ``$FIVEFOLD_CACHE``
(default ``~/.cache/fivefold``), and one function per kind of file under it.

    tokenizers/           GGUF tokenizers rebuilt as Hugging Face directories (models/tokenizer.py)
    torch_extensions/     the C++ kernels, one build directory per source hash and ISA (kernels/)
    fingerprints.json     content hashes of checkpoints, by path, size and mtime (models/fingerprint.py)
    peaks.json            the machine's measured bandwidth and FLOP/s (profile/roofline.py)

The run registry and traces live in the working directory's ``.fivefold/`` instead: they
belong to a project, not to the machine.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$FIVEFOLD_CACHE``, or ``~/.cache/fivefold``."""
    return Path(os.environ.get("FIVEFOLD_CACHE", Path.home() / ".cache" / "fivefold"))


def tokenizer_cache_dir() -> Path:
    return cache_dir() / "tokenizers"


def kernel_build_root() -> Path:
    return cache_dir() / "torch_extensions"


def fingerprints_file() -> Path:
    return cache_dir() / "fingerprints.json"


def peaks_file() -> Path:
    return cache_dir() / "peaks.json"
