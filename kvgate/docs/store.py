"""Files, vector stores and their chunks, kept in SQLite (the embedded default: nothing to
run beside the server). A file's bytes live beside the database, one file each; its text,
the chunks with their vectors and BM25 terms, and every status live in the database, so the
search indexes are rebuilt from it at start without embedding anything again.

Everything is owned by a tenant; lookups take the caller's tenant (None: an admin, who sees
everything) and treat another tenant's object as absent.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.docs.chunking import Chunk

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, text TEXT, error TEXT
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS stores (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT, created_at INTEGER NOT NULL,
    last_active_at INTEGER NOT NULL, chunking TEXT NOT NULL, metadata TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS store_files (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, last_error TEXT, chunking TEXT NOT NULL, attributes TEXT NOT NULL,
    usage_bytes INTEGER NOT NULL DEFAULT 0, job TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (store_id, file_id)
);
CREATE TABLE IF NOT EXISTS chunks (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, seq INTEGER NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, section TEXT NOT NULL, text TEXT NOT NULL, terms TEXT NOT NULL,
    vector BLOB NOT NULL, PRIMARY KEY (store_id, file_id, seq)
);
"""


_INSERT_CHUNK = (
    'INSERT INTO chunks (store_id, file_id, seq, start, "end", section, text, terms, vector) '
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _chunk_row(c: StoredChunk) -> tuple[Any, ...]:
    return (
        c.store_id, c.file_id, c.seq, c.chunk.start, c.chunk.end,
        json.dumps(c.chunk.section, ensure_ascii=False), c.chunk.text, "\x1f".join(c.terms),
        c.vector.astype(np.float32).tobytes(),
    )  # fmt: skip


def default_dir() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kvgate"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    text: str | None = None  # its text, once extracted
    error: str | None = None  # why it has none

    def as_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "error" if self.error else "processed",
            "status_details": self.error,
        }


@dataclass(frozen=True)
class StoreRecord:
    id: str
    tenant: str
    name: str | None
    created_at: int
    last_active_at: int
    chunking: dict[str, Any]
    metadata: dict[str, Any]


@dataclass(frozen=True)
class StoreFileRecord:
    store_id: str
    file_id: str
    created_at: int
    status: str  # in_progress | completed | failed | cancelled
    last_error: dict[str, str] | None
    chunking: dict[str, Any]
    attributes: dict[str, Any]
    usage_bytes: int
    #: The ingestion job that indexes this row's file: a file added again gets a new one,
    #: and only the current job may write its chunks or its end.
    job: str = ""


@dataclass(frozen=True)
class StoredChunk:
    store_id: str
    file_id: str
    seq: int
    chunk: Chunk
    terms: list[str]
    vector: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.file_id}#{self.seq}"


class DocStore:
    """The SQLite database and the folder of file bytes under ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        (self.directory / "files").mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            self.directory / "docs.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    @staticmethod
    def _owned(tenant: str | None) -> tuple[str, tuple[Any, ...]]:
        return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))

    # ------------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        return self.directory / "files" / file_id

    def add_file(self, tenant: str, filename: str, purpose: str, data_path: Path) -> FileRecord:
        """Take the uploaded bytes at ``data_path`` (moved into the store)."""
        record = FileRecord(
            new_id("file-"), tenant, filename, purpose, data_path.stat().st_size, int(time.time())
        )
        os.replace(data_path, self.file_path(record.id))
        self._write(
            "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, tenant, filename, purpose, record.bytes, record.created_at),
        )
        return record

    def set_text(self, file_id: str, text: str | None, error: str | None) -> None:
        self._write("UPDATE files SET text = ?, error = ? WHERE id = ?", (text, error, file_id))

    def file(self, file_id: str, tenant: str | None) -> FileRecord | None:
        where, args = self._owned(tenant)
        rows = self._rows(
            "SELECT id, tenant, filename, purpose, bytes, created_at, text, error FROM files "
            f"WHERE id = ?{where}",
            (file_id, *args),
        )
        return FileRecord(*rows[0]) if rows else None

    def files(self, tenant: str | None, purpose: str | None = None) -> list[FileRecord]:
        where, args = self._owned(tenant)
        if purpose is not None:
            where, args = where + " AND purpose = ?", (*args, purpose)
        rows = self._rows(
            "SELECT id, tenant, filename, purpose, bytes, created_at, NULL, error FROM files "
            f"WHERE 1 = 1{where} ORDER BY created_at DESC, rowid DESC",
            args,
        )
        return [FileRecord(*row) for row in rows]

    def usage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant stores."""
        ((count, total),) = self._rows(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?", (tenant,)
        )
        return int(count), int(total)

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM chunks WHERE file_id = ?", (file_id,))
            self._db.execute("DELETE FROM store_files WHERE file_id = ?", (file_id,))
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            self._db.execute("COMMIT")
        self.file_path(file_id).unlink(missing_ok=True)

    # ------------------------------------------------------------------ vector stores

    def add_store(
        self, tenant: str, name: str | None, chunking: dict[str, Any], metadata: dict[str, Any]
    ) -> StoreRecord:
        now = int(time.time())
        record = StoreRecord(new_id("vs_"), tenant, name, now, now, chunking, metadata)
        self._write(
            "INSERT INTO stores (id, tenant, name, created_at, last_active_at, chunking, metadata)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (record.id, tenant, name, now, now, json.dumps(chunking), json.dumps(metadata)),
        )
        return record

    def _store(self, row: tuple[Any, ...]) -> StoreRecord:
        id_, tenant, name, created, active = row[:5]
        return StoreRecord(
            id_, tenant, name, created, active, json.loads(row[5]), json.loads(row[6])
        )

    def store(self, store_id: str, tenant: str | None) -> StoreRecord | None:
        where, args = self._owned(tenant)
        rows = self._rows(
            "SELECT id, tenant, name, created_at, last_active_at, chunking, metadata FROM stores"
            f" WHERE id = ?{where}",
            (store_id, *args),
        )
        return self._store(rows[0]) if rows else None

    def stores(self, tenant: str | None) -> list[StoreRecord]:
        where, args = self._owned(tenant)
        rows = self._rows(
            "SELECT id, tenant, name, created_at, last_active_at, chunking, metadata FROM stores"
            f" WHERE 1 = 1{where} ORDER BY created_at DESC, rowid DESC",
            args,
        )
        return [self._store(r) for r in rows]

    def touch_store(self, store_id: str) -> None:
        self._write(
            "UPDATE stores SET last_active_at = ? WHERE id = ?", (int(time.time()), store_id)
        )

    def rename_store(self, store_id: str, name: str | None, metadata: dict[str, Any]) -> None:
        self._write(
            "UPDATE stores SET name = ?, metadata = ? WHERE id = ?",
            (name, json.dumps(metadata), store_id),
        )

    def delete_store(self, store_id: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM chunks WHERE store_id = ?", (store_id,))
            self._db.execute("DELETE FROM store_files WHERE store_id = ?", (store_id,))
            self._db.execute("DELETE FROM stores WHERE id = ?", (store_id,))
            self._db.execute("COMMIT")

    # ------------------------------------------------------------------ a store's files

    def add_store_file(
        self, store_id: str, file_id: str, chunking: dict[str, Any], attributes: dict[str, Any]
    ) -> StoreFileRecord:
        record = StoreFileRecord(
            store_id, file_id, int(time.time()), "in_progress", None, chunking, attributes, 0,
            new_id("job_"),
        )  # fmt: skip
        self._write(
            "INSERT OR REPLACE INTO store_files (store_id, file_id, created_at, status, "
            "last_error, chunking, attributes, usage_bytes, job) "
            "VALUES (?, ?, ?, ?, NULL, ?, ?, 0, ?)",
            (store_id, file_id, record.created_at, record.status, json.dumps(chunking),
             json.dumps(attributes), record.job),
        )  # fmt: skip
        return record

    def _store_file(self, row: tuple[Any, ...]) -> StoreFileRecord:
        error = json.loads(row[4]) if row[4] else None
        return StoreFileRecord(
            row[0], row[1], row[2], row[3], error, json.loads(row[5]), json.loads(row[6]), row[7],
            row[8],
        )  # fmt: skip

    def store_file(self, store_id: str, file_id: str) -> StoreFileRecord | None:
        rows = self._rows(
            "SELECT store_id, file_id, created_at, status, last_error, chunking, attributes, "
            "usage_bytes, job FROM store_files WHERE store_id = ? AND file_id = ?",
            (store_id, file_id),
        )
        return self._store_file(rows[0]) if rows else None

    def store_files(self, store_id: str, status: str | None = None) -> list[StoreFileRecord]:
        extra, args = ("", ()) if status is None else (" AND status = ?", (status,))
        rows = self._rows(
            "SELECT store_id, file_id, created_at, status, last_error, chunking, attributes, "
            f"usage_bytes, job FROM store_files WHERE store_id = ?{extra} "
            "ORDER BY created_at DESC, rowid DESC",
            (store_id, *args),
        )
        return [self._store_file(r) for r in rows]

    def counts(self, store_id: str) -> dict[str, int]:
        """``file_counts`` of a store, by status, with the total."""
        counts = {"in_progress": 0, "completed": 0, "failed": 0, "cancelled": 0}
        for status, n in self._rows(
            "SELECT status, COUNT(*) FROM store_files WHERE store_id = ? GROUP BY status",
            (store_id,),
        ):
            counts[status] = int(n)
        return {**counts, "total": sum(counts.values())}

    def usage_bytes(self, store_id: str) -> int:
        ((total,),) = self._rows(
            "SELECT COALESCE(SUM(usage_bytes), 0) FROM store_files WHERE store_id = ?",
            (store_id,),
        )
        return int(total)

    def finish_store_file(
        self,
        store_id: str,
        file_id: str,
        job: str,
        status: str,
        error: dict[str, str] | None = None,
    ) -> bool:
        """End job ``job`` of a store file without chunks (failed); False when the row is
        gone or belongs to a newer job."""
        return (
            self._write(
                "UPDATE store_files SET status = ?, last_error = ? "
                "WHERE store_id = ? AND file_id = ? AND job = ?",
                (status, json.dumps(error) if error else None, store_id, file_id, job),
            )
            > 0
        )

    def complete(
        self, store_id: str, file_id: str, job: str, chunks: Sequence[StoredChunk]
    ) -> bool:
        """Write job ``job``'s chunks and mark its file completed, in one transaction, only
        while the row is still that job's (a file removed or added again meanwhile is left
        to whoever did it); replaces any chunks the file had in the store."""
        usage = sum(len(c.chunk.text.encode()) for c in chunks)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                current = self._db.execute(
                    "SELECT 1 FROM store_files WHERE store_id = ? AND file_id = ? AND job = ?",
                    (store_id, file_id, job),
                ).fetchall()
                if not current:
                    self._db.execute("ROLLBACK")
                    return False
                self._db.execute(
                    "DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id)
                )
                self._db.executemany(_INSERT_CHUNK, [_chunk_row(c) for c in chunks])
                self._db.execute(
                    "UPDATE store_files SET status = 'completed', last_error = NULL, "
                    "usage_bytes = ? WHERE store_id = ? AND file_id = ?",
                    (usage, store_id, file_id),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def remove_store_file(self, store_id: str, file_id: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id)
            )
            self._db.execute(
                "DELETE FROM store_files WHERE store_id = ? AND file_id = ?", (store_id, file_id)
            )
            self._db.execute("COMMIT")

    # ------------------------------------------------------------------ chunks

    def chunks(self, store_id: str) -> Iterator[StoredChunk]:
        rows = self._rows(
            'SELECT store_id, file_id, seq, start, "end", section, text, terms, vector '
            "FROM chunks WHERE store_id = ? ORDER BY file_id, seq",
            (store_id,),
        )
        for r in rows:
            chunk = Chunk(r[6], r[3], r[4], tuple(json.loads(r[5])))
            terms = r[7].split("\x1f") if r[7] else []
            yield StoredChunk(r[0], r[1], r[2], chunk, terms, np.frombuffer(r[8], np.float32))

    def chunk(self, store_id: str, key: str) -> StoredChunk | None:
        file_id, _, seq = key.rpartition("#")
        rows = self._rows(
            'SELECT store_id, file_id, seq, start, "end", section, text, terms, vector '
            "FROM chunks WHERE store_id = ? AND file_id = ? AND seq = ?",
            (store_id, file_id, int(seq)),
        )
        if not rows:
            return None
        r = rows[0]
        chunk = Chunk(r[6], r[3], r[4], tuple(json.loads(r[5])))
        terms = r[7].split("\x1f") if r[7] else []
        return StoredChunk(r[0], r[1], r[2], chunk, terms, np.frombuffer(r[8], np.float32))
