"""The ingestion queue: strict priority between tenants' classes, round robin within one.

The ingestion process takes one job at a time; which one comes next is decided here. A
``critical`` tenant's job goes before any ``standard`` one, a ``standard`` before any
``batch``; within a class the tenants take turns, one job each: the next is the tenant
served longest ago (one never served first). So a tenant's file, queued behind any number
of other tenants' jobs of its class, waits for the job running and at most one job of each
of those tenants (each bounded by ``IngestLimits.job_seconds``); alone with one other
tenant, for one job slice.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Generic, TypeVar

from kvgate.governance.tenants import PRIORITIES

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Thread-safe: ``put`` from any thread, ``get`` from the one that runs the jobs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[int, dict[str, deque[T]]] = {}  # class rank -> tenant -> its jobs
        self._served: dict[str, int] = {}  # tenant -> when it last had a turn (a count)
        self._turns = itertools.count()

    def put(self, tenant: str, priority: str, item: T) -> None:
        """``priority``: the tenant's class (critical, standard, batch; else batch's turn)."""
        rank = PRIORITIES.get(priority, max(PRIORITIES.values()))
        with self._cond:
            self._queues.setdefault(rank, {}).setdefault(tenant, deque()).append(item)
            self._cond.notify()

    def get(self, timeout: float) -> T | None:
        """The next job, waiting up to ``timeout`` seconds for one; None if none came."""
        with self._cond:
            if not self._cond.wait_for(self._any, timeout):
                return None
            rank = min(r for r, tenants in self._queues.items() if tenants)
            tenants = self._queues[rank]
            tenant = min(tenants, key=lambda t: self._served.get(t, -1))  # ties: queued first
            jobs = tenants[tenant]
            item = jobs.popleft()
            if not jobs:
                del tenants[tenant]
            self._served[tenant] = next(self._turns)
            return item

    def _any(self) -> bool:
        return any(self._queues.values())

    def __len__(self) -> int:
        with self._cond:
            return sum(len(jobs) for tenants in self._queues.values() for jobs in tenants.values())
