"""Ingesting one file into one vector store: the job the ingestion process runs.

One file into one store: its text (extracted once, kept), its chunks, their vectors and BM25
terms, written to the store's database, then its status. The work runs in a child process
(``ingest_process.py``: one job at a time, under a time and a memory limit) at the OS
priority of ingestion's class (``batch``: Linux's ``SCHED_IDLE`` policy at nice 19,
``standard``: nice 10, ``critical``: nice 0): parsing, jieba and the embedder never hold the
server's GIL, and the engine's threads win the cores whenever they want them. The child
reads and writes the same database (SQLite in WAL mode, or PostgreSQL) and tells the server
each job's end, so the server brings the indexes it keeps up to date. Measured with
bench/longdoc_serving.py: see bench/results/.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvgate.retrieval.bounds import FileTooComplex, IngestLimits, MiB
from kvgate.retrieval.chunking import Chunk, chunk_auto, chunk_static
from kvgate.retrieval.quota import StorageQuotaExceeded
from kvgate.retrieval.retrieval import Embedder, chunk_vectors, index_text, words
from kvgate.retrieval.store import DocStore, StoredChunk
from kvgate.retrieval.text import UnreadableFile, extract_text

log = logging.getLogger("kvgate.retrieval")

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


def ingest(
    store: DocStore,
    embedder: Embedder,
    store_id: str,
    file_id: str,
    job: str,
    limits: IngestLimits | None = None,
) -> None:
    """One job, start to end; a failure is the file's (its ``last_error``: a code and a
    message, never a library's exception). A job whose file was removed, or added again (a
    newer job), stops at its next check and writes nothing."""
    limits = limits or IngestLimits()
    try:
        _ingest(store, embedder, store_id, file_id, job, limits)
    except StorageQuotaExceeded as exc:  # its text or chunks would pass the tenant's quota
        log.info("ingest %s %s: refused: %s", store_id, file_id, exc.message)
        store.finish_store_file(
            store_id, file_id, job, "failed", {"code": exc.code, "message": exc.message}
        )
    except MemoryError:
        log.warning("ingestion of %s into %s ran out of memory", file_id, store_id)
        store.finish_store_file(store_id, file_id, job, "failed", too_much_memory(limits))
    except Exception:
        log.exception("ingestion of %s into %s failed", file_id, store_id)
        store.finish_store_file(
            store_id, file_id, job, "failed",
            {"code": "server_error", "message": "ingesting this file failed (see the server log)"},
        )  # fmt: skip


def too_much_memory(limits: IngestLimits) -> dict[str, str]:
    return {
        "code": FileTooComplex.code,
        "message": f"this file needs more than the {limits.memory_bytes // MiB} MiB of memory "
        "ingestion may use",
    }


def _ingest(
    store: DocStore, embedder: Embedder, store_id: str, file_id: str, job: str, limits: IngestLimits
) -> None:
    record = store.store_file(store_id, file_id)
    file = store.file(file_id, None)
    if record is None or file is None or record.job != job:
        return  # removed, or added again, before its turn
    started = time.perf_counter()
    text = file.text
    if text is None:
        try:
            text = extract_text(file.filename, store.file_bytes(file_id), limits)
        except UnreadableFile as exc:
            store.set_text(file_id, None, exc.message)
            code = "unsupported_file" if "unsupported" in exc.message else "invalid_file"
            if isinstance(exc, FileTooComplex):
                code = exc.code
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
    # Paragraph vectors for structure-aware chunks only: a static window's paragraphs are
    # cut anywhere, and ``static`` is OpenAI's plain windows.
    paragraphs = record.chunking.get("type") != "static"
    stored: list[StoredChunk] = []
    for i in range(0, len(chunks), EMBED_BATCH):
        if not store.beat(store_id, file_id, job):  # renews its lease, or it is gone
            log.info("ingest %s %s: removed while indexing", store_id, file.filename)
            return
        part = chunks[i : i + EMBED_BATCH]
        texts = [index_text(title, c) for c in part]
        vectors = chunk_vectors(embedder, title, part, paragraphs)
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


def described(embedder: Embedder) -> str:
    precision = getattr(embedder, "precision", type(embedder).__name__)
    why = getattr(embedder, "why", "")
    return f"{precision} ({why})" if why else str(precision)
