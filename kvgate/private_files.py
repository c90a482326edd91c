"""Data at rest readable by its owner only: what kvgate writes (the documents database, the
usage ledger, uploads, lock files) is made 0600 and the directories it makes 0700, whatever
the process's umask (which only ever takes permission bits away from a mode asked for, so
an explicit ``chmod`` after creating is what makes the mode exact).

A directory kvgate did not make (a ``--data-dir`` an operator prepared) keeps its mode, but
``exposed`` says whether others may read or enter it, for the start-up check
(``kvgate serve --strict-data-dir`` refuses such a directory, else it is a warning).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
#: Permission bits that let a user other than the owner read, write or enter.
OTHERS = stat.S_IRWXG | stat.S_IRWXO


def private_dir(path: str | os.PathLike[str], *, ours: bool = True) -> Path:
    """``path`` as a directory, made (with its parents) if missing. Made here, or ``ours``
    (a folder kvgate alone lays out inside its data directory): mode 0700. A directory the
    operator made (``ours=False``) keeps its mode: ``exposed`` reports it."""
    path = Path(path)
    made = not path.is_dir()
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if made or ours:
        os.chmod(path, DIR_MODE)
    return path


def private_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a file of mode 0600: created empty if missing (before a library such as
    SQLite creates it with the umask's mode), tightened if it exists."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return path


def tighten(path: str | os.PathLike[str]) -> None:
    """An existing file of kvgate's (a database's ``-wal``/``-shm`` left by an older
    version) to 0600; nothing when it is absent."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(path, FILE_MODE)


def open_private(path: str | os.PathLike[str], mode: str = "w") -> int:
    """A file descriptor for ``path`` opened for writing (``w`` truncates, ``a`` appends),
    created 0600; for ``os.fdopen``."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if mode == "w" else os.O_APPEND)
    fd = os.open(path, flags, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def exposed(path: str | os.PathLike[str]) -> str | None:
    """Why others may read or enter ``path`` (its mode, in octal), else None (also when it
    does not exist yet: kvgate will make it 0700)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    if mode & OTHERS:
        return f"{os.fspath(path)} has mode {stat.S_IMODE(mode):04o} (others may read it)"
    return None
