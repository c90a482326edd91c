"""The weights digest of a model version, and its cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kvgate.engine import lineage
from kvgate.engine.lineage import weights_digest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "digests"
    monkeypatch.setenv("KVGATE_DIGEST_CACHE", str(where))
    return where


def _plain(path: Path) -> str:
    return hashlib.sha256(path.name.encode() + path.read_bytes()).hexdigest()


def test_a_file_is_hashed_once_then_read_from_the_cache(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights" * 1000)
    first = weights_digest(str(model))
    assert first == (_plain(model), int(model.stat().st_mtime))
    assert len(list(cache.glob("*.json"))) == 1

    def no_hashing(*_: object) -> tuple[str, int]:
        raise AssertionError("hashed again with the files unchanged")

    monkeypatch.setattr(lineage, "_hash_files", no_hashing)
    assert weights_digest(str(model)) == first


def test_a_changed_file_is_hashed_again(tmp_path: Path, cache: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"a" * 100)
    before = weights_digest(str(model))
    model.write_bytes(b"b" * 100)  # same size: the modification time or inode tells
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    after = weights_digest(str(model))
    assert after[0] == _plain(model) != before[0]


def test_a_directory_digest_covers_names_and_contents(tmp_path: Path, cache: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 10)
    one = weights_digest(str(d))
    assert weights_digest(str(d)) == one  # from the cache
    (d / "extra.txt").write_text("more")
    assert weights_digest(str(d))[0] != one[0]


def test_an_unwritable_cache_only_costs_the_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVGATE_DIGEST_CACHE", str(blocker / "digests"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"w" * 10)
    assert weights_digest(str(model))[0] == _plain(model)
