"""The database under the documents store (and the stored responses of
``/v1/responses``, ``server/responses/stored.py``): SQLite (the embedded default, one server) or
PostgreSQL (a URL: several replicas sharing one store). ``DocStore`` writes its SQL once,
with ``?`` placeholders; each database here runs it in its own dialect.

What differs, and is said here only:
- placeholders (``?`` / ``%s``) and the insertion-order column (SQLite's ``rowid``; a
  ``BIGSERIAL ord`` in PostgreSQL);
- a transaction that will write takes its lock up front (SQLite's ``BEGIN IMMEDIATE``;
  PostgreSQL's ``SELECT ... FOR UPDATE`` on the row it checks);
- a file's bytes: beside the SQLite database, one file each; inside PostgreSQL (a ``bytea``
  row), so every replica reads every upload;
- a tenant's storage quota is checked and its data written under a lock on the tenant
  (SQLite's one writer; PostgreSQL's advisory lock on the tenant's name).

SQLite's files (the database, its ``-wal`` and ``-shm``) are 0600 whatever the umask: the
database is made 0600 before SQLite opens it, and SQLite gives the others its mode.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvgate.private_files import private_dir, private_file, tighten

Row = tuple[Any, ...]


class Tx(Protocol):
    """One transaction's statements."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    def write(self, sql: str, args: Sequence[Any] = ()) -> int: ...

    def write_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...


class Database(Protocol):
    #: Several processes (replicas) may use it at once, each with its own ingestion.
    shared: bool
    #: The column that orders rows by insertion.
    rowid: str
    #: Appended to the SELECT that checks a row inside a writing transaction.
    for_update: str
    #: A statement (one ``?``: the tenant) that, inside a transaction, holds the tenant's
    #: storage until the transaction ends; empty where every writing transaction is alone.
    lock_tenant: str
    #: Where it is, to open it again in another process.
    url: str

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    def write(self, sql: str, args: Sequence[Any] = ()) -> int: ...

    def transaction(self) -> contextlib.AbstractContextManager[Tx]: ...

    def close(self) -> None: ...


_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, text TEXT, error TEXT,
    text_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS stores (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT, created_at INTEGER NOT NULL,
    last_active_at INTEGER NOT NULL, chunking TEXT NOT NULL, metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS stores_by_tenant ON stores (tenant);
CREATE TABLE IF NOT EXISTS quotas (tenant TEXT PRIMARY KEY, limits TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS store_files (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, last_error TEXT, chunking TEXT NOT NULL, attributes TEXT NOT NULL,
    usage_bytes INTEGER NOT NULL DEFAULT 0, job TEXT NOT NULL DEFAULT '',
    beat_at INTEGER NOT NULL DEFAULT 0, chunks INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (store_id, file_id)
);
CREATE TABLE IF NOT EXISTS chunks (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, seq INTEGER NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, section TEXT NOT NULL, text TEXT NOT NULL, terms TEXT NOT NULL,
    vector BLOB NOT NULL, PRIMARY KEY (store_id, file_id, seq)
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at INTEGER NOT NULL,
    status TEXT NOT NULL, previous_id TEXT, owner TEXT NOT NULL, response TEXT NOT NULL,
    input TEXT NOT NULL, bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_tenant ON responses (tenant, created_at);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""

_POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, text TEXT, error TEXT,
    ord BIGSERIAL, text_bytes BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, created_at);
CREATE TABLE IF NOT EXISTS file_data (id TEXT PRIMARY KEY, data BYTEA NOT NULL);
CREATE TABLE IF NOT EXISTS stores (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT, created_at BIGINT NOT NULL,
    last_active_at BIGINT NOT NULL, chunking TEXT NOT NULL, metadata TEXT NOT NULL,
    ord BIGSERIAL
);
CREATE INDEX IF NOT EXISTS stores_by_tenant ON stores (tenant);
CREATE TABLE IF NOT EXISTS quotas (tenant TEXT PRIMARY KEY, limits TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS store_files (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, created_at BIGINT NOT NULL,
    status TEXT NOT NULL, last_error TEXT, chunking TEXT NOT NULL, attributes TEXT NOT NULL,
    usage_bytes BIGINT NOT NULL DEFAULT 0, job TEXT NOT NULL DEFAULT '',
    beat_at BIGINT NOT NULL DEFAULT 0, ord BIGSERIAL, chunks BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (store_id, file_id)
);
CREATE TABLE IF NOT EXISTS chunks (
    store_id TEXT NOT NULL, file_id TEXT NOT NULL, seq INTEGER NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, section TEXT NOT NULL, text TEXT NOT NULL, terms TEXT NOT NULL,
    vector BYTEA NOT NULL, PRIMARY KEY (store_id, file_id, seq)
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at BIGINT NOT NULL,
    status TEXT NOT NULL, previous_id TEXT, owner TEXT NOT NULL, response TEXT NOT NULL,
    input TEXT NOT NULL, bytes BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_tenant ON responses (tenant, created_at);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""

#: Columns added since the first schema, to a database made before them: (table, column,
#: its definition, the statement that fills it from what the rows already hold); the
#: fill uses ``{text_bytes}``, the dialect's byte length of a text.
_ADDED = (
    ("store_files", "beat_at", "INTEGER NOT NULL DEFAULT 0", ""),
    ("files", "text_bytes", "BIGINT NOT NULL DEFAULT 0",
     "UPDATE files SET text_bytes = {text_bytes} WHERE text IS NOT NULL"),
    ("store_files", "chunks", "BIGINT NOT NULL DEFAULT 0",
     "UPDATE store_files SET chunks = (SELECT COUNT(*) FROM chunks c "
     "WHERE c.store_id = store_files.store_id AND c.file_id = store_files.file_id)"),
)  # fmt: skip


class SqliteDb:
    """One connection (WAL), its statements one at a time under a lock."""

    shared = False
    rowid = "rowid"
    for_update = ""
    lock_tenant = ""  # BEGIN IMMEDIATE: one writing transaction at a time, every process

    def __init__(self, path: Path) -> None:
        self.url = f"sqlite:///{path}"
        private_file(path)
        for suffix in ("-wal", "-shm", "-journal"):  # left by a version before 0600
            tighten(f"{path}{suffix}")
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")  # the ingestion process writes too
        self._db.executescript(_SQLITE_SCHEMA)
        for table, column, definition, fill in _ADDED:
            if column not in {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
                if fill:
                    self._db.execute(fill.format(text_bytes="LENGTH(CAST(text AS BLOB))"))
        self._lock = threading.Lock()

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def write(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _SqliteTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return self._db.execute(sql, args).fetchall()

    def write(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.execute(sql, args).rowcount

    def write_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class PostgresDb:
    """A small pool of connections (psycopg 3), so threads do not queue behind one; the
    pool checks a connection before lending it, so a restarted server is reconnected."""

    shared = True
    rowid = "ord"
    for_update = " FOR UPDATE"
    lock_tenant = "SELECT pg_advisory_xact_lock(7316121, hashtext(?))"

    def __init__(self, url: str, max_connections: int = 4) -> None:
        from psycopg_pool import ConnectionPool

        self.url = url
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            kwargs={"autocommit": True},
            check=ConnectionPool.check_connection,
            open=True,
            name="kvgate-docs",
            timeout=10.0,  # seconds to wait for a connection before an error
        )
        try:
            with self._pool.connection() as conn, conn.transaction():
                # Replicas starting together would race on CREATE TABLE: one at a time.
                conn.execute("SELECT pg_advisory_xact_lock(7316120)")
                conn.execute(_POSTGRES_SCHEMA)
                for table, column, definition, fill in _ADDED:
                    found = conn.execute(
                        "SELECT 1 FROM information_schema.columns "
                        "WHERE table_name = %s AND column_name = %s",
                        (table, column),
                    ).fetchall()
                    if not found:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
                        if fill:
                            conn.execute(fill.format(text_bytes="OCTET_LENGTH(text)"))
        except BaseException:
            self._pool.close()  # or it keeps trying to connect in the background
            raise

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._pool.connection() as conn:
            return [tuple(r) for r in conn.execute(_pg(sql), args).fetchall()]

    def write(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._pool.connection() as conn:
            return conn.execute(_pg(sql), args).rowcount

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._pool.connection() as conn, conn.transaction():
            yield _PostgresTx(conn)

    def close(self) -> None:
        self._pool.close()


class _PostgresTx:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return [tuple(r) for r in self._conn.execute(_pg(sql), args).fetchall()]

    def write(self, sql: str, args: Sequence[Any] = ()) -> int:
        return int(self._conn.execute(_pg(sql), args).rowcount)

    def write_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cur:
            cur.executemany(_pg(sql), rows)


def is_postgres(url: str | None) -> bool:
    return bool(url) and str(url).split("://", 1)[0] in ("postgres", "postgresql")


def open_database(directory: Path, url: str | None) -> Database:
    """PostgreSQL at ``url`` (``postgresql://...``), else SQLite under ``directory``."""
    if url and is_postgres(url):
        return PostgresDb(url)
    if url and not url.startswith("sqlite:///"):
        raise ValueError(f"docs store URL must be postgresql://... or sqlite:///..., got {url!r}")
    path = Path(url[len("sqlite:///") :]) if url else directory / "docs.sqlite3"
    private_dir(path.parent, ours=False)
    return SqliteDb(path)
