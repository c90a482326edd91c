"""The usage ledger: one durable record per request that consumed tokens, for billing.

SQLite (WAL: a committed write survives the process being killed), written by one thread of
its own so the event loop never waits on a disk except where a guarantee needs it:

- ``admit``: a row ``admitted`` when the request is admitted (queued, not waited for);
- ``delivered``: before the first tokens reach the client (the first streamed chunk with
  text, or a whole response), the row is marked delivered with the counts so far, and the
  caller waits for that commit: a client never holds tokens the ledger does not know of;
- ``progress``: counts while a stream runs (coalesced, committed within ``flush_s``);
- ``settle``: the final counts and finish reason, status ``settled``.

At start, ``reconcile`` settles what a crash left open: rows delivered but unsettled become
``reconciled`` with their last counts (finish reason ``interrupted``); rows never delivered
are deleted (the client got nothing: nothing to bill). So after ``kill -9`` and a restart
there is exactly one record per request whose client received tokens, none for the others.
Several processes may share one ledger (the replicas of ``kvgate.cluster``): each row names
the ledger that wrote it (``owner``), and each ledger holds an OS lock on a file of its own
name for as long as it lives; a ledger starting reconciles only the rows of owners whose
lock is free (they are gone), never those of a process still serving them.

``GET /admin/usage?tenant=&since=&until=`` reads it (``query``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvgate.usage")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    model_version TEXT NOT NULL,
    admitted_at REAL NOT NULL,
    settled_at REAL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    kv_block_seconds REAL NOT NULL DEFAULT 0,
    finish_reason TEXT,
    delivered INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage (tenant, admitted_at);
CREATE INDEX IF NOT EXISTS usage_status ON usage (status);
"""


def default_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "kvgate" / "usage.sqlite3"


@dataclass(frozen=True)
class Counts:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_block_seconds: float = 0.0


@dataclass(frozen=True)
class Reconciled:
    reconciled: int  # delivered, unsettled: recorded with their last counts
    dropped: int  # never delivered: removed


class UsageLedger:
    def __init__(self, path: str | os.PathLike[str], *, flush_s: float = 0.2) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_s = flush_s
        self._ops: queue.SimpleQueue[tuple[Callable[[sqlite3.Connection], Any], Future[Any]] | None]
        self._ops = queue.SimpleQueue()
        self._progress: dict[str, Counts] = {}  # row -> latest counts, not yet written
        self._lock = threading.Lock()
        con = self._connect()
        con.executescript(_SCHEMA)
        columns = {row[1] for row in con.execute("PRAGMA table_info(usage)")}
        if "owner" not in columns:  # a ledger from before owners
            con.execute("ALTER TABLE usage ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        con.close()
        self.owner = uuid.uuid4().hex
        self._owners = Path(f"{self.path}.owners")
        self._owners.mkdir(exist_ok=True)
        self._owner_lock = open(self._owners / self.owner, "w")  # noqa: SIM115 (held for life)
        fcntl.flock(self._owner_lock, fcntl.LOCK_EX)
        self.last_reconcile = self._reconcile()
        self._thread = threading.Thread(target=self._run, name="kvgate-usage", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash
        con.execute("PRAGMA busy_timeout=5000")
        return con

    def _gone(self, owner: str) -> bool:
        """Whether the ledger ``owner`` is no longer alive (its lock file is free)."""
        if not owner:
            return True  # a row from before owners: its process is the one restarting
        path = self._owners / owner
        try:
            with open(path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:
            return True
        with contextlib.suppress(OSError):
            path.unlink()
        return True

    def _reconcile(self) -> Reconciled:
        con = self._connect()
        reconciled = dropped = 0
        with con:
            con.execute("BEGIN IMMEDIATE")
            owners = [r[0] for r in con.execute(
                "SELECT DISTINCT owner FROM usage WHERE status = 'admitted' AND owner != ?",
                (self.owner,),
            )]  # fmt: skip
            for owner in filter(self._gone, owners):
                reconciled += con.execute(
                    "UPDATE usage SET status = 'reconciled', finish_reason = 'interrupted', "
                    "settled_at = ? WHERE status = 'admitted' AND delivered = 1 AND owner = ?",
                    (time.time(), owner),
                ).rowcount
                dropped += con.execute(
                    "DELETE FROM usage WHERE status = 'admitted' AND delivered = 0 AND owner = ?",
                    (owner,),
                ).rowcount
        con.close()
        if reconciled or dropped:
            log.warning(
                "usage ledger: %d requests left open by a crash recorded with their last counts, "
                "%d that never delivered a token dropped",
                reconciled,
                dropped,
            )
        return Reconciled(reconciled, dropped)

    # ------------------------------------------------------------------ writes
    def admit(
        self, request_id: str, tenant: str, model: str, model_version: str, prompt_tokens: int
    ) -> str:
        """A new row for an admitted request; returns its row id (queued, not waited for)."""
        row = uuid.uuid4().hex  # made here: no waiting for the database to number it
        now = time.time()

        def write(con: sqlite3.Connection) -> None:
            con.execute(
                "INSERT INTO usage (id, request_id, tenant, model, model_version, admitted_at, "
                "prompt_tokens, status, owner) VALUES (?, ?, ?, ?, ?, ?, ?, 'admitted', ?)",
                (row, request_id, tenant, model, model_version, now, prompt_tokens, self.owner),
            )

        self._submit(write)
        return row

    def delivered(self, row: str, counts: Counts) -> Future[Any]:
        """Mark the row delivered (tokens are about to reach the client); wait for the
        returned future before sending them."""

        def write(con: sqlite3.Connection) -> None:
            self._write_counts(con, row, counts, "delivered = 1")

        return self._submit(write)

    def progress(self, row: str, counts: Counts) -> None:
        """Latest counts of a running request; written within ``flush_s``, coalesced."""
        with self._lock:
            self._progress[row] = counts

    def settle(
        self, row: str, counts: Counts, finish_reason: str | None, *, delivered: bool = False
    ) -> Future[Any]:
        """The request is over: its final counts (``delivered``: and they are about to reach
        the client, a whole response). A request that never delivered a token is removed
        instead: nothing reached the client."""
        with self._lock:
            self._progress.pop(row, None)
        now = time.time()
        mark = ", delivered = 1" if delivered else ""

        def write(con: sqlite3.Connection) -> None:
            self._write_counts(
                con, row, counts, f"status = 'settled', settled_at = ?, finish_reason = ?{mark}",
                (now, finish_reason),
            )  # fmt: skip
            con.execute("DELETE FROM usage WHERE id = ? AND delivered = 0", (row,))

        return self._submit(write)

    @staticmethod
    def _write_counts(
        con: sqlite3.Connection, row: str, c: Counts, extra: str, args: tuple[Any, ...] = ()
    ) -> None:
        con.execute(
            f"UPDATE usage SET prompt_tokens = ?, completion_tokens = ?, cached_tokens = ?, "
            f"kv_block_seconds = ?, {extra} WHERE id = ?",
            (c.prompt_tokens, c.completion_tokens, c.cached_tokens, c.kv_block_seconds, *args, row),
        )

    def _submit(self, fn: Callable[[sqlite3.Connection], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._ops.put((fn, future))
        return future

    def close(self) -> None:
        self._ops.put(None)
        self._thread.join(10)
        # Settled rows need no owner; unsettled ones (none after a clean stop) keep the
        # file so the next ledger reconciles them.
        self._owner_lock.close()

    # ------------------------------------------------------------------ the writer
    def _run(self) -> None:
        con = self._connect()
        while True:
            items: list[tuple[Callable[[sqlite3.Connection], Any], Future[Any]] | None] = []
            try:  # whatever arrived together goes in one transaction, one commit
                items.append(self._ops.get(timeout=self.flush_s))
                while True:
                    items.append(self._ops.get(block=False))
            except queue.Empty:
                pass
            batch = [item for item in items if item is not None]
            with self._lock:
                progress, self._progress = self._progress, {}
            try:
                con.execute("BEGIN")
                for fn, _ in batch:
                    fn(con)
                for row, counts in progress.items():
                    self._write_counts(con, row, counts, "status = status")
                con.execute("COMMIT")
            except sqlite3.Error as exc:
                log.exception("usage ledger write failed")
                if con.in_transaction:
                    con.execute("ROLLBACK")
                for _, future in batch:
                    future.set_exception(exc)
            else:
                for _, future in batch:
                    future.set_result(None)
            if None in items:
                break
        con.close()

    # ------------------------------------------------------------------ reads
    def query(
        self, tenant: str | None = None, since: float | None = None, until: float | None = None
    ) -> dict[str, Any]:
        """Totals and records (settled and reconciled) admitted in [since, until)."""
        where: list[str] = ["status != 'admitted'"]
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if since is not None:
            where.append("admitted_at >= ?")
            args.append(since)
        if until is not None:
            where.append("admitted_at < ?")
            args.append(until)
        con = self._connect()
        con.row_factory = sqlite3.Row
        try:
            rows = con.execute(
                f"SELECT * FROM usage WHERE {' AND '.join(where)} ORDER BY admitted_at, id", args
            ).fetchall()
        finally:
            con.close()
        hidden = ("id", "delivered")
        records = [{k: v for k, v in dict(r).items() if k not in hidden} for r in rows]
        totals = asdict(Counts())
        for r in records:
            for key in totals:
                totals[key] += r[key]
        totals["requests"] = len(records)
        return {"totals": totals, "records": records}
