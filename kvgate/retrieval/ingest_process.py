"""The ingestion process: a child fed one job at a time, under a time and a memory limit.

The server keeps the queue (``fair_queue.py``: by tenant class, round robin by tenant) and
hands the child the next job only when the last one ended, so the child holds one job at
most: when it dies, or is stopped, only that job fails, with why, and a new child takes
the rest. A job is stopped from here when it runs past ``IngestLimits.job_seconds`` or the
child's resident set passes ``memory_bytes`` (read from ``/proc`` every ``POLL_S``). Inside
the child, once it has started, ``RLIMIT_DATA`` holds its writable private memory to
``memory_bytes`` less what its mapped files hold resident (PyTorch's libraries) and a margin,
so its resident set stays under ``memory_bytes``: an allocation past it is a
``MemoryError`` that fails the job alone, and the child lives on. ``RLIMIT_AS`` would
count PyTorch's reserved, unused address space (VmSize ~1.4 GiB at start against ~750 MiB
resident). Both fail the file with ``file_too_complex``. The child dies with the server
(``PR_SET_PDEATHSIG``), even by ``kill -9``.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import queue
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.retrieval.bounds import FileTooComplex, IngestLimits
from kvgate.retrieval.fair_queue import FairQueue
from kvgate.retrieval.ingest import THREADS, Job, described, ingest, lower_priority, too_much_memory
from kvgate.retrieval.retrieval import Embedder
from kvgate.retrieval.store import DocStore

log = logging.getLogger("kvgate.retrieval")

#: Seconds between the server's looks at a running job (its end, its time, the child's RSS).
POLL_S = 0.1
#: Bytes left between the child's data limit and ``memory_bytes``, for its mapped files'
#: pages that become resident later (code paths first run in a job).
MARGIN_BYTES = 64 * 2**20
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

Error = dict[str, str]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (the
    server's dispatcher thread, which lives as long as the server); exit now if the server
    is already gone (it died before this ran)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("ingestion: PR_SET_PDEATHSIG failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(1)


def limit_memory(memory_bytes: int) -> int:
    """Hold this process's resident set under ``memory_bytes``: its data segment (writable
    private memory: the heap, anonymous maps) to that less its resident mapped files and
    ``MARGIN_BYTES``, so an allocation past it fails (``MemoryError``) instead of growing.
    Returns the data limit (bytes)."""
    pid = os.getpid()
    mapped = (rss_bytes(pid, "RssFile") or 0) + (rss_bytes(pid, "RssShmem") or 0)
    limit = max(memory_bytes - mapped - MARGIN_BYTES, 1)
    data = rss_bytes(pid, "VmData") or 0
    if data > limit:
        log.warning(
            "ingestion: %d MiB of data at start, over its limit of %d MiB: every file will fail",
            data // 2**20, limit // 2**20,
        )  # fmt: skip
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def rss_bytes(pid: int, field: str = "VmRSS") -> int | None:
    """A process's resident set (``VmHWM``: its peak), in bytes; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError):
        return None
    return None


def _child(
    where: tuple[str, str | None],
    embedder: Callable[[], Embedder],
    priority: str,
    limits: IngestLimits,
    parent: int,
    jobs: multiprocessing.Queue[Job | None],
    events: multiprocessing.Queue[tuple[str, Job | None]],
) -> None:
    """The ingestion process: says it is ready, then runs the jobs it is given until a None."""
    die_with_parent(parent)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    got = lower_priority(priority)  # (again) before torch starts its threads: they inherit it
    import torch

    torch.set_num_threads(THREADS)
    store = DocStore(*where)
    model = embedder()
    data = limit_memory(limits.memory_bytes)  # now: its start-up is not the files' to pay
    log.info(
        "ingestion: embedder %s, %d threads, %s, data limit %d MiB",
        described(model), THREADS, got, data // 2**20,
    )  # fmt: skip
    events.put(("ready", None))
    while (job := jobs.get()) is not None:
        ingest(store, model, *job, limits=limits)
        events.put(("done", job))
    store.close()


@dataclass
class _Child:
    proc: Any  # multiprocessing's SpawnProcess
    jobs: multiprocessing.Queue[Job | None]
    events: multiprocessing.Queue[tuple[str, Job | None]]


class IngestProcess:
    """The queue, the child, and the thread that feeds it (``on_done`` for a job that ended
    in the child, ``on_lost`` with the error for one the child could not end)."""

    def __init__(
        self,
        where: tuple[str, str | None],
        embedder: Callable[[], Embedder],
        priority: str,
        on_done: Callable[[Job], None],
        on_lost: Callable[[Job, Error], None],
        limits: IngestLimits | None = None,
    ) -> None:
        """``where``: the store's directory and URL (``DocStore``'s arguments); ``embedder``
        must pickle (a class, or a ``functools.partial`` of one)."""
        self._where = where
        self._embedder = embedder
        self._priority = priority
        self._on_done = on_done
        self._on_lost = on_lost
        self.limits = limits or IngestLimits()
        self._context = multiprocessing.get_context("spawn")
        self._queue: FairQueue[Job] = FairQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._child: _Child | None = None
        self._closing = threading.Event()
        #: The job the child is running (None: none).
        self.running: Job | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id (None: none started, or it is gone)."""
        child = self._child
        return None if child is None else child.proc.pid

    def submit(self, tenant: str, priority: str, job: Job) -> None:
        """Queue ``job`` of ``tenant``, whose class is ``priority``."""
        self._queue.put(tenant, priority, job)
        with self._lock:
            if self._thread is None and not self._closing.is_set():
                # The child is started from this thread, which it dies with: it lives as long
                # as the service (not a request's worker thread, which may end any time).
                self._thread = threading.Thread(
                    target=self._run, name="kvgate-ingest-feed", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while not self._closing.is_set():
            job = self._queue.get(0.5)
            if job is None:
                continue
            try:
                child = self._ready_child()
                if child is None:  # it could not start: the job cannot run
                    self._lost(job, {"code": "server_error",
                                     "message": "the ingestion process could not start "
                                                "(see the server log)"})  # fmt: skip
                    continue
                self._run_job(child, job)
            except Exception:  # the feed must go on; the job's end is unknown
                log.exception("ingestion: feeding job %s failed", job)
        self._stop_child()

    def _ready_child(self) -> _Child | None:
        if self._child is not None and self._child.proc.is_alive():
            return self._child
        self._child = None
        jobs: multiprocessing.Queue[Job | None] = self._context.Queue()
        events: multiprocessing.Queue[tuple[str, Job | None]] = self._context.Queue()
        proc = self._context.Process(
            target=_child,
            args=(self._where, self._embedder, self._priority, self.limits, os.getpid(),
                  jobs, events),
            name="kvgate-ingest", daemon=True,
        )  # fmt: skip
        proc.start()
        # At once, from here: the child's start (a new interpreter importing kvgate, then the
        # embedder's weights) is seconds of CPU that would otherwise run at the server's
        # priority, beside the chats, before the child's own call.
        assert proc.pid is not None
        lower_priority(self._priority, proc.pid)
        while not self._closing.is_set():
            try:
                kind, _ = events.get(timeout=0.5)
            except queue.Empty:
                if proc.is_alive():
                    continue
                log.error("ingestion process died while starting (exit code %s)", proc.exitcode)
                return None
            if kind == "ready":
                self._child = _Child(proc, jobs, events)
                return self._child
        proc.kill()
        return None

    def _run_job(self, child: _Child, job: Job) -> None:
        child.jobs.put(job)
        self.running = job
        started = time.monotonic()
        try:
            while True:
                try:
                    kind, ended = child.events.get(timeout=POLL_S)
                except queue.Empty:
                    error = self._check(child, time.monotonic() - started)
                    if self._closing.is_set():
                        return  # left in progress: started again at the next start
                    if error is not None:
                        self._lost(job, error)
                        return
                    continue
                if kind == "done" and ended == job:
                    self._on_done(job)
                    return
        finally:
            self.running = None

    def _check(self, child: _Child, seconds: float) -> Error | None:
        """Why the running job must end here (the child is then gone), or None."""
        proc, limits = child.proc, self.limits
        if not proc.is_alive():
            self._child = None
            code = proc.exitcode
            how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
            log.error("ingestion process died (%s)", how)
            message = f"the ingestion process died while indexing this file ({how})"
            return {"code": "server_error", "message": message}
        rss = rss_bytes(proc.pid) or 0
        if seconds > limits.job_seconds:
            why = {"code": FileTooComplex.code,
                   "message": f"ingesting this file took longer than the {limits.job_seconds:g} "
                              "s one file may take"}  # fmt: skip
        elif rss > limits.memory_bytes:
            why = too_much_memory(limits)
        else:
            return None
        if self._closing.is_set():
            return None
        log.warning("ingestion: stopping the process: %s", why["message"])
        self._kill(child)
        return why

    def _kill(self, child: _Child) -> None:
        child.proc.kill()
        child.proc.join(10)
        self._child = None

    def _lost(self, job: Job, error: Error) -> None:
        try:
            self._on_lost(job, error)
        except Exception:
            log.exception("ingestion: recording the failure of %s failed", job)

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.jobs.put(None)
        child.proc.join(10)
        if child.proc.is_alive():
            child.proc.terminate()
            child.proc.join(5)

    def close(self) -> None:
        with self._lock:
            self._closing.set()
            thread = self._thread
        if thread is not None:
            thread.join(30)
