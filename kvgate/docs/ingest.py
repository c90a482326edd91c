"""Ingesting files into vector stores, in a process of its own.

One file into one store: its text (extracted once, kept), its chunks, their vectors and BM25
terms, written to the store's database, then its status. The work runs in a child process
at the OS priority of ingestion's class (``batch``: Linux's ``SCHED_IDLE`` policy at nice 19,
``standard``: nice 10, ``critical``: nice 0): parsing, jieba and the embedder never hold the
server's GIL, and the engine's threads win the cores whenever they want them. The child
reads and writes the same database (SQLite in WAL mode, or PostgreSQL) and tells the server
each job's end, so the server brings the indexes it keeps up to date. Measured with
bench/longdoc_serving.py: see the README.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvgate.docs.chunking import Chunk, chunk_auto, chunk_static
from kvgate.docs.quota import StorageQuotaExceeded
from kvgate.docs.retrieval import Embedder, index_text, words
from kvgate.docs.store import DocStore, StoredChunk
from kvgate.docs.text import UnreadableFile, extract_text

log = logging.getLogger("kvgate.docs")

#: OS nice value of the ingestion process, by the priority class of its tenant.
NICE = {"critical": 0, "standard": 10, "batch": 19}
#: Classes whose ingestion runs under ``SCHED_IDLE``: only on a core nothing else wants, and
#: preempted at once by any normal thread that wakes there (nice 19 alone still gets a share,
#: and a woken engine thread may wait for the scheduler's slice to end).
IDLE = frozenset({"batch"})
#: ``auto`` chunking: the cap (embedder tokens) and the overlap where a unit is longer.
AUTO_MAX_TOKENS = 512
AUTO_OVERLAP_TOKENS = 64
#: Chunks per embedder call: sorted by length within it, so the padding of a batch is small.
EMBED_BATCH = 64
#: PyTorch threads of the ingestion process: at its OS priority they take only what serving
#: leaves idle.
THREADS = 2

Job = tuple[str, str, str]  # (vector store id, file id, job id: StoreFileRecord.job)


def chunks_of(text: str, chunking: Mapping[str, Any], count: Callable[[str], int]) -> list[Chunk]:
    if chunking.get("type") == "static":
        static = chunking["static"]
        return chunk_static(
            text, count, static["max_chunk_size_tokens"], static["chunk_overlap_tokens"]
        )
    return chunk_auto(text, count, AUTO_MAX_TOKENS, AUTO_OVERLAP_TOKENS)


def title_of(text: str, filename: str) -> str:
    """A document's title: its first heading or line, else its file name."""
    for line in text.splitlines():
        line = line.strip().lstrip("#").strip()
        if line:
            return line[:100]
    return filename


def ingest(store: DocStore, embedder: Embedder, store_id: str, file_id: str, job: str) -> None:
    """One job, start to end; a failure is the file's (its ``last_error``). A job whose file
    was removed, or added again (a newer job), stops at its next check and writes nothing."""
    try:
        _ingest(store, embedder, store_id, file_id, job)
    except StorageQuotaExceeded as exc:  # its text or chunks would pass the tenant's quota
        log.info("ingest %s %s: refused: %s", store_id, file_id, exc.message)
        store.finish_store_file(
            store_id, file_id, job, "failed", {"code": exc.code, "message": exc.message}
        )
    except Exception as exc:
        log.exception("ingestion of %s into %s failed", file_id, store_id)
        store.finish_store_file(
            store_id, file_id, job, "failed",
            {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"},
        )  # fmt: skip


def _ingest(store: DocStore, embedder: Embedder, store_id: str, file_id: str, job: str) -> None:
    record = store.store_file(store_id, file_id)
    file = store.file(file_id, None)
    if record is None or file is None or record.job != job:
        return  # removed, or added again, before its turn
    started = time.perf_counter()
    text = file.text
    if text is None:
        try:
            text = extract_text(file.filename, store.file_bytes(file_id))
        except UnreadableFile as exc:
            store.set_text(file_id, None, exc.message)
            code = "unsupported_file" if "unsupported" in exc.message else "invalid_file"
            store.finish_store_file(
                store_id, file_id, job, "failed", {"code": code, "message": exc.message}
            )
            log.info("ingest %s %s: failed: %s", store_id, file.filename, exc.message)
            return
        except FileNotFoundError:
            return  # the file was deleted meanwhile
        store.set_text(file_id, text, None)
    chunks = chunks_of(text, record.chunking, embedder.count_tokens)
    store.check_chunks(store_id, file_id, chunks)  # over quota: before embedding them
    title = title_of(text, file.filename)
    stored: list[StoredChunk] = []
    for i in range(0, len(chunks), EMBED_BATCH):
        if not store.beat(store_id, file_id, job):  # renews its lease, or it is gone
            log.info("ingest %s %s: removed while indexing", store_id, file.filename)
            return
        part = chunks[i : i + EMBED_BATCH]
        texts = [index_text(title, c) for c in part]
        vectors = embedder.passages(texts)
        for j, (chunk, t) in enumerate(zip(part, texts, strict=True)):
            stored.append(StoredChunk(store_id, file_id, i + j, chunk, words(t), vectors[j]))
        if (i // EMBED_BATCH) % 5 == 4:
            log.info(
                "ingest %s %s: %d/%d chunks", store_id, file.filename, len(stored), len(chunks)
            )
    if not store.complete(store_id, file_id, job, stored):
        return  # removed or added again meanwhile: nothing of this job is kept
    seconds = time.perf_counter() - started
    log.info(
        "ingest %s %s: %d chunks, %d characters in %.1f s (%.0f characters/s)",
        store_id, file.filename, len(stored), len(text), seconds, len(text) / seconds,
    )  # fmt: skip


def lower_priority(priority: str, pid: int = 0) -> str:
    """Put thread ``pid`` (0: this one; a process's pid: its main thread) at the OS priority of
    ``priority``'s class, and so the threads it starts from then on, which inherit it; never
    above the priority it has. Says what it got."""
    nice = NICE.get(priority, NICE["batch"])
    got = []
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(os.getpriority(os.PRIO_PROCESS, pid), nice))
        got.append(f"nice {os.getpriority(os.PRIO_PROCESS, pid)}")
    except OSError:
        log.warning("ingestion: could not lower its priority to nice %d", nice)
    idle = getattr(os, "SCHED_IDLE", None)  # Linux only
    if priority in IDLE and idle is not None:
        try:
            os.sched_setscheduler(pid, idle, os.sched_param(0))
            got.append("SCHED_IDLE")
        except OSError:
            log.warning("ingestion: could not set SCHED_IDLE")
    return ", ".join(got) or "unchanged"


def _child(
    where: tuple[str, str | None],
    embedder: Callable[[], Embedder],
    priority: str,
    jobs: multiprocessing.Queue[Job | None],
    done: multiprocessing.Queue[Job],
) -> None:
    """The ingestion process: jobs in, their ends out, until a None."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    got = lower_priority(priority)  # (again) before torch starts its threads: they inherit it
    import torch

    torch.set_num_threads(THREADS)
    store = DocStore(*where)
    model = embedder()
    log.info("ingestion: embedder %s, %d threads, %s", described(model), THREADS, got)
    while (job := jobs.get()) is not None:
        ingest(store, model, *job)
        done.put(job)
    store.close()


def described(embedder: Embedder) -> str:
    precision = getattr(embedder, "precision", type(embedder).__name__)
    why = getattr(embedder, "why", "")
    return f"{precision} ({why})" if why else str(precision)


class IngestProcess:
    """The child process and the thread that hears of its jobs' ends (``on_done``). A child
    that dies is started again for the next job; the jobs it held are failed."""

    def __init__(
        self,
        where: tuple[str, str | None],
        embedder: Callable[[], Embedder],
        priority: str,
        on_done: Callable[[Job], None],
        on_lost: Callable[[Job], None],
    ) -> None:
        """``where``: the store's directory and URL (``DocStore``'s arguments); ``embedder``
        must pickle (a class, or a ``functools.partial`` of one)."""
        self._where = where
        self._embedder = embedder
        self._priority = priority
        self._on_done = on_done
        self._on_lost = on_lost
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._proc: Any = None
        self._jobs: multiprocessing.Queue[Job | None] | None = None
        self._done: multiprocessing.Queue[Job] | None = None
        self._held: set[Job] = set()
        self._listener: threading.Thread | None = None
        self._closing = False

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            assert self._jobs is not None
            self._held.add(job)
            self._jobs.put(job)

    def _start(self) -> None:
        self._jobs = self._context.Queue()
        self._done = self._context.Queue()
        self._proc = self._context.Process(
            target=_child,
            args=(self._where, self._embedder, self._priority, self._jobs, self._done),
            name="kvgate-ingest", daemon=True,
        )  # fmt: skip
        self._proc.start()
        # At once, from here: the child's start (a new interpreter importing kvgate, then the
        # embedder's weights) is seconds of CPU that would otherwise run at the server's
        # priority, beside the chats, before the child's own call below.
        lower_priority(self._priority, self._proc.pid)
        self._listener = threading.Thread(
            target=self._listen, args=(self._proc, self._done), name="kvgate-ingest-ends",
            daemon=True,
        )  # fmt: skip
        self._listener.start()

    def _listen(self, proc: Any, done: multiprocessing.Queue[Job]) -> None:
        while True:
            try:
                job = done.get(timeout=0.5)
            except queue.Empty:
                if proc.is_alive():
                    continue
                with self._lock:  # the child is gone: what it held will not end
                    lost, self._held = set(self._held), set()
                if not self._closing:
                    for job in lost:
                        self._on_lost(job)
                return
            with self._lock:
                self._held.discard(job)
            self._on_done(job)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            proc, jobs = self._proc, self._jobs
        if proc is None or jobs is None:
            return
        jobs.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if self._listener is not None:
            self._listener.join(5)
