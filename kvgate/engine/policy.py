"""Who runs next: the scheduling policy the scheduler is given. Pure Python.

The scheduler owns the mechanics (token budget, blocks, preemption by recompute); the policy
owns the waiting queue and decides order and entitlement. Its questions are pure queries;
what it must remember of a step it is told afterwards (``on_step``, ``on_urgent_offered``,
``on_scheduled``, ``on_finished``), so no answer depends on which question came first:

- ``plan``: once per step, first: the running requests that get its budget, in order, and
  whether the step is set aside for one tenant's prefill (a ``StepPlan``);
- ``pick``: which waiting request is tried next, under that plan;
- ``may_hold``: whether a tenant may hold that many KV blocks (its ceiling);
- ``victim``: whom to preempt when a request needs room;
- ``urgent``: which waiting request may run inside the step in flight, between two of its
  layers, rather than wait for the step to end.

``FifoPolicy`` is arrival order, newest running request preempted first: what tenant-blind
engines do. ``TenantFairPolicy`` adds strict priority between classes, weighted fair sharing
within a class by virtual token counters, and KV quotas (a guaranteed share and a ceiling):
an idle tenant's share is lent to busy ones and taken back by preemption when it returns.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.engine.request import Request


class Need(enum.Enum):
    """Why a request cannot get its blocks."""

    POOL = "pool"  # the pool is out of free blocks
    QUOTA = "quota"  # its tenant would pass its ceiling
    SLOT = "slot"  # max_num_seqs requests are already running


@dataclass(frozen=True)
class StepPlan:
    """The policy's decision for one step, made before anything in it is scheduled.

    ``running``: the running requests that get the step's budget, in order (the others wait
    this step without losing their place). ``exclusive``: the tenant whose waiting request has
    the step set aside for its prefill (it may then take the whole prompt, up to twice the
    token budget, as an urgent step does), or None.
    """

    running: tuple[Request, ...]
    exclusive: str | None = None

    def owns(self, request: Request) -> bool:
        """Whether the step is set aside for ``request``'s prefill."""
        return self.exclusive is not None and request.tenant == self.exclusive


class SchedulingPolicy(Protocol):
    def __len__(self) -> int:
        """Requests waiting."""
        ...

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests (any order)."""
        ...

    def add(self, request: Request) -> None:
        """A new request arrives."""
        ...

    def requeue(self, request: Request) -> None:
        """A preempted request goes back to wait, ahead of its tenant's newer ones."""
        ...

    def remove(self, request: Request) -> None:
        """A waiting request leaves (scheduled, aborted or expired)."""
        ...

    def plan(self, running: Sequence[Request]) -> StepPlan:
        """This step's plan (see ``StepPlan``), from the running requests."""
        ...

    def on_step(self, plan: StepPlan) -> None:
        """The step planned by ``plan`` is being scheduled."""
        ...

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        """The waiting request to try next, from a tenant not in ``blocked``; None to stop."""
        ...

    def urgent(self, running: Sequence[Request]) -> Request | None:
        """A waiting request that should not wait for the step in flight to end: the engine
        runs its prefill between two layers of that step. None: nobody is that urgent."""
        ...

    def on_urgent_offered(self, request: Request) -> None:
        """``request`` was offered an urgent step, taken or not (one that did not fit, e.g. a
        prompt over twice the budget, would not fit a step of its own either): the next
        step is a normal one."""
        ...

    def may_hold(self, tenant: str, num_blocks: int) -> bool:
        """Whether ``tenant`` may hold ``num_blocks`` KV blocks in all."""
        ...

    def victim(
        self,
        request: Request,
        running: Sequence[Request],
        tenant_blocks: Mapping[str, int],
        need: Need,
        admitting: bool,
        extra_blocks: int = 0,
    ) -> Request | None:
        """A running request to preempt so that ``request`` gets room, or None.

        ``extra_blocks``: what ``request`` would take. For a running request that must grow
        (``admitting`` False) the answer is never None: it may be the request itself.
        """
        ...

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` of ``request`` are computed in this step (its tenant was served)."""
        ...

    def on_finished(self, request: Request) -> None:
        """The request ended (any reason)."""
        ...


class FifoPolicy:
    """Arrival order; the newest running request is preempted first; no quotas."""

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

    def plan(self, running: Sequence[Request]) -> StepPlan:
        return StepPlan(tuple(running))

    def on_step(self, plan: StepPlan) -> None:
        pass

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        if not self._queue or self._queue[0].tenant in blocked:
            return None  # head-of-line: FIFO never jumps the queue
        return self._queue[0]

    def urgent(self, running: Sequence[Request]) -> Request | None:
        return None  # arrival order: nobody jumps the step in flight either

    def on_urgent_offered(self, request: Request) -> None:
        pass

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

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        pass

    def on_finished(self, request: Request) -> None:
        pass


@dataclass(frozen=True)
class TenantShare:
    """What the policy needs to know of a tenant.

    ``priority``: 0 is served first (critical), larger numbers later. ``weight``: its share of
    served tokens against other tenants of the same class. ``guaranteed_blocks``: KV blocks it
    can always reclaim by preemption; ``ceiling_blocks``: most it may ever hold.
    """

    priority: int = 1
    weight: float = 1.0
    guaranteed_blocks: int = 0
    ceiling_blocks: int | None = None

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"weight must be positive, got {self.weight}")


class TenantFairPolicy:
    """Strict priority between classes; weighted fair shares within one; KV quotas.

    Fair share: each tenant has a virtual time, the tokens it has been served divided by its
    weight; the waiting request of the lowest (priority, virtual time) goes first. A tenant that
    returns from idle starts at the smallest virtual time among active tenants, so an idle
    spell earns no credit to flood with later.
    """

    def __init__(self, shares: Mapping[str, TenantShare], default: TenantShare) -> None:
        self.shares = dict(shares)
        self.default = default
        self._queues: dict[str, deque[Request]] = {}
        self._len = 0
        self._seq: dict[str, int] = {}  # request id -> arrival order, for stable ties
        self._counter = itertools.count()
        self.vtime: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> unfinished requests
        # Whether the last step was set aside for one tenant's prefill (planned, or urgent):
        # the next one then is not (see ``plan``).
        self._exclusive_last_step = False

    def update(self, shares: Mapping[str, TenantShare], default: TenantShare) -> None:
        """New shares (a reloaded tenants file); queued and running requests keep their place."""
        self.shares = dict(shares)
        self.default = default

    def share(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant, self.default)

    # ------------------------------------------------------------------ the waiting queue
    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(list(q) for q in list(self._queues.values()))

    def add(self, request: Request) -> None:
        tenant = request.tenant
        if not self._active.get(tenant):
            others = [self.vtime.get(t, 0.0) for t, n in self._active.items() if n]
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), min(others, default=0.0))
        self._active[tenant] = self._active.get(tenant, 0) + 1
        self._seq[request.request_id] = next(self._counter)
        self._queues.setdefault(tenant, deque()).append(request)
        self._len += 1

    def requeue(self, request: Request) -> None:
        self._queues.setdefault(request.tenant, deque()).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._queues[request.tenant]

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        best: Request | None = None
        best_key: tuple[int, float, int, int] | None = None
        for tenant, queue in self._queues.items():
            if tenant in blocked or (plan.exclusive is not None and tenant != plan.exclusive):
                continue
            head = queue[0]
            # Equal virtual times (a tenant just back from idle starts level with the busiest):
            # the tenant with less outstanding work goes first.
            key = (
                self.share(tenant).priority,
                self.vtime.get(tenant, 0.0),
                self._active.get(tenant, 0),
                self._order(head),
            )
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    # ------------------------------------------------------------------ entitlement
    def plan(self, running: Sequence[Request]) -> StepPlan:
        """By priority; but a tenant owed service gets its next prefill in a step of its own.

        A quiet tenant's time to first token is what it feels: a step it shares with a full
        batch of another tenant's decodes takes several times longer than its prefill alone.
        So when a tenant owed service (``_owed_tenant``: back from idle, or light beside a
        flooder) has a request waiting, the running requests of its class and below sit out
        one step. Never two steps in a row, so a stream of newcomers cannot starve running
        work.
        """
        ordered = sorted(running, key=lambda r: self.share(r.tenant).priority)  # stable
        newcomer = None if self._exclusive_last_step else self._owed_tenant(ordered)
        if newcomer is None:
            return StepPlan(tuple(ordered))
        priority = self.share(newcomer).priority
        kept = tuple(r for r in ordered if self.share(r.tenant).priority < priority)
        return StepPlan(kept, newcomer)

    def on_step(self, plan: StepPlan) -> None:
        self._exclusive_last_step = plan.exclusive is not None

    def urgent(self, running: Sequence[Request]) -> Request | None:
        """The request ``plan`` would give a step of its own need not wait for the step in
        flight either: a full step of other tenants' work can take longer than its whole
        prefill. Same rule against starving running work: never right after such a step, and
        the next step is a normal one (``on_urgent_offered``)."""
        if self._exclusive_last_step:
            return None
        tenant = self._owed_tenant(running)
        return self._queues[tenant][0] if tenant is not None else None

    def on_urgent_offered(self, request: Request) -> None:
        self._exclusive_last_step = True

    def _owed_tenant(self, running: Sequence[Request]) -> str | None:
        """A tenant owed service, with a fresh request waiting: some other tenant is running,
        and this one is of no lower class than anything running and has been served no more
        (virtual time) than any other running tenant. Either back from idle (it starts level
        with the least served), or light: running something but with no backlog, so a tenant
        saturating the engine (always a queue) never qualifies while it runs."""
        if not running:
            return None
        top = min(self.share(r.tenant).priority for r in running)
        busy = {r.tenant: self.vtime.get(r.tenant, 0.0) for r in running}
        # The two least-served running tenants: the least served other than any one tenant
        # is among them (called between layers, so linear in running + tenants, no more).
        least = sorted(busy.items(), key=lambda item: item[1])[:2]
        best: tuple[int, float, int] | None = None
        found = None
        for tenant, queue in self._queues.items():
            if queue[0].num_preemptions:
                continue  # a preempted request waits its turn
            if tenant in busy and len(queue) > 1:
                continue  # a backlog: fair shares, not a step of its own
            others = [vt for t, vt in least if t != tenant]
            if not others:
                continue  # nobody else to be protected from
            key = (self.share(tenant).priority, self.vtime.get(tenant, 0.0), self._order(queue[0]))
            if key[0] <= top and key[1] <= others[0] and (best is None or key < best):
                best, found = key, tenant
        return found

    def may_hold(self, tenant: str, num_blocks: int) -> bool:
        ceiling = self.share(tenant).ceiling_blocks
        return ceiling is None or num_blocks <= ceiling

    def victim(
        self,
        request: Request,
        running: Sequence[Request],
        tenant_blocks: Mapping[str, int],
        need: Need,
        admitting: bool,
        extra_blocks: int = 0,
    ) -> Request | None:
        tenant = request.tenant
        others = [r for r in running if r is not request]
        if need is Need.QUOTA:
            # Only the tenant's own blocks count against its ceiling.
            own = [r for r in others if r.tenant == tenant]
            if admitting:
                return None  # a newcomer waits for its tenant's running work
            return max(own, key=self._order) if own else request
        priority = self.share(tenant).priority

        def over(t: str) -> int:
            return tenant_blocks.get(t, 0) - self.share(t).guaranteed_blocks

        lower = [r for r in others if self.share(r.tenant).priority > priority]
        if lower:  # strict priority: the lowest class goes first, its most over-share tenant
            return max(
                lower,
                key=lambda r: (self.share(r.tenant).priority, over(r.tenant), self._order(r)),
            )
        if over(tenant) + extra_blocks <= 0:  # within its guarantee: take back what was lent
            lenders = [
                r
                for r in others
                if r.tenant != tenant
                and self.share(r.tenant).priority == priority
                and over(r.tenant) > 0
            ]
            if lenders:
                return max(lenders, key=lambda r: (over(r.tenant), self._order(r)))
        if admitting:
            return None
        own = [r for r in running if r.tenant == tenant]
        return max(own, key=self._order)  # the tenant's newest, possibly the request itself

    # ------------------------------------------------------------------ accounting
    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        tenant = request.tenant
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + num_tokens / self.share(tenant).weight

    def on_finished(self, request: Request) -> None:
        self._seq.pop(request.request_id, None)
        n = self._active.get(request.tenant, 0) - 1
        if n > 0:
            self._active[request.tenant] = n
        else:
            self._active.pop(request.tenant, None)

    def _order(self, request: Request) -> int:
        return self._seq.get(request.request_id, -1)
