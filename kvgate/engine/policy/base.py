"""The three parts of a scheduling policy and what they answer (see the package docstring)."""

from __future__ import annotations

import enum
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
    """The planner's decision for one step, made before anything in it is scheduled.

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


class WaitingQueue(Protocol):
    """The waiting requests, in the policy's order."""

    def __len__(self) -> int:
        """Requests waiting."""
        ...

    def __iter__(self) -> Iterator[Request]:
        """Waiting requests (any order; a copy: other threads read while the engine runs)."""
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

    def pick(self, blocked: set[str], plan: StepPlan) -> Request | None:
        """The waiting request to try next, from a tenant not in ``blocked``; None to stop."""
        ...


class Entitlement(Protocol):
    """Who may hold what, and who gives way."""

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


class Planner:
    """How each step is laid out, and what the policy is told of what happened. This base
    is the plain one: every running request in order, nothing set aside, nobody urgent, and
    every notice ignored."""

    def plan(self, running: Sequence[Request]) -> StepPlan:
        """This step's plan (see ``StepPlan``), from the running requests."""
        return StepPlan(tuple(running))

    def urgent(self, running: Sequence[Request]) -> Request | None:
        """A waiting request that should not wait for the step in flight to end: the engine
        runs its prefill between two layers of that step. None: nobody is that urgent."""
        return None

    def on_arrived(self, request: Request) -> None:
        """A new request arrived (before it joins the queue)."""

    def on_step(self, plan: StepPlan) -> None:
        """The step planned by ``plan`` is being scheduled."""

    def on_urgent_offered(self, request: Request) -> None:
        """``request`` was offered an urgent step, taken or not (one that did not fit, e.g. a
        prompt over twice the budget, would not fit a step of its own either): the next
        step is a normal one."""

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` of ``request`` are computed in this step (its tenant was served)."""

    def on_finished(self, request: Request) -> None:
        """The request ended (any reason)."""


class SchedulingPolicy:
    """The three parts the scheduler asks (``planner``: the plain ``Planner`` when None)."""

    def __init__(
        self, queue: WaitingQueue, entitlement: Entitlement, planner: Planner | None = None
    ) -> None:
        self.queue = queue
        self.entitlement = entitlement
        self.planner = planner if planner is not None else Planner()
