"""The disk KV tier: one file per full block, under a folder named by the KV format, with a
size limit and least-recently-used eviction; it survives restarts.

Layout: ``<root>/<format>/<key hex>.kvb``. ``format`` is a digest of everything that makes
a block's bytes mean something (the weights, the model's config, the settings that change
its KV, the KV layout, dtype and block size, kvgate's version: ``kv_transfer.tier_format``),
so another model, KV dtype or weights version never finds a file of this one. Each file
repeats the format and the key in its header and carries its payload's CRC-32: a file that
is truncated, corrupt or misplaced is skipped with a log line and removed, never loaded.

A file is written to a temporary name and renamed into place (a reader never sees half a
file); temporary files left by a crash are removed at open. The index (key -> size, in LRU
order) is rebuilt at open from the folder, oldest modification time first. Thread-safe: the
engine thread asks (``lookup``), the I/O threads read and write.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvgate.engine.block_pool import BlockHash
from kvgate.engine.offload import TierCounters, TierState
from kvgate.private_files import open_private, private_dir

log = logging.getLogger("kvgate.engine")

MAGIC = b"KVGTIER1"
#: magic, format digest (32), key (32), payload bytes (u64), payload CRC-32 (u32).
_HEADER = struct.Struct("<8s32s32sQI")
SUFFIX = ".kvb"


def default_dir() -> Path:
    """``$KVGATE_DATA_DIR/kv-tier``, else ``kvgate/kv-tier`` in ``$XDG_DATA_HOME`` or
    ``~/.local/share`` (beside the server's other data)."""
    data = os.environ.get("KVGATE_DATA_DIR")
    if data:
        return Path(data) / "kv-tier"
    home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(home) / "kvgate" / "kv-tier"


class DiskTier:
    kind = "disk"

    def __init__(self, root: str | os.PathLike[str], fmt: bytes, capacity_bytes: int) -> None:
        """``fmt``: the 32-byte KV format digest; ``capacity_bytes``: the size limit (files,
        headers included)."""
        if len(fmt) != 32:
            raise ValueError("the KV format digest must be 32 bytes")
        if capacity_bytes <= 0:
            raise ValueError(f"the KV tier's size must be positive, got {capacity_bytes}")
        self.fmt = fmt
        self.capacity_bytes = capacity_bytes
        private_dir(root, ours=False)
        self.dir, self._lock_file = _claim(Path(root), fmt.hex()[:32])
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # key -> file bytes, LRU first
        self._pins: dict[BlockHash, int] = {}
        self._pending: dict[BlockHash, int] = {}  # stores on their way -> reserved bytes
        self._used = 0
        self._open()

    # ------------------------------------------------------------------ index
    def _open(self) -> None:
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()  # a write a crash interrupted
                continue
            if not path.name.endswith(SUFFIX):
                continue  # the lock, or a stranger
            try:
                key = bytes.fromhex(path.name[: -len(SUFFIX)])
                st = path.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 32:
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        if found:
            log.info(
                "KV tier %s: %d blocks (%.1f MiB) from an earlier run",
                self.dir, len(found), self._used / 2**20,
            )  # fmt: skip
        self._evict_to(self.capacity_bytes)
        others = [p for p in self.dir.parent.iterdir() if p.is_dir() and p != self.dir]
        if others:
            size = sum(f.stat().st_size for p in others for f in p.glob(f"*{SUFFIX}"))
            log.warning(
                "KV tier: %d other folders in %s hold %.1f MiB of KV in other formats (other "
                "models, KV dtypes, kvgate versions or replicas); --kv-tier-size does not "
                "count them: remove those no server uses",
                len(others), self.dir.parent, size / 2**20,
            )  # fmt: skip

    def touch(self, keys: Sequence[BlockHash]) -> None:
        """Mark loaded files used, on disk too: a restart orders its LRU by their times."""
        for key in keys:
            with contextlib.suppress(OSError):
                os.utime(self.path(key))

    def path(self, key: BlockHash) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
            return n

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._index

    def prepare_load(self, keys: Sequence[BlockHash]) -> bool:
        with self._lock:
            if any(k not in self._index for k in keys):
                return False
            for k in keys:
                self._pins[k] = self._pins.get(k, 0) + 1
            return True

    def complete_load(self, keys: Sequence[BlockHash]) -> None:
        with self._lock:
            for k in keys:
                left = self._pins.get(k, 0) - 1
                if left > 0:
                    self._pins[k] = left
                else:
                    self._pins.pop(k, None)
                if k in self._index:
                    self._index.move_to_end(k)

    def prepare_store(self, keys: Sequence[BlockHash], nbytes: int) -> list[BlockHash]:
        size = _HEADER.size + nbytes
        with self._lock:
            fresh = [
                k for k in dict.fromkeys(keys) if k not in self._index and k not in self._pending
            ]
            room = self.capacity_bytes - size * len(fresh)
            if room < 0:
                fresh = fresh[: self.capacity_bytes // size]
                room = self.capacity_bytes - size * len(fresh)
            self._evict_to(room)
            # Pinned blocks may have kept more than room: store what fits.
            fit = max(0, (self.capacity_bytes - self._used) // size)
            fresh = fresh[:fit]
            self._pending.update(dict.fromkeys(fresh, size))
            self._used += size * len(fresh)  # reserved now, so concurrent stores see it
            return fresh

    def complete_store(self, keys: Sequence[BlockHash], ok: bool) -> None:
        """``keys`` were written (``ok``) or given up; their reservation becomes their file
        or is given back."""
        with self._lock:
            for k in keys:
                size = self._pending.pop(k, None)
                if size is None:
                    continue
                if ok:
                    self._index[k] = size
                else:
                    self._used -= size

    def _evict_to(self, limit: int) -> None:
        """Remove least recently used, unpinned files until at most ``limit`` bytes are used;
        under the lock."""
        for key in list(self._index):
            if self._used <= limit:
                return
            if key in self._pins:
                continue
            size = self._index.pop(key)
            self._used -= size
            self.counters.evicted_blocks += 1
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    def _forget(self, key: BlockHash) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    # ------------------------------------------------------------------ bytes
    def write(self, key: BlockHash, payload: bytes | bytearray | memoryview) -> bool:
        """Write one block's file (on an I/O thread, after ``prepare_store``)."""
        path = self.path(key)
        tmp = path.with_name(path.name + ".tmp")
        header = _HEADER.pack(MAGIC, self.fmt, key, len(payload), zlib.crc32(payload))
        try:
            with os.fdopen(open_private(tmp), "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("KV tier: writing %s failed (%s); not stored", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self.count(bytes_written=len(header) + len(payload))
        return True

    def read(self, key: BlockHash, nbytes: int) -> bytearray | None:
        """One block's payload of ``nbytes``, checked (``read_into``)."""
        out = bytearray(nbytes)
        return out if self.read_into(key, memoryview(out)) else None

    def read_into(self, key: BlockHash, out: memoryview) -> bool:
        """Read one block's payload into ``out`` (its size: the format's payload) and check
        it; False (the file skipped with a log line and removed) when it is missing,
        truncated, corrupt or not this format's."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                size = os.fstat(f.fileno()).st_size
                got = f.readinto(out) if len(header) == _HEADER.size else 0
        except FileNotFoundError:
            log.warning("KV tier: %s is gone; recomputing its block", path)
            self._forget(key)
            return False
        except OSError as exc:  # maybe passing (EMFILE, EIO): fail the load, keep the file
            log.warning("KV tier: %s unreadable (%s); recomputing its block", path, exc)
            return False
        why = self._check(header, size, got, key, out)
        if why is not None:
            log.warning("KV tier: skipping %s: %s; recomputing its block", path, why)
            self.count(corrupt=1)
            self._forget(key)
            return False
        self.count(bytes_read=size)
        return True

    def _check(
        self, header: bytes, size: int, got: int, key: BlockHash, out: memoryview
    ) -> str | None:
        nbytes = out.nbytes
        if len(header) < _HEADER.size:
            return f"truncated ({size} bytes, shorter than its header)"
        magic, fmt, stored_key, length, crc = _HEADER.unpack(header)
        if magic != MAGIC:
            return "not a kvgate KV tier file"
        if fmt != self.fmt:
            return "written for another model or KV format"
        if stored_key != key:
            return "holds another block"
        if length != nbytes:
            return f"a payload of {length} bytes where this KV format has {nbytes}"
        if size != _HEADER.size + length or got != length:
            return f"truncated ({size - _HEADER.size} of {length} payload bytes)"
        if zlib.crc32(out) != crc:
            return "corrupt (CRC-32 mismatch)"
        return None

    def count(self, **deltas: float) -> None:
        """Add to counters (from any thread)."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    def state(self) -> TierState:
        with self._lock:
            c = TierCounters(**vars(self.counters))
            return TierState(self.kind, self._used, self.capacity_bytes, len(self._index), c)

    def close(self) -> None:
        """Give the folder up (another engine may claim it)."""
        with contextlib.suppress(OSError):
            os.close(self._lock_file)


def _claim(root: Path, name: str) -> tuple[Path, int]:
    """The folder ``name`` under ``root``, locked for this process (an advisory ``flock`` on
    its ``.lock``, released when the process ends): two engines of one format (replicas on
    one host, or two servers) must not evict and overwrite each other's files, so a second
    one takes ``name.1``, then ``name.2``... Returns the folder and the lock's descriptor."""
    for n in range(64):
        folder = private_dir(root / (name if n == 0 else f"{name}.{n}"))
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return folder, fd
    raise OSError(f"every KV tier folder of this format under {root} is in use")
