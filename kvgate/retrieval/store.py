"""Files, vector stores and their chunks, kept in SQLite (the embedded default: nothing to
run beside the server) or in PostgreSQL (``--docs-url postgresql://...``: several replicas
share one store; ``docs/db.py``). A file's text, the chunks with their vectors and BM25
terms, and every status live in the database, so the search indexes are rebuilt from it at
start without embedding anything again.

Everything is owned by a tenant; lookups take the caller's tenant (None: an admin, who sees
everything) and treat another tenant's object as absent. What a tenant stores is counted as
it is written, and its quota (``docs/quota.py``) checked in the same transaction: an
upload's bytes, a file's extracted text (``files.text_bytes``), each store's chunks
(``store_files.chunks``, and ``usage_bytes``: the bytes of their text, terms, section and
vector as written).

The directory and what kvgate writes there are its owner's only (``private_files.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.private_files import private_dir
from kvgate.retrieval.chunking import Chunk
from kvgate.retrieval.db import Database, Row, Tx, open_database
from kvgate.retrieval.quota import (
    StorageLimits,
    StoredUsage,
    check_chunks,
    check_room,
    check_store,
    check_text,
    check_upload,
)

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


def _row_bytes(row: Sequence[Any]) -> int:
    """Bytes a chunk row stores: its section path, text, terms and vector."""
    return len(row[5].encode()) + len(row[6].encode()) + len(row[7].encode()) + len(row[8])


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
    #: When the job last said it was alive (unix seconds): its lease (``DocStore.beat``).
    beat_at: int = 0


@dataclass(frozen=True)
class StoredChunk:
    store_id: str
    file_id: str
    seq: int
    chunk: Chunk
    terms: list[str]
    #: Its whole text's vector then its paragraphs' (``retrieval.chunk_vectors``): written as
    #: ``[1 + n, dim]`` or ``[dim]``, read back flat (``HybridIndex.add`` takes either).
    vector: np.ndarray

    @property
    def key(self) -> str:
        return f"{self.file_id}#{self.seq}"


class DocStore:
    """The database (``docs/db.py``) and, for SQLite, the folder of file bytes under
    ``directory``; ``directory`` also spools uploads as they arrive."""

    def __init__(self, directory: str | os.PathLike[str], url: str | None = None) -> None:
        # The directory itself keeps the mode an operator gave it (the start-up check says
        # whether others may read it); the folders kvgate lays out in it are 0700.
        self.directory = private_dir(directory, ours=False)
        private_dir(self.directory / "files")
        private_dir(self.spool)
        self._db: Database = open_database(self.directory, url)
        self.url = url

    @property
    def spool(self) -> Path:
        """Where uploads are written as they arrive (0700; each upload 0600)."""
        return self.directory / "incoming"

    @property
    def shared(self) -> bool:
        """Other processes (replicas) may use this store at the same time."""
        return self._db.shared

    @property
    def where(self) -> str:
        """Where it is, for the log (a URL without its password)."""
        url = self._db.url
        if "@" in url and "://" in url:
            scheme, rest = url.split("://", 1)
            creds, host = rest.rsplit("@", 1)
            url = f"{scheme}://{creds.split(':', 1)[0]}@{host}"
        return url

    @property
    def database(self) -> Database:
        """The database itself, for what else keeps its rows beside the documents (stored
        responses)."""
        return self._db

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return self._db.rows(sql, args)

    def _write(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.write(sql, args)

    @staticmethod
    def _owned(tenant: str | None) -> tuple[str, tuple[Any, ...]]:
        return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))

    # ------------------------------------------------------------------ files

    def add_file(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        data_path: Path,
        limits: StorageLimits | None = None,
    ) -> FileRecord:
        """Take the uploaded bytes at ``data_path`` (moved into the store); over ``limits``:
        StorageQuotaExceeded, and the bytes stay where they are."""
        record = FileRecord(
            new_id("file-"), tenant, filename, purpose, data_path.stat().st_size, int(time.time())
        )
        with self._db.transaction() as tx:
            if limits is not None:
                self._hold(tx, tenant)
                check_upload(tenant, limits, self._usage(tx, tenant), record.bytes)
            if self.shared:
                tx.write(
                    "INSERT INTO file_data (id, data) VALUES (?, ?)",
                    (record.id, data_path.read_bytes()),
                )
            tx.write(
                "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, tenant, filename, purpose, record.bytes, record.created_at),
            )
        if self.shared:
            data_path.unlink(missing_ok=True)
        else:
            os.replace(data_path, self._file_path(record.id))
        return record

    def _file_path(self, file_id: str) -> Path:
        return self.directory / "files" / file_id

    def local_file(self, file_id: str) -> Path | None:
        """The file's bytes on this machine's disk (SQLite), else None (they are in the
        database: ``file_bytes``)."""
        return None if self.shared else self._file_path(file_id)

    def file_bytes(self, file_id: str) -> bytes:
        """The uploaded bytes; FileNotFoundError once the file is deleted."""
        if not self.shared:
            return self._file_path(file_id).read_bytes()
        rows = self._rows("SELECT data FROM file_data WHERE id = ?", (file_id,))
        if not rows:
            raise FileNotFoundError(file_id)
        return bytes(rows[0][0])

    def set_text(self, file_id: str, text: str | None, error: str | None) -> None:
        """Keep the file's extracted text (or why it has none); a text that would pass its
        tenant's quota: StorageQuotaExceeded, and nothing is written."""
        size = len(text.encode()) if text is not None else 0
        with self._db.transaction() as tx:
            found = tx.rows("SELECT tenant FROM files WHERE id = ?", (file_id,))
            if not found:
                return
            tenant = found[0][0]
            if size:
                limits = self._lock_tenant(tx, tenant)
                check_text(tenant, limits, self._usage(tx, tenant, text_of=file_id), size)
            tx.write(
                "UPDATE files SET text = ?, error = ?, text_bytes = ? WHERE id = ?",
                (text, error, size, file_id),
            )

    # ------------------------------------------------------------------ quotas

    def set_limits(self, tenant: str, limits: StorageLimits) -> None:
        """The tenant's quota as its ingestion jobs (in another process) will check it."""
        self._write(
            "INSERT INTO quotas (tenant, limits) VALUES (?, ?) "
            "ON CONFLICT (tenant) DO UPDATE SET limits = excluded.limits",
            (tenant, limits.to_json()),
        )

    def _hold(self, tx: Tx, tenant: str) -> None:
        """Hold the tenant's storage until ``tx`` ends: its quota is checked and its data
        written by one transaction at a time."""
        if self._db.lock_tenant:
            tx.rows(self._db.lock_tenant, (tenant,))

    def _lock_tenant(self, tx: Tx, tenant: str) -> StorageLimits:
        """``_hold``, and the tenant's quota as last set (``set_limits``)."""
        self._hold(tx, tenant)
        rows = tx.rows("SELECT limits FROM quotas WHERE tenant = ?", (tenant,))
        return StorageLimits.from_json(rows[0][0]) if rows else StorageLimits()

    @staticmethod
    def _usage(
        tx: Tx, tenant: str, text_of: str = "", chunks_of: tuple[str, str] = ("", "")
    ) -> StoredUsage:
        """What ``tenant`` stores, without the text of file ``text_of`` and the chunks of
        ``chunks_of`` (store, file): what a write is about to replace."""
        ((files, uploaded, text),) = tx.rows(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), "
            "COALESCE(SUM(CASE WHEN id = ? THEN 0 ELSE text_bytes END), 0) "
            "FROM files WHERE tenant = ?",
            (text_of, tenant),
        )
        ((chunks, index),) = tx.rows(
            "SELECT COALESCE(SUM(f.chunks), 0), COALESCE(SUM(f.usage_bytes), 0) "
            "FROM store_files f JOIN stores s ON s.id = f.store_id "
            "WHERE s.tenant = ? AND NOT (f.store_id = ? AND f.file_id = ?)",
            (tenant, *chunks_of),
        )
        ((stores,),) = tx.rows("SELECT COUNT(*) FROM stores WHERE tenant = ?", (tenant,))
        return StoredUsage(
            int(files), int(uploaded), int(text), int(index), int(chunks), int(stores)
        )

    @staticmethod
    def _store_bytes(tx: Tx, store_id: str, without: str = "") -> int:
        ((total,),) = tx.rows(
            "SELECT COALESCE(SUM(usage_bytes), 0) FROM store_files "
            "WHERE store_id = ? AND file_id <> ?",
            (store_id, without),
        )
        return int(total)

    def check_room(self, tenant: str, store_id: str, file_id: str, limits: StorageLimits) -> None:
        """StorageQuotaExceeded when indexing ``file_id`` into the store cannot fit at all
        (the tenant or the store already at a limit, counting what it would replace)."""
        with self._db.transaction() as tx:
            used = self._usage(tx, tenant, chunks_of=(store_id, file_id))
            check_room(tenant, limits, used, self._store_bytes(tx, store_id, file_id))

    def check_chunks(self, store_id: str, file_id: str, chunks: Sequence[Chunk]) -> None:
        """Before embedding: StorageQuotaExceeded when these chunks alone (their text, not
        yet their terms and vectors) would pass the store's tenant's quota."""
        size = sum(len(c.text.encode()) for c in chunks)
        with self._db.transaction() as tx:
            self._check_chunks(tx, store_id, file_id, len(chunks), size)

    def _check_chunks(self, tx: Tx, store_id: str, file_id: str, count: int, size: int) -> None:
        found = tx.rows("SELECT tenant FROM stores WHERE id = ?", (store_id,))
        if not found:
            return
        tenant = found[0][0]
        limits = self._lock_tenant(tx, tenant)
        used = self._usage(tx, tenant, chunks_of=(store_id, file_id))
        check_chunks(tenant, limits, used, self._store_bytes(tx, store_id, file_id), count, size)

    def file(self, file_id: str, tenant: str | None, with_text: bool = True) -> FileRecord | None:
        """The file (its extracted text too unless ``with_text`` is False: a long law's is
        100k characters)."""
        where, args = self._owned(tenant)
        text = "text" if with_text else "NULL"
        rows = self._rows(
            f"SELECT id, tenant, filename, purpose, bytes, created_at, {text}, error FROM files "
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
            f"WHERE 1 = 1{where} ORDER BY created_at DESC, {self._db.rowid} DESC",
            args,
        )
        return [FileRecord(*row) for row in rows]

    def usage(self, tenant: str) -> StoredUsage:
        """What the tenant stores."""
        with self._db.transaction() as tx:
            return self._usage(tx, tenant)

    def delete_file(self, file_id: str) -> None:
        with self._db.transaction() as tx:
            tx.write("DELETE FROM chunks WHERE file_id = ?", (file_id,))
            tx.write("DELETE FROM store_files WHERE file_id = ?", (file_id,))
            tx.write("DELETE FROM files WHERE id = ?", (file_id,))
            if self.shared:
                tx.write("DELETE FROM file_data WHERE id = ?", (file_id,))
        if not self.shared:
            self._file_path(file_id).unlink(missing_ok=True)

    def stores_holding(self, file_id: str) -> list[str]:
        """The vector stores that hold the file."""
        rows = self._rows("SELECT store_id FROM store_files WHERE file_id = ?", (file_id,))
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ vector stores

    def add_store(
        self,
        tenant: str,
        name: str | None,
        chunking: dict[str, Any],
        metadata: dict[str, Any],
        limits: StorageLimits | None = None,
    ) -> StoreRecord:
        """A new vector store; one past ``limits``: StorageQuotaExceeded."""
        now = int(time.time())
        record = StoreRecord(new_id("vs_"), tenant, name, now, now, chunking, metadata)
        with self._db.transaction() as tx:
            if limits is not None:
                self._hold(tx, tenant)
                check_store(tenant, limits, self._usage(tx, tenant))
            tx.write(
                "INSERT INTO stores (id, tenant, name, created_at, last_active_at, chunking, "
                "metadata) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.id, tenant, name, now, now, json.dumps(chunking), json.dumps(metadata)),
            )
        return record

    def _store(self, row: Row) -> StoreRecord:
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
            f" WHERE 1 = 1{where} ORDER BY created_at DESC, {self._db.rowid} DESC",
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
        with self._db.transaction() as tx:
            tx.write("DELETE FROM chunks WHERE store_id = ?", (store_id,))
            tx.write("DELETE FROM store_files WHERE store_id = ?", (store_id,))
            tx.write("DELETE FROM stores WHERE id = ?", (store_id,))

    # ------------------------------------------------------------------ a store's files

    def add_store_file(
        self, store_id: str, file_id: str, chunking: dict[str, Any], attributes: dict[str, Any]
    ) -> StoreFileRecord:
        """The file in the store, to be indexed by a new job (replacing any row it had there,
        and that row's chunks)."""
        record = StoreFileRecord(
            store_id, file_id, int(time.time()), "in_progress", None, chunking, attributes, 0,
            new_id("job_"),
        )  # fmt: skip
        with self._db.transaction() as tx:
            tx.write("DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id))
            tx.write(
                "DELETE FROM store_files WHERE store_id = ? AND file_id = ?", (store_id, file_id)
            )
            tx.write(
                "INSERT INTO store_files (store_id, file_id, created_at, status, last_error, "
                "chunking, attributes, usage_bytes, job, beat_at) "
                "VALUES (?, ?, ?, ?, NULL, ?, ?, 0, ?, ?)",
                (store_id, file_id, record.created_at, record.status, json.dumps(chunking),
                 json.dumps(attributes), record.job, record.created_at),
            )  # fmt: skip
        return record

    def _store_file(self, row: Row) -> StoreFileRecord:
        error = json.loads(row[4]) if row[4] else None
        return StoreFileRecord(
            row[0], row[1], row[2], row[3], error, json.loads(row[5]), json.loads(row[6]), row[7],
            row[8], row[9],
        )  # fmt: skip

    _STORE_FILE = (
        "SELECT store_id, file_id, created_at, status, last_error, chunking, attributes, "
        "usage_bytes, job, beat_at FROM store_files"
    )

    def store_file(self, store_id: str, file_id: str) -> StoreFileRecord | None:
        rows = self._rows(
            f"{self._STORE_FILE} WHERE store_id = ? AND file_id = ?", (store_id, file_id)
        )
        return self._store_file(rows[0]) if rows else None

    def store_files(self, store_id: str, status: str | None = None) -> list[StoreFileRecord]:
        extra, args = ("", ()) if status is None else (" AND status = ?", (status,))
        rows = self._rows(
            f"{self._STORE_FILE} WHERE store_id = ?{extra} "
            f"ORDER BY created_at DESC, {self._db.rowid} DESC",
            (store_id, *args),
        )
        return [self._store_file(r) for r in rows]

    def completed_jobs(self, store_id: str) -> dict[str, str]:
        """The store's indexed files: file id -> the job whose chunks it holds."""
        rows = self._rows(
            "SELECT file_id, job FROM store_files WHERE store_id = ? AND status = 'completed'",
            (store_id,),
        )
        return {r[0]: r[1] for r in rows}

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

    def beat(self, store_id: str, file_id: str, job: str) -> bool:
        """Job ``job`` is alive (its lease renewed); False when the row is gone or belongs
        to a newer job: the job should stop."""
        return (
            self._write(
                "UPDATE store_files SET beat_at = ? "
                "WHERE store_id = ? AND file_id = ? AND job = ? AND status = 'in_progress'",
                (int(time.time()), store_id, file_id, job),
            )
            > 0
        )

    def stale_jobs(self, older_than: float) -> list[StoreFileRecord]:
        """Jobs still in progress whose lease was last renewed more than ``older_than``
        seconds ago (0: every job in progress)."""
        cutoff = int(time.time() - older_than) if older_than > 0 else 2**62
        rows = self._rows(
            f"{self._STORE_FILE} WHERE status = 'in_progress' AND beat_at <= ?", (cutoff,)
        )
        return [self._store_file(r) for r in rows]

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
        to whoever did it); replaces any chunks the file had in the store. Chunks that would
        pass the tenant's quota: StorageQuotaExceeded, and nothing is written."""
        rows = [_chunk_row(c) for c in chunks]
        usage = sum(_row_bytes(r) for r in rows)
        with self._db.transaction() as tx:
            current = tx.rows(
                "SELECT 1 FROM store_files WHERE store_id = ? AND file_id = ? AND job = ?"
                + self._db.for_update,
                (store_id, file_id, job),
            )
            if not current:
                return False
            self._check_chunks(tx, store_id, file_id, len(rows), usage)
            tx.write("DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id))
            tx.write_many(_INSERT_CHUNK, rows)
            tx.write(
                "UPDATE store_files SET status = 'completed', last_error = NULL, "
                "usage_bytes = ?, chunks = ? WHERE store_id = ? AND file_id = ?",
                (usage, len(rows), store_id, file_id),
            )
        return True

    def remove_store_file(self, store_id: str, file_id: str) -> None:
        with self._db.transaction() as tx:
            tx.write("DELETE FROM chunks WHERE store_id = ? AND file_id = ?", (store_id, file_id))
            tx.write(
                "DELETE FROM store_files WHERE store_id = ? AND file_id = ?", (store_id, file_id)
            )

    # ------------------------------------------------------------------ chunks

    _CHUNK = 'SELECT c.store_id, c.file_id, c.seq, c.start, c."end", c.section, c.text, c.terms'

    @staticmethod
    def _chunk(r: Row, vector: bool = True) -> StoredChunk:
        chunk = Chunk(r[6], r[3], r[4], tuple(json.loads(r[5])))
        terms = r[7].split("\x1f") if r[7] else []
        vec = np.frombuffer(bytes(r[8]), np.float32) if vector else np.zeros(0, np.float32)
        return StoredChunk(r[0], r[1], r[2], chunk, terms, vec)

    def chunks(self, store_id: str) -> Iterator[StoredChunk]:
        rows = self._rows(
            f"{self._CHUNK}, c.vector FROM chunks c WHERE c.store_id = ? ORDER BY c.file_id, c.seq",
            (store_id,),
        )
        for r in rows:
            yield self._chunk(r)

    def job_chunks(self, store_id: str, file_id: str, job: str) -> list[StoredChunk]:
        """The chunks job ``job`` wrote, read in one statement with the row that says the
        job completed (none when it has not, or the file was added again since)."""
        rows = self._rows(
            f"{self._CHUNK}, c.vector FROM chunks c JOIN store_files f "
            "ON f.store_id = c.store_id AND f.file_id = c.file_id "
            "WHERE c.store_id = ? AND c.file_id = ? AND f.job = ? AND f.status = 'completed' "
            "ORDER BY c.seq",
            (store_id, file_id, job),
        )
        return [self._chunk(r) for r in rows]

    def chunk_places(self, store_id: str) -> list[StoredChunk]:
        """Every chunk of a store without its text, terms or vector (filters read only
        where each lies)."""
        rows = self._rows(
            'SELECT c.store_id, c.file_id, c.seq, c.start, c."end", c.section, '
            "'', '' FROM chunks c WHERE c.store_id = ? ORDER BY c.file_id, c.seq",
            (store_id,),
        )
        return [self._chunk(r, vector=False) for r in rows]

    def chunks_at(self, store_id: str, keys: Sequence[str]) -> dict[str, StoredChunk]:
        """The chunks of these keys (``file#seq``) that still exist, in one query."""
        if not keys:
            return {}
        pairs = [k.rpartition("#") for k in keys]
        where = " OR ".join(["(c.file_id = ? AND c.seq = ?)"] * len(pairs))
        args = [x for f, _, seq in pairs for x in (f, int(seq))]
        rows = self._rows(
            f"{self._CHUNK}, c.vector FROM chunks c WHERE c.store_id = ? AND ({where})",
            (store_id, *args),
        )
        found = (self._chunk(r) for r in rows)
        return {c.key: c for c in found}

    def chunk(self, store_id: str, key: str) -> StoredChunk | None:
        return self.chunks_at(store_id, [key]).get(key)
