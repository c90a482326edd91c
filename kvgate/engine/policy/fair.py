"""Strict priority between classes; weighted fair shares within one; KV quotas.

Fair share: each tenant has a virtual time, the tokens it has been served divided by its
weight; the waiting request of the lowest (priority, virtual time) goes first. A tenant that
returns from idle starts at the smallest virtual time among active tenants, so an idle spell
earns no credit to flood with later.

The three parts (``FairQueue``, ``TenantQuotas``, ``FairPlanner``) read one ``TenantBook``:
the shares, virtual times and arrival order. Only the planner writes it, from what it is
told (``on_arrived``, ``on_scheduled``, ``on_finished``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvgate.engine.policy.base import Need, Planner, SchedulingPolicy, StepPlan
from kvgate.engine.request import Request


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


class TenantBook:
    """The tenants' shares and service: virtual times, unfinished requests per tenant, and
    each request's arrival order (for stable ties)."""

    def __init__(self, shares: Mapping[str, TenantShare], default: TenantShare) -> None:
        self.shares = dict(shares)
        self.default = default
        self.vtime: dict[str, float] = {}
        self.active: dict[str, int] = {}  # tenant -> unfinished requests
        self._seq: dict[str, int] = {}  # request id -> arrival order
        self._counter = itertools.count()

    def share(self, tenant: str) -> TenantShare:
        return self.shares.get(tenant, self.default)

    def priority(self, tenant: str) -> int:
        return self.share(tenant).priority

    def order(self, request: Request) -> int:
        return self._seq.get(request.request_id, -1)

    def arrived(self, request: Request) -> None:
        tenant = request.tenant
        if not self.active.get(tenant):
            others = [self.vtime.get(t, 0.0) for t, n in self.active.items() if n]
            self.vtime[tenant] = max(self.vtime.get(tenant, 0.0), min(others, default=0.0))
        self.active[tenant] = self.active.get(tenant, 0) + 1
        self._seq[request.request_id] = next(self._counter)

    def served(self, request: Request, num_tokens: int) -> None:
        tenant = request.tenant
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + num_tokens / self.share(tenant).weight

    def ended(self, request: Request) -> None:
        self._seq.pop(request.request_id, None)
        n = self.active.get(request.tenant, 0) - 1
        if n > 0:
            self.active[request.tenant] = n
        else:
            self.active.pop(request.tenant, None)


class FairQueue:
    """One queue per tenant; the head of the lowest (priority, virtual time) goes first."""

    def __init__(self, book: TenantBook) -> None:
        self.book = book
        self.queues: dict[str, deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(list(q) for q in list(self.queues.values()))

    def add(self, request: Request) -> None:
        self.queues.setdefault(request.tenant, deque()).append(request)
        self._len += 1

    def requeue(self, request: Request) -> None:
        self.queues.setdefault(request.tenant, deque()).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self.queues[request.tenant]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self.queues[request.tenant]

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        book = self.book
        best: Request | None = None
        best_key: tuple[int, float, int, int] | None = None
        for tenant, queue in self.queues.items():
            if tenant in blocked or (plan.exclusive is not None and tenant != plan.exclusive):
                continue
            head = queue[0]
            # Equal virtual times (a tenant just back from idle starts level with the busiest):
            # the tenant with less outstanding work goes first.
            key = (
                book.priority(tenant),
                book.vtime.get(tenant, 0.0),
                book.active.get(tenant, 0),
                book.order(head),
            )
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best


class TenantQuotas:
    """Ceilings, guarantees and strict priority decide who gives way."""

    def __init__(self, book: TenantBook) -> None:
        self.book = book

    def may_hold(self, tenant: str, num_blocks: int) -> bool:
        ceiling = self.book.share(tenant).ceiling_blocks
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
        book = self.book
        tenant = request.tenant
        others = [r for r in running if r is not request]
        if need is Need.QUOTA:
            # Only the tenant's own blocks count against its ceiling.
            own = [r for r in others if r.tenant == tenant]
            if admitting:
                return None  # a newcomer waits for its tenant's running work
            return max(own, key=book.order) if own else request
        priority = book.priority(tenant)

        def over(t: str) -> int:
            return tenant_blocks.get(t, 0) - book.share(t).guaranteed_blocks

        lower = [r for r in others if book.priority(r.tenant) > priority]
        if lower:  # strict priority: the lowest class goes first, its most over-share tenant
            return max(
                lower, key=lambda r: (book.priority(r.tenant), over(r.tenant), book.order(r))
            )
        if over(tenant) + extra_blocks <= 0:  # within its guarantee: take back what was lent
            lenders = [
                r
                for r in others
                if r.tenant != tenant and book.priority(r.tenant) == priority and over(r.tenant) > 0
            ]
            if lenders:
                return max(lenders, key=lambda r: (over(r.tenant), book.order(r)))
        if admitting:
            return None
        own = [r for r in running if r.tenant == tenant]
        return max(own, key=book.order)  # the tenant's newest, possibly the request itself


class FairPlanner(Planner):
    """By priority; but a tenant owed service gets its next prefill in a step of its own, or
    inside the step in flight."""

    def __init__(self, book: TenantBook, queue: FairQueue) -> None:
        self.book = book
        self.queue = queue
        # Whether the last step was set aside for one tenant's prefill (planned, or urgent):
        # the next one then is not (see ``plan``).
        self._exclusive_last_step = False

    def plan(self, running: Sequence[Request]) -> StepPlan:
        """A quiet tenant's time to first token is what it feels: a step it shares with a full
        batch of another tenant's decodes takes several times longer than its prefill alone.
        So when a tenant owed service (``_owed_tenant``: back from idle, or light beside a
        flooder) has a request waiting, the running requests of its class and below sit out
        one step. Never two steps in a row, so a stream of newcomers cannot starve running
        work.
        """
        book = self.book
        ordered = sorted(running, key=lambda r: book.priority(r.tenant))  # stable
        newcomer = None if self._exclusive_last_step else self._owed_tenant(ordered)
        if newcomer is None:
            return StepPlan(tuple(ordered))
        priority = book.priority(newcomer)
        kept = tuple(r for r in ordered if book.priority(r.tenant) < priority)
        return StepPlan(kept, newcomer)

    def urgent(self, running: Sequence[Request]) -> Request | None:
        """The request ``plan`` would give a step of its own need not wait for the step in
        flight either: a full step of other tenants' work can take longer than its whole
        prefill. Same rule against starving running work: never right after such a step, and
        the next step is a normal one (``on_urgent_offered``)."""
        if self._exclusive_last_step:
            return None
        tenant = self._owed_tenant(running)
        return self.queue.queues[tenant][0] if tenant is not None else None

    def _owed_tenant(self, running: Sequence[Request]) -> str | None:
        """A tenant owed service, with a fresh request waiting: some other tenant is running,
        and this one is of no lower class than anything running and has been served no more
        (virtual time) than any other running tenant. Either back from idle (it starts level
        with the least served), or light: running something but with no backlog, so a tenant
        saturating the engine (always a queue) never qualifies while it runs."""
        if not running:
            return None
        book = self.book
        top = min(book.priority(r.tenant) for r in running)
        busy = {r.tenant: book.vtime.get(r.tenant, 0.0) for r in running}
        # The two least-served running tenants: the least served other than any one tenant
        # is among them (called between layers, so linear in running + tenants, no more).
        least = sorted(busy.items(), key=lambda item: item[1])[:2]
        best: tuple[int, float, int] | None = None
        found = None
        for tenant, queue in self.queue.queues.items():
            if queue[0].num_preemptions:
                continue  # a preempted request waits its turn
            if tenant in busy and len(queue) > 1:
                continue  # a backlog: fair shares, not a step of its own
            others = [vt for t, vt in least if t != tenant]
            if not others:
                continue  # nobody else to be protected from
            key = (book.priority(tenant), book.vtime.get(tenant, 0.0), book.order(queue[0]))
            if key[0] <= top and key[1] <= others[0] and (best is None or key < best):
                best, found = key, tenant
        return found

    def on_arrived(self, request: Request) -> None:
        self.book.arrived(request)

    def on_step(self, plan: StepPlan) -> None:
        self._exclusive_last_step = plan.exclusive is not None

    def on_urgent_offered(self, request: Request) -> None:
        self._exclusive_last_step = True

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        self.book.served(request, num_tokens)

    def on_finished(self, request: Request) -> None:
        self.book.ended(request)


class TenantFairPolicy(SchedulingPolicy):
    """Strict priority between classes; weighted fair shares within one; KV quotas; a tenant
    owed service first (see the module docstring)."""

    def __init__(self, shares: Mapping[str, TenantShare], default: TenantShare) -> None:
        self.book = TenantBook(shares, default)
        queue = FairQueue(self.book)
        super().__init__(queue, TenantQuotas(self.book), FairPlanner(self.book, queue))

    def update(self, shares: Mapping[str, TenantShare], default: TenantShare) -> None:
        """New shares (a reloaded tenants file); queued and running requests keep their place."""
        self.book.shares = dict(shares)
        self.book.default = default
