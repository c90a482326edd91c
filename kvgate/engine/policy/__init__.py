"""Who runs next: the scheduling policy the scheduler is given. Pure Python.

The scheduler owns the mechanics (token budget, blocks, preemption by recompute); the policy
decides order and entitlement, in three parts (``base.py``), each asked only its own
questions, all pure queries; what a part must remember of a step it is told afterwards
(``on_*``), so no answer depends on which question came first:

- the **queue** of waiting requests: ``pick``, which one is tried next under the step's plan;
- the **entitlement**: ``may_hold`` (whether a tenant may hold that many KV blocks: its
  ceiling) and ``victim`` (whom to preempt when a request needs room);
- the **planner**: ``plan``, once per step, first (the running requests that get its budget,
  in order, and whether the step is set aside for one tenant's prefill: a ``StepPlan``), and
  ``urgent`` (which waiting request may run inside the step in flight, between two of its
  layers); its base (``Planner``) plans nothing and is told everything to no effect.

``FifoPolicy`` is arrival order, newest running request preempted first: what tenant-blind
engines do (``fifo.py``). ``TenantFairPolicy`` adds strict priority between classes,
weighted fair sharing within a class by virtual token counters, and KV quotas (a guaranteed
share and a ceiling): an idle tenant's share is lent to busy ones and taken back by
preemption when it returns (``fair.py``).
"""

from kvgate.engine.policy.base import (
    Entitlement,
    Need,
    Planner,
    SchedulingPolicy,
    StepPlan,
    WaitingQueue,
)
from kvgate.engine.policy.fair import TenantFairPolicy, TenantShare
from kvgate.engine.policy.fifo import FifoPolicy

__all__ = [
    "Entitlement",
    "FifoPolicy",
    "Need",
    "Planner",
    "SchedulingPolicy",
    "StepPlan",
    "TenantFairPolicy",
    "TenantShare",
    "WaitingQueue",
]
