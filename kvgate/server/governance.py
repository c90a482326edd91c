"""The server's side of tenant governance: who the caller is, what its request may use, and
the refusals counted by reason. The scheduling itself happens in the engine's policy.

A reload (SIGHUP or ``POST /admin/reload``) swaps the tenants config atomically: requests
already admitted keep running; an invalid file is refused with its error and the old config
stays in force.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.policy import TenantFairPolicy, TenantShare
from kvgate.engine.request import Request
from kvgate.engine.snapshot import EngineSnapshot, TenantSnapshot
from kvgate.errors import InvalidConfig, KVGateError
from kvgate.governance.admission import TenantGate, Ticket
from kvgate.governance.tenants import TenantsConfig, TenantSpec

log = logging.getLogger("kvgate.server")


@dataclass(frozen=True)
class RequestContext:
    """Per-request governance fields handed to the engine with each choice."""

    tenant: str = "default"
    cache_salt: bytes | None = None
    deadline: float | None = None  # time.monotonic()
    queue_deadline: float | None = None


@dataclass
class Admission:
    """Tickets of one HTTP request's choices; ``release`` once it is over (idempotent)."""

    tickets: list[Ticket]
    #: Tokens each choice used (prompt + output); what it did not use is given back.
    used: dict[int, int] = field(default_factory=dict)

    def release(self) -> None:
        for i, ticket in enumerate(self.tickets):
            ticket.release(self.used.get(i))


class Governance:
    def __init__(
        self,
        tenants: TenantsConfig,
        tenants_file: str | None = None,
        metrics_keys: frozenset[bytes] = frozenset(),
    ) -> None:
        """``metrics_keys``: digests of keys given on the command line that may read
        per-tenant figures; they survive reloads of the tenants file."""
        self.extra_metrics_keys = metrics_keys
        self.tenants = self._with_metrics_keys(tenants)
        self.tenants_file = tenants_file
        self.gate: TenantGate | None = None
        self.policy: TenantFairPolicy | None = None
        self._apply_policy: Callable[[Callable[[], None]], None] | None = None
        self.num_blocks = 0
        self.refusals: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # reload may come from a signal handler's thread

    def attach(
        self,
        num_blocks: int,
        block_size: int,
        policy: TenantFairPolicy | None,
        run_in_engine: Callable[[Callable[[], None]], None],
        blocks_for: Callable[[int], int] | None = None,
    ) -> None:
        """The engine is ready: size quotas against its pool and hand the policy its shares.
        ``blocks_for``: see ``TenantGate``."""
        self.num_blocks = num_blocks
        self.gate = TenantGate(num_blocks, block_size, blocks_for=blocks_for)
        self.policy = policy
        self._apply_policy = run_in_engine
        self._push_shares(self.tenants)

    def _with_metrics_keys(self, tenants: TenantsConfig) -> TenantsConfig:
        if not self.extra_metrics_keys:
            return tenants
        return dataclasses.replace(
            tenants, metrics_keys=tenants.metrics_keys | self.extra_metrics_keys
        )

    def spec(self, tenant: str) -> TenantSpec:
        return self.tenants.spec(tenant)

    def context(
        self, tenant: str, timeout: float | None, authorization: str | None = None
    ) -> RequestContext:
        """``authorization``: the caller's header, for the per-key salt of a key that names
        no tenant (``TenantsConfig.key_salt``)."""
        spec = self.spec(tenant)
        key_salt = self.tenants.key_salt(authorization)
        now = time.monotonic()
        limit = spec.deadline_seconds(timeout)
        return RequestContext(
            tenant=tenant,
            cache_salt=key_salt if key_salt is not None else spec.cache_salt,
            deadline=None if limit is None else now + limit,
            queue_deadline=None if spec.max_queue_time is None else now + spec.max_queue_time,
        )

    def admit(self, tenant: str, requests: Sequence[Request], *, paid: bool = False) -> Admission:
        """Admit every choice or none (raises the refusal, counted by its code). ``paid``:
        the choices' requests were charged at the door (``TenantGate.charge_requests``)."""
        assert self.gate is not None, "admission before the engine is ready"
        sizes = [(r.num_prompt_tokens, r.params.max_tokens) for r in requests]
        try:
            tickets = self.gate.admit_all(self.spec(tenant), sizes, paid=paid)
        except KVGateError as exc:
            self.count_refusal(tenant, exc.code)
            raise
        return Admission(tickets)

    def check_queue_share(self, tenant: str, n: int, capacity: int | None) -> None:
        """See ``TenantGate.check_queue_share``; nothing to check without a queue limit."""
        if self.gate is None or capacity is None:
            return
        tenants = self.tenants
        self.gate.check_queue_share(
            tenants.spec(tenant), n, capacity, lambda t: tenants.spec(t).weight
        )

    def room_for(self, tenant: str, prompt_tokens: int) -> int | None:
        """See ``TenantGate.room_for``; None before the engine is ready or without limits."""
        return self.gate.room_for(self.spec(tenant), prompt_tokens) if self.gate else None

    def count_refusal(self, tenant: str, reason: str) -> None:
        self.refusals[(tenant, reason)] += 1

    def reload(self) -> TenantsConfig:
        """Re-read the tenants file; raises ``InvalidConfig`` (old config kept) when invalid."""
        if self.tenants_file is None:
            raise InvalidConfig("no tenants file to reload (start with --tenants FILE)")
        with self._lock:
            new = self._with_metrics_keys(TenantsConfig.load(self.tenants_file))
            self.tenants = new
            self._push_shares(new)
        log.info("tenants reloaded from %s: %s", self.tenants_file, ", ".join(sorted(new.tenants)))
        return new

    def report(self, snapshot: EngineSnapshot | None) -> dict[str, dict[str, Any]]:
        """Per-tenant accounting and quota use (for /admin/tenants and /metrics), from the
        engine's latest snapshot (None: no engine yet) and this server's refusals."""
        tenants = self.tenants
        refusal_items = list(self.refusals.items())  # a copy: the event loop adds to it
        names = set(tenants.tenants) | {t for (t, _), _ in refusal_items}
        engine_rows = snapshot.tenants if snapshot is not None else {}
        names |= set(engine_rows)
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(names):
            spec = tenants.spec(name)
            share = spec.share(self.num_blocks)
            row = engine_rows.get(name) or TenantSnapshot()
            out[name] = {
                "priority": spec.priority,
                "weight": spec.weight,
                "kv_blocks_held": row.kv_blocks,
                "kv_guaranteed_blocks": share.guaranteed_blocks,
                "kv_ceiling_blocks": (
                    share.ceiling_blocks if share.ceiling_blocks is not None else self.num_blocks
                ),
                "running": row.running,
                "waiting": row.waiting,
                "in_flight": self.gate.in_flight(name) if self.gate is not None else 0,
                "prompt_tokens": row.prompt_tokens,
                "generation_tokens": row.generation_tokens,
                "kv_block_seconds": round(row.kv_block_seconds, 3),
                "prefix_cache_queries": row.prefix_queries,
                "prefix_cache_hits": row.prefix_hits,
                "finished": dict(row.finished),
                "refusals": {r: n for (t, r), n in refusal_items if t == name},
            }
        return out

    def _push_shares(self, tenants: TenantsConfig) -> None:
        policy, run = self.policy, self._apply_policy
        if policy is None or run is None:
            return
        shares = tenants.shares(self.num_blocks)
        default = TenantShare()
        run(lambda: policy.update(shares, default))
