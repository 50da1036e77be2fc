"""What identifies a model's weights: a SHA-256 of their content, not of their path or size.

The result cache keys answers by it (two fine-tunes of the same size must never share an
answer) and the run registry records it. Reading a checkpoint whole takes a fraction of a
second per 100 MB, so each file's digest is computed once and kept in
``$FIVEFOLD_CACHE/fingerprints.json``, keyed by the file's absolute path, size and
modification time (a rewritten file has a new mtime and is hashed again).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from fivefold.paths import fingerprints_file

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".json")  # .json: config and tokenizer


def _digest_store() -> Path:
    return fingerprints_file()


def _load_store() -> dict[str, str]:
    try:
        return json.loads(_digest_store().read_text())
    except (OSError, ValueError):
        return {}  # absent or half-written by a concurrent process: start again


def _save_store(store: dict[str, str]) -> None:
    path = _digest_store()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
            json.dump(store, fh)
        os.replace(fh.name, path)  # atomic: replicas starting together never read a torn file
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def file_digest(path: Path, store: dict[str, str] | None = None) -> str:
    """SHA-256 of one file's bytes, from ``store`` when its path, size and mtime are known."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if store is not None and key in store:
        return store[key]
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if store is not None:
        store[key] = digest
    return digest


def weights_fingerprint(path: str | Path) -> str:
    """16 hex digits naming the content of a checkpoint file or directory (weights, config,
    tokenizer); the same bytes anywhere give the same fingerprint."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    store = _load_store()
    known = len(store)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{file_digest(f, store)}\n".encode())
    if len(store) != known:
        _save_store(store)
    return h.hexdigest()[:16]


def model_fingerprint(model: str | None) -> str | None:
    """``weights_fingerprint`` of a model name or path (None when it cannot be resolved)."""
    if not model:
        return None
    try:
        from fivefold.models.registry import resolve_model_path

        return weights_fingerprint(resolve_model_path(model))
    except Exception:  # an unknown name or an unreadable path: the run is recorded without one
        return None
