"""The weights fingerprint is a hash of the content: same-size checkpoints that differ in
one byte differ, the same bytes elsewhere agree, and a file is re-hashed only when its
path, size or mtime change."""

from __future__ import annotations

import os

import pytest

from fivefold.models import fingerprint
from fivefold.models.fingerprint import weights_fingerprint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fingerprints.json"


def _checkpoint(path, middle: bytes):
    path.mkdir()
    # Same size, same first and last MiB: only the middle differs (what the old sampled hash missed).
    (path / "model.safetensors").write_bytes(b"a" * (2 << 20) + middle + b"z" * (2 << 20))
    (path / "config.json").write_text('{"hidden_size": 8}')
    return path


def test_same_size_fine_tunes_differ_and_copies_agree(tmp_path, cache):
    a = _checkpoint(tmp_path / "a", b"\x00" * 64)
    b = _checkpoint(tmp_path / "b", b"\x00" * 63 + b"\x01")
    copy = _checkpoint(tmp_path / "copy", b"\x00" * 64)
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(a) == weights_fingerprint(copy)
    assert len(weights_fingerprint(a)) == 16 and cache.exists()


def test_digests_are_cached_by_path_size_and_mtime(tmp_path, cache, monkeypatch):
    a = _checkpoint(tmp_path / "a", b"\x00" * 64)
    first = weights_fingerprint(a)
    calls = []
    real = fingerprint.hashlib.file_digest
    monkeypatch.setattr(fingerprint.hashlib, "file_digest", lambda *args: calls.append(1) or real(*args))
    assert weights_fingerprint(a) == first and calls == [], "nothing is re-read while path, size and mtime hold"
    weights = a / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert weights_fingerprint(a) != first and calls == [1], "a rewritten file is hashed again, alone"


def test_a_torn_store_is_rebuilt(tmp_path, cache):
    a = _checkpoint(tmp_path / "a", b"\x00" * 64)
    first = weights_fingerprint(a)
    cache.write_text('{"half": ')
    assert weights_fingerprint(a) == first
