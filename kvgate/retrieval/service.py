"""Files and vector stores as a service: uploads, background ingestion, search.

Ingestion (text → chunks → embeddings → index) runs in a process of its own beside
serving, as a tenant of its own with a priority class (``batch`` by default), at that
class's OS priority (``docs/ingest.py``), one job at a time under per-file limits
(``docs/bounds.py``, ``docs/ingest_process.py``); the jobs wait in a queue that serves the
tenants' classes in priority order and the tenants of a class in turn
(``docs/fair_queue.py``). Progress is logged per file and shown in each store's
``file_counts`` and each file's ``status`` / ``last_error``.

Every call takes the caller's tenant (None: an admin): another tenant's files and stores are
absent (404), and searches only ever read the caller's own stores.

The search indexes live in this process and follow the database: before each search a
store's index is brought to the files the database says are indexed, and which job wrote
each (one small query), so what another replica ingested or removed, through a shared
PostgreSQL store, is searched here too, and a removal racing a rebuild cannot leave stale
chunks. Ingestion jobs hold a lease (renewed by the process that queued them); in a shared
store a job whose replica died is taken over by another once its lease runs out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.errors import InvalidRequest, KVGateError
from kvgate.retrieval.bounds import IngestLimits
from kvgate.retrieval.filters import matches
from kvgate.retrieval.ingest import described
from kvgate.retrieval.ingest_process import Error, IngestProcess
from kvgate.retrieval.quota import StorageLimits, StorageQuotaExceeded
from kvgate.retrieval.retrieval import Embedder, HybridIndex, words
from kvgate.retrieval.store import DocStore, FileRecord, StoredChunk, StoreFileRecord, StoreRecord
from kvgate.retrieval.text import SUFFIXES, suffix_of

#: The quota's two names are docs/quota.py's, imported from here as well.
__all__ = [
    "LEASE_S", "RENEW_S", "DocsService", "NotFound", "SearchResult", "StorageLimits",
    "StorageQuotaExceeded", "chunking_of",
]  # fmt: skip

log = logging.getLogger("kvgate.retrieval")


class NotFound(KVGateError):
    """A file or vector store that does not exist for this caller (404)."""

    code = "not_found"


@dataclass(frozen=True)
class SearchResult:
    file_id: str
    filename: str
    score: float
    text: str
    attributes: dict[str, Any]
    #: Where it came from: its store and its chunk's key there (for ``expand``).
    store_id: str = ""
    key: str = ""

    def as_api(self) -> dict[str, Any]:
        return {
            "file_id": self.file_id,
            "filename": self.filename,
            "score": round(self.score, 6),
            "attributes": self.attributes,
            "content": [{"type": "text", "text": self.text}],
        }


def chunking_of(strategy: Mapping[str, Any] | None) -> dict[str, Any]:
    """A ``chunking_strategy`` as stored: ``auto``, or ``static`` with its two sizes
    (OpenAI's rules: 100 <= max <= 4096, 0 <= overlap <= max / 2; defaults 800 and 400)."""
    if strategy is None or strategy.get("type", "auto") == "auto":
        return {"type": "auto"}
    if strategy.get("type") != "static":
        raise InvalidRequest(
            "chunking_strategy.type must be 'auto' or 'static'", param="chunking_strategy.type"
        )
    static = strategy.get("static") or {}
    if not isinstance(static, Mapping):
        raise InvalidRequest(
            "chunking_strategy.static must be an object", param="chunking_strategy.static"
        )
    size = static.get("max_chunk_size_tokens", 800)
    overlap = static.get("chunk_overlap_tokens", 400)
    if isinstance(size, bool) or not isinstance(size, int) or not 100 <= size <= 4096:
        raise InvalidRequest(
            "max_chunk_size_tokens must be an integer in [100, 4096]",
            param="chunking_strategy.static.max_chunk_size_tokens",
        )
    if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= size // 2:
        raise InvalidRequest(
            "chunk_overlap_tokens must be an integer in [0, max_chunk_size_tokens / 2]",
            param="chunking_strategy.static.chunk_overlap_tokens",
        )
    return {
        "type": "static",
        "static": {"max_chunk_size_tokens": size, "chunk_overlap_tokens": overlap},
    }


#: A shared store's ingestion lease (seconds) and how often a replica renews its jobs' and
#: looks for jobs whose lease ran out.
LEASE_S = 120.0
RENEW_S = 30.0


@dataclass
class _Job:
    store_id: str
    file_id: str
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _SyncedIndex:
    """A store's index and, per file it holds, the job whose chunks those are."""

    index: HybridIndex
    jobs: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class DocsService:
    def __init__(
        self,
        store: DocStore,
        embedder: Callable[[], Embedder],
        limits: Callable[[str], StorageLimits] = lambda _: StorageLimits(),
        priority: str = "batch",
        ingest_limits: IngestLimits | None = None,
        tenant_class: Callable[[str], str] = lambda _: "standard",
    ) -> None:
        """``embedder``: makes an embedder (here for queries, on first use; in the ingestion
        process for passages), so it must pickle; ``limits``: a tenant's storage limits,
        read at each upload (a reload may change them); ``ingest_limits``: what one file's
        ingestion may take; ``tenant_class``: a tenant's priority class (its jobs' turn)."""
        self.store = store
        self._make_embedder = embedder
        self._embedder: Embedder | None = None
        self._embedder_lock = threading.Lock()
        self.limits = limits
        self.priority = priority
        self._indexes: dict[str, _SyncedIndex] = {}
        self._index_lock = threading.Lock()
        self._pending: dict[str, _Job] = {}  # by job id
        self._tenant_class = tenant_class
        self._worker = IngestProcess(
            (str(store.directory), store.url), embedder, priority, self._job_done, self._job_lost,
            ingest_limits,
        )  # fmt: skip
        self._closed = threading.Event()
        # Alone on its database, every job in progress was this server's: all start again.
        # Shared, only those whose lease ran out (their replica is gone).
        self._requeue(store.stale_jobs(LEASE_S if store.shared else 0))
        if store.shared:
            threading.Thread(target=self._leases, name="kvgate-docs-leases", daemon=True).start()

    @property
    def embedder(self) -> Embedder:
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = self._make_embedder()
                log.info("queries: embedder %s", described(self._embedder))
            return self._embedder

    def close(self) -> None:
        self._closed.set()
        self._worker.close()
        self.store.close()

    # ------------------------------------------------------------------ files

    def add_file(self, tenant: str, filename: str, purpose: str, data_path: Path) -> FileRecord:
        """Take an upload; its quota (``docs/quota.py``) is checked in the transaction that
        adds it, so uploads racing cannot pass it together."""
        if suffix_of(filename) not in SUFFIXES:
            data_path.unlink(missing_ok=True)
            raise InvalidRequest(
                f"unsupported file type {suffix_of(filename) or '(none)'!r}; supported: "
                + ", ".join(SUFFIXES),
                param="file",
            )
        try:
            return self.store.add_file(tenant, filename, purpose, data_path, self.limits(tenant))
        except StorageQuotaExceeded:
            data_path.unlink(missing_ok=True)
            raise

    def file(self, tenant: str | None, file_id: str) -> FileRecord:
        record = self.store.file(file_id, tenant)
        if record is None:
            raise NotFound(f"No such file: {file_id!r}", param="file_id")
        return record

    def delete_file(self, tenant: str | None, file_id: str) -> None:
        self.file(tenant, file_id)
        stores = self.store.stores_holding(file_id)
        self.store.delete_file(file_id)
        for store_id in stores:
            self._sync(store_id)

    # ------------------------------------------------------------------ vector stores

    def create_store(
        self,
        tenant: str,
        name: str | None,
        file_ids: Sequence[str],
        chunking: dict[str, Any],
        metadata: dict[str, Any],
    ) -> StoreRecord:
        limits = self.limits(tenant)
        for file_id in file_ids:  # every file must exist, and fit, before anything
            self.file(tenant, file_id)
            self.store.check_room(tenant, "", file_id, limits)
        record = self.store.add_store(tenant, name, chunking, metadata, limits)
        for file_id in file_ids:
            self.add_store_file(tenant, record.id, file_id, chunking, {})
        return record

    def vector_store(self, tenant: str | None, store_id: str) -> StoreRecord:
        record = self.store.store(store_id, tenant)
        if record is None:
            raise NotFound(f"No such vector store: {store_id!r}", param="vector_store_id")
        return record

    def delete_store(self, tenant: str | None, store_id: str) -> None:
        self.vector_store(tenant, store_id)
        with self._index_lock:
            self._indexes.pop(store_id, None)
        self.store.delete_store(store_id)

    def add_store_file(
        self,
        tenant: str | None,
        store_id: str,
        file_id: str,
        chunking: dict[str, Any] | None,
        attributes: dict[str, Any],
    ) -> StoreFileRecord:
        store = self.vector_store(tenant, store_id)
        file = self.file(store.tenant, file_id)  # a store holds its own tenant's files only
        limits = self.check_room(store, file.id)
        self.store.set_limits(store.tenant, limits)  # what its job checks, in its process
        record = self.store.add_store_file(
            store_id, file.id, chunking or store.chunking, attributes
        )
        self._sync(store_id)  # its old chunks, if it was there, leave the index now
        self._enqueue(record, store.tenant)
        return record

    def check_room(self, store: StoreRecord, file_id: str) -> StorageLimits:
        """StorageQuotaExceeded when the store's tenant (or the store) is already at a limit,
        so indexing ``file_id`` there cannot fit; else the tenant's limits."""
        limits = self.limits(store.tenant)
        self.store.check_room(store.tenant, store.id, file_id, limits)
        return limits

    def store_file(self, tenant: str | None, store_id: str, file_id: str) -> StoreFileRecord:
        self.vector_store(tenant, store_id)
        record = self.store.store_file(store_id, file_id)
        if record is None:
            raise NotFound(f"No file {file_id!r} in vector store {store_id!r}", param="file_id")
        return record

    def remove_store_file(self, tenant: str | None, store_id: str, file_id: str) -> None:
        self.store_file(tenant, store_id, file_id)
        self.store.remove_store_file(store_id, file_id)
        self._sync(store_id)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until every queued ingestion has ended (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = list(self._pending.values())
            if not jobs:
                return True
            jobs[0].done.wait(max(0.0, deadline - time.monotonic()))
        return not self._pending

    # ------------------------------------------------------------------ search

    def search(
        self,
        tenant: str | None,
        store_ids: Sequence[str],
        query: str,
        max_num_results: int = 10,
        filters: Mapping[str, Any] | None = None,
        mode: str = "hybrid",
    ) -> list[SearchResult]:
        """The best chunks over the caller's ``store_ids`` (each must be its own)."""
        stores = [self.vector_store(tenant, s) for s in store_ids]
        terms = words(query)
        vector = self.embedder.query(query) if mode != "bm25" and query.strip() else None
        found: list[tuple[float, str, str]] = []
        files: dict[str, FileRecord | None] = {}
        attributes: dict[str, dict[str, Any]] = {}
        for store in stores:
            self.store.touch_store(store.id)
            index = self._index(store.id)
            allowed = None
            if filters:
                allowed = self._filtered(store.id, filters, files, attributes)
            for hit in index.search(terms, vector, max_num_results, allowed, mode):
                found.append((hit.score, store.id, hit.key))
        found.sort(key=lambda x: -x[0])
        top = found[:max_num_results]
        chunks: dict[str, dict[str, StoredChunk]] = {}
        for store_id in {s for _, s, _ in top}:  # one query a store, not one a result
            keys = [k for _, s, k in top if s == store_id]
            chunks[store_id] = self.store.chunks_at(store_id, keys)
        records: dict[tuple[str, str], StoreFileRecord | None] = {}
        results = []
        for score, store_id, key in top:
            stored = chunks[store_id].get(key)
            if stored is None:  # removed since the search
                continue
            file = files.get(stored.file_id) or self.store.file(stored.file_id, None, False)
            if file is None:
                continue
            files[stored.file_id] = file
            attrs = attributes.get(f"{store_id}/{key}") or self._attributes(
                store_id, stored, file, records
            )
            results.append(
                SearchResult(file.id, file.filename, score, stored.chunk.text, attrs, store_id, key)
            )
        return results

    def expand(self, result: SearchResult, radius: int = 1) -> SearchResult:
        """``result`` with up to ``radius`` chunks before and after it that lie under the same
        heading (the neighbouring clauses of an article, the rest of a section): one exact
        slice of the file's text, ``start`` and ``end`` widened to it."""
        file = self.store.file(result.file_id, None)
        if file is None or file.text is None or not result.key:
            return result
        _, _, seq_text = result.key.rpartition("#")
        seq = int(seq_text)
        here = self.store.chunk(result.store_id, result.key)
        if here is None:
            return result
        parent = here.chunk.section[:-1]
        start, end = here.chunk.start, here.chunk.end
        for step in (-1, 1):
            for k in range(1, radius + 1):
                other = self.store.chunk(result.store_id, f"{result.file_id}#{seq + step * k}")
                if other is None or other.chunk.section[:-1] != parent:
                    break
                start, end = min(start, other.chunk.start), max(end, other.chunk.end)
        if (start, end) == (here.chunk.start, here.chunk.end):
            return result
        attributes = {**result.attributes, "start": start, "end": end}
        return SearchResult(
            result.file_id, result.filename, result.score, file.text[start:end], attributes,
            result.store_id, result.key,
        )  # fmt: skip

    def _attributes(
        self,
        store_id: str,
        stored: StoredChunk,
        file: FileRecord,
        records: dict[tuple[str, str], StoreFileRecord | None] | None = None,
    ) -> dict[str, Any]:
        """A chunk's attributes: its store file's, and where it lies. ``records``: the
        store files already read in this search."""
        records = {} if records is None else records
        if (store_id, stored.file_id) not in records:
            records[store_id, stored.file_id] = self.store.store_file(store_id, stored.file_id)
        record = records[store_id, stored.file_id]
        base = {k: v for k, v in (record.attributes if record else {}).items() if k != "_batch"}
        return {
            **base,
            "section": stored.chunk.section_path,
            "start": stored.chunk.start,
            "end": stored.chunk.end,
        }

    def _filtered(
        self,
        store_id: str,
        filters: Mapping[str, Any],
        files: dict[str, FileRecord | None],
        attributes: dict[str, dict[str, Any]],
    ) -> set[str]:
        allowed = set()
        records: dict[tuple[str, str], StoreFileRecord | None] = {}
        for stored in self.store.chunk_places(store_id):
            file = files.get(stored.file_id)
            if file is None:
                file = files[stored.file_id] = self.store.file(stored.file_id, None, False)
            if file is None:
                continue
            attrs = self._attributes(store_id, stored, file, records)
            attributes[f"{store_id}/{stored.key}"] = attrs
            if matches(filters, {"filename": file.filename, **attrs}):
                allowed.add(stored.key)
        return allowed

    def _index(self, store_id: str) -> HybridIndex:
        """The store's index, brought to what the database says is indexed."""
        synced = self._sync(store_id, create=True)
        assert synced is not None
        return synced.index

    def _sync(self, store_id: str, create: bool = False) -> _SyncedIndex | None:
        """Bring the store's index to the database (``create``: build it when this process
        has none yet; else only an index already here is updated)."""
        with self._index_lock:
            synced = self._indexes.get(store_id)
            if synced is None:
                if not create:
                    return None
                synced = self._indexes[store_id] = _SyncedIndex(HybridIndex(self.embedder.dim))
        with synced.lock:
            want = self.store.completed_jobs(store_id)
            gone = {f for f, job in synced.jobs.items() if want.get(f) != job}
            if gone:
                synced.index.remove_files(gone)
                for file_id in gone:
                    del synced.jobs[file_id]
            for file_id, job in want.items():
                if file_id in synced.jobs:
                    continue
                rows = self.store.job_chunks(store_id, file_id, job)
                if rows:
                    synced.index.add([c.key for c in rows], [c.terms for c in rows],
                                     [c.vector for c in rows])  # fmt: skip
                # Even with no rows (added again since): the next sync sees the new job.
                synced.jobs[file_id] = job
        return synced

    # ------------------------------------------------------------------ ingestion

    def _enqueue(self, record: StoreFileRecord, tenant: str | None = None) -> None:
        """Queue the record's job in its tenant's turn (``tenant``: the store's, if known)."""
        if tenant is None:
            owner = self.store.store(record.store_id, None)
            tenant = owner.tenant if owner is not None else ""
        self._pending[record.job] = _Job(record.store_id, record.file_id)
        job = (record.store_id, record.file_id, record.job)
        self._worker.submit(tenant, self._tenant_class(tenant), job)

    def _requeue(self, records: Sequence[StoreFileRecord]) -> None:
        """Jobs that will not end where they were queued (this server restarted, or the
        replica that held them is gone): each file starts again under a new job."""
        for record in records:
            if self.store.store_file(record.store_id, record.file_id) != record:
                continue  # changed since it was read: someone else has it
            log.info("ingest %s %s: started again", record.store_id, record.file_id)
            again = self.store.add_store_file(
                record.store_id, record.file_id, record.chunking, record.attributes
            )
            self._enqueue(again)

    def _leases(self) -> None:
        """A shared store: renew the leases of this replica's queued jobs, and take over
        those of replicas that stopped renewing theirs."""
        while not self._closed.wait(RENEW_S):
            try:
                for job_id, job in list(self._pending.items()):
                    self.store.beat(job.store_id, job.file_id, job_id)
                self._requeue(self.store.stale_jobs(LEASE_S))
            except Exception:
                log.exception("renewing ingestion leases failed; trying again")

    def _job_done(self, job: tuple[str, str, str]) -> None:
        """The ingestion process ended a job: its chunks join the index kept here."""
        store_id, _, job_id = job
        self._sync(store_id)
        pending = self._pending.pop(job_id, None)
        if pending is not None:
            pending.done.set()

    def _job_lost(self, job: tuple[str, str, str], error: Error) -> None:
        """The ingestion process could not end a job (it died, or was stopped at a limit)."""
        store_id, file_id, job_id = job
        self.store.finish_store_file(store_id, file_id, job_id, "failed", error)
        log.error("ingest %s %s: failed: %s", store_id, file_id, error["message"])
        self._job_done(job)
