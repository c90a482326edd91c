"""Files and folders made private whatever the umask; an operator's folder keeps its mode
but is reported."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.private_files import exposed, open_private, private_dir, private_file


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask-022", "umask-000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield int(request.param)
    finally:
        os.umask(old)


def test_what_kvgate_makes_is_its_owners_only(tmp_path: Path, umask: int) -> None:
    made = private_dir(tmp_path / "a" / "data", ours=False)
    assert _mode(made) == 0o700 and exposed(made) is None
    db = private_file(made / "docs.sqlite3")
    assert _mode(db) == 0o600 and db.stat().st_size == 0
    with os.fdopen(open_private(made / "lock"), "w") as f:
        f.write("x")
    assert _mode(made / "lock") == 0o600


def test_an_older_file_and_kvgates_own_folders_are_tightened(tmp_path: Path, umask: int) -> None:
    old = tmp_path / "docs.sqlite3"
    old.write_bytes(b"rows")
    old.chmod(0o644)
    assert _mode(private_file(old)) == 0o600 and old.read_bytes() == b"rows"  # not truncated
    folder = tmp_path / "files"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert _mode(private_dir(folder)) == 0o700


def test_an_operators_folder_keeps_its_mode_and_is_reported(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)
    assert _mode(private_dir(shared, ours=False)) == 0o750
    assert exposed(shared) == f"{shared} has mode 0750 (others may read it)"
    assert exposed(tmp_path / "absent") is None
