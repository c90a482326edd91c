"""Arrival order, the newest running request preempted first, no quotas: what tenant-blind
engines do."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence

from kvgate.engine.policy.base import Need, SchedulingPolicy, StepPlan
from kvgate.engine.request import Request


class FifoQueue:
    """One queue in arrival order; preempted requests go back to its head."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))  # a copy: other threads read while the engine runs

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        if not self._queue or self._queue[0].tenant in blocked:
            return None  # head-of-line: FIFO never jumps the queue
        return self._queue[0]


class NewestFirst:
    """No ceilings; a running request that must grow preempts the newest admitted one (maybe
    itself); a waiting one preempts nobody."""

    def may_hold(self, tenant: str, num_blocks: int) -> bool:
        return True

    def victim(
        self,
        request: Request,
        running: Sequence[Request],
        tenant_blocks: Mapping[str, int],
        need: Need,
        admitting: bool,
        extra_blocks: int = 0,
    ) -> Request | None:
        if admitting:
            return None
        return running[-1]  # newest admitted


class FifoPolicy(SchedulingPolicy):
    """Arrival order; the newest running request is preempted first; no quotas; the plain
    planner (nobody jumps the step in flight either)."""

    def __init__(self) -> None:
        super().__init__(FifoQueue(), NewestFirst())
